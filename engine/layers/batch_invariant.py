"""Batch-invariant mode (`--batch-invariant`): a row's numbers never depend on the step.

A request's logits must be bitwise the same whatever else shares its step, so a seeded
sampled request gives the same tokens alone or in a busy batch. Two things make a row's
result depend on its neighbours in a plain forward:

- Per-token ops (linears, norms, MLP activations, rotary tables) run over all T packed
  rows at once. A kernel library may pick its algorithm (blocking, split of the reduction,
  vector tail, thread split) by the shape, so a row can round differently at T = 1 and at
  T = 7. Here every such module runs over fixed tiles of TILE_ROWS rows (the last padded
  with zeros): each call has the same shape whatever T is, so the kernel, its blocking and
  its thread split are fixed, and a row's result can only depend on its position inside
  the tile. tests/engine/test_batch_invariant.py checks that it does not, bitwise.
- Attention: see engine/attention/invariant.py (a query's shapes depend only on its own
  position, never on the other sequences or on how its prompt was chunked).

The wrapping is done once at load, on the module instances, so the HF model code is
unchanged and the cost is only paid when the mode is on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

TILE_ROWS = 16  # rows per tile: one decode step of 16 streams is one tile
_TILED_SUFFIXES = ("RMSNorm", "LayerNorm", "MLP")


def enable(model: torch.nn.Module, rows: int = TILE_ROWS) -> int:
    """Wrap every per-token module of `model` to run over fixed row tiles; returns how many
    modules were wrapped. Children of a wrapped module (an MLP's linears) already see tiles."""
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(w + ".") for w in wrapped):
            continue
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear) or kind.endswith(_TILED_SUFFIXES):
            module.forward = functools.partial(tiled, module.forward, rows)  # type: ignore[method-assign]
        elif kind.endswith("RotaryEmbedding"):
            module.forward = functools.partial(tiled_rotary, module.forward, rows)  # type: ignore[method-assign]
        else:
            continue
        wrapped.append(name)
    return len(wrapped)


def tiled(forward: Callable[[torch.Tensor], torch.Tensor], rows: int,
          x: torch.Tensor) -> torch.Tensor:
    """forward over x [..., D] as [rows, D] tiles (zero-padded) -> [..., D_out]."""
    flat = x.reshape(-1, x.shape[-1])  # [N, D]
    n = flat.shape[0]
    padded = _pad_rows(flat, rows)
    out = torch.cat([forward(tile) for tile in padded.split(rows)])  # [N', D_out]
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


def tiled_rotary(forward: Callable[..., tuple[torch.Tensor, torch.Tensor]], rows: int,
                 x: torch.Tensor, position_ids: torch.Tensor,
                 **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary embedding's (cos, sin) [B, T, hd] computed over tiles of `rows` positions."""
    t = position_ids.shape[1]
    pad = -t % rows
    ids = torch.nn.functional.pad(position_ids, (0, pad)) if pad else position_ids
    parts = [forward(x, tile, **kwargs) for tile in ids.split(rows, dim=1)]
    cos = torch.cat([c for c, _ in parts], dim=1)[:, :t]
    sin = torch.cat([s for _, s in parts], dim=1)[:, :t]
    return cos, sin


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    pad = -x.shape[0] % rows
    return torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
