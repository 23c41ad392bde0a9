"""`--quantization w8a8` (engine/layers/quantization/linear.py W8A8Linear): its own reference
math (int8 activations per token, int32 sums, both scales), the weight-only kernel for a few
rows, the loader's choice of modules, and an engine run on a tiny model. The perplexity bound
on the real model: tests/engine/test_quant_smollm2.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import engine.layers.quantization.linear as linear_module
from engine.config import EngineConfig
from engine.layers.quantization.linear import (
    EXACT_FLOAT_K,
    W8A8_ABOVE,
    Int8Linear,
    W8A8Linear,
    cpu_has_int8_dot,
    int_mm_by_float,
    quantize_rows,
    w8a8_mm,
)
from engine.layers.quantization.pack import quantize_int8
from engine.layers.quantization.quant import quantize_model, resolve_mode
from engine.llm import LLM
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams

GEN = torch.Generator().manual_seed(0)


def linear(n: int, k: int, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=GEN) * 0.02)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=GEN))
    return layer


def test_rows_are_quantized_each_with_its_own_scale() -> None:
    x = torch.tensor([[0.5, -1.27, 0.0], [0.0, 0.0, 0.0], [100.0, 50.0, -25.0]])
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.shape == (3, 1)
    assert codes[0].tolist() == [50, -127, 0] and codes[1].tolist() == [0, 0, 0]
    assert codes[2].tolist() == [127, 64, -32]  # 63.5 and -31.75 round half to even
    assert torch.allclose(scale[:, 0], torch.tensor([1.27, 0.0, 100.0]) / 127)


@pytest.mark.parametrize("m,k,n", [(9, 576, 192), (64, 1536, 576), (17, 30, 14)])
def test_the_product_is_its_reference_math(m: int, k: int, n: int) -> None:
    """int32 sums of the int8 codes, exactly, then the two scales: float64 reference."""
    w = quantize_int8(torch.randn(n, k, generator=GEN) * 0.02)
    scales = w.scale.to(torch.bfloat16)
    x = torch.randn(m, k, generator=GEN).to(torch.bfloat16)
    xq, x_scale = quantize_rows(x)
    assert torch.equal(torch._int_mm(xq, w.codes.t()).long(), xq.long() @ w.codes.long().t())
    reference = (xq.double() * x_scale.double()) @ (w.codes.double() * scales.double()[:, None]).t()
    torch.testing.assert_close(w8a8_mm(x, w.codes, scales).double(), reference,
                               atol=1e-6, rtol=1e-6)
    dense = x.double() @ w.dequantize().double().t()  # what the quantization costs
    assert (reference - dense).abs().max() < 0.02 * dense.abs().max()


@pytest.mark.parametrize("k", [1, 576, EXACT_FLOAT_K, EXACT_FLOAT_K + 1, 2600])
def test_float_gemms_give_the_int8_gemms_sums_bit_for_bit(k: int) -> None:
    """The path for CPUs without int8 dot products: at the edge of exactness too (every code
    at -128 and 127: a slice's sums reach 2^24 in magnitude; one more term would round)."""
    codes = torch.randint(-128, 128, (40, k), generator=GEN, dtype=torch.int8)
    xq = torch.randint(-127, 128, (13, k), generator=GEN, dtype=torch.int8)
    xq[0], codes[0], codes[1] = -128, -128, 127  # +2^24 and -2^23.9 per full slice
    want = xq.long() @ codes.long().t()
    got = int_mm_by_float(xq, codes)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert torch.equal(torch._int_mm(xq, codes.t()), got)


def test_only_an_x86_cpu_without_int8_dot_products_takes_the_float_path() -> None:
    assert not cpu_has_int8_dot("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    for flag in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert cpu_has_int8_dot(f"flags\t\t: fpu avx2 {flag} avx512f\n")
    assert cpu_has_int8_dot("processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\n")  # ARM


def test_w8a8_takes_the_float_path_only_without_int8_dot_products(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = quantize_int8(torch.randn(24, 64, generator=GEN) * 0.02)
    x = torch.randn(9, 64, generator=GEN)
    calls: list[int] = []
    real = linear_module.int_mm_by_float

    def counted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(linear_module, "int_mm_by_float", counted)
    results = []
    for has_dot in (True, False):
        monkeypatch.setattr(linear_module, "CPU_INT8_DOT", has_dot)
        results.append(w8a8_mm(x, w.codes, w.scale))
        assert len(calls) == (0 if has_dot else 1)
    assert torch.equal(results[0], results[1])


def test_a_few_rows_take_the_weight_only_kernel_and_more_the_int8_gemm() -> None:
    layer = linear(192, 576, bias=True).to(torch.bfloat16)
    w = quantize_int8(layer.weight)
    w8a8 = W8A8Linear(w, layer.bias)
    weight_only = Int8Linear(w, layer.bias)
    few = torch.randn(1, W8A8_ABOVE, 576, generator=GEN).to(torch.bfloat16)
    many = torch.randn(2, W8A8_ABOVE, 576, generator=GEN).to(torch.bfloat16)
    assert w8a8.bias is not None
    with torch.inference_mode():
        assert torch.equal(w8a8(few), weight_only(few))
        got = w8a8(many)
        want = (w8a8_mm(many.reshape(-1, 576), w8a8.codes, w8a8.scales).to(torch.bfloat16)
                .reshape(2, W8A8_ABOVE, 192) + w8a8.bias)
    assert got.shape == (2, W8A8_ABOVE, 192) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert not torch.equal(got, weight_only(many))  # the activations were quantized


def test_the_loader_makes_the_decoder_w8a8_and_keeps_the_head_weight_only() -> None:
    model = nn.Module()
    model.q = linear(64, 32)  # type: ignore[assignment]
    model.lm_head = linear(100, 32)  # type: ignore[assignment]
    model.embed = nn.Embedding(100, 32)  # type: ignore[assignment]
    model.get_output_embeddings = lambda: model.lm_head  # type: ignore[assignment]
    model.get_input_embeddings = lambda: model.embed  # type: ignore[assignment]
    assert resolve_mode("w8a8", False, torch.device("cpu"), torch.bfloat16, False) == "w8a8"
    assert quantize_model(model, "w8a8", None) == 2
    assert type(model.q) is W8A8Linear and model.q.dense is None
    assert type(model.lm_head) is Int8Linear


def test_an_engine_serves_w8a8(tiny_llama: Path) -> None:
    """A tiny Llama end to end in bf16: fused q/k/v and gate/up stay W8A8, prompts of more
    than 8 tokens take the int8 GEMM, decodes the weight-only kernel; text comes out, and
    greedy is deterministic."""
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                            block_size=4)
    llm = LLM(EngineConfig(model=str(tiny_llama), dtype="bfloat16", device="cpu",
                           num_kv_blocks=64, quantization="w8a8", enforce_eager=True,
                           scheduler=sched))
    layers = llm.engine.runner.model.model.layers
    kinds = {type(m) for m in layers.modules() if isinstance(m, Int8Linear)}
    assert kinds == {W8A8Linear}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[(7 * i + 3) % 300 + 3 for i in range(20)], [5, 6, 7]]
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in first] == [6, 6]
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
