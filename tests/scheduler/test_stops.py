"""Stop conditions checked in Scheduler.postprocess (hand-made sampled tokens)."""

from __future__ import annotations

import pytest

from scheduler import SchedulerConfig, SequenceStatus
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence
from tests.support.schedsim import assert_all_free, make_scheduler, make_seq

EOS = 0


def run_with_tokens(seq: Sequence, tokens: list[int], max_model_len: int = 256,
                    num_blocks: int = 64) -> list[Sequence]:
    """Feed `tokens` as the sampled ids, one per step, until seq finishes or they run out."""
    cfg = SchedulerConfig(block_size=4, max_model_len=max_model_len)
    sched = make_scheduler(cfg, num_blocks, eos_token_ids=[EOS])
    sched.add(seq)
    returned: list[Sequence] = []
    for tok in tokens:
        out = sched.schedule()
        returned += sched.postprocess(out, {seq.seq_id: tok})
        sched.check_invariants()
        if seq.is_finished:
            break
    if not seq.is_finished:
        sched.abort(seq.seq_id)
    assert_all_free(sched)
    return returned


def test_eos_stops_with_token_as_reason() -> None:
    seq = make_seq("a", 5, max_tokens=10)
    returned = run_with_tokens(seq, [7, 8, EOS, 9])
    assert seq.output_token_ids == [7, 8, EOS] and len(returned) == 3
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == EOS


def test_ignore_eos() -> None:
    seq = make_seq("a", 5, max_tokens=3, ignore_eos=True)
    run_with_tokens(seq, [EOS, EOS, EOS, EOS])
    assert seq.output_token_ids == [EOS] * 3 and seq.status == SequenceStatus.FINISHED_LENGTH
    assert seq.stop_reason is None


def test_stop_token_ids() -> None:
    seq = make_seq("a", 5, max_tokens=10, stop_token_ids=(42,), ignore_eos=True)
    run_with_tokens(seq, [EOS, 41, 42, 43])
    assert seq.output_token_ids == [EOS, 41, 42] and seq.stop_reason == 42
    assert seq.status.finish_reason == "stop"


def test_min_tokens_defers_stops() -> None:
    seq = make_seq("a", 5, max_tokens=10, min_tokens=3, stop_token_ids=(42,))
    run_with_tokens(seq, [EOS, 42, 5, 42])
    assert seq.output_token_ids == [EOS, 42, 5, 42] and seq.stop_reason == 42


def test_max_tokens() -> None:
    seq = make_seq("a", 5, max_tokens=2)
    returned = run_with_tokens(seq, [3, 4, 5])
    assert seq.output_token_ids == [3, 4] and seq.status.finish_reason == "length"
    assert returned == [seq, seq]


def test_max_model_len() -> None:
    seq = make_seq("a", 6, max_tokens=100)
    run_with_tokens(seq, [3] * 10, max_model_len=8)
    assert seq.num_tokens == 8 and seq.status == SequenceStatus.FINISHED_LENGTH


def test_max_tokens_zero_drops_the_sample() -> None:
    seq = make_seq("a", 9, max_tokens=0, prompt_logprobs=1)
    returned = run_with_tokens(seq, [3])
    assert returned == [seq] and seq.output_token_ids == []
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.num_computed_tokens == 9


def test_unfinished_sequence_is_returned_each_sample() -> None:
    seq = make_seq("a", 5, max_tokens=10)
    assert len(run_with_tokens(seq, [3, 4])) == 2 and seq.is_finished  # aborted at the end


def test_stop_string_finishes_a_running_sequence() -> None:
    sched = make_scheduler(SchedulerConfig(block_size=4), 16, eos_token_ids=[EOS])
    seq = make_seq("a", 5, max_tokens=10)
    sched.add(seq)
    sched.postprocess(sched.schedule(), {"a": 7})
    sched.stop_on_string(seq, "###")
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "###"
    assert sched.get("a") is None
    assert_all_free(sched)


def test_stop_string_wins_over_a_length_finish_of_the_same_step() -> None:
    sched = make_scheduler(SchedulerConfig(block_size=4), 16, eos_token_ids=[EOS])
    seq = make_seq("a", 5, max_tokens=1)
    sched.add(seq)
    sched.postprocess(sched.schedule(), {"a": 7})
    assert seq.status == SequenceStatus.FINISHED_LENGTH
    sched.stop_on_string(seq, "###")  # the text of that last token held a stop string
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "###"
    assert_all_free(sched)


def test_stop_string_on_a_sequence_the_scheduler_never_held_is_refused() -> None:
    sched = make_scheduler(SchedulerConfig(block_size=4), 16)
    stranger = make_seq("a", 5)
    with pytest.raises(ValueError, match="needs a sequence of this scheduler"):
        sched.stop_on_string(stranger, "###")
    assert stranger.status == SequenceStatus.WAITING


def test_stop_tokens_are_the_ones_is_stop_token_accepts() -> None:
    """scheduler/stop_policy.py: the set the sampler bans before min_tokens and the test the
    scheduler applies to each sampled token agree, with and without ignore_eos."""
    from scheduler.stop_policy import is_stop_token, stop_tokens

    eos = {1, 2}
    for params in (SamplingParams(stop_token_ids=(7,)),
                   SamplingParams(stop_token_ids=(7,), ignore_eos=True)):
        banned = stop_tokens(params, eos)
        assert banned == {t for t in range(10) if is_stop_token(params, t, eos)}
    assert stop_tokens(SamplingParams(stop_token_ids=(7,), ignore_eos=True), eos) == {7}
