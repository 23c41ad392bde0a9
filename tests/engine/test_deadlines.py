"""Request deadlines in LLMEngine, on a controlled clock: a request still queued at its
deadline fails with error_code "queue_timeout"; a running one finishes with what it has
(finish_reason "timeout"); either way its blocks are free and the others are untouched."""

from __future__ import annotations

from typing import Any

from engine.core.llm_engine import LLMEngine
from engine.outputs import ErrorCode, RequestOutput
from engine.worker.model_runner import ModelRunner
from scheduler.sampling_params import SamplingParams
from tests.engine.test_llm_engine import drain, make
from tests.support.faults import FaultyRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_with_clock(runner: ModelRunner, **sched: Any) -> tuple[LLMEngine, Clock]:
    engine = make(runner, **sched)
    clock = Clock()
    engine.clock = clock
    return engine, clock


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def alone(runner: ModelRunner, prompt: list[int]) -> list[int]:
    engine = make(runner)
    engine.add_request("solo", prompt, GREEDY)
    return tokens(drain(engine)["solo"])


def test_queued_request_past_its_deadline_fails_and_frees_its_place(
        llama_runner: ModelRunner) -> None:
    engine, clock = engine_with_clock(llama_runner, max_num_seqs=1)
    engine.add_request("running", [3, 4, 5], GREEDY)
    engine.add_request("queued", [6, 7, 8], GREEDY, arrival_time=clock.now,
                       deadline=clock.now + 5)
    first = engine.step()  # only "running" fits (max_num_seqs=1)
    assert {o.request_id for o in first} == {"running"}
    assert engine.scheduler.num_waiting == 1
    clock.now += 5
    second = engine.step()
    expired = [o for o in second if o.request_id == "queued"]
    assert len(expired) == 1
    out = expired[0]
    assert out.finished and out.error_code == "queue_timeout"
    assert "5.0 s in the queue" in (out.error or "")
    assert out.new_token_ids == () and out.num_output_tokens == 0
    assert engine.scheduler.num_waiting == 0 and "queued" not in engine.requests
    rest = drain(engine)  # the running request is untouched: same tokens as alone
    running = [o for o in [*first, *second] if o.request_id == "running"]
    assert tokens([*running, *rest["running"]]) == alone(llama_runner, [3, 4, 5])


def test_running_request_past_its_deadline_finishes_with_what_it_has(
        llama_runner: ModelRunner) -> None:
    def run(deadline: float | None) -> dict[str, list[RequestOutput]]:
        engine, clock = engine_with_clock(llama_runner)
        engine.add_request("slow", [3, 4, 5], GREEDY,
                           deadline=None if deadline is None else clock.now + deadline)
        engine.add_request("other", [6, 7, 8], GREEDY)
        outs: dict[str, list[RequestOutput]] = {}
        for step in range(5):
            if step == 4:  # four steps in, the deadline passes
                clock.now += 1
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
        for rid, more in drain(engine).items():  # drain asserts every block is free again
            outs[rid].extend(more)
        return outs

    outs, reference = run(deadline=1), run(deadline=None)
    final = outs["slow"][-1]
    assert final.finish_reason == "timeout" and final.error is None
    got = tokens(outs["slow"])
    assert 0 < len(got) < GREEDY.max_tokens
    # What it has is what it would have had: the same batch without a deadline, cut short.
    assert got == tokens(reference["slow"])[:len(got)]
    assert outs["other"][-1].finish_reason == "length"
    assert len(tokens(outs["other"])) == GREEDY.max_tokens


def test_deadline_in_the_future_changes_nothing(llama_runner: ModelRunner) -> None:
    engine, clock = engine_with_clock(llama_runner)
    engine.add_request("a", [3, 4, 5], GREEDY, deadline=clock.now + 3600)
    outs = drain(engine)["a"]
    assert outs[-1].finish_reason == "length"
    assert tokens(outs) == alone(llama_runner, [3, 4, 5])


def test_reused_request_id_is_not_expired_by_its_predecessors_deadline(
        llama_runner: ModelRunner) -> None:
    engine, clock = engine_with_clock(llama_runner)
    engine.add_request("x", [3, 4, 5], GREEDY, deadline=clock.now + 1)
    drain(engine)  # finished well before its deadline; the heap entry is now stale
    engine.add_request("x", [3, 4, 5], GREEDY, deadline=clock.now + 100)
    clock.now += 2
    outs = drain(engine)["x"]
    assert outs[-1].finish_reason == "length"


def test_stale_deadlines_do_not_pile_up(llama_runner: ModelRunner) -> None:
    engine, clock = engine_with_clock(llama_runner)
    quick = SamplingParams(temperature=0.0, max_tokens=1)
    for i in range(300):  # each finishes long before its deadline
        engine.add_request(f"q{i}", [3, 4], quick, deadline=clock.now + 3600)
        drain(engine)
    assert len(engine._deadlines) <= 2 * 1 + 64 + 1


def test_deadline_that_passed_before_a_failed_step_still_answers_timeout(
        llama_runner: ModelRunner) -> None:
    # Deadlines are checked at the start of the step, so those requests have their answer
    # before the forward fails: timeout / queue_timeout, not "engine step failed".
    runner = FaultyRunner(llama_runner)
    engine, clock = engine_with_clock(runner, max_num_seqs=2)  # type: ignore[arg-type]
    engine.add_request("slow", [3, 4, 5], GREEDY, deadline=clock.now + 5)
    engine.add_request("other", [6, 7, 8], GREEDY)
    engine.add_request("queued", [9, 10, 11], GREEDY, arrival_time=clock.now,
                       deadline=clock.now + 5)
    engine.step()  # slow and other run, queued waits (max_num_seqs=2)
    clock.now += 5
    runner.fail = 1
    outs = {o.request_id: o for o in engine.step()}
    assert outs["slow"].finish_reason == "timeout" and outs["slow"].error is None
    assert outs["queued"].error_code == ErrorCode.QUEUE_TIMEOUT
    assert outs["other"].error_code == ErrorCode.STEP_FAILED
    assert all(o.finished for o in outs.values()) and not engine.has_unfinished()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
