"""BlockManager: allocation, prefix-cache hits, collisions, LRU eviction, invariant checks."""

from __future__ import annotations

import pytest

from scheduler import SchedulerConfig, SequenceStatus
from scheduler import block_manager as bm_module
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from tests.support.schedsim import (
    FakeRunner,
    drain,
    expected_output,
    make_scheduler,
    make_seq,
    step,
)


def compute(bm: BlockManager, seq: Sequence, n: int, hits: list[int] | None = None) -> None:
    """What the scheduler plus runner do for one chunk of n tokens."""
    hits = hits or []
    assert bm.can_allocate(seq, n, hits)
    bm.allocate(seq, n, hits)
    seq.num_computed_tokens += len(hits) * bm.block_size + n
    bm.cache_full_blocks(seq)
    bm.check_invariants()


def make_sched(num_blocks: int = 32, **cfg: object) -> Scheduler:
    return make_scheduler(SchedulerConfig(block_size=4, **cfg), num_blocks)  # type: ignore[arg-type]


def test_second_sequence_hits_shared_prefix() -> None:
    sched = make_sched()
    prefix = list(range(100, 108))  # two full blocks
    a, b = make_seq("a", prefix + [1, 2], max_tokens=4), make_seq("b", prefix + [3], max_tokens=4)
    runner = FakeRunner(sched)
    sched.add(a)
    step(sched, runner)  # a's prompt is computed: its two full blocks are published
    sched.add(b)
    out, _ = step(sched, runner)
    assert b.num_cached_tokens == 8 and out.num_scheduled_tokens[-1] == 1
    assert b.block_table[:2] == a.block_table[:2]
    bm = sched.block_manager
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [2, 2]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 9, 8)
    drain(sched, runner)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 4)


@pytest.mark.parametrize("length, hit", [(8, 4), (9, 8), (12, 8)])
def test_hit_never_covers_the_whole_prompt(length: int, hit: int) -> None:
    sched = make_sched()
    prompt = list(range(100, 100 + length))
    a, b = make_seq("a", prompt, max_tokens=1), make_seq("b", prompt, max_tokens=1)
    sched.add(a)
    runner = FakeRunner(sched)
    drain(sched, runner)
    sched.add(b)
    out, _ = step(sched, runner)
    assert b.num_cached_tokens == hit and out.num_scheduled_tokens == [length - hit]
    assert b.output_token_ids == a.output_token_ids
    drain(sched, runner)


def test_prompt_logprobs_and_disabled_cache_take_no_hits() -> None:
    for sched, params in [(make_sched(), {"prompt_logprobs": 0}),
                          (make_sched(enable_prefix_caching=False), {})]:
        runner = FakeRunner(sched)
        sched.add(make_seq("a", 12, max_tokens=1))
        drain(sched, runner)
        b = make_seq("b", 12, max_tokens=1, **params)
        sched.add(b)
        drain(sched, runner)
        assert b.num_cached_tokens == 0 and sched.block_manager.prefix_cache_hits == 0
    assert sched.block_manager.prefix_cache_queries == 0  # disabled: nothing counted


def test_preempted_sequence_recomputes_from_its_own_cached_blocks() -> None:
    sched = make_sched(num_blocks=5)
    a = make_seq("a", list(range(100, 106)), max_tokens=6)
    b = make_seq("b", list(range(200, 208)), max_tokens=6)  # shares nothing with a
    sched.add(a)
    sched.add(b)
    drain(sched)
    assert b.num_preemptions == 1 and b.num_cached_tokens == 0
    assert sched.block_manager.prefix_cache_hits == 8  # b's own blocks, after preemption
    for seq in (a, b):
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 6)


def test_collision_gives_no_false_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, ids: 7)
    sched = make_sched()
    runner = FakeRunner(sched)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=2)
    sched.add(a)
    drain(sched, runner)
    # Same hash, other tokens: a miss. Same first block: one hit (the second collides).
    other, same = make_seq("o", [9, 9, 9, 9, 9], max_tokens=2), make_seq("s", a.token_ids)
    for seq in (other, same):
        sched.add(seq)
        drain(sched, runner)
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 4


def test_parent_collision_gives_no_false_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hash that ignores the parent: block [5,6,7,8] hashes alike after any first block.
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, ids: hash(ids))
    sched = make_sched()
    runner = FakeRunner(sched)
    tail = [5, 6, 7, 8, 0]
    for seq_id, head in [("x", [1, 1, 1, 1]), ("y", [2, 2, 2, 2]), ("z", [2, 2, 2, 2])]:
        seq = make_seq(seq_id, head + tail, max_tokens=1)
        sched.add(seq)
        drain(sched, runner)  # FakeRunner fails on any wrong cached slot
    assert seq.num_cached_tokens == 4  # z reuses y's first block only


def test_duplicate_blocks_computed_in_one_step_stay_private() -> None:
    sched = make_sched()
    a, b = make_seq("a", 13, max_tokens=2), make_seq("b", 13, max_tokens=2)
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(sched)
    step(sched, runner)
    bm = sched.block_manager
    assert all(bm.blocks[i].hash is not None for i in a.block_table[:3])
    assert all(bm.blocks[i].hash is None for i in b.block_table)
    drain(sched, runner)


def test_lru_eviction_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq("a", [1, 2, 3, 4, 5]), make_seq("b", [6, 7, 8, 9, 10])
    for seq in (a, b):
        compute(bm, seq, 4)
        bm.free(seq)
        bm.check_invariants()
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    assert bm.get_computed_blocks(make_seq("a2", a.token_ids)) == [0, 1]
    fresh = make_seq("c", [20, 21])
    compute(bm, fresh, 1)  # evicts a's tail block first (least recently freed)
    assert bm.get_computed_blocks(make_seq("a2", a.token_ids)) == [0]
    compute(bm, fresh, 1)
    compute(bm, fresh, 1)  # evicts a's first block
    assert bm.get_computed_blocks(make_seq("a2", a.token_ids)) == []
    assert len(bm.get_computed_blocks(make_seq("b2", b.token_ids))) == 2
    assert bm.usage == 0.5
    bm.free(fresh)
    assert bm.num_free_blocks == 4


def test_idle_hits_use_free_blocks_and_failed_check_mutates_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    compute(bm, a, 4)
    bm.free(a)
    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1] and bm.num_blocks_needed(b, 5, hits) == 3
    assert not bm.can_allocate(b, 5, hits)  # 2 idle hits + 3 fresh > 3 free
    with pytest.raises(RuntimeError, match="without room"):
        bm.allocate(b, 5, hits)
    assert b.block_table == [] and bm.num_free_blocks == 3 and bm.prefix_cache_queries == 5
    compute(bm, b, 1, hits)  # 2 hits + 1 fresh fit
    assert bm.prefix_cache_hits == 4 and bm.prefix_cache_queries == 5 + 9
    assert bm.get_computed_blocks(b) == []  # a sequence holding blocks looks up nothing
    bm.free(b)
    bm.check_invariants()


def test_check_invariants_reports_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq("a", [1, 2, 3])
    compute(bm, seq, 2)
    bm.blocks[seq.block_table[0]].ref_count = 2
    with pytest.raises(AssertionError, match="ref_count 2, held by 1"):
        bm.check_invariants()
    bm.blocks[seq.block_table[0]].ref_count = 1
    bm._cached[12345] = 3
    with pytest.raises(AssertionError, match="stale"):
        bm.check_invariants()
    del bm._cached[12345]
    bm.free(seq)
    bm.check_invariants()


def test_bad_pool_size() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    assert make_sched().block_manager.caches(make_seq("a", 3))
    assert make_seq("a", 3).status == SequenceStatus.WAITING


def test_block_states_show_used_cached_and_free_blocks() -> None:
    """The live view's grid: "2" in a block table, "1" free but published, "0" empty."""
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.block_states() == "000000"
    a = make_seq("a", list(range(100, 109)), max_tokens=1)  # 2 full blocks and 1 token
    compute(bm, a, 9)
    states = bm.block_states()
    assert states.count("2") == 3 and states.count("0") == 3
    bm.free(a)
    states = bm.block_states()  # the full blocks stay published for reuse, the last is empty
    assert states.count("1") == 2 and states.count("0") == 4 and "2" not in states
