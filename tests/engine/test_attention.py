"""Paged attention equals dense SDPA over each sequence's own context (fp32, 1e-5)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.attention import build_metadata, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 6, 2, 16, 4, 64, 2


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: int) -> torch.Tensor:
    """q [H, n, hd] at positions c..c+n-1; k, v [kvH, c+n, hd] -> [n, H, hd]."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    n = q.shape[1]
    mask = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0].transpose(0, 1)


def run_case(specs: list[tuple[int, int]], seed: int) -> None:
    """specs: (already computed c, scheduled n) per sequence; n == 1 sequences are decodes."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pool = torch.zeros(LAYERS, 2, NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    layer = 1
    tables, full_k, full_v = [], [], []
    for c, n in specs:  # fill each context's first c tokens into the pool through its table
        table = [free.pop() for _ in range(-(-(c + n) // BLOCK))]
        k = torch.randn(KV_HEADS, c + n, HEAD_DIM, generator=gen)
        v = torch.randn(KV_HEADS, c + n, HEAD_DIM, generator=gen)
        for p in range(c):
            pool[layer, 0, table[p // BLOCK], :, p % BLOCK] = k[:, p]
            pool[layer, 1, table[p // BLOCK], :, p % BLOCK] = v[:, p]
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
    order = sorted(range(len(specs)), key=lambda i: specs[i][1] != 1)  # decodes first
    slots, decodes, prefills, qs, ks, vs, starts = [], [], [], [], [], [], {}
    for i in order:
        c, n = specs[i]
        starts[i] = len(slots)
        slots += [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(c, c + n)]
        if n == 1:
            decodes.append((tables[i], c + 1))
        else:
            prefills.append((starts[i], n, c, tables[i]))
        qs.append(torch.randn(HEADS, n, HEAD_DIM, generator=gen))
        ks.append(full_k[i][:, c:])
        vs.append(full_v[i][:, c:])
    meta = build_metadata(pool, BLOCK, slots, decodes, prefills, torch.device("cpu"))
    q, k, v = torch.cat(qs, 1)[None], torch.cat(ks, 1)[None], torch.cat(vs, 1)[None]
    out, _ = paged_attention(SimpleNamespace(layer_idx=layer), q, k, v, None,
                             scaling=HEAD_DIM ** -0.5, attn_metadata=meta)
    assert out.shape == (1, len(slots), HEADS, HEAD_DIM)
    for j, i in enumerate(order):
        c, n = specs[i]
        ref = dense_reference(qs[j], full_k[i], full_v[i], c)
        torch.testing.assert_close(out[0, starts[i]:starts[i] + n], ref, atol=1e-5, rtol=1e-5)
    for i, (c, n) in enumerate(specs):  # the new K/V now sit in their slots
        p = c + n - 1
        torch.testing.assert_close(pool[layer, 0, tables[i][p // BLOCK], :, p % BLOCK],
                                   full_k[i][:, p])
    assert pool[0].abs().sum() == 0  # other layers untouched


@pytest.mark.parametrize("seed", range(4))
def test_mixed_decodes_and_prefill_chunks_match_dense(seed: int) -> None:
    rng = random.Random(seed)
    specs = [(rng.randint(0, 30), 1) for _ in range(5)]  # decodes (c == 0 included)
    specs += [(0, rng.randint(2, 12)), (rng.randint(1, 20), rng.randint(2, 9))]  # prefills
    rng.shuffle(specs)
    run_case(specs, seed)


def test_only_decodes_and_only_prefills() -> None:
    run_case([(7, 1), (0, 1), (15, 1)], seed=10)
    run_case([(0, 5), (3, 4)], seed=11)


def test_decode_block_padding_is_masked() -> None:
    # One long and one short context: the short one's padded table points at block 0,
    # which holds another sequence's data that must not leak in.
    run_case([(37, 1), (2, 1)], seed=12)
