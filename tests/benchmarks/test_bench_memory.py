"""benchmarks/bench_memory.py on a tiny checkpoint: each mode in its own process, the
engine's account in the JSON, a mode that fails reported with its error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_memory
from tests.support.models import build_checkpoint


def test_each_mode_is_measured_in_its_own_process(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    folder = build_checkpoint(tmp_path / "tiny", "llama")
    monkeypatch.setattr(bench_memory, "RESULTS_DIR", tmp_path / "results")
    bench_memory.main(["--model", str(folder), "--quantization", "int8", "int5",
                       "--dtype", "float32", "--kv-cache-memory", str(1 << 20)])
    saved = json.loads(next((tmp_path / "results").glob("memory-tiny-*.json")).read_text())
    int8, bad = saved["rows"]
    from engine.layers.quantization import many_rows

    assert int8["quantized_weights"] > 0
    # one copy where the many-row kernel serves large steps, dense copies where it cannot
    assert (int8["dense_copies"] == 0) == many_rows.available()
    assert int8["dense_weights"] > 0  # the embedding: its lookup stays dense
    assert int8["kv_pool"] >= 1 << 19 and 0 < int8["resident"] <= int8["peak"]
    assert "quantization must be" in " ".join(bad["error"])
    assert next((tmp_path / "results").glob("memory-tiny-*.png")).stat().st_size > 0
