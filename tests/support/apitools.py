"""Helpers for the API tests: an app around a FakeEngine, and an SSE body parser."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.testclient import TestClient

from api.app import create_app
from tests.support.fake_engine import FakeEngine


@contextmanager
def serve(engine: FakeEngine, wait_ready: bool = True, **kwargs: Any) -> Iterator[TestClient]:
    app = create_app(engine, **kwargs)
    with TestClient(app) as client:
        deadline = time.monotonic() + 2
        while wait_ready and not engine.is_ready() and time.monotonic() < deadline:
            time.sleep(0.005)
        yield client


def sse_events(raw: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = []
    for block in raw.split("\n\n")[:-1]:
        lines = [ln for ln in block.split("\n") if not ln.startswith(":")]  # comments: pings
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        events.append(lines[0][len("data: "):])
    return events


def sse_json(raw: str) -> list[dict[str, Any]]:
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
