"""The per-step cost model: an engine step's wall time as a function of what it computes.

    t = fixed + per_decode * D + per_prefill * P + per_decode_ctx * Cd + per_prefill_attn * Ap

D: decode rows (one token each); P: prompt tokens in prefill chunks; Cd: the decode rows'
summed context lengths (the K/V each decode reads); Ap: the prefill chunks' query-key pairs
(a chunk of n tokens after c cached ones attends to about n * (c + n / 2) keys). The first two
terms are the weights' matmuls, which grow with tokens; the context terms are attention.

Measured by benchmarks/profile_step_cost.py and read by benchmarks/simulate_replicas.py: the
simulator takes any profile JSON of this shape, so a GPU profile can replace the CPU one.
Pure standard library: the least-squares fit is a small weighted normal-equation solve.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scheduler.output import SchedulerOutput

FEATURES = ("fixed", "per_decode", "per_prefill", "per_decode_ctx", "per_prefill_attn")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, in the cost model's terms."""

    decode_tokens: int = 0
    prefill_tokens: int = 0
    decode_context: int = 0  # summed context of the decode rows (tokens attended)
    prefill_attention: float = 0.0  # summed query-key pairs of the prefill chunks

    def features(self) -> tuple[float, ...]:
        """In FEATURES order; the context terms in thousands so the fit is well scaled."""
        return (1.0, float(self.decode_tokens), float(self.prefill_tokens),
                self.decode_context / 1e3, self.prefill_attention / 1e6)


def chunk_attention(computed: int, n: int) -> float:
    """Query-key pairs of a causal chunk of n tokens after `computed` cached ones."""
    return n * (computed + (n + 1) / 2)


def shape_of(batch: SchedulerOutput) -> StepShape:
    """The shape of a scheduled step (before postprocess advances the computed counts)."""
    d = p = ctx = 0
    attn = 0.0
    for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
        c = seq.num_computed_tokens
        if n == 1:
            d, ctx = d + 1, ctx + c + 1
        else:
            p, attn = p + n, attn + chunk_attention(c, n)
    return StepShape(d, p, ctx, attn)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per step: coefficients in FEATURES order (context terms per 1e3 / 1e6)."""

    fixed: float
    per_decode: float
    per_prefill: float
    per_decode_ctx: float = 0.0
    per_prefill_attn: float = 0.0

    def step_time(self, shape: StepShape) -> float:
        coefs = (self.fixed, self.per_decode, self.per_prefill, self.per_decode_ctx,
                 self.per_prefill_attn)
        return max(self.fixed, sum(c * x for c, x in zip(coefs, shape.features(), strict=True)))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(**{k: float(d.get(k, 0.0)) for k in FEATURES})


def fit(shapes: Seq[StepShape], seconds: Seq[float]) -> CostModel:
    """Least squares on relative error (weights 1/t), all coefficients >= 0: a feature whose
    coefficient comes out negative (noise on a term that barely matters) is dropped and the
    rest refitted, so the model never predicts less time for more work."""
    if len(shapes) != len(seconds) or not shapes:
        raise ValueError("fit() needs as many timings as shapes, at least one")
    active = list(range(len(FEATURES)))
    while True:
        coefs = _weighted_lstsq([s.features() for s in shapes], list(seconds), active)
        negative = [i for i in active if coefs[i] < 0 and i != 0]
        if not negative:
            return CostModel(*coefs)
        active.remove(min(negative, key=lambda i: coefs[i]))


def _weighted_lstsq(rows: list[tuple[float, ...]], y: list[float], active: list[int]
                    ) -> list[float]:
    k = len(active)
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for row, t in zip(rows, y, strict=True):
        w = 1.0 / (t * t)  # minimise the squared *relative* error of each point
        xs = [row[i] for i in active]
        for i in range(k):
            b[i] += w * xs[i] * t
            for j in range(k):
                a[i][j] += w * xs[i] * xs[j]
    sol = _solve(a, b)
    coefs = [0.0] * len(FEATURES)
    for i, j in enumerate(active):
        coefs[j] = sol[i]
    return coefs


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular column gets coefficient 0."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            continue
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-300 else 0.0 for i in range(n)]


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
