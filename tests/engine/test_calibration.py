"""The step-time budget's start-up calibration (engine/worker/calibration.py): its grid pins
every cost-model coefficient at the engine's own limits, and an engine with --target-itl-ms
is fitted at load and serves the same greedy tokens as one without the budget."""

from __future__ import annotations

import itertools
import logging
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core import llm_engine
from engine.llm import LLM
from engine.worker import calibration
from engine.worker.calibration import LONGEST_CHUNK, build_step, grid
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.step_budget import StepBudget
from scheduler.step_cost import FEATURES, StepShape, shape_of
from tests.support.schedsim import SIM_COST

LIMITS = [(64, 2048, 4096, 16, 1456), (16, 256, 512, 16, 256), (8, 64, 256, 4, 128),
          (1, 16, 64, 16, 4)]


def shapes(limits: tuple[int, int, int, int, int]) -> list[StepShape]:
    blocks, rng = itertools.cycle(range(64)), random.Random(0)
    return [shape_of(build_step(pt, blocks, limits[3], rng, 49152)) for pt in grid(*limits)]


@pytest.mark.parametrize("limits", LIMITS)
def test_the_grid_stays_within_the_engines_limits(limits: tuple[int, int, int, int, int]) -> None:
    max_rows, max_tokens, max_len, bs, num_blocks = limits
    for d, ctx, p, cached, _ in grid(*limits):
        assert d <= max_rows and d + p <= max_tokens and ctx < max_len
        assert d == 0 or 0 < ctx and d * -(-ctx // bs) <= num_blocks  # rows side by side
        assert p == 0 or 0 < cached + p <= max_len and p <= LONGEST_CHUNK


@pytest.mark.parametrize("limits", LIMITS)
def test_the_grid_pins_every_coefficient(limits: tuple[int, int, int, int, int]) -> None:
    """Step times from a known model: the calibrated fit is that model (each coefficient
    within 1e-6), so none of the terms is confounded with another (the fit from alike live
    steps could not tell the per-token from the per-chunk price)."""
    budget = StepBudget(target_s=0.03, stretch=2.0)
    assert budget.calibrate([(s, SIM_COST.step_time(s)) for s in shapes(limits)])
    assert budget.model is not None
    for f in FEATURES:
        assert getattr(budget.model, f) == pytest.approx(getattr(SIM_COST, f), rel=1e-6), f


def test_an_engine_is_fitted_at_load_and_serves_the_same_tokens(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration runs the real steps (they write the real pool), timed on a clock that
    each step advances by a known model's price: the engine's budget is that model before any
    request (a tiny model's real step times are noise, too flat to price prompt tokens by),
    and the tokens served afterwards are the engine without the budget's."""
    now = [0.0]
    execute = ModelRunner.execute

    def priced(self: ModelRunner, batch: SchedulerOutput, *args: Any) -> Any:
        now[0] += SIM_COST.step_time(shape_of(batch))
        return execute(self, batch, *args)

    monkeypatch.setattr(ModelRunner, "execute", priced)
    monkeypatch.setattr(calibration, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def llm(target_itl_ms: float) -> LLM:
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                                block_size=4, target_itl_ms=target_itl_ms)
        return LLM(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                                num_kv_blocks=128, enforce_eager=True, scheduler=sched))

    calibrated, plain = llm(30.0), llm(0.0)
    budget = calibrated.engine.scheduler.step_budget
    assert budget is not None and budget.model is not None  # before any request
    for f in FEATURES:
        assert getattr(budget.model, f) == pytest.approx(getattr(SIM_COST, f), rel=1e-6), f
    assert plain.engine.scheduler.step_budget is None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 300 + 3 for i in range(10 + 9 * j)] for j in range(6)]
    got = calibrated.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(len(o.token_ids) == 12 for o in got)


def test_a_failed_calibration_leaves_the_budget_to_the_live_steps(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(llm_engine, "calibrate", broken)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                            block_size=4, target_itl_ms=30.0)
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine"):
        llm = LLM(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu",
                               num_kv_blocks=64, enforce_eager=True, scheduler=sched))
    assert "calibration failed (RuntimeError: out of memory)" in caplog.text
    budget = llm.engine.scheduler.step_budget
    assert budget is not None and budget.model is None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids) == 4
