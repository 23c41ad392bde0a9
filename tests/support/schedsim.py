"""A fake model runner and step loop for scheduler tests (no torch).

FakeRunner keeps a paged "KV pool" like the real one: slot p of a sequence holds the exact
token prefix 0..p it was computed from. Every step it reads the context of each scheduled
sequence through its block table and fails if any cached slot is not the sequence's own
prefix (so a wrong prefix hit, a stale block after preemption or a bad block table is
caught), writes the new slots, and samples a token that is a pure function of the tokens
(as greedy decoding is), so outputs must not depend on batching.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from scheduler.config import SchedulerConfig
from scheduler.limits import EngineLimits
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.step_cost import CostModel, StepShape, shape_of

VOCAB = 50  # sampled ids are in [2, VOCAB); 0 and 1 are free for EOS/stop tests
# What a step "takes" in these simulations (seconds), for the step-time budget to fit: a 10 ms
# floor, 0.5 ms a decode row (0.8 ms if it draws), 0.2 ms a prompt token, 1 ms a prefill
# chunk, and attention.
SIM_COST = CostModel(fixed=0.010, per_decode=0.0005, per_prefill=0.0002, per_decode_ctx=0.001,
                     per_prefill_attn=0.05, per_prefill_seq=0.001, per_sampled_row=0.0003)


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
    """Checks every K/V read (each slot remembers the tokens it was computed from) and
    "samples" `model(tokens so far)`; a speculating sequence gets its verified tokens in
    `verified` (kept drafts, then the model's token), as ModelRunner returns them."""

    def __init__(self, sched: Scheduler,
                 model: Callable[[list[int]], int] | None = None) -> None:
        self.sched = sched
        self.model = model or next_token
        self.verified: dict[str, list[int]] = {}
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
        self.verified = {}
        for i, seq in enumerate(out.seqs):
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted after schedule(): the real runner would still compute it
            c, n = seq.num_computed_tokens, out.num_scheduled_tokens[i]
            assert len(seq.block_table) * self.block_size >= c + n, f"no slots: {seq!r}"
            # A sliding window: query c sees positions > c - window, which must be held.
            for p in range(max(0, c - self.window + 1) if self.window else 0, c):
                got = self.slots[self.slot(seq, p)]
                assert got == tuple(seq.token_ids[: p + 1]), f"{seq!r}: bad KV at {p}: {got}"
            drafts = out.draft_token_ids.get(seq.seq_id, [])
            tokens = seq.token_ids[:c] + out.input_token_ids(i)
            for p in range(c, c + n):
                self.slots[self.slot(seq, p)] = tuple(tokens[: p + 1])
            if seq.seq_id in out.draft_token_ids:
                chosen = [self.model(tokens[:c + 1 + j]) for j in range(n)]
                kept = 0
                while kept < len(drafts) and chosen[kept] == drafts[kept]:
                    kept += 1
                self.verified[seq.seq_id] = chosen[:kept + 1]
            elif out.samples(i):
                sampled[seq.seq_id] = self.model(seq.token_ids)
        return sampled


def decoding(sched: Scheduler) -> int:
    """Call before schedule(): how many running sequences are down to their last token?"""
    return sum(seq.num_uncomputed_tokens == 1 for seq in sched.running)


def decode_shape(sched: Scheduler) -> StepShape:
    """Call before schedule(): the running decodes as the step-time budget prices them."""
    rows = [seq for seq in sched.running if seq.num_uncomputed_tokens == 1]
    return StepShape(len(rows), 0, sum(seq.num_computed_tokens + 1 for seq in rows),
                     sampled_rows=sum(not seq.params.greedy for seq in rows))


def check_output(sched: Scheduler, out: SchedulerOutput, was_decoding: int = 0,
                 allowed: float | None = None) -> None:
    """What every SchedulerOutput must satisfy (`was_decoding`: decoding(sched) before it;
    `allowed`: the step-time budget's cap in seconds for this step, if it had one)."""
    cfg = sched.config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.seqs) <= cfg.max_num_seqs
    assert len({s.seq_id for s in out.seqs}) == len(out.seqs), "a sequence scheduled twice"
    assert len(out.seqs) == len(out.num_scheduled_tokens)
    for seq, n in zip(out.seqs, out.num_scheduled_tokens):
        assert 1 <= n <= cfg.prefill_chunk_cap, (seq, n)
        assert seq.status == SequenceStatus.RUNNING and seq.seq_id not in out.preempted_ids
        drafts = out.draft_token_ids.get(seq.seq_id, [])
        assert not drafts or seq.num_uncomputed_tokens == 1, ("drafts on a prompt chunk", seq)
        assert seq.num_computed_tokens + n <= seq.num_tokens + len(drafts)
    # While something decodes, prompt tokens (chunks of more than one) stay within the cap;
    # or, with the step-time budget fitted, the step's predicted time within its cap.
    cap = cfg.decode_step_prefill_cap(was_decoding)
    model = sched.step_budget.model if sched.step_budget is not None else None
    prompt = [n for s, n in zip(out.seqs, out.num_scheduled_tokens, strict=True)
              if n > 1 and s.seq_id not in out.draft_token_ids]
    if cap and model is None:
        assert sum(prompt) <= cap, out
    if allowed is not None and model is not None and sched.step_budget is not None:
        # ... but for the first chunk's floor of a block, which a step may always take
        floor_only = sum(prompt) <= sched.step_budget.floor
        assert model.step_time(shape_of(out)) <= allowed * (1 + 1e-9) or floor_only, out
    # Admission only uses budget the running sequences left over: none of them is skipped,
    # except a prefill that must wait for room under that cap or budget.
    limited = cap > 0 or sched.step_budget is not None
    scheduled = set(map(id, out.seqs))
    for seq in sched.running:
        assert id(seq) in scheduled or (limited and seq.num_uncomputed_tokens > 1), seq


def step_cap(sched: Scheduler) -> float | None:
    """Call before schedule(): the step-time budget's cap on this step (None: no cap)."""
    budget = sched.step_budget
    if budget is None or budget.model is None or not decoding(sched):
        return None
    shape = decode_shape(sched)
    forming = min(sched.config.max_num_seqs, sched.num_running + sched.num_waiting)
    allowance = budget.allowance(shape, forming)
    assert allowance is not None
    return budget.model.step_time(shape) + allowance.seconds


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Sequence]]:
    """One step; with the step-time budget on, the step "takes" SIM_COST's time for it."""
    was_decoding, allowed = decoding(sched), step_cap(sched)
    out = sched.schedule()
    check_output(sched, out, was_decoding, allowed)
    sched.check_invariants()
    if out.seqs:
        sched.observe_step(shape_of(out), SIM_COST.step_time(shape_of(out)))
    done = sched.postprocess(out, runner.run(out), runner.verified)
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
