"""The real embedded SmolLM2 (a Q4_1 GGUF) with quantized weights (slow): its Q4_1 tensors
held as int4 are exactly the dequantized ones, perplexity bounds on tests/data's text
(Newton's Opticks, 1730, public domain: the first ~3200 tokens of the Queries), and greedy
text through LLMEngine."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.layers.quantization.gguf import native_cache, read_native
from engine.layers.quantization.linear import Int4Linear, Int8Linear
from engine.layers.quantization.pack import Int4Weight, quantize_int4
from engine.layers.quantization.quant import quantize_model
from engine.llm import LLM
from engine.worker.loader import LoadedModel, converted_gguf, embedded_gguf, load_model
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from tests.support.perplexity import perplexity, text_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dense() -> LoadedModel:
    return load_model(None, device="cpu", dtype="float32", quantization="none")


@pytest.fixture(scope="module")
def native(dense: LoadedModel) -> dict[str, Any]:
    return read_native(embedded_gguf(), dense.model)


def test_the_converted_folder_stays_a_plain_checkpoint(native: dict[str, Any]) -> None:
    # vLLM (benchmarks/baselines) and HF load every top-level *.safetensors of the folder:
    # the native-weights cache must live elsewhere, or vLLM refuses the folder.
    folder = converted_gguf(embedded_gguf())
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]
    assert native_cache(embedded_gguf()).is_file()


def test_every_q4_1_tensor_held_as_int4_is_exactly_the_converted_weight(
        dense: LoadedModel, native: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    converted = load_file(str(converted_gguf(embedded_gguf()) / "model.safetensors"))
    int4 = {k: w for k, w in native.items() if isinstance(w, Int4Weight)}
    assert len(int4) == 210  # 30 layers x (q, k, v, o, gate, up, down)
    for name, w in int4.items():
        n, k = w.codes.shape
        q = w.codes.reshape(n, k // 32, 32).numpy().astype(np.float32)
        d, zero = w.scale.numpy()[..., None], w.zero.numpy()[..., None]
        m = zero - np.float32(8.0) * d  # the file's min, exactly (checked below by equality)
        rebuilt = (d * q + m).reshape(n, k)  # gguf's own formula: w = d * q + m
        assert np.array_equal(rebuilt, converted[name].numpy()), name
    # And through the kernel itself, for one tensor of each shape (q_proj is row-permuted).
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.5.mlp.down_proj.weight", "model.layers.7.mlp.up_proj.weight"):
        module = Int4Linear(int4[name], kernel_dtype=torch.float32)
        got = module(torch.eye(module.in_features)).t()
        assert torch.equal(got, converted[name]), name


@pytest.fixture(scope="module")
def ids(dense: LoadedModel) -> torch.Tensor:
    return text_ids(dense.tokenizer)


@pytest.fixture(scope="module")
def reference_ppl(dense: LoadedModel, ids: torch.Tensor) -> float:
    assert len(ids) > 3000
    return perplexity(dense.model, ids)


def quantized_ppl(dense: LoadedModel, ids: torch.Tensor, mode: str, gguf: bool,
                  group: int = 32) -> float:
    model = copy.deepcopy(dense.model)
    if not gguf and mode == "int4" and group != 32:
        import engine.layers.quantization.quant as q

        old, q.INT4_GROUP_SIZE = q.INT4_GROUP_SIZE, group
        try:
            quantize_model(model, mode, None, dense_above=None)
        finally:
            q.INT4_GROUP_SIZE = old
    else:
        quantize_model(model, mode, embedded_gguf() if gguf else None, dense_above=None)
    return perplexity(model, ids)


# (mode, weights from the GGUF's own blocks?, int4 group, bound relative to the dense ppl)
# int4 from dense with groups of 64 measured ppl 38.29 vs 28.78 (+33%, fails the bound): the
# shipped INT4_GROUP_SIZE is 32. Measured passing: int8 and GGUF-native int4 (numbers in
# docs/quantization.md).
# w8a8: issue 32's bound, 3% (its prompts of 512 rows all take the int8 GEMM).
CASES = [("int8", False, 32, 0.02), ("int4", True, 32, 0.10), ("int4", False, 32, 0.10),
         ("w8a8", False, 32, 0.03)]


@pytest.mark.parametrize(("mode", "gguf", "group", "bound"), CASES,
                         ids=["int8", "int4-gguf-native", "int4-from-dense-g32", "w8a8"])
def test_perplexity_within_bounds(dense: LoadedModel, ids: torch.Tensor, reference_ppl: float,
                                  mode: str, gguf: bool, group: int, bound: float) -> None:
    ppl = quantized_ppl(dense, ids, mode, gguf, group)
    print(f"perplexity {mode}: {ppl:.3f} against {reference_ppl:.3f} dense")
    assert abs(ppl / reference_ppl - 1) <= bound, (ppl, reference_ppl)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_engine_greedy_text_is_sensible(mode: str) -> None:
    """Through LLMEngine (via LLM): decode steps of 2 rows run the quantized kernels."""
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                            block_size=16)
    llm = LLM(EngineConfig(model=None, dtype="float32", device="cpu", num_kv_blocks=32,
                           quantization=mode, enforce_eager=True, scheduler=sched))
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Int4Linear if mode == "int4" else Int8Linear)
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].text, out[0].text
    # The 135M model is shaky on this fact (int4 answered "around 1,000°"): only ask for text.
    assert len(out[1].token_ids) == 8 and out[1].text.strip().isprintable(), out[1].text


def test_dense_from_int4_regroups_losslessly_at_the_files_group_size(dense: LoadedModel) -> None:
    """int4 quantize-at-load of weights that are already Q4_1 with the same groups finds the
    same grid again (min/max of each group are codes 0 and 15 or inside): a sanity check of
    the quantizer on real weights, within half a step everywhere."""
    w = dense.model.model.layers[0].mlp.down_proj.weight
    q = quantize_int4(w, 32)
    step = q.scale.repeat_interleave(32, dim=1)
    assert torch.all((q.dequantize() - w).abs() <= step * 0.5 + 1e-6)
