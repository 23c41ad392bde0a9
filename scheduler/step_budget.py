"""The step-time budget (`--target-itl-ms`): how many prompt tokens a step that carries decodes
may take, from a cost model of the step fitted to the engine's own recent step times.

A stream's inter-token latency is the length of the steps that carry it, so a step that
mixes a long prompt chunk into a decode batch is a pause in every running stream. A fixed
token cap (decode_step_prefill_tokens) cannot know what its tokens cost: the same 256
prompt tokens are a small share of a 64-row step and a long stall for 4 rows. The budget
instead asks the cost model (scheduler/step_cost.py) what the step's decodes alone cost and
lets prompt chunks fill the time up to

    max(target, prefill_stretch * decode-only time of the forming batch)

The second term keeps prompts flowing when the decodes alone come near the target (a wide
batch): its streams then pause at most prefill_stretch times their steady gap. The forming
batch is the running decodes plus the prompts waiting to join them (see allowance()). A step
with nothing decoding has no stream to stall and keeps the whole token budget.

The model is refitted every REFIT_EVERY steps over the last WINDOW steps, so it follows the
server's load, thread count and compile state; until the window holds both decode and
prefill steps (MIN_POINTS of each) the token caps apply as if the budget were off.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.step_cost import CostModel, NormalEquations, StepShape

WINDOW = 512  # recent steps the fit sees: ~5-30 s of serving
REFIT_EVERY = 16  # steps between refits (a 7x7 solve, ~0.1 ms)
MIN_POINTS = 4  # decode steps and prefill steps the window needs before the fit is trusted
# A step observed above this multiple of the model's prediction counts as this multiple: a
# garbage collection, a recompile or a noisy neighbour must not teach the model that every
# step is slow (it is relative error that the fit minimises, so one 50x outlier would
# outweigh hundreds of ordinary steps).
OUTLIER_CLIP = 3.0


@dataclass(slots=True)
class TokenAllowance:
    """The prompt tokens a step may still take (the budget is off or not fitted yet)."""

    tokens: int

    def fit(self, computed: int, n: int) -> int:
        """The most of n prompt tokens (after `computed` cached ones) that fit."""
        return min(n, self.tokens)

    def debit(self, computed: int, n: int) -> None:
        self.tokens -= n

    def credit(self, computed: int, n: int) -> None:
        self.tokens += n


@dataclass(slots=True)
class TimeAllowance:
    """The seconds of prompt work a step may still take, priced by the cost model."""

    seconds: float
    model: CostModel

    def fit(self, computed: int, n: int) -> int:
        return min(n, self.model.chunk_tokens(computed, self.seconds))

    def debit(self, computed: int, n: int) -> None:
        self.seconds -= self.model.chunk_time(computed, n)

    def credit(self, computed: int, n: int) -> None:
        self.seconds += self.model.chunk_time(computed, n)


Allowance = TokenAllowance | TimeAllowance


class StepBudget:
    """Observes steps, keeps the fit current, prices a step's prefill allowance."""

    def __init__(self, target_s: float, stretch: float) -> None:
        self.target_s = target_s
        self.stretch = stretch
        self.model: CostModel | None = None  # None until the window can fit one
        self.num_refits = 0
        self._eq = NormalEquations()
        self._window: deque[tuple[tuple[float, ...], float]] = deque()
        self._decode_points = 0
        self._prefill_points = 0
        self._since_refit = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A finished step's shape (before postprocess advanced it) and its wall time."""
        if seconds <= 0 or (shape.decode_tokens == 0 and shape.prefill_tokens == 0):
            return
        if self.model is not None:
            seconds = min(seconds, OUTLIER_CLIP * self.model.step_time(shape))
        row = shape.features()
        self._push(row, seconds, 1)
        self._window.append((row, seconds))
        if len(self._window) > WINDOW:
            old, t = self._window.popleft()
            self._push(old, t, -1)
        self._since_refit += 1
        if self._since_refit >= REFIT_EVERY and self._enough_points():
            self._refit()

    def _push(self, row: tuple[float, ...], seconds: float, sign: int) -> None:
        self._eq.add(row, seconds, sign)
        self._decode_points += sign * (row[1] > 0)
        self._prefill_points += sign * (row[2] > 0)

    def _enough_points(self) -> bool:
        return self._decode_points >= MIN_POINTS and self._prefill_points >= MIN_POINTS

    def _refit(self) -> None:
        self._since_refit = 0
        if self.num_refits % (WINDOW // REFIT_EVERY) == 0:
            self._resum()  # the running sums drift as points leave; start them afresh
        model = self._eq.solve()
        # A fit that prices prompt tokens at nothing would let any chunk in; keep the last one.
        if model.per_prefill > 0 and model.fixed > 0:
            self.model = model
        self.num_refits += 1

    def _resum(self) -> None:
        self._eq = NormalEquations()
        for row, t in self._window:
            self._eq.add(row, t)

    def allowance(self, decode: StepShape, forming_rows: int) -> TimeAllowance | None:
        """The prompt-work allowance of a step whose decodes are `decode` (at least one row),
        while the batch is forming towards `forming_rows` decode rows (the running ones and
        the waiting prompts, up to max_num_seqs); None while there is no fit (the caller
        falls back to its token caps).

        The stretch is of the forming batch's decode step, not of this one: in a burst of
        64 prompts, the first 10 admitted decode in 20 ms steps, but every stream will be
        paced by the 64-row step (~60 ms here) once the rest are in, so holding this step
        to 1.5x 20 ms would admit the rest a prompt a step, and their first tokens would
        wait seconds to spare the running streams a gap no longer than their steady pace."""
        if self.model is None:
            return None
        base = self.model.step_time(decode)
        d = decode.decode_tokens
        rows = max(forming_rows, d)  # the rows to come priced like the running ones
        forming = StepShape(rows, 0, decode.decode_context * rows // d,
                            sampled_rows=decode.sampled_rows * rows // d)
        cap = max(self.target_s, self.stretch * self.model.step_time(forming))
        return TimeAllowance(max(0.0, cap - base), self.model)
