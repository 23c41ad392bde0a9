"""oneDNN-packed bf16 linears (engine/layers/packed_linear.py): same results as nn.Linear, eager and
compiled, and every dense linear of a bf16 CPU model packed at load (quantized modules' dense
copies and a tied LM head included), nothing packed in float32 or batch-invariant mode."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.layers.packed_linear import PackedLinear, pack_linears, packing_applies
from engine.layers.quantization.linear import Int8Linear
from engine.layers.quantization.pack import quantize_int8
from engine.worker.loader import load_model
from engine.worker.model_runner import ModelRunner
from tests.engine.test_compiled import compiled_config, run_lockstep
from tests.support.models import loaded_runner, tiny_config

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not packing_applies(CPU, torch.bfloat16, False),
                                reason="this CPU's oneDNN has no bf16 path")


def bf16_linear(k: int, n: int, bias: bool) -> nn.Linear:
    torch.manual_seed(k + n)
    return nn.Linear(k, n, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_packed_equals_linear(rows: int, bias: bool) -> None:
    linear = bf16_linear(64, 96, bias)
    packed = PackedLinear(linear.weight, linear.bias)
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    out = packed(x)
    assert out.shape == (1, rows, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, linear(x))  # bf16 tolerances: same math, same kernel family


@torch.inference_mode()
def test_compiled_packed_linear_is_one_graph_and_equals_eager() -> None:
    model = nn.Sequential(PackedLinear(bf16_linear(64, 128, True).weight, None), nn.SiLU(),
                          PackedLinear(bf16_linear(128, 64, False).weight, None))
    x = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    report = torch._dynamo.explain(model)(x)
    assert report.graph_break_count == 0, report.break_reasons
    torch.testing.assert_close(torch.compile(model, dynamic=False)(x), model(x))


def test_packing_applies_only_to_bf16_on_the_cpu_outside_batch_invariant_mode() -> None:
    assert not packing_applies(CPU, torch.float32, False)  # the golden tests' exact path
    assert not packing_applies(CPU, torch.bfloat16, True)
    assert not packing_applies(torch.device("cuda"), torch.bfloat16, False)


class TiedModel(nn.Module):
    """An embedding, one quantized linear with a dense copy, an LM head tied to the table."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 64).to(torch.bfloat16)
        w = bf16_linear(64, 64, False).weight
        self.proj = Int8Linear(quantize_int8(w.float()), dense=w, dense_above=4)
        self.head = nn.Linear(64, 10, bias=False).to(torch.bfloat16)
        self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.embed


@torch.inference_mode()
def test_pack_linears_packs_dense_copies_and_a_tied_head(
        caplog: pytest.LogCaptureFixture) -> None:
    model = TiedModel()
    assert model.proj.dense is not None
    dense_ref = model.proj.dense(torch.ones(6, 64, dtype=torch.bfloat16))
    with caplog.at_level(logging.INFO, logger="engine.layers.packed_linear"):
        assert pack_linears(model) == 2
    assert isinstance(model.proj.dense, PackedLinear) and isinstance(model.head, PackedLinear)
    assert "+0.0 MB" in caplog.text  # 10 x 64 x 2 bytes: the tied head's own copy, counted
    # above dense_above rows the quantized module runs its (now packed) dense copy
    torch.testing.assert_close(model.proj(torch.ones(6, 64, dtype=torch.bfloat16)), dense_ref)
    assert model.embed.weight.layout == torch.strided  # the lookup keeps the plain table


def test_loader_packs_bf16_models_only(tiny_qwen2: Path) -> None:
    bf16 = load_model(str(tiny_qwen2), device="cpu", dtype="bfloat16").model
    fp32 = load_model(str(tiny_qwen2), device="cpu", dtype="float32").model
    assert not [n for n, m in bf16.named_modules() if type(m) is nn.Linear]
    assert isinstance(bf16.get_output_embeddings(), PackedLinear)  # tied in Qwen2's config
    assert not [n for n, m in fp32.named_modules() if isinstance(m, PackedLinear)]
    ids = torch.tensor([[5, 9, 13, 200, 17]])
    with torch.inference_mode():
        torch.testing.assert_close(bf16(ids).logits.float(), fp32(ids).logits, atol=0.3,
                                   rtol=0.05)  # bf16 against fp32, logits of magnitude ~10


@pytest.fixture(scope="module")
def bf16_qwen2_pair(tiny_qwen2: Path) -> tuple[ModelRunner, ModelRunner]:
    return (loaded_runner(tiny_config(tiny_qwen2, dtype="bfloat16")),
            loaded_runner(compiled_config(tiny_qwen2, dtype="bfloat16", compile_dynamic=True)))


def test_compiled_bf16_runner_with_packed_linears_matches_eager(
        bf16_qwen2_pair: tuple[ModelRunner, ModelRunner]) -> None:
    """The compiled step calls the packed linears through the custom op: same logits as the
    eager packed step within bf16 rounding (inductor fuses the norms and rotary in fp32)."""
    eager, compiled = bf16_qwen2_pair
    assert compiled.compiled is not None
    assert isinstance(compiled.model.get_output_embeddings(), PackedLinear)
    assert run_lockstep(eager, compiled) < 0.25
