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
server's load, thread count and compile state. The first fit comes from a start-up
calibration (calibrate(): synthetic steps of varied shapes that the engine times before it
serves); without one, until the first refit with both decode and prefill steps in the window
(MIN_POINTS of each, and at least REFIT_EVERY steps) the token caps apply as if the budget
were off. The first prompt chunk of a step always gets a KV block's worth of tokens (see
TimeAllowance), so no prompt waits forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.step_cost import CostModel, NormalEquations, StepShape

WINDOW = 512  # recent steps the fit sees: ~5-30 s of serving
REFIT_EVERY = 16  # steps between refits (a 7x7 solve, ~0.1 ms)
MIN_POINTS = 4  # decode steps and prefill steps the window needs before the fit is trusted
# A step observed beyond this factor of the model's prediction, either way, counts as this
# factor: a recompile, a pause or a noisy neighbour (slow), or a clock glitch (fast). The fit
# minimises relative error, so a step timed at 1/50 of its prediction would weigh like
# thousands of ordinary ones (one at 1/5 halved `fixed` in a test); a slow one weighs little.
OUTLIER_CLIP = 3.0


@dataclass(slots=True)
class TokenAllowance:
    """The prompt tokens a step may still take (the budget is off or not fitted yet)."""

    tokens: int

    def fit(self, computed: int, n: int) -> int:
        """The most of n prompt tokens (after `computed` cached ones) that fit (0 once the
        tokens are spent, so nothing is refused while a later prompt is taken)."""
        return min(n, self.tokens)

    def debit(self, computed: int, n: int) -> None:
        self.tokens -= n

    def credit(self, computed: int, n: int) -> None:
        self.tokens += n


@dataclass(slots=True)
class TimeAllowance:
    """The seconds of prompt work a step may still take, priced by the cost model.

    The first chunk a step takes gets at least `floor` tokens even past the allowance, and
    once a chunk is refused nothing more fits: the oldest prompt (running ones come first,
    in admission order) advances every step, and no later one overtakes it. Without that, a
    long prompt whose next chunk the model prices above every allowance (its attention grows
    with its context) would wait while new arrivals' cheap first chunks took the room."""

    seconds: float
    model: CostModel
    floor: int = 0
    taken: bool = False  # some chunk was taken this step
    closed: bool = False  # some chunk was refused this step

    def fit(self, computed: int, n: int) -> int:
        if self.closed:
            return 0
        m = min(n, self.model.chunk_tokens(computed, self.seconds))
        if m == 0 and not self.taken:
            m = min(n, self.floor)
        self.closed = m == 0
        return m

    def debit(self, computed: int, n: int) -> None:
        self.taken = True
        self.seconds -= self.model.chunk_time(computed, n)

    def credit(self, computed: int, n: int) -> None:
        self.seconds += self.model.chunk_time(computed, n)


Allowance = TokenAllowance | TimeAllowance


class StepBudget:
    """Observes steps, keeps the fit current, prices a step's prefill allowance."""

    def __init__(self, target_s: float, stretch: float, floor: int = 16) -> None:
        """`floor`: prompt tokens the first chunk of a step may always take (a KV block)."""
        self.target_s = target_s
        self.stretch = stretch
        self.floor = floor
        self.model: CostModel | None = None  # None until the window can fit one
        self.num_refits = 0
        self.num_rejected = 0  # refits whose model was not taken
        self._eq = NormalEquations()
        self._window: deque[tuple[tuple[float, ...], float]] = deque()
        self._decode_points = 0
        self._prefill_points = 0
        self._since_refit = 0
        self._since_resum = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A finished step's shape (before postprocess advanced it) and its wall time."""
        if seconds <= 0 or (shape.decode_tokens == 0 and shape.prefill_tokens == 0):
            return
        if self.model is not None:
            predicted = self.model.step_time(shape)
            seconds = min(max(seconds, predicted / OUTLIER_CLIP), OUTLIER_CLIP * predicted)
        self._append(shape, seconds)
        self._since_refit += 1
        self._since_resum += 1
        if self._since_resum >= WINDOW:
            self._resum()  # the running sums drift as points leave; start them afresh
        if self._since_refit >= REFIT_EVERY and self._enough_points():
            self._refit()

    def calibrate(self, points: list[tuple[StepShape, float]]) -> bool:
        """Start-up points (engine/worker/calibration.py: synthetic steps of varied shapes,
        timed) joined to the window, then a fit at once if they are enough: the first model
        no longer waits for live steps, nor depends on how alike they are. -> fitted."""
        for shape, seconds in points:  # unclipped, and one fit over all of them at the end
            if seconds > 0 and (shape.decode_tokens or shape.prefill_tokens):
                self._append(shape, seconds)
        if self._enough_points():
            self._refit()
        return self.model is not None

    def _append(self, shape: StepShape, seconds: float) -> None:
        """A point joins the window (and the sums); the oldest leaves past WINDOW."""
        row = shape.features()
        self._push(row, seconds, 1)
        self._window.append((row, seconds))
        if len(self._window) > WINDOW:
            old, t = self._window.popleft()
            self._push(old, t, -1)

    def _push(self, row: tuple[float, ...], seconds: float, sign: int) -> None:
        self._eq.add(row, seconds, sign)
        self._decode_points += sign * (row[1] > 0)
        self._prefill_points += sign * (row[2] > 0)

    def _enough_points(self) -> bool:
        return self._decode_points >= MIN_POINTS and self._prefill_points >= MIN_POINTS

    def _refit(self) -> None:
        self._since_refit = 0
        model = self._eq.solve()
        # A fit that prices prompt tokens at nothing (neither per token nor through their
        # attention) would let any chunk in: keep the last one.
        if model.fixed > 0 and (model.per_prefill > 0 or model.per_prefill_attn > 0):
            self.model = model
        else:
            self.num_rejected += 1
        self.num_refits += 1

    def _resum(self) -> None:
        self._since_resum = 0
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
        d = max(1, decode.decode_tokens)
        rows = max(forming_rows, d)  # the rows to come priced like the running ones
        forming = StepShape(rows, 0, decode.decode_context * rows // d,
                            sampled_rows=decode.sampled_rows * rows // d)
        cap = max(self.target_s, self.stretch * self.model.step_time(forming))
        return TimeAllowance(max(0.0, cap - base), self.model, self.floor)
