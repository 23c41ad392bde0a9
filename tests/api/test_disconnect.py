"""A client that goes away aborts every engine request of its HTTP request (raw ASGI, so
the moment of the disconnect is exact)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

import pytest
from starlette.applications import Starlette

from api.app import create_app
from tests.support.fake_engine import FakeEngine


async def call(engine: FakeEngine, path: str, body: dict[str, Any], hang_up: float,
               app: Starlette | None = None) -> list[dict[str, Any]]:
    """POST body; disconnect after `hang_up` body chunks (int) or seconds (float)."""
    app = app or create_app(engine)
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if isinstance(hang_up, int) and len(chunks) >= hang_up:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
             "server": ("testserver", 80), "headers": [(b"content-type", b"application/json")]}
    async with app.router.lifespan_context(app):
        while not engine.is_ready():
            await asyncio.sleep(0.001)
        if isinstance(hang_up, float):
            asyncio.get_running_loop().call_later(hang_up, gone.set)
        await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["abc", "xyz"], "n": 2, "max_tokens": 100}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3,
                              "max_tokens": 100}),
])
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_every_choice(path: str, body: dict[str, Any], stream: bool) -> None:
    engine = FakeEngine(token_delay=0.05)  # 100 tokens take 5 s: call()'s own time limit
    hang_up: int | float = 4 if stream else 0.1
    asyncio.run(call(engine, path, {**body, "stream": stream}, hang_up))
    ids = {s.request_id for s in engine.submitted}
    assert len(ids) == (4 if path == "/v1/completions" else 3)
    assert set(engine.aborted) == ids  # every choice's stream was closed early
    assert not engine.finished and not engine.active  # none ran on to its end


def test_disconnect_counts_aborts_in_metrics() -> None:
    engine = FakeEngine(token_delay=0.01)
    app = create_app(engine)
    body = {"prompt": "abc", "n": 2, "max_tokens": 100, "stream": True}
    asyncio.run(call(engine, "/v1/completions", body, 2, app))
    assert len(set(engine.aborted)) == 2
    text = app.state.pagedserve.metrics.render().decode()
    assert ('pagedserve:request_success_total{finished_reason="abort",model_name="fake-model"} '
            '2.0') in text


def test_finished_requests_are_not_aborted() -> None:
    engine = FakeEngine()
    sent = asyncio.run(call(engine, "/v1/completions",
                            {"prompt": "ab", "n": 2, "max_tokens": 2, "stream": True}, 10.0))
    assert b"[DONE]" in b"".join(m.get("body", b"") for m in sent)
    assert engine.aborted == [] and len(engine.finished) == 2


def test_cancel_while_choices_are_being_admitted_closes_the_admitted_ones() -> None:
    """One choice is admitted, the next is still waiting for admission when the client goes
    away: the admitted one must be aborted too, or it would run on holding KV blocks."""
    from api.metrics import ServerMetrics
    from api.streams import Job, MergedStream
    from engine.protocol import RequestStream, SamplingParams

    class SlowAdmission(FakeEngine):
        async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                         priority: int = 0, deadline: float | None = None) -> RequestStream:
            if request_id.endswith("-1"):
                await asyncio.Event().wait()  # never admitted
            return await super().submit(request_id, prompt, params, priority, deadline)

    async def main() -> SlowAdmission:
        engine = SlowAdmission(token_delay=0.05)
        await engine.start()
        metrics = ServerMetrics(engine, "fake-model")
        params = SamplingParams(max_tokens=50)
        jobs = [Job(f"r-{i}", [5, 6], params, 0, metrics.tracker(2)) for i in range(2)]
        stream = MergedStream(engine, jobs)
        task = asyncio.create_task(stream.start())
        while not engine.submitted:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return engine

    engine = asyncio.run(asyncio.wait_for(main(), 10))
    assert [s.request_id for s in engine.submitted] == ["r-0"]
    assert engine.aborted == ["r-0"] and not engine.finished
