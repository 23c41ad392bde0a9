"""Worst days on the real stack (uvicorn + api/ + AsyncEngine + a tiny model on 127.0.0.1):
a model step that raises, an engine that dies or hangs, and a graceful shutdown (SIGTERM)
with requests still running. Faults come from tests/support/faults.py, which exists only here."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.core import step_loop
from engine.worker.model_runner import ModelRunner
from tests.support.livetools import live_server

REPO = Path(__file__).resolve().parents[2]
LONG = {"prompt": [3, 4, 5, 6], "max_tokens": 100, "ignore_eos": True, "temperature": 0}


def stream_events(client: httpx.Client, url: str, body: dict[str, Any],
                  first: threading.Event | None = None) -> list[Any]:
    """POST a streamed completion; the SSE payloads (JSON, then the final "[DONE]")."""
    events: list[Any] = []
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if first is not None:
                    first.set()
    return events


def in_thread(fn: Any, *args: Any) -> Future[Any]:
    """Run fn in a thread of its own; .result() re-raises what it raised."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(url + "/v1/completions", json=body)


# ---------------------------------------------------------------------------- engine faults


def test_failed_step_gives_its_requests_a_clean_error_and_serving_goes_on(
        llama_runner: ModelRunner, caplog: pytest.LogCaptureFixture) -> None:
    with live_server(llama_runner, delay=0.01) as s, httpx.Client(timeout=30) as client:
        s.runner.fail = 1
        events = stream_events(client, s.url, LONG)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
        assert "injected fault" in events[-2]["error"]["message"]
        s.blocks_all_free()
        s.runner.fail = 1
        r = client.post(s.url + "/v1/completions", json=LONG)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        s.blocks_all_free()
        assert client.get(s.url + "/health").status_code == 200
        r = client.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert "engine step failed" in caplog.text


def test_engine_that_keeps_failing_turns_health_503_and_says_why(
        llama_runner: ModelRunner, caplog: pytest.LogCaptureFixture) -> None:
    with live_server(llama_runner) as s, httpx.Client(timeout=30) as client:
        s.runner.fail = 100
        for _ in range(step_loop.MAX_CONSECUTIVE_FAILURES):
            assert client.post(s.url + "/v1/completions", json=LONG).status_code == 500
        r = client.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_not_ready"
        r = client.post(s.url + "/v1/completions", json=LONG)
        assert r.status_code == 503
        assert "3 in a row" in caplog.text and "injected fault" in caplog.text


def test_hung_step_turns_health_503_and_logs_it(llama_runner: ModelRunner,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="pagedserve.engine")
    with live_server(llama_runner, stuck_after_s=0.3) as s, httpx.Client(timeout=30) as client:
        s.runner.stall()  # the step hangs until unstall(): /health must turn 503 meanwhile
        pending = in_thread(post, client, s.url, {**LONG, "max_tokens": 2})
        deadline = time.monotonic() + 20
        while client.get(s.url + "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 during a hung step"
            time.sleep(0.05)
        assert "engine step running for" in caplog.text
        s.runner.unstall()
        assert pending.result(10).status_code == 200
        assert client.get(s.url + "/health").status_code == 200


# --------------------------------------------------------------------------- shutdown


def test_sigterm_drains_running_streams_and_refuses_new_ones(llama_runner: ModelRunner) -> None:
    with live_server(llama_runner, delay=0.02, shutdown_timeout=20) as s, \
            httpx.Client(timeout=30) as client:
        first = threading.Event()
        body = {**LONG, "max_tokens": 40, "stream_options": {"include_usage": True}}
        pending = in_thread(stream_events, client, s.url, body, first)
        assert first.wait(10)
        s.http.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        deadline = time.monotonic() + 5
        while client.get(s.url + "/health").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = client.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        events = pending.result(20)
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 40  # finished, not cut
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        s.thread.join(15)
        assert not s.thread.is_alive()  # the server stopped by itself once drained
        s.blocks_all_free()


def test_sigterm_after_shutdown_timeout_aborts_the_rest_cleanly(
        llama_runner: ModelRunner) -> None:
    with live_server(llama_runner, delay=0.05, shutdown_timeout=0.3) as s, \
            httpx.Client(timeout=30) as client:
        first = threading.Event()
        streamed = in_thread(stream_events, client, s.url, LONG, first)
        plain = in_thread(post, client, s.url, LONG)
        assert first.wait(10)
        started = time.monotonic()
        s.http.handle_exit(signal.SIGTERM, None)
        events, response = streamed.result(15), plain.result(15)
        assert time.monotonic() - started < 5  # 100 tokens would take 5 s or more
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "server_shutting_down"
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "server_shutting_down"
        s.thread.join(15)
        assert not s.thread.is_alive()
        s.blocks_all_free()


def test_second_signal_stops_waiting(llama_runner: ModelRunner) -> None:
    with live_server(llama_runner, delay=0.05, shutdown_timeout=60) as s, \
            httpx.Client(timeout=30) as client:
        first = threading.Event()
        pending = in_thread(stream_events, client, s.url, LONG, first)
        assert first.wait(10)
        s.http.handle_exit(signal.SIGINT, None)
        time.sleep(0.2)
        s.http.handle_exit(signal.SIGINT, None)  # Ctrl-C twice: do not wait 60 s
        assert pending.result(10)[-2]["error"]["code"] == "server_shutting_down"
        s.thread.join(15)
        assert not s.thread.is_alive()


def test_real_sigterm_exits_0(tiny_llama: Path) -> None:
    """The CLI process: SIGTERM while idle ends it with exit status 0 (not -15)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "api", "serve", "--model", str(tiny_llama), "--config",
           "tiny", "--port", str(port), "--num-threads", "1", "--shutdown-timeout", "5"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={**LONG, "max_tokens": 3}, timeout=30)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        log = proc.stdout.read().decode() if proc.stdout else ""
        assert "graceful shutdown" in log and "drained" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def stuck_server(module: str, model: Path, marker_env: str,
                 marker: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`python -m <module> serve` (a tests/support module that makes something hang and
    touches $<marker_env> when it does) on the tiny model with a 2 s shutdown timeout, until
    /health is 200; killed at the end if it is still there."""
    port = _free_port()
    cmd = [sys.executable, "-m", module, "serve", "--model", str(model), "--config", "tiny",
           "--port", str(port), "--num-threads", "1", "--shutdown-timeout", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO), marker_env: str(marker)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_healthy(proc, port)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for(marker: Path, what: str) -> None:
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.05)


def _wait_healthy(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


def test_sigterm_ends_the_process_while_a_grammar_compile_runs(tiny_llama: Path,
                                                               tmp_path: Path) -> None:
    """Issue 38: a compile that never ends (tests/support/endless_compile.py) kept the
    process alive after SIGTERM (90 s and more). The drain waits for the compiling request
    like a running one, then answers it 503; the process exits 0 within the shutdown
    timeout (plus start-up of the signal's handling)."""
    started = tmp_path / "compile-started"
    with (stuck_server("tests.support.endless_compile", tiny_llama,
                       "PAGEDSERVE_TEST_COMPILE_STARTED", started) as (proc, port),
          ThreadPoolExecutor(1) as pool):
        waiting = pool.submit(httpx.post, f"http://127.0.0.1:{port}/v1/completions",
                              json={"prompt": "hi", "guided_regex": "[0-9]+"}, timeout=60)
        _wait_for(started, "the compile")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        response = waiting.result(30)
        assert proc.wait(30) == 0
    assert time.monotonic() - signalled < 2 + 8, time.monotonic() - signalled
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "server_shutting_down"


def test_sigterm_ends_the_process_within_the_grace_while_a_step_hangs(
        tiny_llama: Path, tmp_path: Path) -> None:
    """Issue 31: a hung step kept the process ~55 s after SIGTERM (a 25 s drain, then a 30 s
    wait for the step), past Kubernetes' 30 s grace. Now: the drain, a short wait, and an exit
    with status 1 (the step cannot be interrupted); the stuck request is answered."""
    hung = tmp_path / "step-hung"
    with (stuck_server("tests.support.hung_step", tiny_llama, "PAGEDSERVE_TEST_STEP_HUNG",
                       hung) as (proc, port),
          ThreadPoolExecutor(1) as pool):
        stuck = pool.submit(httpx.post, f"http://127.0.0.1:{port}/v1/completions",
                            json={"prompt": "hi", "seed": 7777}, timeout=60)
        _wait_for(hung, "the hung step")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 1
        elapsed = time.monotonic() - signalled
        try:
            answer: int | None = stuck.result(10).status_code
        except httpx.HTTPError:
            answer = None  # closed with the process: an answer too, not a hang
        log = proc.stdout.read().decode() if proc.stdout else ""
    assert elapsed < 2 + 3 + 1 + 4, elapsed  # drain, shutdown wait, hung grace, margin
    assert answer in (500, 503, None), answer
    assert "it is hung; exiting now" in log, log[-2000:]
