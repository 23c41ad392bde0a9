"""A structured-output request waits in the queue until the engine says its grammar is ready;
the requests behind it are admitted meanwhile."""

from __future__ import annotations

import pytest

from scheduler import SchedulerConfig, SchedulerError, SequenceStatus
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from scheduler.sequence import Sequence
from tests.support.schedsim import FakeRunner, drain, make_scheduler, step

JSON = StructuredOutputsParams(kind="json_object", spec="")


def _sched() -> tuple:
    cfg = SchedulerConfig(block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                          max_model_len=64)
    sched = make_scheduler(cfg, 32)
    return sched, FakeRunner(sched)


def test_waiting_for_grammar_is_skipped_until_ready() -> None:
    sched, runner = _sched()
    constrained = Sequence("g", [1, 2, 3], SamplingParams(max_tokens=3, structured_outputs=JSON))
    free = Sequence("f", [4, 5, 6], SamplingParams(max_tokens=3))
    assert constrained.waiting_for_grammar and not free.waiting_for_grammar
    sched.add(constrained)
    sched.add(free)
    out, _ = step(sched, runner)
    assert out.seqs == [free]  # admitted past the request still waiting for its grammar
    assert constrained.status == SequenceStatus.WAITING and sched.num_waiting == 1
    sched.check_invariants()
    sched.grammar_ready("g")
    assert not constrained.waiting_for_grammar
    out, _ = step(sched, runner)
    assert constrained in out.seqs
    drain(sched, runner)
    assert constrained.num_output_tokens == 3 and not sched.has_unfinished()


def test_grammar_ready_for_unknown_request_is_an_error() -> None:
    sched, _ = _sched()
    with pytest.raises(SchedulerError, match="unknown request"):
        sched.grammar_ready("nope")
