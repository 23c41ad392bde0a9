"""Property tests: random add/step/abort/finish interleavings over small pools.

After every operation the scheduler's and block pool's invariants hold; every output obeys
the step limits; the FakeRunner checks every cached KV slot it reads; and after draining,
every block is free and every sequence's tokens are exactly what it would generate alone.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import PromptTooLongError, QueueFullError, SchedulerConfig, SequenceStatus
from scheduler.sequence import Sequence
from tests.support.schedsim import (
    FakeRunner,
    check_output,
    decoding,
    drain,
    expected_output,
    make_scheduler,
    make_seq,
)

EOS = 3
PREFIXES = [list(range(100, 112)), list(range(200, 212))]  # shared prefixes give cache hits

configs = st.builds(
    SchedulerConfig,
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 16),
    max_model_len=st.integers(4, 48),
    block_size=st.sampled_from([1, 2, 4]),
    enable_prefix_caching=st.sampled_from([True, True, False]),
    long_prefill_token_threshold=st.integers(0, 8),
    decode_step_prefill_tokens=st.sampled_from([0, 0, 2, 5]),
    decode_step_prefill_tokens_per_seq=st.sampled_from([0, 0, 2]),
    target_itl_ms=st.sampled_from([0.0, 0.0, 11.0, 30.0]),
    prefill_stretch=st.sampled_from([1.0, 1.5]),
    max_num_queued_reqs=st.sampled_from([0, 0, 0, 3]),
    max_num_queued_tokens=st.sampled_from([0, 0, 20]),
    policy=st.sampled_from(["fcfs", "priority"]),
)
adds = st.tuples(
    st.just("add"),
    st.integers(0, 1),  # which prefix
    st.sampled_from([0, 3, 8, 10, 10]),  # how much of it
    st.lists(st.integers(2, 9), max_size=4),  # own tokens (EOS may appear)
    st.fixed_dictionaries({
        "max_tokens": st.integers(0, 12),
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.sampled_from([(), (5,)]),
        "prompt_logprobs": st.sampled_from([None, None, 1]),
    }),
    st.integers(0, 2),  # priority
)
ops = st.lists(st.one_of(
    adds, adds, adds,
    st.tuples(st.just("step"), st.integers(-1, 3)),  # abort this scheduled index mid-step
    st.tuples(st.just("step"), st.just(-1)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("finish"), st.integers(0, 30)),
), max_size=40)


class Harness:
    def __init__(self, config: SchedulerConfig, num_blocks: int, window: int = 0) -> None:
        self.sched = make_scheduler(config, num_blocks, eos_token_ids=[EOS],
                                    sliding_window=window)
        self.runner = FakeRunner(self.sched)
        self.seqs: list[Sequence] = []
        self.cut: set[str] = set()  # aborted or finished from outside: output may be short

    def add(self, which: int, n: int, own: list[int], params: dict[str, Any], prio: int) -> None:
        prompt = PREFIXES[which][:n] + own or [which + 2]
        params["min_tokens"] = min(1, params["max_tokens"])
        seq = make_seq(f"s{len(self.seqs)}", prompt, priority=prio, arrival_time=0.0, **params)
        try:
            self.sched.add(seq)
        except (PromptTooLongError, QueueFullError):
            return
        self.seqs.append(seq)

    def step(self, abort_index: int) -> None:
        was_decoding = decoding(self.sched)
        out = self.sched.schedule()
        check_output(self.sched, out, was_decoding)
        if 0 <= abort_index < len(out.seqs):
            self.sched.abort(out.seqs[abort_index].seq_id)
            self.cut.add(out.seqs[abort_index].seq_id)
        self.sched.check_invariants()
        self.sched.postprocess(out, self.runner.run(out))

    def end(self, index: int, status: SequenceStatus) -> None:
        if self.seqs:
            seq = self.seqs[index % len(self.seqs)]
            if self.sched.finish(seq.seq_id, status, "stop-string") is not None:
                self.cut.add(seq.seq_id)

    def check_finished(self, seq: Sequence) -> None:
        out, max_len = seq.output_token_ids, self.sched.limits.max_model_len
        assert out == expected_output(seq.prompt_token_ids, len(out))
        if seq.seq_id in self.cut:
            return
        if seq.status == SequenceStatus.FINISHED_STOPPED:
            assert out[-1] == seq.stop_reason and len(out) >= seq.params.min_tokens
            assert out[-1] in seq.params.stop_token_ids or (
                out[-1] == EOS and not seq.params.ignore_eos)
        else:
            assert seq.status == SequenceStatus.FINISHED_LENGTH
            assert len(out) == seq.params.max_tokens or seq.num_tokens == max_len


# Tight pools with prefix caching on and many sequences: preemption and hits are common.
pressure_configs = st.builds(
    SchedulerConfig,
    max_num_seqs=st.integers(2, 4),
    max_num_batched_tokens=st.integers(4, 16),
    max_model_len=st.just(64),
    block_size=st.sampled_from([2, 4]),
    long_prefill_token_threshold=st.integers(0, 6),
    decode_step_prefill_tokens=st.sampled_from([0, 3]),
    policy=st.sampled_from(["fcfs", "priority"]),
)


def run_ops(h: Harness, operations: list[tuple[Any, ...]]) -> None:
    for op in operations:
        if op[0] == "add":
            h.add(*op[1:])
        elif op[0] == "step":
            h.step(op[1])
        else:
            status = SequenceStatus.FINISHED_ABORTED if op[0] == "abort" else \
                SequenceStatus.FINISHED_STOPPED
            h.end(op[1], status)
        h.sched.check_invariants()
    drain(h.sched, h.runner, max_steps=1000)
    for seq in h.seqs:
        assert seq.is_finished and not seq.block_table
        h.check_finished(seq)
    # Shown by --hypothesis-show-statistics: how often the interesting paths ran.
    event(f"sequences: {min(len(h.seqs), 4)}")
    event(f"preempted: {h.sched.num_preemptions > 0}")
    event(f"prefix hits: {h.sched.block_manager.prefix_cache_hits > 0}")
    event(f"stopped: {any(s.status == SequenceStatus.FINISHED_STOPPED for s in h.seqs)}")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, pool_tokens=st.integers(4, 32),
       first=st.lists(adds, min_size=1, max_size=6), operations=ops)
def test_random_interleavings_keep_invariants(
    config: SchedulerConfig, pool_tokens: int, first: list[tuple[Any, ...]],
    operations: list[tuple[Any, ...]],
) -> None:
    run_ops(Harness(config, max(1, pool_tokens // config.block_size)), first + operations)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=pressure_configs, pool_tokens=st.integers(8, 24),
       first=st.lists(adds, min_size=3, max_size=8), operations=ops)
def test_random_interleavings_under_pressure(
    config: SchedulerConfig, pool_tokens: int, first: list[tuple[Any, ...]],
    operations: list[tuple[Any, ...]],
) -> None:
    run_ops(Harness(config, pool_tokens // config.block_size), first + operations)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=pressure_configs, pool_tokens=st.integers(8, 24), window=st.integers(1, 9),
       first=st.lists(adds, min_size=3, max_size=8), operations=ops)
def test_random_interleavings_with_a_sliding_window(
    config: SchedulerConfig, pool_tokens: int, window: int, first: list[tuple[Any, ...]],
    operations: list[tuple[Any, ...]],
) -> None:
    """Every layer slides: blocks out of the window are released as sequences run (issue 33).
    The fake runner checks each query's window is still held and holds its own prefix."""
    run_ops(Harness(config, pool_tokens // config.block_size, window), first + operations)
