"""Sibling projections of one input run as one matmul: q/k/v of attention, gate/up of the MLP.

Why. At decode's few rows a linear's cost is mostly per call (the kernel's setup, its thread
fork and join, the weight stream starting over), so three small projections cost far more than
one of their combined width. Per layer of SmolLM2-135M, Sapphire Rapids box, 2 threads,
medians (benchmarks/bench_fused_linears.py, results/fused-linears-intel-xeon-processor-2c.json):

| path | rows | q, k, v apart | qkv | gate, up apart | gate_up |
|---|---:|---:|---:|---:|---:|
| int4 | 1 | 79 us | 40 us | 110 us | 85 us |
| int4 | 8 | 151 us | 102 us | 298 us | 251 us |
| bf16 packed | 16 | 160 us | 62 us | 218 us | 199 us |
| bf16 packed | 64 | 251 us | 112 us | 409 us | 320 us |

How, keeping HF's own forward code. The parts stay where HF calls them (`self.q_proj(x)`,
`self.k_proj(x)`, ...), each a `ProjectionSlice` of one `FusedProjections`. The first part
called computes every part at once and the group keeps the other parts' outputs, for that
same input tensor, until the last part has taken its own. A part called with another tensor,
or out of order, computes its own output through the fused linear (never a wrong one). The
memo is cleared within the forward, so under torch.compile it is no more than a value flowing
through the trace: the graph has one matmul per group, and its one guard on the memo (`is
None`) is among those engine/worker/compile.py's guard filter drops. That is safe: the graph never
reads the memo (it computes each group), and a memo left behind by a forward that raised
holds its own input tensor, so no later input can be taken for it.

The fused linear is whatever the parts were: nn.Linear (fused before engine/layers/packed_linear.py
packs it), or the int4/int8 modules of engine/layers/quantization/linear.py (their packed codes, scales and
dense copies concatenated along the output rows; the groups run along the input, so every
output row keeps its own bits). Parts of different kinds (a GGUF that stores v_proj in another
type than q_proj) stay apart.

Only where no exactness is promised against HF: bf16/fp16 weights, or quantized ones. float32
keeps HF's modules as they are (the golden tests' path), and so does batch-invariant mode.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from engine.layers.quantization.linear import Int4Linear, Int8Linear, W8A8Linear, concat_dense
from engine.worker.file_pages import mapped_checkpoints, release_freed, release_pages

log = logging.getLogger(__name__)

# Sibling groups by attribute name, in HF's call order (Llama, Mistral, Qwen2/3, SmolLM...).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjections(nn.Module):
    """One linear computing the concatenated outputs of several projections of one input."""

    def __init__(self, linear: nn.Module, sizes: Sequence[int]) -> None:
        super().__init__()
        self.linear = linear
        self.sizes = list(sizes)
        # (input, outputs) between the first part's call and the last one's. Cleared by the
        # last part: a step's activations are not held after its forward.
        self._memo: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        memo = self._memo
        if memo is not None and memo[0] is x:
            outputs = memo[1]
        else:
            outputs = tuple(self.linear(x).split(self.sizes, dim=-1))
        self._memo = None if index == len(self.sizes) - 1 else (x, outputs)
        return outputs[index]

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


class ProjectionSlice(nn.Module):
    """One part of a FusedProjections group, where HF's module calls the old projection."""

    def __init__(self, group: FusedProjections, index: int, in_features: int) -> None:
        super().__init__()
        # The first part holds the group as its child (so .to(), named_modules() and the
        # packing pass see it once); the others refer to it without registering it again.
        if index == 0:
            self.group = group
        else:
            object.__setattr__(self, "group", group)
        self.index = index
        self.in_features = in_features
        self.out_features = group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of the group, out={self.out_features}"


def fusion_applies(dtype: torch.dtype, quantized: bool, batch_invariant: bool) -> bool:
    return not batch_invariant and (quantized or dtype != torch.float32)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every sibling group (GROUPS) whose parts can be concatenated. -> groups fused."""
    fused = 0
    mapped = mapped_checkpoints()
    # The parents only: a list of every module would keep each replaced part alive to the end,
    # a second copy of the projections at the peak of the load (int8 at the 1B shape: +600 MB).
    parents = [m for m in model.modules() if any(hasattr(m, names[0]) for names in GROUPS)]
    for module in parents:
        for names in GROUPS:
            parts = [getattr(module, name, None) for name in names]
            linear = concat_linears(parts)
            if linear is None:
                continue
            group = FusedProjections(linear, [_out_features(p) for p in parts])
            for index, name in enumerate(names):
                setattr(module, name, ProjectionSlice(group, index, _in_features(parts[0])))
                part = parts[index]
                if isinstance(part, nn.Linear):  # read once, now in the fused copy
                    release_pages(part.weight, mapped)
            fused += 1
        release_freed()  # the parts' buffers, back to the OS before the next layer's concat
    log.info("fused %d sibling projection groups (q/k/v, gate/up) into one matmul each", fused)
    return fused


def concat_linears(parts: Sequence[Any]) -> nn.Module | None:
    """The parts as one module of the same kind, outputs concatenated; None if they cannot be
    (missing, of different kinds or input widths, or one with a bias and one without)."""
    if not parts or any(not isinstance(p, nn.Module) for p in parts):
        return None
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts):
        return None
    if len({_in_features(p) for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
        return None
    if kind is nn.Linear:
        if len({p.weight.dtype for p in parts}) != 1:
            return None
        return concat_dense([p.weight for p in parts], [p.bias for p in parts])
    if kind in (Int4Linear, Int8Linear, W8A8Linear):
        return kind.concat(parts)
    return None


def _in_features(module: Any) -> int:
    return int(module.in_features)


def _out_features(module: Any) -> int:
    return int(module.out_features)
