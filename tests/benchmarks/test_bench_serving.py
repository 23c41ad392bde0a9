"""The serving benchmark's load generator and metrics, against an in-process fake SSE server
(no model) and on hand-made timestamps."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# benchmarks/ is not an installed package (pyproject installs engine, api, scheduler only).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bench_serving import BASELINE, OURS, parse_args, ratios
from benchmarks.common import ServerProcess, free_port
from benchmarks.serving_load import (
    RequestResult,
    RequestSpec,
    _Stream,
    arrival_offsets,
    compute_metrics,
    run_load,
)

TOKEN_DELAY = 0.01  # seconds between the fake server's tokens


class FakeSSE:
    """Streams max_tokens one-word chunks, TOKEN_DELAY apart; prompt "fail" gets a 500."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if body["prompt"] == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        return StreamingResponse(self.events(body), media_type="text/event-stream")

    async def events(self, body: dict[str, Any]) -> AsyncIterator[str]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY)
                yield _sse({"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]})
            yield _sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            if body.get("stream_options", {}).get("include_usage"):
                yield _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeSSE, str]]:
    app_state = FakeSSE()
    app = Starlette(routes=[Route("/v1/completions", app_state.completions, methods=["POST"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    yield app_state, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def test_load_against_fake_server(fake: tuple[FakeSSE, str]) -> None:
    state, url = fake
    specs = [RequestSpec("hello", 5, 4)] * 6 + [RequestSpec("fail", 1, 4)]
    body = {"stream_options": {"include_usage": True}}
    results, duration = asyncio.run(run_load(url, specs, max_concurrency=2, extra_body=body))
    assert state.max_in_flight <= 2
    assert state.bodies[0]["stream"] is True and state.bodies[0]["temperature"] == 0.0
    ok = [r for r in results if r.success]
    assert len(ok) == 6 and not results[-1].success and "HTTP 500" in results[-1].error
    for r in ok:
        assert r.usage_reported and r.output_tokens == 4 and r.prompt_tokens == 7
        assert r.finish_reason == "length"
        assert len(r.itl) == 3  # 4 content chunks -> 3 gaps; the finish chunk is not one
        assert r.ttft >= TOKEN_DELAY * 0.9 and all(g >= TOKEN_DELAY * 0.5 for g in r.itl)
        assert r.latency >= r.ttft + sum(r.itl) - 1e-6
    m = compute_metrics(results, duration)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (6, 1, 24)
    # 6 requests of >= 4 token delays, two at a time: at least 3 rounds
    assert duration >= 3 * 4 * TOKEN_DELAY * 0.9


def test_counts_chunks_when_usage_is_missing(fake: tuple[FakeSSE, str]) -> None:
    _, url = fake
    results, _ = asyncio.run(run_load(url, [RequestSpec("hi", 2, 3)]))
    assert results[0].success and not results[0].usage_reported
    assert results[0].output_tokens == 3 and results[0].prompt_tokens == 2


def test_stream_timestamps() -> None:
    st = _Stream(start=10.0)
    st.on_event({"choices": [{"text": ""}]}, 10.1)  # empty role/keep-alive chunk: no TTFT
    st.on_event({"choices": [{"text": "a"}]}, 10.5)
    st.on_event({"choices": [{"text": "b"}]}, 10.7)
    st.on_event({"choices": [{"text": "cd"}]}, 11.0)
    st.on_event({"choices": [{"text": "", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, 11.2)
    assert st.ttft == pytest.approx(0.5)
    assert st.itl == pytest.approx([0.2, 0.3])
    assert st.chunks == 3 and st.usage["completion_tokens"] == 4 and st.finish_reason == "length"
    st.on_event({"error": {"message": "x"}}, 11.3)
    assert "x" in st.error


def test_metrics_on_hand_made_results() -> None:
    rs = [RequestResult(True, prompt_tokens=10, output_tokens=5, ttft=0.1, itl=(0.1, 0.2),
                        latency=0.5, usage_reported=True),
          RequestResult(True, prompt_tokens=20, output_tokens=3, ttft=0.3, itl=(0.4,),
                        latency=1.3, usage_reported=True),
          RequestResult(True, prompt_tokens=5, output_tokens=1, ttft=0.2, latency=0.2,
                        usage_reported=True),
          RequestResult(False, error="HTTP 500")]
    m = compute_metrics(rs, duration=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    # TPOT = (e2e - ttft) / (out - 1): 0.4/4 = 100 ms and 1.0/2 = 500 ms; 1-token request skipped
    assert m["mean_tpot_ms"] == pytest.approx(300.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_itl_ms"] == pytest.approx(700.0 / 3)
    assert m["median_itl_ms"] == pytest.approx(200.0)
    # numpy's linear percentiles: rank 0.99 * 2 between 500 and 1300; rank 0.9 * 2 in 200..300
    assert m["p99_e2el_ms"] == pytest.approx(500 + 0.98 * 800)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)
    assert m["errors"] == ["HTTP 500"] and m["usage_reported"]


def test_metrics_with_no_success() -> None:
    m = compute_metrics([RequestResult(False, error="e")], duration=1.0)
    assert m["completed"] == 0 and math.isnan(m["median_ttft_ms"]) and math.isnan(m["p99_itl_ms"])


def test_arrival_offsets() -> None:
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    const = arrival_offsets(5, 2.0, math.inf, 0)
    assert const == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    poisson = arrival_offsets(200, 10.0, 1.0, seed=1)
    assert poisson[0] == 0.0 and poisson == sorted(poisson)
    assert poisson[-1] < 20.0 and poisson[-1] > 15.0  # rescaled so n gaps span n / rate
    assert poisson == arrival_offsets(200, 10.0, 1.0, seed=1)
    assert poisson != arrival_offsets(200, 10.0, 1.0, seed=2)
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    bursty = arrival_offsets(200, 10.0, 0.2, seed=1)
    bgaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert _cv(bgaps) > _cv(gaps) > 0.5  # burstiness < 1 spreads the gaps more


def _cv(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5 / mean


def test_ratios_are_oriented_so_bigger_is_better_for_ours() -> None:
    def run(tput: float, ttft: float) -> dict[str, float]:
        keys = ("median_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_ttft_ms")
        return {"request_throughput": tput, "output_throughput": tput * 10,
                "median_ttft_ms": ttft} | {k: ttft for k in keys}

    res = {OURS: {"runs": {"4": run(2.0, 100.0)}}, BASELINE: {"runs": {"4": run(1.0, 300.0)}}}
    r = ratios(res)["4"]
    assert r["output_throughput"] == pytest.approx(2.0) and r["median_ttft_ms"] == pytest.approx(3.0)
    assert ratios({OURS: res[OURS]}) == {}


def test_cli_defaults() -> None:
    a = parse_args([])
    assert a.concurrency == [1, 4, 16] and a.dtype == "bfloat16" and a.ignore_eos
    assert math.isinf(a.request_rate) and a.servers == [OURS, BASELINE]


def test_server_process_reports_early_exit_and_stops() -> None:
    dead = ServerProcess("dead", lambda port: [sys.executable, "-c", "print('bye'); raise SystemExit(3)"])
    with dead, pytest.raises(RuntimeError, match="exited with 3"):
        dead.wait_healthy(10)
    sleeper = ServerProcess("sleeper", lambda port: [sys.executable, "-c", "import time; time.sleep(60)"])
    with sleeper:
        assert sleeper.proc is not None and sleeper.proc.poll() is None
    assert sleeper.proc.returncode == -15  # SIGTERM was enough
