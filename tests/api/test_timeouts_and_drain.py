"""Deadlines and draining at the API edge, against the fake engine: the `timeout` field and
--request-timeout become the engine deadline; a queue timeout is a 503 (or an error event
and [DONE]); a timeout mid-generation is a normal answer with finish_reason "timeout"; a
draining server refuses new work with 503 and ends what it cannot wait for."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from starlette.testclient import TestClient

from api.app import create_app
from api.state import AppState
from tests.support.apitools import serve, sse_json
from tests.support.errors import assert_error
from tests.support.fake_engine import FakeEngine

PROMPT = {"prompt": "hello world", "max_tokens": 5}




@pytest.mark.parametrize("bad", ["0", "-1", '"5"', "true", "[1]", "1e400"])
def test_timeout_must_be_a_positive_number(client: TestClient, bad: str) -> None:
    r = client.post("/v1/completions", content=f'{{"prompt": "a", "timeout": {bad}}}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "timeout" and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("own", "server", "expected"),
                         [(2.0, None, 2.0), (None, 3.0, 3.0), (2.0, 3.0, 2.0), (9.0, 3.0, 3.0),
                          (None, None, None)])
def test_deadline_is_the_tighter_of_request_and_server_timeout(
        own: float | None, server: float | None, expected: float | None) -> None:
    engine = FakeEngine()
    with serve(engine, request_timeout=server) as client:
        body = {**PROMPT, **({} if own is None else {"timeout": own})}
        before = time.monotonic()
        assert client.post("/v1/completions", json=body).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                **({} if own is None else {"timeout": own})}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        after = time.monotonic()
    assert len(engine.submitted) == 2
    for sub in engine.submitted:
        if expected is None:
            assert sub.deadline is None
        else:
            assert sub.deadline is not None
            assert before + expected <= sub.deadline <= after + expected


def test_queue_timeout_is_503_or_an_error_event() -> None:
    engine = FakeEngine(token_delay=0.3)  # the first token comes after the deadline
    with serve(engine) as client:
        r = client.post("/v1/completions", json={**PROMPT, "timeout": 0.05})
        err = assert_error(r, 503, code="queue_timeout")
        assert "queue" in err["message"]
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "timeout": 0.05, "stream": True})
        assert r.status_code == 200  # admitted: the stream had started
        events = sse_json(r.text)
        assert events[-1]["error"]["code"] == "queue_timeout"
        metrics = client.get("/metrics").text
        assert 'admission_rejections_total{model_name="fake-model",reason="queue_timeout"} 2.0' in metrics


def test_timeout_mid_generation_keeps_what_was_generated() -> None:
    engine = FakeEngine(token_delay=0.05)
    with serve(engine) as client:
        body = {"prompt": "abcdefghij", "max_tokens": 60, "timeout": 0.4}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "timeout"
        assert 0 < len(choice["text"]) < 60 and "abcdefghij".startswith(choice["text"][:10])
        events = sse_json(client.post("/v1/completions", json={**body, "stream": True}).text)
        finals = [c for e in events for c in e["choices"] if c["finish_reason"]]
        assert [c["finish_reason"] for c in finals] == ["timeout"]
        assert 'finished_reason="timeout"' in client.get("/metrics").text


def test_draining_refuses_new_requests_with_503() -> None:
    engine = FakeEngine()
    app = create_app(engine)
    with TestClient(app) as client:
        AppState.of_app(app).lifecycle.draining = True
        for path, body in [("/v1/completions", PROMPT),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})]:
            assert_error(client.post(path, json=body), 503, code="server_shutting_down")
        assert_error(client.get("/health"), 503, code="server_shutting_down")
        assert 'admission_rejections_total{model_name="fake-model",reason="shutting_down"} 2.0' in \
            client.get("/metrics").text
        assert engine.submitted == []


def _stream_in_thread(client: TestClient, body: dict[str, Any],
                      out: list[str]) -> threading.Thread:
    def run() -> None:
        out.append(client.post("/v1/completions", json={**body, "stream": True}).text)

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_open(app: Any, n: int) -> None:
    deadline = time.monotonic() + 5
    while AppState.of_app(app).lifecycle.num_open < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert AppState.of_app(app).lifecycle.num_open == n


def test_drain_lets_running_streams_finish() -> None:
    engine = FakeEngine(token_delay=0.01)
    app = create_app(engine)
    with TestClient(app) as client:
        out: list[str] = []
        t = _stream_in_thread(client, {"prompt": "abc", "max_tokens": 40}, out)
        _wait_open(app, 1)
        assert client.portal is not None
        failed = client.portal.call(AppState.of_app(app).lifecycle.drain, 10.0)
        t.join(10)
        assert failed == 0
        events = sse_json(out[0])
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert engine.aborted == []


def test_drain_timeout_ends_the_rest_with_an_error_event() -> None:
    engine = FakeEngine(token_delay=0.05)
    app = create_app(engine)
    with TestClient(app) as client:
        out: list[str] = []
        t = _stream_in_thread(client, {"prompt": "abc", "max_tokens": 120}, out)
        _wait_open(app, 1)
        started = time.monotonic()
        assert client.portal is not None
        failed = client.portal.call(AppState.of_app(app).lifecycle.drain, 0.3)
        t.join(10)
        assert failed == 1 and time.monotonic() - started < 5
        events = sse_json(out[0])  # ends with [DONE]
        assert events[-1]["error"]["code"] == "server_shutting_down"
        assert len(engine.aborted) == 1  # its engine request was aborted: blocks freed
        assert AppState.of_app(app).lifecycle.num_open == 0
