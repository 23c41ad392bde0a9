"""A fake model runner and step loop for scheduler tests (no torch).

FakeRunner keeps a paged "KV pool" like the real one: slot p of a sequence holds the exact
token prefix 0..p it was computed from. Every step it reads the context of each scheduled
sequence through its block table and fails if any cached slot is not the sequence's own
prefix (so a wrong prefix hit, a stale block after preemption or a bad block table is
caught), writes the new slots, and samples a token that is a pure function of the tokens
(as greedy decoding is), so outputs must not depend on batching.
"""

from __future__ import annotations

from collections.abc import Collection

from scheduler.config import SchedulerConfig
from scheduler.limits import EngineLimits
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus

VOCAB = 50  # sampled ids are in [2, VOCAB); 0 and 1 are free for EOS/stop tests


def next_token(token_ids: list[int]) -> int:
    return 2 + (sum(token_ids[-3:]) * 7 + len(token_ids)) % (VOCAB - 2)


def make_seq(seq_id: str, prompt: list[int] | int, priority: int = 0,
             arrival_time: float | None = None, **params: object) -> Sequence:
    ids = list(range(10, 10 + prompt)) if isinstance(prompt, int) else prompt
    return Sequence(seq_id, ids, SamplingParams(**params), priority=priority,  # type: ignore[arg-type]
                    arrival_time=arrival_time)


def make_limits(config: SchedulerConfig, num_blocks: int,
                eos_token_ids: Collection[int] = (), sliding_window: int = 0) -> EngineLimits:
    """The limits LLMEngine.load() would resolve for this config and pool (a model that
    allows any length): max_model_len is capped by what the pool holds. sliding_window: a
    model whose every layer sees only its last that-many tokens."""
    return EngineLimits(max_model_len=min(config.max_model_len, num_blocks * config.block_size),
                        num_kv_blocks=num_blocks, block_size=config.block_size,
                        vocab_size=VOCAB, eos_token_ids=frozenset(eos_token_ids),
                        sliding_window=sliding_window)


def make_scheduler(config: SchedulerConfig, num_blocks: int,
                   eos_token_ids: Collection[int] = (), sliding_window: int = 0) -> Scheduler:
    return Scheduler(config, make_limits(config, num_blocks, eos_token_ids, sliding_window))


class FakeRunner:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.block_size = sched.block_manager.block_size
        self.slots: list[tuple[int, ...] | None] = [None] * (
            sched.block_manager.num_blocks * self.block_size)
        self.steps = 0
        self.window = sched.limits.sliding_window

    def slot(self, seq: Sequence, p: int) -> int:
        assert seq.block_table[p // self.block_size] >= 0, f"{seq!r}: position {p} released"
        return seq.block_table[p // self.block_size] * self.block_size + p % self.block_size

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        self.steps += 1
        sampled: dict[str, int] = {}
        for i, seq in enumerate(out.seqs):
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted after schedule(): the real runner would still compute it
            c, n = seq.num_computed_tokens, out.num_scheduled_tokens[i]
            assert len(seq.block_table) * self.block_size >= c + n, f"no slots: {seq!r}"
            # A sliding window: query c sees positions > c - window, which must be held.
            for p in range(max(0, c - self.window + 1) if self.window else 0, c):
                got = self.slots[self.slot(seq, p)]
                assert got == tuple(seq.token_ids[: p + 1]), f"{seq!r}: bad KV at {p}: {got}"
            for p in range(c, c + n):
                self.slots[self.slot(seq, p)] = tuple(seq.token_ids[: p + 1])
            if out.samples(i):
                sampled[seq.seq_id] = next_token(seq.token_ids)
        return sampled


def decoding(sched: Scheduler) -> int:
    """Call before schedule(): how many running sequences are down to their last token?"""
    return sum(seq.num_uncomputed_tokens == 1 for seq in sched.running)


def check_output(sched: Scheduler, out: SchedulerOutput, was_decoding: int = 0) -> None:
    """What every SchedulerOutput must satisfy (`was_decoding`: decoding(sched) before it)."""
    cfg = sched.config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.seqs) <= cfg.max_num_seqs
    assert len({s.seq_id for s in out.seqs}) == len(out.seqs), "a sequence scheduled twice"
    assert len(out.seqs) == len(out.num_scheduled_tokens)
    for seq, n in zip(out.seqs, out.num_scheduled_tokens):
        assert 1 <= n <= cfg.prefill_chunk_cap, (seq, n)
        assert seq.status == SequenceStatus.RUNNING and seq.seq_id not in out.preempted_ids
        assert seq.num_computed_tokens + n <= seq.num_tokens
    # While something decodes, prompt tokens (chunks of more than one) stay within the cap.
    cap = cfg.decode_step_prefill_cap(was_decoding)
    if cap:
        assert sum(n for n in out.num_scheduled_tokens if n > 1) <= cap, out
    # Admission only uses budget the running sequences left over: none of them is skipped,
    # except a prefill that must wait for room under that cap.
    scheduled = set(map(id, out.seqs))
    for seq in sched.running:
        assert id(seq) in scheduled or (cap > 0 and seq.num_uncomputed_tokens > 1), seq


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Sequence]]:
    was_decoding = decoding(sched)
    out = sched.schedule()
    check_output(sched, out, was_decoding)
    sched.check_invariants()
    done = sched.postprocess(out, runner.run(out))
    sched.check_invariants()
    return out, done


def drain(sched: Scheduler, runner: FakeRunner | None = None, max_steps: int = 2000) -> int:
    """Step until nothing is unfinished; returns the number of steps. Ends with a free pool."""
    runner = runner or FakeRunner(sched)
    steps = 0
    while sched.has_unfinished():
        step(sched, runner)
        steps += 1
        assert steps <= max_steps, f"no progress: running={sched.running} waiting={sched.waiting}"
    assert_all_free(sched)
    return steps


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What a sequence generates alone, with no stop condition but max_tokens."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(next_token(ids))
    return ids[len(prompt):]
