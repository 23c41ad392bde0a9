"""bench_kv_cache on a tiny checkpoint: both pools get the same budget, the int8 one holds
more sequences, and a batch the bf16 pool cannot hold preempts there and not in int8."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import bench_kv_cache
from tests.support.models import build_checkpoint


def test_the_int8_pool_holds_more_of_the_batch(tmp_path: Path) -> None:
    folder = build_checkpoint(tmp_path / "tiny", "llama")
    bench_kv_cache.main(["--model", str(folder), "--kv-cache-memory", "40KiB",
                         "--concurrency", "2", "8", "--prompt-len", "12", "--max-tokens", "12",
                         "--rounds", "1", "--out", str(tmp_path / "out")])
    saved = json.loads(next((tmp_path / "out").glob("kv-cache-tiny-auto-*.json")).read_text())
    auto, int8 = saved["capacity"]["auto"], saved["capacity"]["int8"]
    assert auto["pool_mib"] <= 40 / 1024 and int8["pool_mib"] <= 40 / 1024
    assert int8["sequences"] > 1.5 * auto["sequences"]
    runs = saved["throughput"]
    assert all(r["tok_s"] > 0 for r in runs.values())
    assert runs["auto@8"]["preemptions"] > 0 == runs["int8@8"]["preemptions"]
