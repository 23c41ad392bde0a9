"""The per-step cost model: an engine step's wall time as a function of what it computes.

    t = fixed + per_decode * D + per_prefill * P + per_decode_ctx * Cd + per_prefill_attn * Ap
          + per_prefill_seq * S + per_sampled_row * R

D: decode rows (one token each); P: prompt tokens in prefill chunks; Cd: the decode rows'
summed context lengths (the K/V each decode reads); Ap: the prefill chunks' query-key pairs
(a chunk of n tokens after c cached ones attends to about n * (c + n / 2) keys); S: prefill
chunks; R: decode rows that draw (temperature > 0) rather than take the argmax. The first two
terms are the weights' matmuls, which grow with tokens; the context terms are attention; S
counts what each chunk costs whatever its length (its own attention call in every layer); R
the softmax and top-p over a vocabulary-wide row (random-token prompts at temperature 1 made
a 64-row step ~1.5x a greedy one).

Fitted online from the server's own steps by scheduler/step_budget.py (the step-time
budget), and offline by benchmarks/profile_step_cost.py for benchmarks/simulate_replicas.py.
Pure standard library: the least-squares fit is a small weighted normal-equation solve, whose
sums (NormalEquations) can be kept current one step at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass
from typing import Any

from scheduler.output import SchedulerOutput

FREE_TOKENS = 1 << 30  # chunk_tokens' answer when prompt tokens cost nothing
FEATURES = ("fixed", "per_decode", "per_prefill", "per_decode_ctx", "per_prefill_attn",
            "per_prefill_seq", "per_sampled_row")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, in the cost model's terms."""

    decode_tokens: int = 0
    prefill_tokens: int = 0
    decode_context: int = 0  # summed context of the decode rows (tokens attended)
    prefill_attention: float = 0.0  # summed query-key pairs of the prefill chunks
    prefill_seqs: int = 0  # prefill chunks (one per sequence)
    sampled_rows: int = 0  # decode rows that draw a token (not greedy)

    def features(self) -> tuple[float, ...]:
        """In FEATURES order; the context terms in thousands so the fit is well scaled."""
        return (1.0, float(self.decode_tokens), float(self.prefill_tokens),
                self.decode_context / 1e3, self.prefill_attention / 1e6,
                float(self.prefill_seqs), float(self.sampled_rows))


def chunk_attention(computed: int, n: int) -> float:
    """Query-key pairs of a causal chunk of n tokens after `computed` cached ones."""
    return n * (computed + (n + 1) / 2)


def shape_of(batch: SchedulerOutput) -> StepShape:
    """The shape of a scheduled step (before postprocess advances the computed counts): a row
    of more than one token is a prefill chunk, one of one a decode row."""
    d = p = ctx = s = r = 0
    attn = 0.0
    for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
        c = seq.num_computed_tokens
        if n == 1:  # a decode row (or a one-token prompt chunk: priced alike)
            d, ctx, r = d + 1, ctx + c + 1, r + (not seq.params.greedy)
        else:
            p, attn, s = p + n, attn + chunk_attention(c, n), s + 1
    return StepShape(d, p, ctx, attn, s, r)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per step: coefficients in FEATURES order (context terms per 1e3 / 1e6)."""

    fixed: float
    per_decode: float
    per_prefill: float
    per_decode_ctx: float = 0.0
    per_prefill_attn: float = 0.0
    per_prefill_seq: float = 0.0
    per_sampled_row: float = 0.0

    def step_time(self, shape: StepShape) -> float:
        coefs = (self.fixed, self.per_decode, self.per_prefill, self.per_decode_ctx,
                 self.per_prefill_attn, self.per_prefill_seq, self.per_sampled_row)
        return max(self.fixed, sum(c * x for c, x in zip(coefs, shape.features(), strict=True)))

    def chunk_time(self, computed: int, n: int) -> float:
        """What a prefill chunk of n tokens after `computed` cached ones adds to a step."""
        return (self.per_prefill_seq + self.per_prefill * n
                + self.per_prefill_attn * chunk_attention(computed, n) / 1e6)

    def chunk_tokens(self, computed: int, seconds: float) -> int:
        """The longest chunk after `computed` cached tokens whose chunk_time fits `seconds`
        (0 if none does, at most FREE_TOKENS); chunk_time is increasing in n, so the positive
        root of (b/2) n^2 + (a + b (c + 1/2)) n + s = seconds, rounded down, is the answer."""
        left = seconds - self.per_prefill_seq
        a, b = self.per_prefill, self.per_prefill_attn / 1e6
        lin = a + b * (computed + 0.5)
        if left <= 0:
            return 0
        if lin <= 0:
            return FREE_TOKENS  # free tokens: the token budget bounds them
        # The root in the form that keeps its precision when b is tiny (no -lin + sqrt(...)).
        return int(min(FREE_TOKENS, 2 * left / (lin + math.sqrt(lin * lin + 2 * b * left))))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(**{k: float(d.get(k, 0.0)) for k in FEATURES})


def fit(shapes: Seq[StepShape], seconds: Seq[float]) -> CostModel:
    """Least squares on relative error, all coefficients >= 0 (see NormalEquations.solve)."""
    if len(shapes) != len(seconds) or not shapes:
        raise ValueError("fit() needs as many timings as shapes, at least one")
    eq = NormalEquations()
    for shape, t in zip(shapes, seconds, strict=True):
        eq.add(shape.features(), t)
    return eq.solve()


class NormalEquations:
    """The sums of a weighted least-squares fit of step times on FEATURES, which points can
    join and leave one at a time (a sliding window of recent steps costs O(k^2) a step)."""

    def __init__(self) -> None:
        k = len(FEATURES)
        self.a = [[0.0] * k for _ in range(k)]
        self.b = [0.0] * k
        self.count = 0

    def add(self, row: Seq[float], t: float, sign: float = 1.0) -> None:
        """Add (sign 1) or remove (sign -1) a point. Weight 1/t^2: the fit minimises each
        point's squared *relative* error, so short decode steps count as much as long ones."""
        w = sign / (t * t)
        for i, xi in enumerate(row):
            if xi:
                self.b[i] += w * xi * t
                ai = self.a[i]
                for j, xj in enumerate(row):
                    ai[j] += w * xi * xj
        self.count += 1 if sign > 0 else -1

    def solve(self) -> CostModel:
        """The fit with every coefficient but `fixed` >= 0: a feature whose coefficient comes
        out negative (noise on a term that barely matters) is dropped and the rest refitted,
        so the model never predicts less time for more work (a greedy active set: a dropped
        feature is not tried again, so this is non-negative, not always the best such fit)."""
        active = list(range(len(FEATURES)))
        while True:
            sol = _solve([[self.a[i][j] for j in active] for i in active],
                         [self.b[i] for i in active])
            coefs = [0.0] * len(FEATURES)
            for i, j in enumerate(active):
                coefs[j] = sol[i]
            negative = [i for i in active if coefs[i] < 0 and i != 0]
            if not negative:
                return CostModel(*coefs)
            active.remove(min(negative, key=lambda i: coefs[i]))


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
