"""Paged attention as one opaque torch custom op, for the compiled forward (engine/worker/compile.py).

torch.compile cannot trace our attention (Python loops over decode groups and prefill chunks,
writes into the pool): left as a plain function it would break the graph at every layer. So
the compiled model calls `torch.ops.pagedserve.paged_attention(q, k, v, layer, scale)`: only
tensors and numbers cross the op boundary. The step's AttentionMetadata (and with it the KV
pool) is not an argument: the runner installs it for the length of one forward with
`forward_context(meta)` and the op reads it from there (vLLM's forward-context shape). The
op writes the step's new K/V into the pool itself; nothing else in the graph reads the pool,
so the write needs no ordering the compiler could break.

Padded tokens: the compiled forward may run a [1, T_bucket] batch whose last rows are
padding. The metadata describes only the real tokens (its write_blocks has one entry per
real token), so the op attends and writes only those and returns zeros for the padding.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.attention.paged import AttentionMetadata, attend_step

OP_NAME = "pagedserve::paged_attention"


class _Context(threading.local):
    meta: AttentionMetadata | None = None


_context = _Context()


@contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    """The metadata the attention op of this thread's next forward reads. Thread-local: the
    engine thread's step and a test's runner on another thread never see each other's."""
    previous, _context.meta = _context.meta, meta
    try:
        yield
    finally:
        _context.meta = previous


def current_metadata() -> AttentionMetadata:
    meta = _context.meta
    if meta is None:
        raise RuntimeError("the paged attention op ran outside forward_context()")
    return meta


# Defined with torch.library.Library rather than @torch.library.custom_op: the latter's Python
# wrapper (autograd hop, aliasing checks) cost ~7 us a call here against ~2, once per layer
# per step. The fake kernel is what torch.compile traces.
_lib = torch.library.Library("pagedserve", "FRAGMENT")
_lib.define("paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale)"
            " -> Tensor")


def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       layer: int, scale: float) -> torch.Tensor:
    """query [1, H, T, hd], key/value [1, kvH, T, hd] -> [1, T, H, hd] (T may include
    padding past the metadata's tokens: those rows come back zero)."""
    return attend_step(query, key, value, layer, scale, current_metadata())


_lib.impl("paged_attention", paged_attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME)
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
      scale: float) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
