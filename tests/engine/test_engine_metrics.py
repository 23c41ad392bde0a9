"""What the engine measures for /metrics: each request's intervals (taken as the events
happen, not guessed by the API) and the tokens-per-step histogram."""

from __future__ import annotations

import pytest

from engine.core.llm_engine import LLMEngine
from engine.protocol import ITERATION_TOKEN_BUCKETS
from engine.worker.model_runner import ModelRunner
from scheduler.sampling_params import SamplingParams
from tests.engine.test_llm_engine import drain, make
from tests.support.faults import FaultyRunner

DELAY = 0.02  # every step takes at least this long


def test_request_timings_follow_the_steps(llama_runner: ModelRunner) -> None:


    engine: LLMEngine = make(llama_runner, max_num_batched_tokens=8)
    engine.runner = FaultyRunner(llama_runner, delay=DELAY)  # type: ignore[assignment]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("long", list(range(10, 30)), params)  # 20 tokens: 3 prefill steps
    engine.add_request("one", [5, 6], SamplingParams(max_tokens=1, ignore_eos=True))
    outs = drain(engine)
    long_t, one_t = outs["long"][-1].timings, outs["one"][-1].timings
    assert long_t is not None and one_t is not None
    assert long_t.queue is not None and long_t.queue >= 0
    assert long_t.prefill is not None and long_t.prefill >= 3 * DELAY  # 3 chunks of 8
    assert long_t.decode is not None and long_t.decode >= 4 * DELAY  # 4 more tokens
    assert long_t.inference == pytest.approx(long_t.prefill + long_t.decode)
    assert one_t.decode == 0.0 and one_t.prefill is not None and one_t.prefill >= DELAY
    # "one" waited behind the first chunk of "long" (the budget is 8 tokens)
    assert one_t.queue is not None and one_t.queue >= DELAY


def test_iteration_tokens_histogram(llama_runner: ModelRunner) -> None:


    engine = make(llama_runner, max_num_batched_tokens=8)
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=3, ignore_eos=True))
    drain(engine)
    s = engine.stats()
    # steps of 8, 8, 4 prompt tokens (the last samples), then 2 decodes of 1 token
    assert s.iteration_tokens_sum == 20 + 2
    assert len(s.iteration_tokens) == len(ITERATION_TOKEN_BUCKETS) + 1
    counts = dict(zip(ITERATION_TOKEN_BUCKETS, s.iteration_tokens))
    assert counts[1] == 2 and counts[8] == 5 and s.iteration_tokens[-1] == s.num_steps == 5


def test_a_request_never_scheduled_has_no_intervals(llama_runner: ModelRunner) -> None:


    engine = make(llama_runner)
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=3))
    final = engine.abort_request("x")
    assert final is not None and final.timings is not None
    assert final.timings.queue is None and final.timings.inference is None
