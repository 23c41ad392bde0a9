"""Prometheus metrics a vLLM dashboard or autoscaler reads unchanged.

Names are vLLM's under a configurable prefix (`--metrics-prefix`, default `pagedserve`;
`vllm` gives `vllm:num_requests_running` and so on), and every series carries a
`model_name` label, as vLLM's do. Engine state is read at scrape time (EngineStats); the
per-request engine intervals (queue, prefill, decode, inference) come measured by the
engine with the final delta (RequestOutput.timings); TTFT, inter-token and end-to-end
latency are measured at the API edge, where the client sees them. prometheus_client's
process, GC and platform collectors are registered too; as in vLLM, their series
(process_*, python_*) carry no model_name. Each app owns a registry (never the
process-global one), so several apps can live in one process.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from engine.outputs import ErrorCode, RequestOutput
from engine.protocol import ITERATION_TOKEN_BUCKETS, EngineClient, EngineStats

DEFAULT_PREFIX = "pagedserve"
PREFIX_PATTERN = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
LABEL = "model_name"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))  # 1 .. 500000
N_BUCKETS = (1, 2, 5, 10, 20)


def check_prefix(prefix: str) -> str:
    """A metric-name prefix (the part before ':'); ValueError when Prometheus would refuse it."""
    if not PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(f"metrics prefix must match {PREFIX_PATTERN.pattern}, got {prefix!r}")
    return prefix


# Engine series read from EngineStats at scrape time: name -> (help, value of a snapshot).
ENGINE_GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "num_requests_running": ("Requests in the running batch.", lambda s: s.num_running),
    "num_requests_waiting": ("Requests waiting to be scheduled.", lambda s: s.num_waiting),
    "kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1).", lambda s: s.kv_cache_usage),
    # vLLM's older name of the same, which its own Grafana dashboard still reads.
    "gpu_cache_usage_perc": (("Fraction of KV blocks in use (0-1); the older name of "
                             "kv_cache_usage_perc."), lambda s: s.kv_cache_usage),
    "num_kv_blocks": ("KV blocks in the pool.", lambda s: s.num_kv_blocks),
    "num_free_kv_blocks": ("KV blocks free (including cached, evictable).",
                           lambda s: s.num_free_kv_blocks),
}
ENGINE_COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "num_preemptions": ("Sequences preempted (recompute).", lambda s: s.num_preemptions),
    "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                             lambda s: s.prefix_cache_queries),
    "prefix_cache_hits": ("Prompt tokens found in the prefix cache.",
                          lambda s: s.prefix_cache_hits),
}

SPEC_DECODE_COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "spec_decode_num_drafts": ("Speculative drafts (one sequence's draft tokens in one step).",
                               lambda s: s.spec_num_drafts),
    "spec_decode_num_draft_tokens": ("Draft tokens proposed.", lambda s: s.spec_num_draft_tokens),
    "spec_decode_num_accepted_tokens": ("Draft tokens accepted.",
                                        lambda s: s.spec_num_accepted_tokens),
}


class EngineCollector(Collector):
    """Engine gauges, counters and the tokens-per-step histogram, read from engine.stats()
    at each scrape. One row of series per engine: a subclass with several engines (Ray
    replicas) overrides `labels` and `rows()`."""

    labels: tuple[str, ...] = (LABEL,)

    def __init__(self, engine: EngineClient, prefix: str, model_name: str) -> None:
        self._engine = engine
        self._p = prefix + ":"
        self._model = model_name

    def rows(self) -> list[tuple[list[str], EngineStats]]:
        """(label values, stats) per engine."""
        return [([self._model], self._engine.stats())]

    def collect(self) -> Iterator[Metric]:
        rows = self.rows()
        names = list(self.labels)
        for name, (doc, value) in ENGINE_GAUGES.items():
            gauge = GaugeMetricFamily(self._p + name, doc, labels=names)
            for labels, s in rows:
                gauge.add_metric(labels, value(s))
            yield gauge
        for name, (doc, value) in ENGINE_COUNTERS.items():
            counter = CounterMetricFamily(self._p + name, doc, labels=names)
            for labels, s in rows:
                counter.add_metric(labels, value(s))
            yield counter
        yield self._iteration_tokens(rows)
        if any(s.spec_accepted_per_pos for _, s in rows):
            yield from self._spec_decode(rows)
        info = self._cache_config(rows[0][1] if rows else EngineStats())
        if info is not None:
            yield info
        yield self._memory(rows)

    def _spec_decode(self, rows: list[tuple[list[str], EngineStats]]) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (only while speculation is on)."""
        for name, (doc, value) in SPEC_DECODE_COUNTERS.items():
            counter = CounterMetricFamily(self._p + name, doc, labels=list(self.labels))
            for labels, s in rows:
                counter.add_metric(labels, value(s))
            yield counter
        per_pos = CounterMetricFamily(
            self._p + "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted.",
            labels=[*self.labels, "position"])
        for labels, s in rows:
            for pos, count in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([*labels, str(pos)], count)
        yield per_pos

    def _memory(self, rows: list[tuple[list[str], EngineStats]]) -> Metric:
        """Where the engine's resident memory went once ready (engine/worker/memory.py):
        weights by form, the KV pool, the warm-up, the rest, resident and peak."""
        g = GaugeMetricFamily(self._p + "memory_bytes",
                              "Engine resident memory by kind, once ready (bytes): weights "
                              "by form, kv_pool, warm_up, other, resident, peak.",
                              labels=[*self.labels, "kind"])
        for labels, s in rows:
            for kind, nbytes in s.memory:
                g.add_metric([*labels, kind], float(nbytes))
        return g

    def _iteration_tokens(self, rows: list[tuple[list[str], EngineStats]]) -> Metric:
        h = HistogramMetricFamily(self._p + "iteration_tokens_total",
                                  "Tokens per engine step.", labels=list(self.labels))
        bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        for labels, s in rows:
            counts = s.iteration_tokens or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
            h.add_metric(labels, list(zip(bounds, counts, strict=True)),
                         float(s.iteration_tokens_sum))
        return h

    def _cache_config(self, s: EngineStats) -> Metric | None:
        """vLLM's cache_config_info: value 1, the configuration in labels (once loaded)."""
        limits = self._engine.limits
        if limits is None:
            return None
        labels = {LABEL: self._model, "block_size": str(limits.block_size),
                  "num_gpu_blocks": str(limits.num_kv_blocks), "cache_dtype": s.cache_dtype,
                  "enable_prefix_caching": str(s.enable_prefix_caching)}
        g = GaugeMetricFamily(self._p + "cache_config_info",
                              "Information of the KV cache configuration.", labels=list(labels))
        g.add_metric(list(labels.values()), 1.0)
        return g


class HistogramAlias(Collector):
    """A histogram's series again under another name and help text: its samples as they are
    at each scrape, renamed (vLLM serves the inter-token latency under two names; a token then
    costs one observation, not two)."""

    def __init__(self, source: Histogram, name: str, documentation: str) -> None:
        self._source = source  # the labelled parent: its collect() holds every child's series
        self._name = name
        self._doc = documentation

    def describe(self) -> list[Metric]:
        return [Metric(self._name, self._doc, "histogram")]

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            alias = Metric(self._name, self._doc, family.type)
            cut = len(family.name)
            for sample in family.samples:
                alias.add_sample(self._name + sample.name[cut:], sample.labels, sample.value,
                                 sample.timestamp, sample.exemplar)
            yield alias


class ServerMetrics:
    """The registry of one app plus the request counters and histograms."""

    def __init__(self, engine: EngineClient, model_name: str,
                 prefix: str = DEFAULT_PREFIX) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p, self.model_name = check_prefix(prefix) + ":", model_name
        self.prefix = prefix
        self.engine_collector: EngineCollector = EngineCollector(engine, prefix, model_name)
        r.register(self.engine_collector)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        if GC_COLLECTOR is not None:  # absent on interpreters without gc.get_stats
            GCCollector(registry=r)
        self.prompt_tokens = self._counter(p + "prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = self._counter(p + "generation_tokens", "Tokens generated.")
        self.request_success = Counter(p + "request_success", "Finished requests.",
                                       [LABEL, "finished_reason"], registry=r)
        # reason: max_num_queued_reqs | max_num_queued_tokens | prompt_too_long |
        # engine_dead | shutting_down | queue_timeout (admitted, deadline passed in the queue)
        self.rejections = Counter(p + "admission_rejections", "Requests refused at admission.",
                                  [LABEL, "reason"], registry=r)
        self._rejected: dict[str, int] = {}
        h = self._histogram
        self.ttft = h(p + "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        itl = Histogram(p + "inter_token_latency_seconds", "Time between output deltas.",
                        [LABEL], buckets=ITL_BUCKETS, registry=r)
        self.itl = itl.labels(self.model_name)
        # The same histogram under vLLM's older name: shown twice, observed once per token.
        r.register(HistogramAlias(itl, p + "time_per_output_token_seconds",
                                  "Time per output token (vLLM's older name of "
                                  "inter_token_latency_seconds)."))
        self.request_tpot = h(p + "request_time_per_output_token_seconds",
                              "Per request: decode time / (generated tokens - 1).", ITL_BUCKETS)
        self.e2e = h(p + "e2e_request_latency_seconds", "Request latency end to end.",
                     REQUEST_BUCKETS)
        self.queue_time = h(p + "request_queue_time_seconds",
                            "Time waiting before first scheduled.", REQUEST_BUCKETS)
        self.prefill_time = h(p + "request_prefill_time_seconds",
                              "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode_time = h(p + "request_decode_time_seconds", "First token to last token.",
                             REQUEST_BUCKETS)
        self.inference_time = h(p + "request_inference_time_seconds",
                                "First scheduled to last token.", REQUEST_BUCKETS)
        self.request_prompt_tokens = h(p + "request_prompt_tokens", "Prompt tokens per request.",
                                       TOKEN_BUCKETS)
        self.request_generation_tokens = h(p + "request_generation_tokens",
                                           "Generated tokens per request.", TOKEN_BUCKETS)
        self.params_n = h(p + "request_params_n", "The n parameter of requests.", N_BUCKETS)
        self.params_max_tokens = h(p + "request_params_max_tokens",
                                   "The max_tokens of requests (resolved).", TOKEN_BUCKETS)
        self.max_num_generation_tokens = h(
            p + "request_max_num_generation_tokens",
            "The most tokens any of a request's n choices generated.", TOKEN_BUCKETS)

    def use_engine_collector(self, collector: EngineCollector) -> None:
        """Serve the engine series from `collector` instead (one row per Ray replica)."""
        self.registry.unregister(self.engine_collector)
        self.engine_collector = collector
        self.registry.register(collector)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, [LABEL], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, [LABEL], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def reject(self, reason: str) -> None:
        self.rejections.labels(self.model_name, reason).inc()
        self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def rejected_by_reason(self) -> dict[str, int]:
        """Refusals at admission so far, by reason (the live view's count of 429s and 503s)."""
        return dict(self._rejected)

    def finished(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()

    def observe_params(self, n: int, max_tokens: int) -> ChoiceGroup:
        """Once per API request (a prompt of a completion, a chat), as vLLM counts them;
        the group its n choices' trackers report to."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)
        return ChoiceGroup(self, n)

    def tracker(self, num_prompt_tokens: int, group: ChoiceGroup | None = None
                ) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens, group)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ChoiceGroup:
    """The n choices of one API request (vLLM's parent request): once the last has ended,
    the most tokens any of them generated is observed (request_max_num_generation_tokens)."""

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self._m = metrics
        self._left = n
        self._most = 0

    def ended(self, num_output_tokens: int) -> None:
        self._most = max(self._most, num_output_tokens)
        self._left -= 1
        if self._left == 0:
            self._m.max_num_generation_tokens.observe(self._most)


class RequestTracker:
    """Timing of one engine request, seen from the API edge, plus the engine's intervals."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int,
                 group: ChoiceGroup | None = None) -> None:
        self._m = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._group = group
        self._arrival = time.monotonic()
        self._last: float | None = None
        self._num_output_tokens = 0

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            if self._last is None:
                self._m.ttft.observe(now - self._arrival)
            else:  # one observation: time_per_output_token_seconds shows this histogram
                self._m.itl.observe(now - self._last)
            self._last = now
            self._m.generation_tokens.inc(len(out.new_token_ids))
            self._num_output_tokens += len(out.new_token_ids)
        if out.finished:
            self._finish(out, now)

    def on_abort(self) -> None:
        """The client went away before the engine finished (the final delta is never read)."""
        self._m.finished("abort")
        self._m.e2e.observe(time.monotonic() - self._arrival)
        if self._group is not None:
            self._group.ended(self._num_output_tokens)

    def _finish(self, out: RequestOutput, now: float) -> None:
        m = self._m
        if self._group is not None:
            self._group.ended(out.num_output_tokens)
        if out.error_code == ErrorCode.QUEUE_TIMEOUT:  # admitted, but refused late: never ran
            m.reject("queue_timeout")
        m.prompt_tokens.inc(self._num_prompt_tokens)
        m.finished(out.finish_reason or "abort")
        m.e2e.observe(now - self._arrival)
        m.request_prompt_tokens.observe(out.num_prompt_tokens or self._num_prompt_tokens)
        m.request_generation_tokens.observe(out.num_output_tokens)
        t = out.timings
        if t is None:
            return
        for histogram, value in ((m.queue_time, t.queue), (m.prefill_time, t.prefill),
                                 (m.decode_time, t.decode), (m.inference_time, t.inference)):
            if value is not None:
                histogram.observe(value)
        if t.decode is not None and out.num_output_tokens > 1:
            m.request_tpot.observe(t.decode / (out.num_output_tokens - 1))
