"""Step statistics for /metrics: the tokens-per-step histogram the engine counts every step,
and the EngineStats snapshot built from it and the scheduler's counters."""

from __future__ import annotations

import bisect
import itertools

from engine.protocol import ITERATION_TOKEN_BUCKETS, EngineStats
from scheduler.scheduler import Scheduler


class IterationTokens:
    """Steps per tokens-per-step bucket (ITERATION_TOKEN_BUCKETS, then +Inf) and the sum of
    all steps' tokens."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.tokens_sum = 0

    def count(self, num_tokens: int) -> None:
        i = bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)  # first bound >= it
        self.counts[i] += 1
        self.tokens_sum += num_tokens

    def cumulative(self) -> tuple[int, ...]:
        """Counts per bound, cumulative as EngineStats.iteration_tokens wants them."""
        return tuple(itertools.accumulate(self.counts))


def engine_stats(s: Scheduler, iterations: IterationTokens, num_steps: int, *,
                 cache_dtype: str, enable_prefix_caching: bool,
                 memory: tuple[tuple[str, int], ...] = ()) -> EngineStats:
    bm = s.block_manager
    return EngineStats(
        num_running=s.num_running, num_waiting=s.num_waiting,
        num_kv_blocks=bm.num_blocks, num_free_kv_blocks=bm.num_free_blocks,
        num_preemptions=s.num_preemptions, prefix_cache_queries=bm.prefix_cache_queries,
        prefix_cache_hits=bm.prefix_cache_hits, num_steps=num_steps,
        iteration_tokens=iterations.cumulative(), iteration_tokens_sum=iterations.tokens_sum,
        cache_dtype=cache_dtype, enable_prefix_caching=enable_prefix_caching, memory=memory)
