"""The built-in pages and the live view's event stream.

GET / (the playground), GET /dashboard (the live view) and /ui/* are static files shipped in
the package (api/ui/: plain HTML, CSS and JS, nothing fetched from elsewhere). They hold no
server data, so they load without the API key; everything they show comes from API routes
that --api-key guards (the page sends the key from a field kept in session storage).

GET /v1/engine/events: server-sent events, one `engine` event per look at the engine (at most
every MIN_INTERVAL_MS), each the JSON of `event_payload` (its schema is ENGINE_EVENT in
api/openapi_schemas.py). A look is built between two steps only while someone is connected:
a server nobody watches pays one small step record per step (engine/core/live_view.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from api.errors import bad_request
from api.sse import PING_S, SEP
from api.state import AppState
from engine.protocol import EngineView
from engine.snapshot import EngineSnapshot

MIN_INTERVAL_MS = 100  # at most 10 looks a second per viewer
MAX_INTERVAL_MS = 10_000
DEFAULT_INTERVAL_MS = 250
MAX_EVENTS = 1_000_000
DRAIN_CHECK_S = 0.25  # how soon a waiting event stream notices a drain
UI_PACKAGE = ("api", "ui")  # api/ui/, shipped as package data


def ui_routes() -> list[BaseRoute]:
    """The pages and their assets (left out with --disable-ui)."""
    return [Route("/", _page("index.html"), methods=["GET"]),
            Route("/dashboard", _page("dashboard.html"), methods=["GET"]),
            Route("/v1/engine/events", engine_events, methods=["GET"]),
            Mount("/ui", StaticFiles(packages=[UI_PACKAGE]), name="ui")]


def _page(name: str) -> Any:
    static = StaticFiles(packages=[UI_PACKAGE])

    async def page(request: Request) -> Response:
        path, _ = static.lookup_path(name)
        # Pages are small and change with the package: always revalidated.
        return FileResponse(path, media_type="text/html",
                            headers={"Cache-Control": "no-cache"})
    return page


async def engine_events(request: Request) -> Response:
    app = AppState.of(request)
    interval = _interval_ms(request) / 1e3
    max_events = _int_param(request, "max_events", None, 1, MAX_EVENTS)
    app.check_ready()
    return EventSourceResponse(_events(app, interval, max_events), sep=SEP, ping=PING_S)


def _interval_ms(request: Request) -> int:
    value = _int_param(request, "interval_ms", DEFAULT_INTERVAL_MS, MIN_INTERVAL_MS,
                       MAX_INTERVAL_MS)
    assert value is not None
    return value


def _int_param(request: Request, name: str, default: int | None, lo: int,
               hi: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer", param=name) from None
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be between {lo} and {hi}", param=name)
    return value


async def _events(app: AppState, interval: float,
                  max_events: int | None) -> AsyncIterator[ServerSentEvent]:
    """One look per interval until the viewer leaves, the server drains, or max_events."""
    since: dict[str, int] = {}
    sent = 0
    loop = asyncio.get_running_loop()
    while not app.lifecycle.draining and (max_events is None or sent < max_events):
        started = loop.time()
        try:
            views = await app.engine.live_view(since)
        except Exception as e:  # noqa: BLE001 - EngineDeadError, or a failed snapshot (logged)
            yield ServerSentEvent(data=json.dumps({"error": str(e)}), event="error", sep=SEP)
            return
        for view in views:
            if view.snapshot.steps:
                since[view.name] = view.snapshot.steps[-1].step
        yield ServerSentEvent(data=json.dumps(event_payload(app, views)), event="engine",
                              sep=SEP)
        sent += 1
        await _pause(app, started + interval)


async def _pause(app: AppState, until: float) -> None:
    """Sleep until the next look, in short slices so that a drain (SIGTERM) ends the stream
    at once, not after an interval of up to MAX_INTERVAL_MS."""
    loop = asyncio.get_running_loop()
    while not app.lifecycle.draining and (left := until - loop.time()) > 0:
        await asyncio.sleep(min(DRAIN_CHECK_S, left))


def event_payload(app: AppState, views: list[EngineView]) -> dict[str, Any]:
    return {"model": app.served_model_name, "time": time.time(),
            "rejected": app.metrics.rejected_by_reason(),
            "engines": [_engine(v) for v in views]}


def _engine(view: EngineView) -> dict[str, Any]:
    s = view.stats
    return {"name": view.name,
            "stats": {"num_running": s.num_running, "num_waiting": s.num_waiting,
                      "num_kv_blocks": s.num_kv_blocks,
                      "num_free_kv_blocks": s.num_free_kv_blocks,
                      "kv_cache_usage": s.kv_cache_usage, "num_preemptions": s.num_preemptions,
                      "prefix_cache_queries": s.prefix_cache_queries,
                      "prefix_cache_hits": s.prefix_cache_hits, "num_steps": s.num_steps,
                      "finish_rate": s.finish_rate},
            **_snapshot(view.snapshot)}


def _snapshot(snap: EngineSnapshot) -> dict[str, Any]:
    return {"steps": [{"step": r.step, "time": r.time, "duration_ms": round(r.duration_ms, 3),
                       "decode_rows": r.decode_rows, "prefill_rows": r.prefill_rows,
                       "prefill_tokens": r.prefill_tokens, "preemptions": r.preemptions}
                      for r in snap.steps],
            "kv_blocks": snap.kv_blocks,
            "requests": [{"id": r.request_id, "state": r.state,
                          "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                          "cached_tokens": r.cached_tokens, "age_ms": round(r.age_ms, 1),
                          "ttft_ms": _ms(r.ttft_ms), "itl_ms": _ms(r.itl_ms)}
                         for r in snap.requests],
            "num_requests": snap.num_requests}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
