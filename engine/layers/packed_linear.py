"""Dense linears on the CPU in bfloat16 with their weights packed once, at load, for oneDNN.

`F.linear` on a bf16 CPU tensor runs oneDNN too, but it reorders the plain [N, K] weight into
oneDNN's blocked layout on every call: at decode's few rows that reorder costs as much as the
matmul itself. Packing the weight once (`mkldnn._reorder_linear_weight`) and calling
`mkldnn._linear_pointwise` on it was 1.4-2.3x faster per linear on the Sapphire Rapids box
(576x1536 at 1 row: 26 us against 67; the 49152x576 LM head: 1.2 ms against 2.1; at 256
rows still 1.2-1.5x), measured by benchmarks/bench_quant_rows.py. This is what inductor's
`freezing` does inside a compiled graph; done here it holds in eager mode, for the LM head
(outside the graph), and without freezing's cost: freezing bypasses the AOT autograd cache
and re-runs its constant folding on every start (a second start took 90 s against 31).

Packing replaces the plain weight (same bytes, other layout), except that a tied LM head
gets its own packed copy, as the embedding lookup keeps the plain table (vocab x hidden x 2
bytes: 56 MB on SmolLM2). bf16 only: float32 keeps torch's path, which the golden tests
hold token-exact against HF. Not in batch-invariant mode, whose matmuls are its own.

Compiled, the call goes through the custom op `pagedserve::packed_linear`, because inductor
lowers `mkldnn._linear_pointwise` only for a frozen constant weight; eagerly it is called
directly (the op's Python hop costs ~2 us a call).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.worker.file_pages import mapped_checkpoints, release_freed, release_pages

log = logging.getLogger(__name__)

OP_NAME = "pagedserve::packed_linear"


def packing_applies(device: torch.device, dtype: torch.dtype, batch_invariant: bool) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and not batch_invariant
            and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


# torch.library.Library rather than @torch.library.custom_op, whose Python wrapper (autograd
# hop, aliasing checks) cost ~7 us a call here against ~2: the op runs ~210 times a step.
_lib = torch.library.Library("pagedserve", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def packed_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    """x [rows, K] (contiguous) @ packed weight [N, K]^T (+ bias) -> [rows, N]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_lib.impl("packed_linear", packed_linear_op, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME)
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
      out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class PackedLinear(nn.Module):
    """nn.Linear whose weight is held only as a oneDNN-packed bf16 tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Not persistent: the layout is oneDNN's own, valid only in this process.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().contiguous()), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features).contiguous()
        if torch.compiler.is_compiling():
            out = torch.ops.pagedserve.packed_linear(x2d, self.packed, self.bias,
                                                     self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2d, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, oneDNN-packed bf16"


def pack_linears(model: Any) -> int:
    """Replace every bf16 nn.Linear in `model` (an HF model; the dense copies inside quantized
    modules included) with a PackedLinear. -> how many were replaced."""
    table = model.get_input_embeddings().weight
    replaced, copied = 0, 0
    mapped = mapped_checkpoints()
    # Names, not modules: a list of the modules would keep every replaced weight alive to the
    # end, beside its packed copy (the peak at load, docs/memory.md).
    names = [name for name, module in model.named_modules()
             if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16]
    for name in names:
        module = model.get_submodule(name)
        if module.weight is table:  # a tied LM head: the lookup keeps the plain table
            copied += module.weight.numel() * module.weight.element_size()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module.weight, module.bias))
        if module.weight is not table:
            release_pages(module.weight, mapped)  # read once, now held packed
        del module
        release_freed()  # the dense weight, if it was the last reference, back to the OS
        replaced += 1
    log.info("oneDNN-packed %d bf16 linears (+%.1f MB: the tied LM head's own copy)", replaced,
             copied / 2**20)
    return replaced

