"""The built-in pages and the live view's event stream (api/live.py, issue 36), on the fake
engine: what is served and from where, the event stream's shape against its OpenAPI schema,
its parameters, --api-key and --disable-ui, and that nobody watching means no look at the
engine. The pages themselves run in a real browser in tests/ui/."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from importlib import resources
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from tests.support.apitools import serve
from tests.support.fake_engine import FakeEngine

UI_FILES = ("index.html", "dashboard.html", "common.js", "playground.js", "dashboard.js",
            "style.css")


def events(client: TestClient, query: str, **headers: str) -> list[tuple[str, Any]]:
    """(event name, JSON data) of a finite event stream."""
    with client.stream("GET", "/v1/engine/events?" + query, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    out = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln and not ln.startswith(":")]
        if not lines:
            continue
        name = next(ln[6:].strip() for ln in lines if ln.startswith("event:"))
        data = "\n".join(ln[5:].strip() for ln in lines if ln.startswith("data:"))
        out.append((name, json.loads(data)))
    return out


def test_pages_and_assets_are_served_from_the_package(client: TestClient) -> None:
    for path, kind in (("/", "text/html"), ("/dashboard", "text/html"),
                       ("/ui/style.css", "text/css"), ("/ui/dashboard.js", "javascript")):
        r = client.get(path)
        assert r.status_code == 200 and kind in r.headers["content-type"], (path, r.headers)
    assert "playground" in client.get("/").text and "live view" in client.get("/dashboard").text
    assert client.get("/ui/nope.js").status_code == 404


def test_ui_files_load_nothing_from_elsewhere() -> None:
    """No CDN, fonts or scripts from other hosts: every src/href/url() is local."""
    folder = resources.files("api") / "ui"
    for name in UI_FILES:
        text = (folder / name).read_text()
        remote = re.findall(r"""(?:src|href)\s*=\s*["'](?:https?:)?//|url\(\s*["']?(?:https?:)?//|"""
                            r"""@import|fetch\(\s*["']https?:""", text)
        assert not remote, (name, remote)


def test_events_match_their_openapi_schema(engine: FakeEngine, client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    op = spec["paths"]["/v1/engine/events"]["get"]
    assert {p["name"] for p in op["parameters"]} == {"interval_ms", "max_events"}
    schema = {**spec["components"]["schemas"]["EngineEvent"],
              "components": spec["components"]}
    got = events(client, "max_events=3&interval_ms=100")
    assert [name for name, _ in got] == ["engine"] * 3
    for _, data in got:
        jsonschema.validate(data, schema)
    [engine_view] = got[0][1]["engines"]
    assert engine_view["name"] == "engine" and len(engine_view["kv_blocks"]) == 100
    assert engine_view["kv_blocks"].count("2") == 25  # what the fake's stats say


@contextlib.contextmanager
def running(client: TestClient, engine: FakeEngine, prompt: str) -> Iterator[None]:
    """A completion of 100 tokens, 20 ms each, in flight on another thread."""
    engine.token_delay = 0.02
    thread = threading.Thread(target=client.post, args=("/v1/completions",),
                              kwargs={"json": {"prompt": prompt, "max_tokens": 100}})
    thread.start()
    deadline = time.monotonic() + 10
    while not any(p[1] >= 2 for p in engine.progress.values()):  # two tokens out
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.01)
    try:
        yield
    finally:
        thread.join(10)


def test_events_show_a_running_request_and_its_steps(engine: FakeEngine,
                                                     client: TestClient) -> None:
    with running(client, engine, "abcdef"):
        [(_, data)] = events(client, "max_events=1&interval_ms=100")
    [view] = data["engines"]
    [row] = view["requests"]
    assert row["state"] == "running" and row["prompt_tokens"] == 7  # BOS + 6
    assert row["output_tokens"] >= 2
    assert view["steps"] and all(s["decode_rows"] == 1 for s in view["steps"])


def test_each_event_has_only_the_steps_after_the_previous_one(engine: FakeEngine,
                                                            client: TestClient) -> None:
    with running(client, engine, "abc"):
        got = events(client, "max_events=3&interval_ms=100")
    seen = [s["step"] for _, data in got for s in data["engines"][0]["steps"]]
    assert seen == sorted(set(seen)), seen  # no step twice, in order


@pytest.mark.parametrize("query, param", [("interval_ms=50", "interval_ms"),
                                          ("interval_ms=x", "interval_ms"),
                                          ("interval_ms=10001", "interval_ms"),
                                          ("max_events=0", "max_events")])
def test_bad_parameters_are_400s_naming_them(client: TestClient, query: str,
                                             param: str) -> None:
    r = client.get("/v1/engine/events?" + query)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_nobody_watching_means_no_look_at_the_engine(engine: FakeEngine,
                                                     client: TestClient) -> None:
    for _ in range(3):
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
    assert engine.looks == 0
    events(client, "max_events=2&interval_ms=100")
    assert engine.looks == 2


def test_refusals_are_counted_by_reason(engine: FakeEngine, client: TestClient) -> None:
    from engine.protocol import QueueFullError
    engine.admission_error = QueueFullError("queue full", limit="max_num_queued_reqs")
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 429
    engine.admission_error = None
    [(_, data)] = events(client, "max_events=1&interval_ms=100")
    assert data["rejected"] == {"max_num_queued_reqs": 1}


def test_api_key_guards_the_event_stream_not_the_static_pages() -> None:
    with serve(FakeEngine(), api_key="sesame") as client:
        r = client.get("/v1/engine/events?max_events=1")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/", "/dashboard", "/ui/common.js"):
            assert client.get(path).status_code == 200, path
        got = events(client, "max_events=1&interval_ms=100", authorization="Bearer sesame")
        assert got[0][0] == "engine"


def test_disable_ui_removes_the_pages_and_the_event_stream() -> None:
    with serve(FakeEngine(), enable_ui=False) as client:
        for path in ("/", "/dashboard", "/ui/style.css", "/v1/engine/events"):
            assert client.get(path).status_code == 404, path
        assert client.get("/v1/models").status_code == 200


def test_a_dead_engine_ends_the_stream_with_an_error_event(engine: FakeEngine,
                                                           client: TestClient) -> None:
    with client.stream("GET", "/v1/engine/events?interval_ms=100") as r:
        lines = r.iter_lines()
        assert any(line.startswith("event: engine") for line in lines)
        engine.dead = True
        rest = "\n".join(lines)
    assert "event: error" in rest and "engine is dead" in rest


def test_a_drain_ends_the_stream_without_waiting_out_the_interval() -> None:
    """A graceful shutdown must not wait for a viewer's 10 s interval to pass."""
    from api.live import DRAIN_CHECK_S, _events
    from api.metrics import ServerMetrics
    from api.state import AppState

    async def main() -> float:
        engine = FakeEngine()
        await engine.start()
        app = AppState(engine, ServerMetrics(engine, "fake"), "fake")  # type: ignore[arg-type]
        stream = _events(app, 10.0, None)
        first = await stream.__anext__()
        assert first.event == "engine"
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        app.lifecycle.draining = True
        t = time.monotonic()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, 5)
        return time.monotonic() - t

    assert asyncio.run(main()) <= DRAIN_CHECK_S + 1.0
