"""Quantized linears (engine/quant*.py) on small tensors and the tiny checkpoints: GGUF block
parsing bit for bit, kernel vs dequantized matmul, the kernel choice by row count, config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.layers.quantization.gguf import int4_from_q4, int8_from_q8_0
from engine.layers.quantization.linear import Int4Linear, Int8Linear
from engine.layers.quantization.pack import quantize_int4, quantize_int8
from engine.layers.quantization.quant import quantize_model, resolve_mode
from engine.worker.loader import load_model

CPU = torch.device("cpu")


def kernel_weight(module: Int4Linear | Int8Linear) -> torch.Tensor:
    """The weight the module's kernel really uses: its output for the identity matrix."""
    eye = torch.eye(module.in_features, dtype=module.kernel_dtype)
    return module(eye).t()


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def synthetic_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    write_gguf(path, {f"w.{kind}": (rng.normal(0, 0.5, (48, 96)).astype(np.float32), kind)
                      for kind in ("Q4_0", "Q4_1", "Q8_0")})
    return path


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_held_as_int4_are_bitwise_the_dequantized_weights(synthetic_gguf: Path,
                                                                         kind: str) -> None:
    import gguf

    tensor = next(t for t in gguf.GGUFReader(str(synthetic_gguf)).tensors
                  if t.name == f"w.{kind}")
    expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type))
    weight = int4_from_q4(np.asarray(tensor.data), kind, 96)
    assert weight.group_size == 32 and weight.codes.min() >= 0 and weight.codes.max() <= 15
    # Through the CPU kernel itself (float32 activations: no rounding of scale or input).
    exact = Int4Linear(weight, kernel_dtype=torch.float32)
    assert torch.equal(kernel_weight(exact), expected)


def test_gguf_q8_0_requantized_per_row_within_half_a_step(synthetic_gguf: Path) -> None:
    import gguf

    tensor = next(t for t in gguf.GGUFReader(str(synthetic_gguf)).tensors if t.name == "w.Q8_0")
    expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type))
    weight = int8_from_q8_0(np.asarray(tensor.data), 96)
    err = (weight.dequantize() - expected).abs().amax(dim=1)
    assert torch.all(err <= weight.scale * 0.5 + 1e-7)
    module = Int8Linear(weight, kernel_dtype=torch.float32)
    assert torch.allclose(kernel_weight(module), weight.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_quantize_at_load_error_is_within_half_a_step(group: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 128)
    q = quantize_int4(w, group)
    step = q.scale.repeat_interleave(group, dim=1)
    assert torch.all((q.dequantize() - w).abs() <= step * 0.5 + 1e-6)


def test_int4_rejects_bad_group_sizes() -> None:
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(torch.randn(4, 96), 48)
    with pytest.raises(ValueError, match="multiple"):
        quantize_int4(torch.randn(4, 96), 64)


# bfloat16 activations and scales: relative error of a dot product of ~K terms ~ 2^-8.
RTOL = ATOL = 2e-2


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_quantized_linear_matches_the_dequantized_matmul(rows: int) -> None:
    torch.manual_seed(1)
    w, bias, x = torch.randn(96, 64) * 0.1, torch.randn(96), torch.randn(2, rows, 64)
    q4, q8 = quantize_int4(w, 32), quantize_int8(w)
    out4 = Int4Linear(q4, bias)(x)
    out8 = Int8Linear(q8, bias)(x)
    assert out4.shape == out8.shape == (2, rows, 96) and out4.dtype == torch.float32
    torch.testing.assert_close(out4, F.linear(x, q4.dequantize(), bias), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out8, F.linear(x, q8.dequantize(), bias), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("cls", ["int4", "int8"])
def test_kernel_choice_by_rows(cls: str) -> None:
    """Up to dense_above rows the quantized kernel runs, above it the dense copy: a dense copy
    of zeros makes the two paths tell themselves apart."""
    torch.manual_seed(2)
    w = torch.randn(64, 64)
    zeros = torch.zeros_like(w)
    module = (Int4Linear(quantize_int4(w, 32), dense=zeros, dense_above=4) if cls == "int4"
              else Int8Linear(quantize_int8(w), dense=zeros, dense_above=4))
    small, large = torch.randn(1, 4, 64), torch.randn(1, 5, 64)
    assert module(small).abs().sum() > 0  # 4 rows: the kernel
    assert torch.equal(module(large), torch.zeros(1, 5, 64))  # 5 rows: the dense copy


def test_resolve_mode() -> None:
    bf16 = torch.bfloat16
    assert resolve_mode("auto", gguf=True, device=CPU, dtype=bf16, batch_invariant=False) == "auto"
    assert resolve_mode("auto", gguf=False, device=CPU, dtype=bf16, batch_invariant=False) == "none"
    assert resolve_mode("auto", gguf=True, device=CPU, dtype=bf16, batch_invariant=True) == "none"
    assert resolve_mode("int4", gguf=False, device=CPU, dtype=bf16, batch_invariant=False) == "int4"
    with pytest.raises(ValueError, match="batch-invariant"):
        resolve_mode("int8", gguf=False, device=CPU, dtype=bf16, batch_invariant=True)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_mode("int4", gguf=False, device=torch.device("cuda"), dtype=bf16,
                     batch_invariant=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_auto_keeps_dense_arithmetic_outside_the_kernels_dtype(dtype: torch.dtype) -> None:
    """The kernels compute in bfloat16: `auto` in another dtype keeps the GGUF dense (issue 30:
    in float32 small steps ran in bf16 and greedy tokens left HF's); an explicit mode still
    quantizes, as asked."""
    assert resolve_mode("auto", gguf=True, device=CPU, dtype=dtype, batch_invariant=False) == "none"
    assert resolve_mode("int4", gguf=True, device=CPU, dtype=dtype, batch_invariant=False) == "int4"


def test_the_log_says_the_kernels_compute_in_bf16(tiny_llama: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="engine.layers.quantization.quant"):
        load_model(str(tiny_llama), device="cpu", dtype="float32", quantization="int8")
    assert "kernels compute in bfloat16, not the model's float32" in caplog.text


def test_config_and_cli_accept_only_known_modes() -> None:
    from api.cli import build_parser, config_overrides

    assert EngineConfig().quantization == "auto"
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="q4")
    args = build_parser().parse_args(["serve", "--quantization", "int4"])
    assert config_overrides(args)["quantization"] == "int4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "fp8"])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_safetensors_model_quantized_at_load(tiny_llama: Path, mode: str) -> None:
    dense = load_model(str(tiny_llama), device="cpu", dtype="float32", quantization="none")
    quant = load_model(str(tiny_llama), device="cpu", dtype="float32", quantization=mode)
    mlp = quant.model.model.layers[0].mlp
    assert isinstance(mlp.down_proj, Int4Linear if mode == "int4" else Int8Linear)
    assert isinstance(quant.model.lm_head, Int8Linear)  # lm_head stays at 8 bits
    assert quant.facts == dense.facts
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        ref = dense.model(input_ids=ids).logits
        # 6 rows: no dense copies, so the kernels run whatever DENSE_ABOVE_ROWS is.
        quantize_model(dense.model, mode, None, dense_above=None)
        got = dense.model(input_ids=ids).logits
    assert not torch.equal(got, ref)
    rel = (got - ref).norm() / ref.norm()
    assert rel < (0.06 if mode == "int8" else 0.4), rel.item()  # measured 0.039, 0.288


def test_auto_keeps_a_safetensors_model_dense(tiny_llama: Path) -> None:
    m = load_model(str(tiny_llama), device="cpu", dtype="float32", quantization="auto")
    assert isinstance(m.model.model.layers[0].mlp.down_proj, torch.nn.Linear)
