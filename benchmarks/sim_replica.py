"""One simulated replica: our real Scheduler and BlockManager on a simulated clock.

Admission, chunked prefill, prefix-cache hits, LRU eviction and preemption are the
scheduler's own; only the forward is replaced. A step is schedule() -> (cost model says how
long the forward takes) -> postprocess() with the planned answer tokens as the "sampled" ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.step_cost import CostModel, shape_of
from scheduler.config import SchedulerConfig
from scheduler.limits import EngineLimits
from scheduler.output import SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence

EOS = 0  # never planned as an answer token (sim_workload draws ids >= 1000)


@dataclass(frozen=True, slots=True)
class StepEvent:
    """A sequence that got a token in a step: its first one, its last one, or both."""

    seq: Sequence
    first_token: bool
    finished: bool


class SimReplica:
    def __init__(self, index: int, config: SchedulerConfig, num_kv_blocks: int,
                 cost: CostModel, next_token: Callable[[Sequence], int]) -> None:
        """`next_token(seq)`: the token seq "samples" now (its planned answer's next one)."""
        limits = EngineLimits(max_model_len=config.max_model_len, num_kv_blocks=num_kv_blocks,
                              block_size=config.block_size, vocab_size=1 << 17,
                              eos_token_ids=frozenset({EOS}))
        self.index = index
        self.scheduler = Scheduler(config, limits)
        self.cost = cost
        self.next_token = next_token
        self.batch: SchedulerOutput | None = None  # the step in flight, if any
        self.busy_s = 0.0  # simulated seconds spent in steps
        self.num_steps = 0
        self.num_requests = 0  # routed here, in all

    @property
    def busy(self) -> bool:
        return self.batch is not None

    @property
    def in_flight(self) -> int:
        """Requests here and unfinished: the load a router sees (Ray's queue length)."""
        return self.scheduler.num_running + self.scheduler.num_waiting

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self.num_requests += 1

    def start_step(self) -> float | None:
        """Schedule the next step; -> its duration, or None when there is nothing to run."""
        assert self.batch is None, "a step is already in flight"
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return None
        self.batch = batch
        shape = shape_of(batch)
        dt = self.cost.step_time(shape)
        self.scheduler.observe_step(shape, dt)  # a preset's step-time budget fits the model
        self.busy_s += dt
        self.num_steps += 1
        return dt

    def finish_step(self) -> list[StepEvent]:
        """The forward of the step in flight is done: advance every sequence in it."""
        batch, self.batch = self.batch, None
        assert batch is not None, "no step in flight"
        sampled = {seq.seq_id: self.next_token(seq)
                   for i, seq in enumerate(batch.seqs) if batch.samples(i)}
        done = self.scheduler.postprocess(batch, sampled)
        # A recompute after preemption samples the *next* token, so output 1 is the first.
        return [StepEvent(seq, seq.num_output_tokens == 1, seq.is_finished) for seq in done]

    @property
    def prefix_cache(self) -> tuple[int, int]:
        """(tokens looked up, tokens hit) at admission, as /metrics counts them."""
        bm = self.scheduler.block_manager
        return bm.prefix_cache_queries, bm.prefix_cache_hits
