"""Step statistics for /metrics: the tokens-per-step histogram the engine counts every step,
and the EngineStats snapshot built from it and the scheduler's counters; the periodic
speculative-decoding log line."""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable

from engine.protocol import ITERATION_TOKEN_BUCKETS, EngineStats
from scheduler.scheduler import Scheduler
from scheduler.speculative import SpecDecodeStats

logger = logging.getLogger("pagedserve.engine")

SPEC_LOG_INTERVAL_S = 10.0


class SpecDecodeLog:
    """Logs, at most every SPEC_LOG_INTERVAL_S and only after drafts, what speculation kept
    since the last line (vLLM's "SpecDecoding metrics" line): the mean acceptance length (the
    tokens a speculating step yields per sequence), the draft acceptance rate and the rate
    per draft position."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_time = clock()
        # drafts, draft tokens, accepted, per position: the counters at the last line
        self._last: tuple[int, int, int, tuple[int, ...]] = (0, 0, 0, ())

    def maybe_log(self, stats: SpecDecodeStats) -> None:
        now = self._clock()
        if now - self._last_time < SPEC_LOG_INTERVAL_S or stats.num_drafts == self._last[0]:
            return
        drafts0, tokens0, accepted0, pos0 = self._last
        drafts, tokens = stats.num_drafts - drafts0, stats.num_draft_tokens - tokens0
        accepted = stats.num_accepted_tokens - accepted0
        per_pos = [a - (pos0[i] if i < len(pos0) else 0)
                   for i, a in enumerate(stats.accepted_per_pos)]
        logger.info("speculative decoding: mean acceptance length %.2f, accepted %d of %d "
                    "draft tokens (%.1f%%) in %d drafts; per position %s",
                    1 + accepted / drafts, accepted, tokens, 100 * accepted / max(tokens, 1),
                    drafts, ", ".join(f"{a / drafts:.2f}" for a in per_pos))
        self._last_time = now
        self._last = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                      tuple(stats.accepted_per_pos))


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
    spec = s.spec_stats
    return EngineStats(
        num_running=s.num_running, num_waiting=s.num_waiting,
        num_kv_blocks=bm.num_blocks, num_free_kv_blocks=bm.num_free_blocks,
        num_preemptions=s.num_preemptions, prefix_cache_queries=bm.prefix_cache_queries,
        prefix_cache_hits=bm.prefix_cache_hits, num_steps=num_steps,
        iteration_tokens=iterations.cumulative(), iteration_tokens_sum=iterations.tokens_sum,
        cache_dtype=cache_dtype, enable_prefix_caching=enable_prefix_caching, memory=memory,
        spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_pos=tuple(spec.accepted_per_pos))
