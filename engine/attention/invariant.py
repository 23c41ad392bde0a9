"""Attention in batch-invariant mode (engine/layers/batch_invariant.py): a query's result depends
only on its own sequence and position.

- Decodes (build_metadata(..., batch_invariant=True)): each decode's context is padded to
  its own block count (never to a neighbour's), and a group holds only decodes of that same
  width, so the bmm and softmax a decode goes through have the same shapes alone or in a
  busy step.
- Prefill chunks (here): queries are tiled by KV block. The queries of block b (positions
  b*bs .. b*bs + bs - 1) attend as one [bs x (b + 1) * bs] tile, rows outside the chunk
  zero and masked keys at -inf, whatever the chunk's start and length. So a prompt
  position gives the same bits whether its prompt came in one chunk or several, next to
  other sequences or alone (prompts are chunked differently in a busy step). A sliding
  window is a mask on the same tile, so it changes no shape (blocks released out of the
  window are read as block 0, masked: ModelRunner._held_blocks keeps positions absolute).

A decode and a prefill of the same position still use different shapes (padding every
decode to a block of queries would cost block_size times the decode attention), so a
sequence recomputed after a preemption may continue differently from one that was not.
"""

from __future__ import annotations

import torch

from engine.attention.scores import FULL, ScoreRule, cap_scores, softmax


def tiled_prefill_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                            num_computed: int, block_size: int, scale: float,
                            rule: ScoreRule = FULL) -> torch.Tensor:
    """One prefill chunk's queries q [H, n, hd] (its K/V already in the pool) over its
    sequence's context as gathered from the pool, k_ctx, v_ctx [kvH, nb * bs, hd], where
    num_computed tokens came before the chunk -> [n, H, hd]. rule: the layer's window, soft
    cap and sinks."""
    heads, n, head_dim = q.shape
    kv_heads, bs, c = k_ctx.shape[0], block_size, num_computed
    out = q.new_empty(n, heads, head_dim)
    for b in range(c // bs, (c + n - 1) // bs + 1):
        lo, hi = max(c, b * bs), min(c + n, (b + 1) * bs)  # chunk positions in block b
        tile = q.new_zeros(heads, bs, head_dim)
        tile[:, lo - b * bs:hi - b * bs] = q[:, lo - c:hi - c]
        res = _block_tile(tile, k_ctx[:, :(b + 1) * bs], v_ctx[:, :(b + 1) * bs], kv_heads,
                          scale, rule)  # [H, bs, hd]
        out[lo - c:hi - c] = res[:, lo - b * bs:hi - b * bs].transpose(0, 1)
    return out


def _block_tile(tile: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int,
                scale: float, rule: ScoreRule = FULL) -> torch.Tensor:
    """Queries of one block, tile [H, bs, hd], over keys k, v [kvH, W, hd] where
    W = (b + 1) * bs; query row r sits at position W - bs + r -> [H, bs, hd]."""
    heads, bs, head_dim = tile.shape
    width = k.shape[1]
    qg = tile.reshape(kv_heads, heads // kv_heads * bs, head_dim)  # q head h: kv h // G
    scores = torch.bmm(qg, k.transpose(1, 2)).float() * scale  # [kvH, G * bs, W]
    if rule.softcap:
        scores = cap_scores(scores, rule.softcap)
    keys = torch.arange(width, device=tile.device)
    rows = torch.arange(bs, device=tile.device) + (width - bs)
    visible = keys[None, :] <= rows[:, None]
    if rule.window:
        visible &= keys[None, :] > rows[:, None] - rule.window
    visible = visible.repeat(heads // kv_heads, 1)  # [G * bs, W]
    scores.masked_fill_(~visible, float("-inf"))
    sink = None  # row g * bs + r of kv head j is query head j * G + g's
    if rule.sink is not None:
        sink = rule.sink.view(kv_heads, -1, 1).expand(-1, -1, bs).reshape(kv_heads, -1, 1)
    probs = softmax(scores, sink).to(tile.dtype)
    return torch.bmm(probs, v).view(heads, bs, head_dim)
