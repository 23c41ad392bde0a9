"""Blocks out of a sliding window are released while a sequence runs (issue 33): a model
whose every layer sees only its last `window` tokens (Mistral v0.1) holds about
window / block_size blocks per sequence, not its whole context."""

from __future__ import annotations

from scheduler import SchedulerConfig
from scheduler.block_manager import NULL_BLOCK
from scheduler.scheduler import Scheduler
from tests.support.schedsim import (
    FakeRunner,
    drain,
    expected_output,
    make_scheduler,
    make_seq,
    step,
)


def make_sched(window: int, num_blocks: int = 32, **cfg: object) -> Scheduler:
    config = SchedulerConfig(block_size=2, **cfg)  # type: ignore[arg-type]
    return make_scheduler(config, num_blocks, sliding_window=window)


def held(table: list[int]) -> int:
    return sum(1 for b in table if b != NULL_BLOCK)


def test_a_long_sequence_holds_only_its_window() -> None:
    sched, bm = (s := make_sched(window=4)), s.block_manager
    seq = make_seq("a", 10, max_tokens=30, ignore_eos=True)
    sched.add(seq)
    runner = FakeRunner(sched)
    most = 0
    while not seq.is_finished:
        step(sched, runner)
        sched.check_invariants()
        if not seq.is_finished:  # the released entries are the table's prefix
            assert seq.block_table[:len(seq.block_table) - held(seq.block_table)] == \
                [NULL_BLOCK] * (len(seq.block_table) - held(seq.block_table))
            most = max(most, held(seq.block_table)) if seq.num_computed_tokens > 10 else most
    assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 30)
    # 40 tokens of context in blocks of 2: 20 blocks without the window; with it, the window's
    # 2 blocks, the one being filled, and the parent kept for publishing the next.
    assert most <= 4
    assert bm.num_free_blocks == bm.num_blocks


def test_released_blocks_stay_in_the_prefix_cache() -> None:
    sched = make_sched(window=2)
    prompt = list(range(100, 112))
    a = make_seq("a", prompt, max_tokens=2, ignore_eos=True)
    sched.add(a)
    runner = FakeRunner(sched)
    step(sched, runner)  # a's prompt: 6 blocks published, the first ones released at once
    assert a.block_table[0] == NULL_BLOCK
    b = make_seq("b", prompt + [7], max_tokens=2, ignore_eos=True)
    sched.add(b)
    step(sched, runner)
    assert b.num_cached_tokens == 12  # every block of a's prompt, released or not
    drain(sched, runner)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 2)


def test_a_window_of_one_without_prefix_caching_may_release_every_block() -> None:
    sched = make_sched(window=1, enable_prefix_caching=False)
    seq = make_seq("a", 4, max_tokens=3, ignore_eos=True)
    sched.add(seq)
    runner = FakeRunner(sched)
    step(sched, runner)  # 4 computed: the next query sees only itself
    assert seq.block_table == [NULL_BLOCK, NULL_BLOCK]
    sched.check_invariants()
    drain(sched, runner)
    assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 3)


def test_a_preempted_sequence_with_released_blocks_recomputes_the_same_tokens() -> None:
    # 4 sequences of 6 + 10 tokens in 8 blocks of 2, 6 tokens a step: preempts 3 times.
    sched = make_sched(window=3, num_blocks=8, max_num_seqs=4, max_num_batched_tokens=6)
    seqs = [make_seq(f"s{i}", list(range(20 + i, 26 + i)), max_tokens=10, ignore_eos=True)
            for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    runner = FakeRunner(sched)
    drain(sched, runner)
    assert sched.num_preemptions > 0
    for seq in seqs:
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 10)
    assert sched.block_manager.num_free_blocks == 8
