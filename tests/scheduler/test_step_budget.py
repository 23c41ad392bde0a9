"""The step-time budget: the cost model's fit, its online window, and the scheduler sizing a
step's prompt work by it (scheduler/step_cost.py, scheduler/step_budget.py)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from scheduler.scheduler import Scheduler
from scheduler.step_budget import MIN_POINTS, REFIT_EVERY, WINDOW, StepBudget, TimeAllowance
from scheduler.step_cost import FEATURES, CostModel, NormalEquations, StepShape, fit
from tests.scheduler.test_scheduler import make_sched
from tests.support.schedsim import (
    SIM_COST,
    FakeRunner,
    drain,
    expected_output,
    make_seq,
    shape_of,
    step,
)


def grid() -> list[StepShape]:
    """Shapes that pin every coefficient: decodes, prefills of several chunks, mixes."""
    shapes = []
    for d, p, s, drawn in itertools.product((0, 1, 8, 32), (0, 16, 128, 512), (1, 2, 4),
                                            (0, 1)):
        if d or p:
            shapes.append(StepShape(d, p, d * (100 + 13 * s), p * (40.0 * s + p / (2 * s)),
                                    s if p else 0, drawn * d // (1 + s % 2)))
    return shapes


def close(a: CostModel, b: CostModel, rel: float) -> bool:
    return all(abs(getattr(a, f) - getattr(b, f)) <= rel * abs(getattr(b, f)) + 1e-12
               for f in FEATURES)


def test_fit_recovers_the_coefficients() -> None:
    shapes = grid()
    assert close(fit(shapes, [SIM_COST.step_time(s) for s in shapes]), SIM_COST, 1e-6)
    with pytest.raises(ValueError):
        fit([], [])


def test_a_model_round_trips_through_a_dict() -> None:
    assert CostModel.from_dict(SIM_COST.to_dict()) == SIM_COST
    assert CostModel.from_dict({"fixed": 1, "per_decode": 2, "per_prefill": 3}).per_prefill_seq == 0


def test_points_leave_the_sums_as_they_joined() -> None:
    shapes = grid()
    times = [SIM_COST.step_time(s) * (1 + 0.05 * (i % 3 - 1)) for i, s in enumerate(shapes)]
    eq = NormalEquations()
    for s, t in zip(shapes, times):
        eq.add(s.features(), t)
    for s, t in zip(shapes[:7], times[:7]):
        eq.add(s.features(), t, -1)
    assert eq.count == len(shapes) - 7
    assert close(eq.solve(), fit(shapes[7:], times[7:]), 1e-6)


def test_a_feature_that_would_come_out_negative_is_dropped() -> None:
    """More decode context making steps *faster* is noise: its coefficient is 0, not < 0."""
    truth = CostModel(fixed=0.01, per_decode=0.001, per_prefill=0.0002)
    shapes = [StepShape(d, p, ctx) for d, p, ctx in itertools.product((1, 4, 16), (0, 64),
                                                                      (100, 2000, 9000))]
    times = [truth.step_time(s) - 1e-7 * s.decode_context for s in shapes]
    model = fit(shapes, times)
    assert model.per_decode_ctx == 0 and model.per_prefill > 0 and model.per_decode > 0


@pytest.mark.parametrize("model", [SIM_COST, dataclasses.replace(SIM_COST, per_prefill_attn=0)])
def test_chunk_tokens_is_the_longest_chunk_that_fits(model: CostModel) -> None:
    for computed, seconds in itertools.product((0, 50, 700), (0.0005, 0.0011, 0.004, 0.08)):
        n = model.chunk_tokens(computed, seconds)
        assert n == 0 or model.chunk_time(computed, n) <= seconds * (1 + 1e-12)
        assert model.chunk_time(computed, n + 1) > seconds
    assert model.chunk_tokens(0, model.per_prefill_seq / 2) == 0  # not even a chunk's own cost


def test_free_prompt_tokens_are_bounded_by_the_token_budget_alone() -> None:
    free = CostModel(fixed=0.01, per_decode=0.001, per_prefill=0.0)
    assert free.chunk_tokens(0, 0.001) >= 1 << 20


def test_time_allowance_debits_and_credits_the_chunk_price() -> None:
    allowance = TimeAllowance(0.02, SIM_COST)
    n = allowance.fit(30, 10_000)
    assert n == SIM_COST.chunk_tokens(30, 0.02) and allowance.fit(30, 5) == 5
    allowance.debit(30, n)
    assert allowance.fit(30, 10_000) == 0 < allowance.seconds + 1e-12
    allowance.credit(30, n)
    assert allowance.seconds == pytest.approx(0.02)
    # Once a chunk is refused, a cheaper later one is refused too (no overtaking).
    closing = TimeAllowance(0.0015, SIM_COST, floor=4, taken=True)
    assert SIM_COST.chunk_time(0, 1) < 0.0015 < SIM_COST.chunk_time(20_000, 1)
    assert closing.fit(20_000, 5) == 0 and closing.fit(0, 1) == 0


def feed(budget: StepBudget, model: CostModel, shapes: list[StepShape], repeat: int = 1) -> None:
    for _ in range(repeat):
        for s in shapes:
            budget.observe(s, model.step_time(s))


def test_the_budget_fits_only_once_it_has_seen_decodes_and_prefills() -> None:
    budget = StepBudget(target_s=0.015, stretch=1.5)
    decodes = [StepShape(d, 0, d * (100 + 40 * (d % 4)), sampled_rows=d // (1 + d % 3))
               for d in range(1, 2 * REFIT_EVERY)]
    feed(budget, SIM_COST, decodes)
    budget.observe(StepShape(), 0.01)  # an empty step, and one with no time: ignored
    budget.observe(StepShape(3, 0, 300), 0.0)
    assert budget.model is None and budget.allowance(StepShape(4, 0, 400), 4) is None
    feed(budget, SIM_COST, [StepShape(0, 64 * k, 0, 64.0 * k * (20 * (k % 4) + 32 * k),
                                      1 + k % 3) for k in range(1, MIN_POINTS + 1)])
    feed(budget, SIM_COST, decodes[:REFIT_EVERY])
    assert budget.model is not None and close(budget.model, SIM_COST, 1e-6)


def test_the_allowance_fills_the_step_up_to_the_target_or_the_stretch() -> None:
    budget = StepBudget(target_s=0.02, stretch=1.5)
    feed(budget, SIM_COST, grid(), repeat=2)
    small, wide = StepShape(2, 0, 300), StepShape(48, 0, 9000)
    base = SIM_COST.step_time(small)
    got = budget.allowance(small, 2)
    assert got is not None and got.seconds == pytest.approx(0.02 - base)
    base = SIM_COST.step_time(wide)
    assert base > 0.02  # its decodes alone exceed the target: the stretch decides
    got = budget.allowance(wide, 48)
    assert got is not None and got.seconds == pytest.approx(0.5 * base)
    # With prompts waiting to join, the stretch is of the batch they form: 10 rows now,
    # 40 once the waiting ones are in (their context is priced at the running rows' mean).
    forming = StepShape(10, 0, 1000)
    got = budget.allowance(forming, 40)
    assert got is not None and got.seconds == pytest.approx(
        1.5 * SIM_COST.step_time(StepShape(40, 0, 4000)) - SIM_COST.step_time(forming))


def test_an_outlier_step_is_clipped() -> None:
    budget = StepBudget(target_s=0.015, stretch=1.5)
    feed(budget, SIM_COST, grid(), repeat=2)
    spike = StepShape(4, 0, 500)
    for _ in range(REFIT_EVERY):  # a run of 100x steps (a recompile, a stalled machine)
        budget.observe(spike, 100 * SIM_COST.step_time(spike))
    assert budget.model is not None
    assert budget.model.step_time(spike) < 1.5 * SIM_COST.step_time(spike)


def test_the_window_follows_a_slower_machine() -> None:
    budget = StepBudget(target_s=0.015, stretch=1.5)
    shapes = grid()
    feed(budget, SIM_COST, shapes, repeat=2)
    slower = CostModel(*(2 * getattr(SIM_COST, f) for f in FEATURES))
    # Outliers are clipped at 3x, so a 2x slower machine is learnt in full once the window
    # has turned over.
    feed(budget, slower, shapes, repeat=WINDOW // len(shapes) + 2)
    assert budget.model is not None and close(budget.model, slower, 1e-6)


def test_a_fit_that_prices_prompt_tokens_at_nothing_is_not_taken() -> None:
    """Prompt steps timed below the decode floor (noise) would fit per_prefill < 0, dropped
    to 0: such a fit would let any chunk in, so the budget does not take it."""
    budget = StepBudget(target_s=0.015, stretch=1.5)
    feed(budget, SIM_COST, [StepShape(d, 0, d * (100 + 40 * (d % 4))) for d in range(1, 40)])
    for k in range(1, 40):
        budget.observe(StepShape(0, 16 * k, 0, 128.0 * k * k, 1), 0.009 - 1e-5 * k)
    assert budget.num_refits > 0 and budget.model is None


def fitted_sched(**cfg: Any) -> Scheduler:
    sched = make_sched(64, **cfg)
    assert sched.step_budget is not None
    feed(sched.step_budget, SIM_COST, grid(), repeat=2)
    return sched


def test_the_scheduler_sizes_prompt_chunks_by_the_step_time() -> None:
    sched = fitted_sched(max_num_batched_tokens=256, max_num_seqs=16, target_itl_ms=20.0,
                         prefill_stretch=1.2, decode_step_prefill_tokens=5)
    runner = FakeRunner(sched)
    decoders = [make_seq(f"d{i}", list(range(20 * i + 300, 20 * i + 310)), max_tokens=30)
                for i in range(4)]
    for seq in decoders:
        sched.add(seq)
    out, _ = step(sched, runner)  # nothing decodes yet: the whole token budget is for prompts
    assert out.num_scheduled_tokens == [10, 10, 10, 10]
    long = make_seq("long", list(range(100, 300)), max_tokens=2)
    sched.add(long)
    decode = StepShape(4, 0, 4 * 11, sampled_rows=4)  # make_seq's rows draw (temperature 1)
    left = 0.02 - SIM_COST.step_time(decode)  # the target is above 1.2x the decode time
    out, _ = step(sched, runner)
    chunk = SIM_COST.chunk_tokens(0, left)
    assert 5 < chunk < 200 and out.num_scheduled_tokens == [1, 1, 1, 1, chunk]
    out, _ = step(sched, runner)  # its next chunk, after `chunk` cached tokens, is smaller
    assert out.num_scheduled_tokens[-1] == SIM_COST.chunk_tokens(chunk, left) <= chunk
    drain(sched, runner)
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 2)


def test_before_the_fit_the_token_caps_apply() -> None:
    sched = make_sched(max_num_batched_tokens=64, target_itl_ms=14.0,
                       decode_step_prefill_tokens=5)
    runner = FakeRunner(sched)
    sched.add(make_seq("a", list(range(300, 304)), max_tokens=20))
    step(sched, runner)
    sched.add(make_seq("long", list(range(100, 140)), max_tokens=2))
    out, _ = step(sched, runner)
    assert sched.step_budget is not None and sched.step_budget.model is None
    assert out.num_scheduled_tokens == [1, 5]


def run_closed_loop(sched: Scheduler, streams: int, requests: int) -> list[float]:
    """`streams` clients, each sending a new 200-token prompt (10-32 tokens out) when its
    last one ends; returns the simulated length of every step that carried a decode."""
    runner, n, gaps = FakeRunner(sched), 0, []
    live: set[str] = set()
    while n < requests or sched.has_unfinished():
        while n < requests and len(live) < streams:
            seq = make_seq(f"r{n}", [400 + n, *range(500, 699)], max_tokens=10 + n * 7 % 23)
            sched.add(seq)
            live.add(seq.seq_id)
            n += 1
        decoding = any(s.num_uncomputed_tokens == 1 for s in sched.running)
        out, done = step(sched, runner)
        if decoding:
            gaps.append(SIM_COST.step_time(shape_of(out)))
        live -= {s.seq_id for s in done if s.is_finished}
    return gaps


def test_a_closed_loop_keeps_every_decode_step_under_the_budget() -> None:
    """16 streams with prompts joining all the time: with the budget, no step that carries
    decodes runs past max(target, stretch x its decodes) once the model is fitted (step()
    asserts that), and the longest such step is far shorter than without the budget."""
    cfg: dict[str, Any] = {"max_num_batched_tokens": 512, "max_num_seqs": 16,
                              "block_size": 4, "max_model_len": 256}
    with_budget = run_closed_loop(make_sched(1024, target_itl_ms=12.0, prefill_stretch=1.3,
                                             **cfg), 16, 200)
    without = run_closed_loop(make_sched(1024, **cfg), 16, 200)
    assert max(with_budget[100:]) < 0.6 * max(without[100:])


def test_the_shape_of_a_step() -> None:
    """Decode rows (greedy or drawn), prefill chunks with their attention, as priced."""
    sched = make_sched(max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    greedy = make_seq("g", list(range(300, 305)), max_tokens=5, temperature=0.0)
    drawn = make_seq("d", list(range(400, 403)), max_tokens=5)
    for seq in (greedy, drawn):
        sched.add(seq)
    step(sched, runner)
    sched.add(make_seq("p", list(range(500, 520)), max_tokens=2))
    out = sched.schedule()
    assert shape_of(out) == StepShape(decode_tokens=2, prefill_tokens=20, decode_context=6 + 4,
                                      prefill_attention=20 * 10.5, prefill_seqs=1,
                                      sampled_rows=1)


def test_a_prompt_priced_past_every_allowance_still_advances_and_is_not_overtaken() -> None:
    """A model that prices every chunk above any step (1 s a chunk): the first prompt chunk of
    a step still gets a block (4 tokens here), and a later arrival waits behind it instead
    of taking the room (a long prompt's attention could otherwise starve it forever)."""
    sched = fitted_sched(max_num_batched_tokens=64, target_itl_ms=20.0, prefill_stretch=1.0)
    budget = sched.step_budget
    assert budget is not None and budget.floor == 4
    budget.model = CostModel(fixed=0.01, per_decode=0.001, per_prefill=0.001,
                             per_prefill_seq=1.0)
    budget.observe = lambda shape, seconds: None  # type: ignore[method-assign]
    runner = FakeRunner(sched)
    sched.add(make_seq("a", list(range(300, 304)), max_tokens=30))
    step(sched, runner)
    long = make_seq("long", list(range(100, 110)), max_tokens=2)
    sched.add(long)
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == [1, 4]
    sched.add(make_seq("late", list(range(200, 203)), max_tokens=2))
    plans = []
    for _ in range(3):
        out, _ = step(sched, runner)
        plans.append(dict(zip([s.seq_id for s in out.seqs], out.num_scheduled_tokens)))
    # long's last 2 prompt tokens go before late is let in (a refused chunk closes the step).
    assert plans == [{"a": 1, "long": 4}, {"a": 1, "long": 2}, {"a": 1, "long": 1, "late": 3}]
    drain(sched, runner)
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 2)


def test_a_fast_outlier_is_clipped_too() -> None:
    budget = StepBudget(target_s=0.015, stretch=1.5)
    feed(budget, SIM_COST, grid(), repeat=2)
    for s in grid()[:REFIT_EVERY]:  # timed at 1/50 of their cost (a clock glitch)
        budget.observe(s, SIM_COST.step_time(s) / 50)
    assert budget.model is not None and budget.model.fixed > 0.7 * SIM_COST.fixed


def test_rejected_fits_are_counted_and_tiny_attention_terms_keep_their_precision() -> None:
    budget = StepBudget(target_s=0.015, stretch=1.5)
    feed(budget, SIM_COST, [StepShape(d, 0, d * (100 + 40 * (d % 4))) for d in range(1, 40)])
    for k in range(1, 40):
        budget.observe(StepShape(0, 16 * k, 0, 128.0 * k * k, 1), 0.009 - 1e-5 * k)
    assert budget.model is None and budget.num_rejected == budget.num_refits > 0
    tiny = CostModel(fixed=0.01, per_decode=0.001, per_prefill=0.0001, per_prefill_attn=1e-16)
    assert tiny.chunk_tokens(0, 0.0095) == 95
    assert CostModel(fixed=0.01, per_decode=0.0, per_prefill=5e-324).chunk_tokens(0, 1.0) > 0


def test_a_start_up_calibration_fits_at_once_and_needs_both_kinds_of_step() -> None:
    """StepBudget.calibrate (the engine's synthetic steps at load): one prompt chunk a step,
    as engine/worker/calibration.py times them, and the fit is taken without waiting for
    REFIT_EVERY live steps; decode steps alone are not enough."""
    decodes = [StepShape(d, 0, d * c, sampled_rows=d * drawn) for d in (1, 4, 16)
               for c in (128, 1024) for drawn in (0, 1)]
    prompts = [StepShape(d, p, d * 128, p * (c + p / 2), 1) for d in (0, 4)
               for p in (16, 256) for c in (0, 512)]
    budget = StepBudget(target_s=0.015, stretch=1.5)
    assert not budget.calibrate([(s, SIM_COST.step_time(s)) for s in decodes])
    assert budget.model is None
    assert len(decodes) + len(prompts) < WINDOW
    assert budget.calibrate([(s, SIM_COST.step_time(s)) for s in prompts])
    assert budget.model is not None and close(budget.model, SIM_COST, 1e-6)
