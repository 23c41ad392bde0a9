"""The per-token path from a RequestOutput to SSE bytes (issue 34 part 5): one engine request is
read in place (no pump task, no second queue), a token costs one histogram observation, and
the metric values over a stream are what they were: the value tests here pass on the code
before the change as well (benchmarks/bench_token_path.py's base worktree).

Metric values are read from /metrics after whole streams through the app (FakeEngine): the
ones the FakeEngine fixes exactly (counts, token sums, its engine timings), and the latency
histograms by their counts, with time_per_output_token_seconds equal to
inter_token_latency_seconds sample for sample."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import Histogram
from prometheus_client.parser import text_string_to_metric_families

from api.errors import APIError
from api.metrics import ServerMetrics
from api.streams import Job, MergedStream
from engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams
from tests.api.test_disconnect import call
from tests.support.apitools import serve, sse_json
from tests.support.fake_engine import FAKE_TIMINGS, FakeEngine

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]
MODEL = (("model_name", "fake-model"),)
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def scrape(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def streamed(requests: list[tuple[str, dict[str, Any]]]
             ) -> tuple[list[list[dict[str, Any]]], Samples]:
    """Each request streamed to its end through the app (every one answers the FakeEngine's
    scripted "Hello there, friend." then EOS, 21 tokens), then /metrics."""
    engine = FakeEngine()
    engine.replies = ["Hello there, friend."]
    with serve(engine) as client:
        bodies = []
        for path, body in requests:
            r = client.post(path, json={**body, "stream": True})
            assert r.status_code == 200, r.text
            bodies.append(sse_json(r.text))
        return bodies, scrape(client.get("/metrics").text)


def value(s: Samples, name: str, **labels: str) -> float:
    return s[f"pagedserve:{name}"].get(tuple(sorted({**dict(MODEL), **labels}.items())), 0.0)


def choice_tokens(events: list[dict[str, Any]]) -> dict[int, int]:
    """Tokens per choice, from the chunks' token_ids (return_token_ids)."""
    ids: dict[int, int] = {}
    for e in events:
        for c in e["choices"]:
            ids[c["index"]] = ids.get(c["index"], 0) + len(c.get("token_ids") or [])
    return ids


STREAMS = [
    # (route, body, choices, tokens per choice, finish reason)
    (CMPL, {"prompt": "abcdefgh", "max_tokens": 6}, 1, 6, "length"),
    (CMPL, {"prompt": "abcdefgh", "max_tokens": 6, "n": 2, "logprobs": 1}, 2, 6, "length"),
    (CMPL, {"prompt": "abcdefgh", "max_tokens": 9, "stop": ["o t"]}, 1, 7, "stop"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}, 1, 21, "stop"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 3}, 3, 5,
     "length"),
]


@pytest.mark.parametrize("route,body,n,tokens,finish", STREAMS)
def test_metric_values_over_a_stream(route: str, body: dict[str, Any], n: int, tokens: int,
                                     finish: str) -> None:
    body = {**body, "return_token_ids": True, "stream_options": {"include_usage": True}}
    (events,), s = streamed([(route, body)])
    assert set(choice_tokens(events).values()) == {tokens}
    assert events[-1]["usage"]["completion_tokens"] == n * tokens
    prompt = events[-1]["usage"]["prompt_tokens"]
    assert value(s, "generation_tokens_total") == n * tokens
    assert value(s, "prompt_tokens_total") == n * prompt  # each choice counts its prompt
    assert value(s, "request_success_total", finished_reason=finish) == n
    assert value(s, "time_to_first_token_seconds_count") == n
    assert value(s, "inter_token_latency_seconds_count") == n * (tokens - 1)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_generation_tokens",
                 "request_prompt_tokens", "request_time_per_output_token_seconds"):
        assert value(s, name + "_count") == n, name
    assert value(s, "request_generation_tokens_sum") == n * tokens
    assert value(s, "request_prompt_tokens_sum") == n * prompt
    decode = FAKE_TIMINGS.decode
    assert decode is not None
    assert value(s, "request_decode_time_seconds_sum") == pytest.approx(n * decode)
    assert value(s, "request_time_per_output_token_seconds_sum") == pytest.approx(
        n * decode / (tokens - 1))
    assert value(s, "request_params_n_sum") == n
    assert value(s, "request_max_num_generation_tokens_sum") == tokens
    assert_alias(s)


def assert_alias(s: Samples) -> None:
    """time_per_output_token_seconds is inter_token_latency_seconds, bucket for bucket."""
    itl, tpot = "pagedserve:inter_token_latency_seconds", "pagedserve:time_per_output_token_seconds"
    for suffix in ("_bucket", "_count", "_sum"):
        assert s[tpot + suffix] == s[itl + suffix], suffix


def test_metric_values_add_up_over_several_streams() -> None:
    _, s = streamed([(route, body) for route, body, *_ in STREAMS])
    assert value(s, "generation_tokens_total") == sum(n * t for *_, n, t, _ in STREAMS)
    assert value(s, "inter_token_latency_seconds_count") == sum(
        n * (t - 1) for *_, n, t, _ in STREAMS)
    assert value(s, "request_success_total", finished_reason="stop") == 2
    assert value(s, "request_success_total", finished_reason="length") == 6
    assert_alias(s)


@pytest.mark.parametrize("path,body", [
    (CMPL, {"prompt": "abc", "max_tokens": 100, "stream": True}),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100,
            "stream": True}),
])
def test_a_client_that_leaves_an_n1_stream_aborts_it(path: str, body: dict[str, Any]) -> None:
    engine = FakeEngine(token_delay=0.01)
    from api.app import create_app

    app = create_app(engine)
    asyncio.run(call(engine, path, body, 4, app))
    assert len(engine.aborted) == 1 and not engine.finished
    s = scrape(app.state.pagedserve.metrics.render().decode())
    assert value(s, "request_success_total", finished_reason="abort") == 1
    assert value(s, "e2e_request_latency_seconds_count") == 1
    tokens = value(s, "generation_tokens_total")
    assert tokens >= 2 and value(s, "inter_token_latency_seconds_count") == tokens - 1
    assert_alias(s)


# --- the path itself -----------------------------------------------------------------------

async def merged(n: int, max_tokens: int = 4, delay: float = 0.0
                 ) -> tuple[FakeEngine, ServerMetrics, MergedStream]:
    engine = FakeEngine(token_delay=delay)
    await engine.start()
    metrics = ServerMetrics(engine, "fake-model")
    params = SamplingParams(max_tokens=max_tokens)
    group = metrics.observe_params(n, max_tokens)
    jobs = [Job(f"r-{i}", [5, 6, 7], params, 0, metrics.tracker(3, group)) for i in range(n)]
    stream = MergedStream(engine, jobs)
    await stream.start()
    return engine, metrics, stream


@pytest.mark.parametrize("n", [1, 2])
def test_one_engine_request_has_no_pump_task(n: int) -> None:
    async def main() -> list[tuple[int, RequestOutput]]:
        engine, _, stream = await merged(n)
        tasks = len(asyncio.all_tasks())
        assert len(stream._tasks) == (0 if n == 1 else n)
        try:
            outs = [item async for item in stream]
        finally:
            await stream.close()
        assert len(engine.finished) == n and not engine.aborted
        assert tasks - len(asyncio.all_tasks()) >= (0 if n == 1 else n)  # pumps ended
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 10))
    assert [i for i, o in outs if o.new_token_ids].count(0) == 4
    assert all(o.finished for i, o in outs if o.finish_reason)
    assert sum(o.finished for _, o in outs) == n


def test_fail_reaches_a_stream_read_in_place_and_close_aborts_it() -> None:
    """Graceful shutdown's fail() on an n = 1 stream: raised once the queued deltas are read,
    then close() aborts the engine request (its blocks freed) and counts the abort."""
    async def main() -> tuple[FakeEngine, ServerMetrics, int]:
        engine, metrics, stream = await merged(1, max_tokens=200, delay=0.01)
        error = APIError(503, "shutting down", type="server_error")
        seen = 0
        with pytest.raises(APIError) as raised:
            async for _, out in stream:
                seen += len(out.new_token_ids)
                if seen == 3:
                    stream.fail(error)
        assert raised.value is error
        await stream.close()
        return engine, metrics, seen

    engine, metrics, seen = asyncio.run(asyncio.wait_for(main(), 10))
    assert engine.aborted == ["r-0"] and not engine.finished and seen >= 3
    s = scrape(metrics.render().decode())
    assert value(s, "request_success_total", finished_reason="abort") == 1


def test_fail_before_the_stream_is_read() -> None:
    async def main() -> FakeEngine:
        engine, _, stream = await merged(1, max_tokens=200, delay=0.01)
        stream.fail(APIError(503, "shutting down"))
        with pytest.raises(APIError, match="shutting down"):
            async for _ in stream:
                pass
        await stream.close()
        return engine

    assert asyncio.run(asyncio.wait_for(main(), 10)).aborted == ["r-0"]


def test_a_token_is_one_histogram_observation(monkeypatch: pytest.MonkeyPatch) -> None:
    """On every delta but the first (time to first token) and the last (the request's own
    histograms), the tracker observes one histogram: the inter-token latency."""
    observed: list[float] = []
    real = Histogram.observe

    def counting(self: Histogram, amount: float, exemplar: Any = None) -> None:
        observed.append(amount)
        real(self, amount, exemplar)

    monkeypatch.setattr(Histogram, "observe", counting)
    metrics = ServerMetrics(FakeEngine(), "fake-model")
    tracker = metrics.tracker(3)
    tracker.on_output(RequestOutput("r", (), "", prompt_token_ids=(1, 2, 3)))
    assert observed == []  # a prefill chunk: nothing yet
    for k in range(10):
        del observed[:]
        tracker.on_output(RequestOutput("r", (10 + k,), "x", num_output_tokens=k + 1))
        assert len(observed) == 1, k
    s = scrape(metrics.render().decode())
    assert value(s, "inter_token_latency_seconds_count") == 9
    assert value(s, "time_to_first_token_seconds_count") == 1
    assert_alias(s)
