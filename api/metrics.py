"""Prometheus metrics: engine state (read at scrape time) and latencies measured at the API edge.

Names follow vLLM's with a `pagedserve:` prefix so dashboards carry over. Each app owns a
registry (never the process-global default one), so several apps can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import ErrorCode, RequestOutput
from engine.protocol import EngineClient, EngineStats

P = "pagedserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineCollector(Collector):
    """Engine gauges and counters, read from engine.stats() at each scrape."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        s: EngineStats = self._engine.stats()
        gauges = {
            "num_requests_running": ("Requests in the running batch.", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1).", s.kv_cache_usage),
            "num_kv_blocks": ("KV blocks in the pool.", s.num_kv_blocks),
            "num_free_kv_blocks": ("KV blocks free (including cached, evictable).",
                                   s.num_free_kv_blocks),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(P + name, doc, value=value)
        counters = {
            "num_preemptions": ("Sequences preempted (recompute).", s.num_preemptions),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                     s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.",
                                  s.prefix_cache_hits),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(P + name, doc, value=value)


class ServerMetrics:
    """The registry of one app plus the edge-measured counters and histograms."""

    def __init__(self, engine: EngineClient) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        r.register(EngineCollector(engine))
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed.",
                                     registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.",
                                         registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests.",
                                       ["finished_reason"], registry=r)
        # reason: max_num_queued_reqs | max_num_queued_tokens | prompt_too_long |
        # engine_dead | shutting_down | queue_timeout (admitted, deadline passed in the queue)
        self.rejections = Counter(P + "admission_rejections", "Requests refused at admission.",
                                  ["reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output deltas.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency end to end.",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds",
                                    "Time spent waiting before first scheduled.",
                                    buckets=REQUEST_BUCKETS, registry=r)

    def tracker(self, num_prompt_tokens: int) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Timing of one engine request, seen from the API edge."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self._m = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._arrival = time.monotonic()
        self._last: float | None = None

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            if self._last is None:
                self._m.ttft.observe(now - self._arrival)
            else:
                self._m.itl.observe(now - self._last)
            self._last = now
            self._m.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            self._finish(out, now)

    def on_abort(self) -> None:
        """The client went away before the engine finished (the final delta is never read)."""
        self._m.request_success.labels(finished_reason="abort").inc()
        self._m.e2e.observe(time.monotonic() - self._arrival)

    def _finish(self, out: RequestOutput, now: float) -> None:
        if out.error_code == ErrorCode.QUEUE_TIMEOUT:  # admitted, but refused late: never ran
            self._m.rejections.labels(reason="queue_timeout").inc()
        self._m.prompt_tokens.inc(self._num_prompt_tokens)
        self._m.request_success.labels(finished_reason=out.finish_reason).inc()
        self._m.e2e.observe(now - self._arrival)
        if out.queue_time is not None:
            self._m.queue_time.observe(out.queue_time)
