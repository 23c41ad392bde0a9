"""bench_kv_huge_pages: shuffled block tables and the two pools' interleaved timing."""

from __future__ import annotations

import random

import pytest

from benchmarks.bench_kv_huge_pages import measure, parse_args, tables_for
from engine.attention import cpu_kernels


def test_tables_give_every_sequence_its_own_blocks() -> None:
    tables = tables_for([40, 16, 1], block_size=16, num_blocks=50, rng=random.Random(0))
    assert tables.shape == (3, 3)
    used = tables[0, :3].tolist() + tables[1, :1].tolist() + tables[2, :1].tolist()
    assert len(set(used)) == 5 and all(0 <= b < 50 for b in used)


@pytest.mark.skipif(not cpu_kernels.paged_decode_available(), reason="no C++ decode kernel")
def test_measure_times_both_pools() -> None:
    args = parse_args(["--layers", "2", "--repeats", "2", "--decodes", "3"])
    r = measure(args, [20, 33, 5])
    assert r["plain_ms"] > 0 and r["huge_ms"] > 0
    assert r["plain_over_huge"] == pytest.approx(r["plain_ms"] / r["huge_ms"])
