"""The load generator: datasets, arrivals, metrics and goodput on hand-made numbers, and the
CLI against an in-process fake SSE server (no model)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from benchmarks import loadgen
from benchmarks.common import free_port
from benchmarks.loadgen import (
    conversation_dataset,
    conversation_lengths,
    length_range,
    random_dataset,
)
from benchmarks.serving_load import (
    RequestResult,
    RequestSpec,
    _Stream,
    arrival_offsets,
    compute_metrics,
    parse_goodput,
    run_load,
)

# benchmarks/ is not an installed package (pyproject installs engine, api, scheduler only).
from tests.support.fake_sse_server import CharTokenizer, FakeSSE, app

TOKEN_DELAY = 0.01  # seconds between the fake server's tokens


def serve(state: FakeSSE) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app(state), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeSSE, str]]:
    state = FakeSSE(TOKEN_DELAY)
    for url in serve(state):
        yield state, url


# --- datasets ---


def test_length_range_follows_vllm() -> None:
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.5) == (50, 150)
    assert length_range(2, 0.9) == (1, 3)
    with pytest.raises(ValueError):
        length_range(10, 1.0)


def test_random_dataset_lengths_and_determinism() -> None:
    tok = CharTokenizer()
    specs = random_dataset(tok, 200, (5, 40), (3, 9), seed=1)
    assert all(5 <= s.prompt_len <= 40 and 3 <= s.output_len <= 9 for s in specs)
    assert all(s.prompt_len == len(tok.encode(s.prompt)) and "\x00" not in s.prompt for s in specs)
    assert {s.prompt_len for s in specs} >= {5, 40} and {s.output_len for s in specs} == set(range(3, 10))
    assert specs == random_dataset(tok, 200, (5, 40), (3, 9), seed=1)
    assert specs != random_dataset(tok, 200, (5, 40), (3, 9), seed=2)
    fixed = random_dataset(tok, 20, length_range(16, 0.0), length_range(4, 0.0), seed=0)
    assert {(s.prompt_len, s.output_len) for s in fixed} == {(16, 4)}


def test_conversation_mix() -> None:
    lens = conversation_lengths(2000, seed=3, max_input=1500, max_output=300, max_model_len=1600)
    assert lens == conversation_lengths(2000, seed=3, max_input=1500, max_output=300, max_model_len=1600)
    ins, outs = [i for i, _ in lens], [o for _, o in lens]
    assert all(4 <= o <= 300 and 1 <= i <= 1500 and i + o <= 1600 for i, o in lens)
    short = sum(i < 400 for i in ins) / len(ins)
    assert 0.6 < short < 0.8  # 70% short turns (a few long ones fall below 400 too)
    assert max(ins) == 1500 and sorted(outs)[len(outs) // 2] > 60  # clipped; chat-length answers
    tok = CharTokenizer()
    specs = conversation_dataset(tok, 30, seed=3, max_input=200, max_output=50, max_model_len=220)
    assert [s.prompt_len for s in specs] == [i for i, _ in conversation_lengths(30, 3, 200, 50, 220)]


# --- arrivals ---


def test_arrival_offsets() -> None:
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    const = arrival_offsets(5, 2.0, math.inf, 0)
    assert const == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    poisson = arrival_offsets(200, 10.0, 1.0, seed=1)
    assert poisson[0] == 0.0 and poisson == sorted(poisson)
    assert 15.0 < poisson[-1] < 20.0  # rescaled so n gaps span n / rate
    assert poisson == arrival_offsets(200, 10.0, 1.0, seed=1)
    assert poisson != arrival_offsets(200, 10.0, 1.0, seed=2)
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    bursty = arrival_offsets(200, 10.0, 0.2, seed=1)
    bgaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert _cv(bgaps) > _cv(gaps) > 0.5  # burstiness < 1 spreads the gaps more


def _cv(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return float((sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5 / mean)


# --- metrics on hand-made numbers ---


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
    assert st.chunks == 3 and st.usage is not None and st.usage["completion_tokens"] == 4
    assert st.finish_reason == "length"
    st.on_event({"error": {"message": "x"}}, 11.3)
    assert "x" in st.error


HAND_MADE = [RequestResult(True, prompt_tokens=10, output_tokens=5, ttft=0.1, itl=(0.1, 0.2),
                           latency=0.5, usage_reported=True),
             RequestResult(True, prompt_tokens=20, output_tokens=3, ttft=0.3, itl=(0.4,),
                           latency=1.3, usage_reported=True),
             RequestResult(True, prompt_tokens=5, output_tokens=1, ttft=0.2, latency=0.2,
                           usage_reported=True),
             RequestResult(False, error="HTTP 500")]


def test_metrics_on_hand_made_results() -> None:
    m = compute_metrics(HAND_MADE, duration=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    # TPOT = (e2e - ttft) / (out - 1): 0.4/4 = 100 ms and 1.0/2 = 500 ms; 1-token request skipped
    assert m["mean_tpot_ms"] == pytest.approx(300.0)
    assert m["median_ttft_ms"] == m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_itl_ms"] == pytest.approx(700.0 / 3)
    assert m["p50_itl_ms"] == pytest.approx(200.0)
    # numpy's linear percentiles: rank 0.99 * 2 between 500 and 1300; rank 0.9 * 2 in 200..300
    assert m["p99_e2el_ms"] == pytest.approx(500 + 0.98 * 800)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)
    assert m["errors"] == ["HTTP 500"] and m["usage_reported"]
    assert "request_goodput" not in m


@pytest.mark.parametrize(("slos", "good"), [
    ({"ttft": 250}, 2),                  # 100 and 200 ms pass, 300 ms does not
    ({"ttft": 250, "tpot": 50}, 1),      # 100 ms TPOT fails; the 1-token request counts TPOT 0
    ({"e2el": 1300}, 3),                 # bounds are inclusive
    ({"ttft": 1000, "tpot": 1000, "e2el": 400}, 1),
    ({"ttft": 0}, 0),
])
def test_goodput_counts_requests_meeting_every_slo(slos: dict[str, float], good: int) -> None:
    m = compute_metrics(HAND_MADE, duration=2.0, slos=slos)
    assert m["request_goodput"] == pytest.approx(good / 2.0)  # failed requests never count
    assert m["goodput_slos_ms"] == slos


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:9000"]) == {"ttft": 500, "tpot": 50.5,
                                                                    "e2el": 9000}
    for bad in ("itl:5", "ttft", "ttft:-1"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


def test_metrics_with_no_success() -> None:
    m = compute_metrics([RequestResult(False, error="e")], duration=1.0)
    assert m["completed"] == 0 and math.isnan(m["p50_ttft_ms"]) and math.isnan(m["p99_itl_ms"])


# --- against the fake server ---


def test_load_against_fake_server(fake: tuple[FakeSSE, str]) -> None:
    state, url = fake
    state.max_in_flight = 0
    specs = [RequestSpec("hello", 5, 4)] * 6 + [RequestSpec("fail", 1, 4)]
    body = {"stream_options": {"include_usage": True}}
    results, duration = asyncio.run(run_load(url, specs, max_concurrency=2, extra_body=body))
    assert state.max_in_flight == 2
    assert state.bodies[-1]["stream"] is True and state.bodies[-1]["temperature"] == 0.0
    ok = [r for r in results if r.success]
    assert len(ok) == 6 and not results[-1].success and "HTTP 500" in results[-1].error
    for r in ok:
        assert r.usage_reported and r.output_tokens == 4 and r.prompt_tokens == 7
        assert r.finish_reason == "length"
        assert len(r.itl) == 3  # 4 content chunks -> 3 gaps; the finish chunk is not one
        # the server sleeps before every chunk (chunks may arrive coalesced: no per-gap bound)
        assert r.ttft >= TOKEN_DELAY * 0.9 and r.ttft + sum(r.itl) >= 4 * TOKEN_DELAY * 0.9
        assert r.latency >= r.ttft + sum(r.itl) - 1e-6
    m = compute_metrics(results, duration)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (6, 1, 24)
    assert duration >= 3 * 4 * TOKEN_DELAY * 0.9  # 6 requests two at a time: 3 rounds


def test_counts_chunks_when_usage_is_missing(fake: tuple[FakeSSE, str]) -> None:
    _, url = fake
    results, _ = asyncio.run(run_load(url, [RequestSpec("hi", 2, 3)]))
    assert results[0].success and not results[0].usage_reported
    assert results[0].output_tokens == 3 and results[0].prompt_tokens == 2


def test_poisson_arrivals_are_spread_out(fake: tuple[FakeSSE, str]) -> None:
    state, url = fake
    state.max_in_flight = 0
    results, duration = asyncio.run(run_load(url, [RequestSpec("hi", 2, 1)] * 5, request_rate=10.0,
                                             burstiness=math.inf))
    assert all(r.success for r in results)
    assert duration >= 0.4  # sends at 0, 0.1, ..., 0.4 s
    assert state.max_in_flight == 1  # 1-token answers finish long before the next send


def test_cli_against_fake_server(fake: tuple[FakeSSE, str], tmp_path: Path) -> None:
    state, url = fake
    out = tmp_path / "r" / "run.json"
    n_before = len(state.bodies)
    result = loadgen.main(["--base-url", url, "--num-prompts", "6", "--random-input-len", "10",
                           "--random-output-len", "4", "--random-range-ratio", "0.5",
                           "--max-concurrency", "3", "--ignore-eos", "--num-warmups", "2",
                           "--goodput", "ttft:10000", "tpot:0.001", "--extra-body", '{"top_k": 1}',
                           "--server-flags", "fake --delay 0.01", "--model", "m",
                           "--save-result", str(out)], tokenizer=CharTokenizer())
    bodies = state.bodies[n_before:]
    assert len(bodies) == 8  # 2 warm-ups + 6 measured
    assert all(b["ignore_eos"] and b["top_k"] == 1 and b["model"] == "m" and b["stream"]
               and b["stream_options"] == {"include_usage": True} for b in bodies)
    saved = json.loads(out.read_text())
    m = saved["metrics"]
    assert m["completed"] == 6 and m["total_output_tokens"] == sum(saved["requested_output_lens"])
    assert all(2 <= n <= 6 for n in saved["requested_output_lens"])
    assert m["request_goodput"] == 0.0  # nobody streams a token in 1 us
    assert saved["server"]["flags"] == "fake --delay 0.01"
    assert saved["server"]["models"]["data"][0]["id"] == "fake"
    assert {"cpu_model", "cpu_count", "torch", "git_commit"} <= saved["machine"].keys()
    assert saved == json.loads(json.dumps(result, default=str))


def test_cli_conversation_and_help(fake: tuple[FakeSSE, str], capsys: pytest.CaptureFixture[str]) -> None:
    _, url = fake
    result = loadgen.main(["--base-url", url, "--dataset", "conversation", "--num-prompts", "3",
                           "--max-output-len", "5", "--num-warmups", "0"], tokenizer=CharTokenizer())
    assert result["metrics"]["completed"] == 3 and "Output token throughput" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        loadgen.parse_args(["--help"])
    assert exit_info.value.code == 0 and "--burstiness" in capsys.readouterr().out
