"""Scheduler policy: budgets, chunked prefill, ordering, preemption, abort, queue bounds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler import (
    PromptTooLongError,
    QueueFullError,
    SchedulerConfig,
    SchedulerError,
    SequenceStatus,
)
from scheduler.limits import EngineLimits
from scheduler.scheduler import Scheduler
from tests.support.schedsim import (
    FakeRunner,
    assert_all_free,
    drain,
    expected_output,
    make_limits,
    make_scheduler,
    make_seq,
    step,
)


def make_sched(num_blocks: int = 64, **cfg: object) -> Scheduler:
    defaults: dict[str, object] = {"block_size": 4, "max_num_batched_tokens": 32,
                                   "max_num_seqs": 8, "max_model_len": 256}
    defaults.update(cfg)
    return make_scheduler(SchedulerConfig(**defaults), num_blocks)  # type: ignore[arg-type]


def test_single_sequence_prefill_then_decodes() -> None:
    sched = make_sched()
    seq = make_seq("a", 10, max_tokens=5)
    sched.add(seq)
    assert sched.num_waiting == 1 and sched.get("a") is seq and sched.has_unfinished()
    runner = FakeRunner(sched)
    out, done = step(sched, runner)
    assert out.num_scheduled_tokens == [10] and done == [seq] and seq.first_scheduled_time
    assert sched.num_running == 1 and sched.num_waiting == 0
    assert drain(sched, runner) == 4
    assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 5)
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.block_table == []
    assert sched.get("a") is None and not sched.has_unfinished()


def test_budget_and_max_num_seqs_respected() -> None:
    sched = make_sched(max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(6):
        sched.add(make_seq(f"s{i}", 8, max_tokens=4))
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    # 8 + 8 + 4 (a chunk of the third prompt): the budget is used up exactly.
    assert [s.seq_id for s in out.seqs] == ["s0", "s1", "s2"]
    assert out.num_scheduled_tokens == [8, 8, 4]
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == [1, 1, 4] and sched.num_running == 3
    drain(sched, runner)


def test_chunked_prefill_rides_with_decodes() -> None:
    sched = make_sched(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    short, long = make_seq("short", 4, max_tokens=6), make_seq("long", 20, max_tokens=2)
    sched.add(short)
    sched.add(long)
    runner = FakeRunner(sched)
    plans = []
    for _ in range(4):
        out, _ = step(sched, runner)
        plans.append(dict(zip([s.seq_id for s in out.seqs], out.num_scheduled_tokens)))
    # The long prompt is spread over 6+6+6+2 tokens while "short" decodes every step.
    assert plans == [{"short": 4, "long": 6}, {"short": 1, "long": 6},
                     {"short": 1, "long": 6}, {"short": 1, "long": 2}]
    drain(sched, runner)
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 2)


def test_prompt_tokens_are_capped_while_others_decode() -> None:
    sched = make_sched(max_num_batched_tokens=32, decode_step_prefill_tokens=5)
    a, b = make_seq("a", 4, max_tokens=20), make_seq("b", 3, max_tokens=20)
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)  # nothing decodes yet: the whole budget is for prompts
    assert out.num_scheduled_tokens == [4, 3]
    # Prompts of their own (make_seq's default ids would hit a's and b's cached blocks).
    long1 = make_seq("long1", list(range(100, 112)), max_tokens=2)
    long2 = make_seq("long2", list(range(200, 206)), max_tokens=2)
    sched.add(long1)
    sched.add(long2)
    plans = []
    while long2.num_output_tokens == 0:
        out, _ = step(sched, runner)
        plans.append(dict(zip([s.seq_id for s in out.seqs], out.num_scheduled_tokens)))
    # a and b decode in every step; at most 5 prompt tokens join them. long1's chunks go
    # first and long2 waits (running, its next chunk skipped) until there is room.
    assert plans == [{"a": 1, "b": 1, "long1": 5}, {"a": 1, "b": 1, "long1": 5},
                     {"a": 1, "b": 1, "long1": 2, "long2": 3},
                     {"a": 1, "b": 1, "long1": 1, "long2": 3}]
    drain(sched, runner)
    assert long1.output_token_ids == expected_output(long1.prompt_token_ids, 2)
    assert long2.output_token_ids == expected_output(long2.prompt_token_ids, 2)


def test_the_prompt_cap_grows_with_the_decode_batch() -> None:
    """decode_step_prefill_tokens_per_seq: 3 decoding sequences x 2 = 6 prompt tokens a step
    (over the floor of 4); with one decoding, the floor."""
    cfg = SchedulerConfig(decode_step_prefill_tokens=4, decode_step_prefill_tokens_per_seq=2)
    assert [cfg.decode_step_prefill_cap(d) for d in (0, 1, 2, 3, 10)] == [0, 4, 4, 6, 20]
    assert SchedulerConfig(decode_step_prefill_tokens_per_seq=2).decode_step_prefill_cap(9) == 0
    sched = make_sched(max_num_batched_tokens=32, decode_step_prefill_tokens=4,
                       decode_step_prefill_tokens_per_seq=2)
    runner = FakeRunner(sched)
    decoders = [make_seq(f"d{i}", list(range(10 * i + 300, 10 * i + 303)), max_tokens=20)
                for i in range(3)]
    for seq in decoders:
        sched.add(seq)
    out, _ = step(sched, runner)  # nothing decodes yet: the whole budget is for prompts
    assert out.num_scheduled_tokens == [3, 3, 3]
    long = make_seq("long", list(range(100, 120)), max_tokens=2)
    sched.add(long)
    out, _ = step(sched, runner)
    assert dict(zip([s.seq_id for s in out.seqs], out.num_scheduled_tokens)) == {
        "d0": 1, "d1": 1, "d2": 1, "long": 6}
    drain(sched, runner)
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 2)


def test_fcfs_order_and_head_of_line_blocking() -> None:
    # 6 blocks of 4: "big" cannot start while "a" holds blocks, and "small" waits behind it.
    sched = make_sched(num_blocks=6, enable_prefix_caching=False)
    a, big, small = make_seq("a", 12, max_tokens=4), make_seq("big", 16), make_seq("small", 2)
    for seq in (a, big, small):
        sched.add(seq)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    assert [s.seq_id for s in out.seqs] == ["a"]
    while a.status == SequenceStatus.RUNNING:
        out, _ = step(sched, runner)
        assert [s.seq_id for s in out.seqs] == ["a"]
    out, _ = step(sched, runner)  # a's blocks are free: big first, then small
    assert [s.seq_id for s in out.seqs] == ["big", "small"]
    drain(sched, runner)


def test_priority_policy_admits_lowest_value_first() -> None:
    sched = make_sched(policy="priority", max_num_seqs=1)
    for seq_id, prio, t in [("late-urgent", 0, 3.0), ("low", 5, 1.0), ("early-urgent", 0, 2.0)]:
        sched.add(make_seq(seq_id, 4, priority=prio, arrival_time=t, max_tokens=1))
    order = []
    runner = FakeRunner(sched)
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        order += [s.seq_id for s in out.seqs]
    assert order == ["early-urgent", "late-urgent", "low"]
    assert_all_free(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_under_small_pool_still_finishes_everything(policy: str) -> None:
    sched = make_sched(num_blocks=8, policy=policy, enable_prefix_caching=False)
    seqs = [make_seq(f"s{i}", 5 + i, priority=i % 2, max_tokens=12) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    drain(sched)
    assert sched.num_preemptions > 0
    assert sched.num_preemptions == sum(s.num_preemptions for s in seqs)
    for seq in seqs:
        assert seq.status == SequenceStatus.FINISHED_LENGTH
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 12)


def test_preempted_sequence_goes_to_front_and_no_admission_that_step() -> None:
    # 3 blocks of 4 tokens: a (4 tokens) and b (4 tokens) each fill a block; c waits.
    sched = make_sched(num_blocks=3, enable_prefix_caching=False)
    a, b, c, d = (make_seq(i, n, max_tokens=8) for i, n in zip("abcd", (4, 3, 2, 2)))
    for seq in (a, b, c, d):
        sched.add(seq)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)  # a: 1 block, b: 1 block, c: 1 block; d waits for blocks
    assert [s.seq_id for s in out.seqs] == ["a", "b", "c"] and list(sched.waiting) == [d]
    out, _ = step(sched, runner)  # a needs a 2nd block: c (newest) is preempted
    assert out.preempted_ids == ["c"] and [s.seq_id for s in out.seqs] == ["a", "b"]
    assert list(sched.waiting) == [c, d] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    drain(sched, runner)
    assert all(len(s.output_token_ids) == 8 for s in (a, b, c, d))


def test_running_sequences_beyond_the_budget_wait_their_turn() -> None:
    sched = make_sched(max_num_batched_tokens=2)
    seqs = [make_seq(f"s{i}", 1, max_tokens=3) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    runner = FakeRunner(sched)
    plans = []
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        plans.append([s.seq_id for s in out.seqs])
    assert plans[:4] == [["s0", "s1"], ["s0", "s1"], ["s0", "s1"], ["s2"]]
    assert all(len(s.output_token_ids) == 3 for s in seqs)
    assert_all_free(sched)


def test_priority_preemption_removes_scheduled_victim_from_output() -> None:
    # Priority mode picks the worst priority even if it was already scheduled this step.
    sched = make_sched(num_blocks=2, policy="priority", enable_prefix_caching=False)
    bad, good = make_seq("bad", 2, priority=9, max_tokens=3), make_seq("good", 4, max_tokens=3)
    sched.add(bad)
    runner = FakeRunner(sched)
    step(sched, runner)
    sched.add(good)
    out, _ = step(sched, runner)
    assert [s.seq_id for s in out.seqs] == ["bad", "good"]
    out, _ = step(sched, runner)  # good needs a 2nd block; bad (scheduled first) is the victim
    assert out.preempted_ids == ["bad"] and [s.seq_id for s in out.seqs] == ["good"]
    drain(sched, runner)
    assert bad.num_preemptions == 1 and len(bad.output_token_ids) == 3


def test_sequence_preempts_itself_when_it_is_the_victim() -> None:
    sched = make_sched(num_blocks=2, policy="priority", enable_prefix_caching=False)
    good, bad = make_seq("good", 3, max_tokens=3), make_seq("bad", 4, priority=9, max_tokens=3)
    sched.add(good)
    sched.add(bad)
    runner = FakeRunner(sched)
    step(sched, runner)
    out, _ = step(sched, runner)  # bad needs a block and is itself the worst: self-preemption
    assert out.preempted_ids == ["bad"] and [s.seq_id for s in out.seqs] == ["good"]
    drain(sched, runner)


def test_long_sequence_alone_is_capped_by_the_pool() -> None:
    # The pool holds 12 tokens, max_model_len is larger: the sequence stops at 12 (length).
    sched = make_sched(num_blocks=3, max_model_len=100)
    seq = make_seq("a", 8, max_tokens=50)
    sched.add(seq)
    drain(sched)
    assert seq.num_tokens == 12 and seq.status == SequenceStatus.FINISHED_LENGTH
    assert seq.num_preemptions == 0


@pytest.mark.parametrize("state", ["waiting", "running", "mid-prefill", "preempted", "in-step"])
def test_abort_in_every_state(state: str) -> None:
    sched = make_sched(num_blocks=3, max_num_batched_tokens=8, enable_prefix_caching=False)
    a, b = make_seq("a", 4, max_tokens=8), make_seq("b", 11 if state == "mid-prefill" else 3)
    runner = FakeRunner(sched)
    sched.add(a)
    sched.add(b)
    if state in ("running", "mid-prefill", "in-step"):
        step(sched, runner)
        assert b.status == SequenceStatus.RUNNING
    if state == "mid-prefill":
        assert 0 < b.num_computed_tokens < b.num_prompt_tokens
    if state == "preempted":
        for _ in range(3):  # a grows into a 2nd block, then b needs one: b (newest) is preempted
            step(sched, runner)
        assert b.status == SequenceStatus.WAITING and b.num_preemptions == 1
    out = sched.schedule() if state == "in-step" else None
    assert sched.abort("b") is b and b.status == SequenceStatus.FINISHED_ABORTED
    assert b.block_table == [] and sched.get("b") is None and sched.abort("b") is None
    sched.check_invariants()
    if out is not None:  # aborted between schedule() and postprocess(): skipped
        assert b not in sched.postprocess(out, runner.run(out))
    drain(sched, runner)
    assert len(a.output_token_ids) == 8


def test_finish_with_stop_string() -> None:
    sched = make_sched()
    seq = make_seq("a", 5, max_tokens=10)
    sched.add(seq)
    step(sched, FakeRunner(sched))
    assert sched.finish("a", SequenceStatus.FINISHED_STOPPED, "###") is seq
    assert seq.stop_reason == "###" and seq.status.finish_reason == "stop"
    assert sched.finish("a", SequenceStatus.FINISHED_STOPPED) is None
    with pytest.raises(ValueError, match="finished status"):
        sched.finish("a", SequenceStatus.RUNNING)
    assert_all_free(sched)


def test_too_long_prompts_are_refused() -> None:
    sched = make_sched(num_blocks=8, max_model_len=20)
    with pytest.raises(PromptTooLongError, match="20 tokens, but max_model_len is 20 and"):
        sched.add(make_seq("a", 20))
    sched.add(make_seq("b", 19))  # one token left for the output
    drain(sched)


def test_prompts_too_long_for_the_pool_are_refused_naming_it() -> None:
    # The limits cap max_model_len at what the pool holds (16 tokens); the message says why.
    sched = make_sched(num_blocks=4, max_model_len=20)
    with pytest.raises(PromptTooLongError, match=r"16 tokens, but max_model_len is 16 \(the KV "
                                                 r"cache holds 4 blocks of 4 tokens\)"):
        sched.add(make_seq("b", 16))
    sched.add(make_seq("c", 15))  # 15 + 1 tokens fill the 4 blocks exactly
    assert sched.num_waiting == 1
    drain(sched)


def test_limits_longer_than_the_pool_are_refused() -> None:
    # A sequence that cannot fit the pool alone could never run again after a preemption.
    config = SchedulerConfig(block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len 20 does not fit the KV pool"):
        Scheduler(config, replace(make_limits(config, 4), max_model_len=20))


def test_limits_not_config_decide_length_pool_and_eos() -> None:
    # config says 256 tokens, block 4, no EOS; the limits (resolved by the engine) win.
    config = SchedulerConfig(block_size=4, max_model_len=256, max_num_batched_tokens=32)
    limits = EngineLimits(max_model_len=9, num_kv_blocks=6, block_size=3, vocab_size=50,
                          eos_token_ids=frozenset({7}))
    sched = Scheduler(config, limits)
    assert sched.block_manager.block_size == 3 and sched.block_manager.num_blocks == 6
    seq = make_seq("a", 6, max_tokens=100)
    sched.add(seq)
    while not seq.is_finished:
        sched.postprocess(sched.schedule(), {"a": 5})
    assert seq.num_tokens == 9 and seq.status == SequenceStatus.FINISHED_LENGTH
    eos = make_seq("b", 3, max_tokens=100)
    sched.add(eos)
    sched.postprocess(sched.schedule(), {"b": 7})
    assert eos.status == SequenceStatus.FINISHED_STOPPED and eos.stop_reason == 7


def test_queue_bounds() -> None:
    sched = make_sched(max_num_queued_reqs=2, max_num_seqs=2)
    for name in "abcd":  # a and b fill the two free slots at the next step: not queued
        sched.add(make_seq(name, 4))
    with pytest.raises(QueueFullError, match="2 requests") as info:
        sched.add(make_seq("e", 4))
    assert info.value.limit == "max_num_queued_reqs"
    runner = FakeRunner(sched)
    step(sched, runner)  # a, b run; c, d wait: still full
    with pytest.raises(QueueFullError, match="2 requests"):
        sched.add(make_seq("f", 4))
    drain(sched, runner)
    sched = make_sched(max_num_queued_tokens=10)
    sched.add(make_seq("big", 30))  # an empty queue takes any prompt
    with pytest.raises(QueueFullError, match="30 queued tokens") as info:
        sched.add(make_seq("x", 1))
    assert info.value.limit == "max_num_queued_tokens"
    runner = FakeRunner(sched)
    step(sched, runner)  # admitted: the queue is empty again
    sched.add(make_seq("y", 6))
    sched.add(make_seq("z", 4))
    with pytest.raises(QueueFullError):
        sched.add(make_seq("w", 1))
    drain(sched, runner)


def test_add_refuses_duplicates_and_used_sequences() -> None:
    sched = make_sched()
    sched.add(make_seq("a", 4))
    with pytest.raises(SchedulerError, match="already in use"):
        sched.add(make_seq("a", 4))
    used = make_seq("b", 4)
    used.num_computed_tokens = 2
    with pytest.raises(ValueError, match="fresh sequence"):
        sched.add(used)
    drain(sched)


def test_empty_schedule() -> None:
    sched = make_sched()
    out = sched.schedule()
    assert out.is_empty and sched.postprocess(out, {}) == []
    assert_all_free(sched)


def test_running_prefill_waits_when_the_steps_prompt_tokens_are_used_up() -> None:
    # While "d" decodes, a step takes at most 4 prompt tokens: "a"'s chunk uses them all, so
    # "b", also mid-prompt, waits for the next step (and is not preempted or dropped).
    sched = make_sched(max_num_batched_tokens=16, long_prefill_token_threshold=4,
                       decode_step_prefill_tokens=4, enable_prefix_caching=False)
    d, a, b = make_seq("d", 3, max_tokens=8), make_seq("a", 16), make_seq("b", 16)
    for seq in (d, a, b):
        sched.add(seq)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)  # nothing decodes yet: no cap, every prompt gets a chunk
    assert out.num_scheduled_tokens == [3, 4, 4]
    out, _ = step(sched, runner)
    assert [s.seq_id for s in out.seqs] == ["d", "a"] and out.num_scheduled_tokens == [1, 4]
    assert b.status == SequenceStatus.RUNNING and b.num_computed_tokens == 4
    assert not out.preempted_ids
    drain(sched, runner)


def test_preempted_prefill_chunk_gives_back_its_prompt_tokens() -> None:
    # While "d" decodes a step takes 6 prompt tokens. "low" (worst priority, admitted before
    # "high") is scheduled a 4-token chunk, finds no free block and is itself the victim.
    # Its chunk left the step, so "high" may take a full 4-token chunk, not the 2 left over.
    sched = make_sched(num_blocks=5, policy="priority", max_num_batched_tokens=16,
                       long_prefill_token_threshold=4, decode_step_prefill_tokens=6,
                       enable_prefix_caching=False)
    runner = FakeRunner(sched)
    sched.add(make_seq("d", 3, max_tokens=20))
    step(sched, runner)  # d's prompt: d now decodes
    sched.add(make_seq("low", list(range(100, 116)), priority=5))
    step(sched, runner)  # low admitted with a 4-token chunk
    sched.add(make_seq("high", list(range(200, 216))))
    out, _ = step(sched, runner)  # low 4 more, high admitted with the 2 prompt tokens left
    assert out.num_scheduled_tokens == [1, 4, 2] and sched.block_manager.num_free_blocks == 0
    out, _ = step(sched, runner)
    assert out.preempted_ids == ["low"]
    assert dict(zip([s.seq_id for s in out.seqs], out.num_scheduled_tokens)) == {"d": 1,
                                                                                  "high": 4}
    drain(sched, runner)


def test_victim_scheduled_earlier_in_the_step_gives_back_its_prompt_tokens() -> None:
    # While "d" decodes a step takes 10 prompt tokens. "low" (worst priority, admitted first)
    # is scheduled a 4-token chunk; "y" then needs a block and preempts it. low's chunk left
    # the step, so "z" after them may take a full 4-token chunk, not the 2 left over.
    sched = make_sched(num_blocks=7, policy="priority", max_num_batched_tokens=16,
                       long_prefill_token_threshold=4, decode_step_prefill_tokens=10,
                       enable_prefix_caching=False)
    runner = FakeRunner(sched)
    sched.add(make_seq("d", 3, max_tokens=20))
    step(sched, runner)
    sched.add(make_seq("low", list(range(100, 116)), priority=5))
    step(sched, runner)
    sched.add(make_seq("y", list(range(200, 216))))
    sched.add(make_seq("z", list(range(300, 316))))
    out, _ = step(sched, runner)  # low 4 more; y and z admitted with the 6 prompt tokens left
    assert out.num_scheduled_tokens == [1, 4, 4, 2] and sched.block_manager.num_free_blocks == 1
    out, _ = step(sched, runner)
    assert out.preempted_ids == ["low"]
    assert dict(zip([s.seq_id for s in out.seqs], out.num_scheduled_tokens)) == {"d": 1, "y": 4,
                                                                                  "z": 4}
    drain(sched, runner)
