"""Paged attention equals dense SDPA over each sequence's own context (fp32, 1e-5)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.attention.paged import (
    AttentionMetadata,
    build_metadata,
    paged_attention,
    split_decodes,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 6, 2, 16, 4, 64, 2


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: int) -> torch.Tensor:
    """q [H, n, hd] at positions c..c+n-1; k, v [kvH, c+n, hd] -> [n, H, hd]."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    n = q.shape[1]
    mask = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0].transpose(0, 1)


def run_case(specs: list[tuple[int, int]], seed: int, budget: int | None = None,
             kernel: bool = False) -> tuple[torch.Tensor, AttentionMetadata]:
    """specs: (already computed c, scheduled n) per sequence; n == 1 sequences are decodes.
    budget: the decode gather budget in bytes (None: the CPU default); kernel: decodes through
    the C++ kernel (engine/attention/cpu_kernels.py). Returns the output."""
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
    slots: list[int] = []
    decodes: list[tuple[list[int], int]] = []
    prefills: list[tuple[int, int, int, list[int]]] = []
    qs: list[torch.Tensor] = []
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    starts: dict[int, int] = {}
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
    meta = build_metadata(pool, BLOCK, slots, decodes, prefills, torch.device("cpu"),
                          gather_budget=budget, paged_decode_kernel=kernel)
    assert (meta.decode_tables is not None) == (kernel and bool(decodes))
    q, k, v = torch.cat(qs, 1)[None], torch.cat(ks, 1)[None], torch.cat(vs, 1)[None]
    out, _ = paged_attention(SimpleNamespace(layer_idx=layer),  # type: ignore[arg-type]
                             q, k, v, None,
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
    return out, meta


def _kernel_or_skip(kernel: bool) -> bool:
    if kernel:
        from engine.attention import cpu_kernels

        if not cpu_kernels.paged_decode_available():
            pytest.skip("the CPU paged-decode kernel did not build here (no g++?)")
    return kernel


BACKENDS = pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])


@BACKENDS
@pytest.mark.parametrize("seed", range(4))
def test_mixed_decodes_and_prefill_chunks_match_dense(seed: int, kernel: bool) -> None:
    rng = random.Random(seed)
    specs = [(rng.randint(0, 30), 1) for _ in range(5)]  # decodes (c == 0 included)
    specs += [(0, rng.randint(2, 12)), (rng.randint(1, 20), rng.randint(2, 9))]  # prefills
    rng.shuffle(specs)
    run_case(specs, seed, kernel=_kernel_or_skip(kernel))


@BACKENDS
def test_only_decodes_and_only_prefills(kernel: bool) -> None:
    run_case([(7, 1), (0, 1), (15, 1)], seed=10, kernel=_kernel_or_skip(kernel))
    run_case([(0, 5), (3, 4)], seed=11, kernel=kernel)


@BACKENDS
def test_decode_block_padding_is_masked(kernel: bool) -> None:
    # One long and one short context: the short one's padded table points at block 0,
    # which holds another sequence's data that must not leak in.
    run_case([(37, 1), (2, 1)], seed=12, kernel=_kernel_or_skip(kernel))


BLOCK_BYTES = 2 * KV_HEADS * BLOCK * HEAD_DIM * 4  # K + V of one block, fp32


@pytest.mark.parametrize("seed", range(3))
def test_grouped_decodes_equal_one_group(seed: int) -> None:
    rng = random.Random(seed)
    specs = [(rng.randint(0, 40), 1) for _ in range(9)] + [(3, 5)]  # a prefill rides along
    one, meta = run_case(specs, seed, budget=1 << 40)
    assert len(meta.decode_groups) == 1
    for budget in (1, 3 * BLOCK_BYTES, 12 * BLOCK_BYTES):  # each decode alone; a few; more
        grouped, meta = run_case(specs, seed, budget=budget)
        assert len(meta.decode_groups) > 1
        spans = [(g.start, g.end) for g in meta.decode_groups]
        assert spans[0][0] == 0 and spans[-1][1] == meta.num_decodes == 9
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # contiguous, in order
        torch.testing.assert_close(grouped, one, atol=1e-6, rtol=1e-6)


def test_decode_group_is_padded_to_its_own_widest_table() -> None:
    _, meta = run_case([(30, 1), (2, 1), (3, 1)], seed=13, budget=8 * BLOCK_BYTES)
    assert [(g.start, g.end) for g in meta.decode_groups] == [(0, 1), (1, 3)]
    assert [g.mask.shape for g in meta.decode_groups] == [(1, 8 * BLOCK), (2, BLOCK)]
    assert [g.rows.numel() for g in meta.decode_groups] == [8 * KV_HEADS, 2 * KV_HEADS]


def test_split_decodes_keeps_each_group_within_budget() -> None:
    # group bytes = size * widest table * block bytes (10 here)
    assert split_decodes([], 10, 100) == []
    assert split_decodes([2, 2, 2], 10, 1000) == [(0, 3)]
    assert split_decodes([2, 2, 2, 2, 2], 10, 40) == [(0, 2), (2, 4), (4, 5)]
    # a wide table closes the group before it, and starts its own
    assert split_decodes([1, 1, 6, 1], 10, 60) == [(0, 2), (2, 3), (3, 4)]
    assert split_decodes([1, 1, 1, 6], 10, 60) == [(0, 3), (3, 4)]
    # a decode over the budget on its own still runs, alone
    assert split_decodes([9, 1], 10, 50) == [(0, 1), (1, 2)]
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 20) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(1, 400)
        groups = split_decodes(sizes, 10, budget)
        assert [s for s, _ in groups] == [0] + [e for _, e in groups[:-1]]
        assert groups[-1][1] == len(sizes)
        for s, e in groups:
            assert e - s == 1 or (e - s) * max(sizes[s:e]) * 10 <= budget
            if e < len(sizes):  # greedy: the next decode would not have fitted
                assert (e + 1 - s) * max(sizes[s:e + 1]) * 10 > budget
