"""Sibling projections fused into one matmul (engine/layers/fused_linears.py): every kind of linear
concatenates to the same outputs, the parts hand out the right slices in any call order, the
loader fuses bf16 and quantized models only, and the fused model compiles as one graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.layers.fused_linears import (
    FusedProjections,
    ProjectionSlice,
    concat_linears,
    fuse_projections,
    fusion_applies,
)
from engine.layers.quantization.linear import Int4Linear, Int8Linear
from engine.layers.quantization.pack import quantize_int4, quantize_int8
from engine.worker.loader import load_model

SIZES = (128, 64, 64)  # q, k, v: multiples of the int4 kernel's 64-row blocks, as in real models


def dense_parts(bias: bool, sizes: tuple[int, ...] = SIZES) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(64, n, bias=bias) for n in sizes]


def quant_parts(kind: str, bias: bool, sizes: tuple[int, ...] = SIZES) -> list[nn.Module]:
    parts: list[nn.Module] = []
    for dense in dense_parts(bias, sizes):
        q = quantize_int4(dense.weight, 32) if kind == "int4" else quantize_int8(dense.weight)
        cls = Int4Linear if kind == "int4" else Int8Linear
        parts.append(cls(q, dense.bias, dense=dense.weight, dense_above=4,  # type: ignore[arg-type]
                         kernel_dtype=torch.float32))
    return parts


@pytest.mark.parametrize("kind", ["dense", "int4", "int8"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 9])  # 9 > dense_above: the quantized modules' dense copy
@torch.inference_mode()
def test_concatenated_linear_gives_each_parts_output(kind: str, bias: bool, rows: int) -> None:
    parts: list[nn.Module] = list(dense_parts(bias)) if kind == "dense" else quant_parts(kind, bias)
    fused = concat_linears(parts)
    assert fused is not None and type(fused) is type(parts[0])
    x = torch.randn(1, rows, 64)
    got = fused(x).split(list(SIZES), dim=-1)
    for part, out in zip(parts, got, strict=True):
        want = part(x)
        if kind == "dense":  # another matmul shape: the same sums, maybe in another order
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        else:  # each packed output row is its own: bit for bit
            assert torch.equal(out, want)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@torch.inference_mode()
def test_parts_whose_packing_does_not_line_up_stay_apart_or_stay_exact(kind: str) -> None:
    """Parts of 32 rows: where torch's int4 packing is blocked by 64 rows (AVX-512 CPUs) the
    concatenated buffers are another matrix, and the load-time probe refuses them; where it
    packs plain rows (an EPYC without AVX-512) they fuse. The int8 codes are plain rows: they
    always fuse. Either way, never a fused module with other outputs than its parts."""
    parts = quant_parts(kind, False, (64, 32, 32))
    fused = concat_linears(parts)
    if kind == "int8":
        assert fused is not None
    if fused is not None:
        x = torch.randn(3, 64)
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_parts_of_different_kinds_stay_apart() -> None:
    dense = dense_parts(False)
    assert concat_linears([*dense[:2], quant_parts("int8", False)[2]]) is None
    assert concat_linears([dense[0], nn.Linear(64, 32, bias=True), dense[2]]) is None
    assert concat_linears([dense[0], nn.Linear(48, 32), dense[2]]) is None
    assert concat_linears([dense[0], None, dense[2]]) is None
    a, b = quant_parts("int4", False)[:2]
    assert isinstance(b, Int4Linear)
    b.group_size = 64  # as if quantized with other groups
    assert Int4Linear.concat([a, b]) is None  # type: ignore[list-item]


class Block(nn.Module):
    """HF's call pattern: the three projections of the same tensor, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = dense_parts(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x) * 2, self.v_proj(x) * 3], dim=-1)


@torch.inference_mode()
def test_parts_share_one_matmul_and_hold_nothing_after_the_last() -> None:
    block = Block()
    x = torch.randn(1, 5, 64)
    want = block(x)
    assert fuse_projections(block) == 1
    assert isinstance(block.q_proj, ProjectionSlice)
    group = block.q_proj.group
    assert group is block.k_proj.group is block.v_proj.group
    calls = []
    group.linear.register_forward_hook(lambda *_: calls.append(1))
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1  # one matmul for the three
    assert group._memo is None  # the last part took its output: no activations held
    # one group registered once: .to(), named_modules() and the packing pass see it once
    assert sum(isinstance(m, FusedProjections) for m in block.modules()) == 1


@torch.inference_mode()
def test_a_part_called_alone_or_with_another_input_computes_its_own() -> None:
    block = Block()
    parts = [block.q_proj, block.k_proj, block.v_proj]
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    want_k, want_v = block.k_proj(y), block.v_proj(x)
    fuse_projections(block)
    block.q_proj(x)  # leaves x's outputs in the memo
    torch.testing.assert_close(block.k_proj(y), want_k, rtol=1e-5, atol=1e-5)  # not x's
    torch.testing.assert_close(block.v_proj(x), want_v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block.k_proj(x), parts[1](x), rtol=1e-5, atol=1e-5)  # alone


def test_fusion_applies_where_no_exactness_is_promised() -> None:
    assert not fusion_applies(torch.float32, False, False)  # the golden tests' path
    assert fusion_applies(torch.float32, True, False)  # quantized: already not HF's numbers
    assert fusion_applies(torch.bfloat16, False, False)
    assert not fusion_applies(torch.bfloat16, False, True)  # batch-invariant: its own matmuls


def test_loader_fuses_bf16_models_only(tiny_qwen2: Path) -> None:
    """Qwen2: q/k/v with biases. Same logits fused or not, within bf16 rounding."""
    fused = load_model(str(tiny_qwen2), device="cpu", dtype="bfloat16").model
    fp32 = load_model(str(tiny_qwen2), device="cpu", dtype="float32").model
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn.v_proj, ProjectionSlice)
    assert isinstance(layer.mlp.up_proj, ProjectionSlice)
    assert not any(isinstance(m, ProjectionSlice) for m in fp32.modules())
    ids = torch.tensor([[5, 9, 13, 200, 17]])
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids).logits.float(), fp32(ids).logits, atol=0.3,
                                   rtol=0.05)  # bf16 against fp32, logits of magnitude ~10


def test_fused_bf16_decoder_is_one_graph(tiny_llama: Path) -> None:
    """The memo is a value in the trace, not a graph break."""
    from engine.attention.compile_op import forward_context
    from engine.attention.paged import build_metadata
    from engine.worker.compile import CompiledForward

    model = load_model(str(tiny_llama), device="cpu", dtype="bfloat16").model
    assert isinstance(model.model.layers[0].self_attn.q_proj, ProjectionSlice)
    body = CompiledForward(model, 4)._body
    meta = build_metadata(None, 4, list(range(4)), [], [(0, 4, 0, [0])], torch.device("cpu"))
    with forward_context(meta), torch.inference_mode():
        report = torch._dynamo.explain(body)(torch.zeros(1, 4, dtype=torch.long),
                                             torch.arange(4)[None])
    assert report.graph_break_count == 0, report.break_reasons
    assert report.graph_count == 1
