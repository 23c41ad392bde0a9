"""The cost model's offline side: its fit error and the profile files that
benchmarks/profile_step_cost.py writes and benchmarks/simulate_replicas.py reads (the model
and its fit live in scheduler/step_cost.py, where the server's step-time budget fits it)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

from scheduler.step_cost import (  # noqa: F401 - re-exported for the benchmarks
    FEATURES,
    CostModel,
    StepShape,
    chunk_attention,
    fit,
    shape_of,
)


def fit_error(model: CostModel, shapes: Seq[StepShape], seconds: Seq[float]) -> dict[str, float]:
    """Relative errors (median, p90, max) and R^2 of the model on the measured points."""
    pred = [model.step_time(s) for s in shapes]
    rel = sorted(abs(p - t) / t for p, t in zip(pred, seconds, strict=True))
    mean = statistics.fmean(seconds)
    ss_tot = sum((t - mean) ** 2 for t in seconds)
    ss_res = sum((p - t) ** 2 for p, t in zip(pred, seconds, strict=True))
    return {"median_rel_error": statistics.median(rel),
            "p90_rel_error": rel[min(len(rel) - 1, math.ceil(0.9 * len(rel)) - 1)],
            "max_rel_error": rel[-1],
            "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0}


@dataclass(frozen=True, slots=True)
class Profile:
    """A profile file: the fitted model plus the facts the simulator sizes replicas by."""

    model: CostModel
    num_kv_blocks: int  # the KV pool one replica has by default on the profiled machine
    block_size: int
    device: str
    source: str  # file it came from, or "inline"

    @classmethod
    def load(cls, path: Path) -> Profile:
        d = json.loads(path.read_text())
        return cls(CostModel.from_dict(d["fit"]["coefficients"]), int(d["num_kv_blocks"]),
                   int(d["block_size"]), str(d.get("device", "?")), str(path))
