"""The memory account (engine/worker/memory.py, issue 37): each weight counted once, by the
form it is held in, the KV pool, and what reaches the engine's stats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.layers.quantization.linear import Int4Linear, Int8Linear
from engine.worker.loader import load_model
from engine.worker.memory import WEIGHT_KINDS, MemoryAccount, resident_bytes, weight_bytes
from engine.worker.model_runner import ModelRunner
from tests.engine.test_golden import make_engine


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def test_a_dense_model_is_all_dense_weights_each_counted_once(tiny_qwen2: Path) -> None:
    """Qwen2's tiny model ties its head to the embedding: one tensor, counted once."""
    model = load_model(str(tiny_qwen2), device="cpu", dtype="float32").model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    got = weight_bytes(model)
    assert got == {"dense_weights": storage_bytes([*model.parameters(), *model.buffers()]),
                   "packed_weights": 0, "quantized_weights": 0, "dense_copies": 0}


@pytest.mark.parametrize(("mode", "dtype"), [("int8", "float32"), ("int4", "bfloat16")])
def test_a_quantized_model_holds_one_copy_of_each_weight(tiny_llama: Path, mode: str,
                                                         dtype: str) -> None:
    """With the many-row kernel (issue 37 part 2) no quantized module keeps a dense weight:
    every linear weight is counted once, as quantized_weights, and the only dense weights
    left are the embedding and the norms."""
    from engine.layers.quantization import many_rows

    if not many_rows.available():
        pytest.skip("no many-row kernel here: the modules keep dense copies (tested below)")
    model = load_model(str(tiny_llama), device="cpu", dtype=dtype, quantization=mode).model
    quantized = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert quantized and all(m.dense is None for m in quantized)
    got = weight_bytes(model)
    assert got["dense_copies"] == 0 and got["packed_weights"] == 0
    own = [t for m in quantized for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]
    assert got["quantized_weights"] == storage_bytes(own) > 0
    embedding = model.get_input_embeddings().weight
    held = {t.untyped_storage().data_ptr() for t in own}
    rest = [t for t in [*model.parameters(), *model.buffers()]
            if t.untyped_storage().data_ptr() not in held]
    assert all(t.dim() < 2 or t is embedding for t in rest)  # norms, rotary tables: no matrix
    assert got["dense_weights"] == storage_bytes(rest)
    assert sum(got.values()) == storage_bytes([*model.parameters(), *model.buffers()])


def test_quantized_weights_and_their_dense_copies_are_told_apart(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 without the many-row kernel: the packed int8 weights and scales are
    quantized_weights; the dense weights the modules then keep for steps above
    DENSE_ABOVE_ROWS rows are dense_copies, not dense_weights."""
    from engine.layers.quantization import many_rows

    monkeypatch.setattr(many_rows, "available", lambda: False)
    model = load_model(str(tiny_llama), device="cpu", dtype="float32",
                       quantization="int8").model
    quantized = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert quantized
    copies = [t for m in quantized if m.dense is not None
              for t in [*m.dense.parameters(), *m.dense.buffers()]]
    own = [t for m in quantized for t in [*m.parameters(recurse=False),
                                         *m.buffers(recurse=False)]]
    got = weight_bytes(model)
    assert got["quantized_weights"] == storage_bytes(own) > 0
    assert got["dense_copies"] == storage_bytes(copies) > 0
    assert sum(got.values()) == storage_bytes([*model.parameters(), *model.buffers()])


def test_packed_weights_are_counted_and_replace_the_dense_ones(tiny_llama: Path) -> None:
    """bf16 where oneDNN has bf16: every linear packed, no dense linear weight left beside
    it (the embedding stays dense: the lookup reads it)."""
    from engine.layers.packed_linear import PackedLinear, packing_applies

    if not packing_applies(torch.device("cpu"), torch.bfloat16, False):
        pytest.skip("oneDNN has no bf16 on this CPU: nothing is packed")
    model = load_model(str(tiny_llama), device="cpu", dtype="bfloat16").model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    got = weight_bytes(model)
    assert got["packed_weights"] >= sum(m.in_features * m.out_features * 2 for m in packed) > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    rest = [t for m in model.modules() if not isinstance(m, PackedLinear)
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]
    assert got["dense_weights"] == storage_bytes(rest)  # the embedding, norms, RoPE's table
    assert got["dense_weights"] < model.get_input_embeddings().weight.numel() * 2 + 1024
    assert got["quantized_weights"] == got["dense_copies"] == 0


def test_the_engine_serves_the_account(llama_runner: ModelRunner) -> None:
    account = llama_runner.memory
    assert isinstance(account, MemoryAccount)
    assert account.kv_pool == llama_runner.kv_cache.untyped_storage().nbytes()
    assert account.weights == weight_bytes(llama_runner.model)
    assert 0 < account.resident <= account.peak and resident_bytes() > 0
    kinds = [kind for kind, _ in account.items()]
    assert kinds == [*WEIGHT_KINDS, "kv_pool", "warm_up", "other", "resident", "peak"]
    assert make_engine(llama_runner).stats().memory == account.items()


def _mapped(folder: Path) -> bool:
    return str(folder) in Path("/proc/self/maps").read_text()


def test_a_packed_model_lets_go_of_its_checkpoints_mapping(tmp_path: Path) -> None:
    """Packed, the model reads only its embedding and norms from the safetensors mapping:
    they are copied out, so the mapping (and every page of the file the load touched) goes
    (issue 37: 2.3 GB of a 1B model's 4.9 GB resident). Tied tensors stay tied."""
    from engine.layers.packed_linear import packing_applies
    from tests.support.models import build_checkpoint

    if not packing_applies(torch.device("cpu"), torch.bfloat16, False):
        pytest.skip("oneDNN has no bf16 on this CPU: nothing is packed")
    folder = build_checkpoint(tmp_path / "tied", "qwen2")  # tied embeddings
    model = load_model(str(folder), device="cpu", dtype="bfloat16").model
    assert not _mapped(folder)
    assert model.get_output_embeddings() is not None
    ids = torch.tensor([[5, 9, 13]])
    with torch.inference_mode():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def _bf16_checkpoint(folder: Path, seed: int) -> Path:
    """A Llama stored in bf16 and large enough (16 MB) that transformers memory-maps it."""
    import transformers

    from tests.support.models import build_tokenizer

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)  # type: ignore[arg-type]
    build_tokenizer(folder)
    return folder


def test_another_models_mapping_does_not_make_a_dense_model_copy_itself(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The half-the-mapping rule counts this model's own mappings only: a dense model read
    as stored keeps its file's pages while another model's file is mapped too (it was
    copied whole before)."""
    a, b = _bf16_checkpoint(tmp_path / "a", 0), _bf16_checkpoint(tmp_path / "b", 1)
    other = load_model(str(a), device="cpu", dtype="bfloat16", batch_invariant=True).model
    with caplog.at_level("INFO", logger="engine.worker.loader"):
        dense = load_model(str(b), device="cpu", dtype="bfloat16", batch_invariant=True).model
    if not (_mapped(a) and _mapped(b)):
        pytest.skip("transformers did not memory-map these checkpoints")
    assert other is not None and dense is not None
    assert "still read from the checkpoint's mapping" not in caplog.text
