"""bench_quant_step on a tiny checkpoint: both engines run every concurrency, and the
fallback engine really holds the dense copies the one-copy engine does without."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_quant_step
from engine.layers.quantization import many_rows
from tests.support.models import build_checkpoint


@pytest.mark.skipif(not many_rows.available(), reason="no many-row kernel on this CPU")
def test_one_copy_against_dense_copies(tmp_path: Path) -> None:
    folder = build_checkpoint(tmp_path / "tiny", "llama")
    bench_quant_step.main(["--model", str(folder), "--quantization", "int8", "--streams", "1",
                           "9", "--steps", "2", "--rounds", "1", "--out", str(tmp_path / "out")])
    saved = json.loads(next((tmp_path / "out").glob("quant-step-tiny-int8-*.json")).read_text())
    assert set(saved["step_ms_median"]) == {"one copy@1", "one copy@9", "dense copies@1",
                                            "dense copies@9"}
    assert all(ms > 0 for ms in saved["step_ms_median"].values())
    memory = saved["memory_mib"]
    assert memory["one copy"]["dense_copies"] == 0 < memory["dense copies"]["dense_copies"]
    assert memory["one copy"]["quantized_weights"] == memory["dense copies"]["quantized_weights"]
    assert many_rows.available()  # the fallback was only pretended while it loaded
