"""The real stack on loopback for stress tests: uvicorn + api/ + AsyncEngine + a tiny model,
and a raw asyncio HTTP/1.1 client that can hang up at an exact moment.

The server runs in a thread of the test process (so its engine and its memory are the
test's to inspect); the client speaks HTTP by hand because the moments that matter
(before the body is sent, before the response headers, after the n-th SSE event) are
awkward to reach through a full client library.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from api.app import create_app
from api.cli import run_serving
from api.server import GracefulServer
from api.state import AppState
from engine.client.async_engine import STUCK_AFTER_S, AsyncEngine
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from tests.support.faults import FaultyRunner

METRIC_LINE = re.compile(r"^(pagedserve:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+|NaN)$")


class SlowRunner(FaultyRunner):
    """A real runner whose steps take at least `delay` s (so a request outlasts a hang-up),
    and which tells a test when some sequence is part-way through its prompt (mid-prefill)."""

    def __init__(self, runner: ModelRunner, delay: float) -> None:
        super().__init__(runner, delay=delay)
        self.mid_prefill = threading.Event()

    def execute(self, batch: Any, masks: Any = None) -> Any:
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            if 0 < seq.num_computed_tokens and seq.num_computed_tokens + n < seq.num_prompt_tokens:
                self.mid_prefill.set()  # a later chunk of a prompt that is not done yet
        return super().execute(batch, masks)


@dataclass
class Live:
    """A running server: its base URL, host/port for raw sockets, its engine, the fault
    runner between the engine and the model, the HTTP server and the serving thread."""

    url: str
    host: str
    port: int
    engine: AsyncEngine
    runner: FaultyRunner
    http: GracefulServer
    thread: threading.Thread

    def blocks_all_free(self, timeout: float = 5.0) -> None:
        """Wait until the engine holds no request and every KV block is free (invariants
        checked)."""
        deadline = time.monotonic() + timeout
        eng = self.engine.engine
        while time.monotonic() < deadline:
            bm = eng.scheduler.block_manager
            if not eng.requests and bm.num_free_blocks == bm.num_blocks:
                bm.check_invariants()
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle: {list(eng.requests)}, {self.engine.stats()}")

    def slow_down(self, delay: float) -> SlowRunner:
        slow = SlowRunner(self.engine.engine.runner, delay)
        self.engine.engine.runner = slow  # type: ignore[assignment]
        return slow

    def metrics(self) -> dict[str, float]:
        """The unlabelled pagedserve gauges/counters from /metrics (labelled ones summed)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            m = METRIC_LINE.match(line)
            if m:
                values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
        return values

    def wait_idle(self, timeout: float = 5.0) -> dict[str, float]:
        """Wait until /metrics shows nothing running or waiting and no KV block in use; the
        engine must then hold no request either. Returns the last metrics read."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["pagedserve:num_requests_running"] == 0
                    and m["pagedserve:num_requests_waiting"] == 0
                    and m["pagedserve:kv_cache_usage_perc"] == 0
                    and m["pagedserve:num_free_kv_blocks"] == m["pagedserve:num_kv_blocks"])
            if idle and not self.engine.engine.requests:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout} s: {m}, engine requests "
                                     f"{list(self.engine.engine.requests)}")
            time.sleep(0.02)
        self.engine.engine.scheduler.check_invariants()
        return m


@contextmanager
def live_server(runner: ModelRunner, *, api_key: str | None = None, delay: float = 0.0,
                shutdown_timeout: float = 10.0, stuck_after_s: float = STUCK_AFTER_S,
                request_timeout: float | None = None, **scheduler: Any) -> Iterator[Live]:
    """Serve `runner` (shared, already loaded) on 127.0.0.1 with an ephemeral port, the way
    the CLI does (api.cli.run_serving), from a thread of the test's. Steps go through a
    FaultyRunner that sleeps `delay` s each."""
    opts: dict[str, Any] = {"block_size": runner.block_size, "max_model_len": 128,
                            "max_num_seqs": 4, "max_num_batched_tokens": 32}
    opts.update(scheduler)
    cfg = EngineConfig(model=None, dtype="float32", device="cpu", enforce_eager=True,
                       scheduler=SchedulerConfig(**opts), served_model_name="tiny")
    faulty = FaultyRunner(runner, delay=delay)
    engine = AsyncEngine(cfg, LLMEngine(cfg, runner=faulty),  # type: ignore[arg-type]
                         stuck_after_s=stuck_after_s)
    app = create_app(engine, api_key=api_key, request_timeout=request_timeout)
    http = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"),
                          AppState.of_app(app).lifecycle, shutdown_timeout)
    thread = threading.Thread(target=run_serving, args=(engine, http), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (http.started and engine.is_ready()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.is_ready(), "the live server did not start"
        port = http.servers[0].sockets[0].getsockname()[1]
        yield Live(f"http://127.0.0.1:{port}", "127.0.0.1", port, engine, faulty, http, thread)
    finally:
        faulty.unstall()
        http.should_exit = True
        thread.join(20)
        assert not thread.is_alive(), "the live server did not stop"


# ------------------------------------------------------------------------- raw client


@dataclass
class RawResponse:
    status: int | None = None  # None: hung up before the status line arrived
    headers: dict[str, str] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)  # SSE data payloads (JSON or [DONE])
    body: bytes = b""  # the de-chunked body read so far

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"


def request_bytes(host: str, port: int, path: str, body: bytes,
                  headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def raw_post(live: Live, path: str, payload: dict[str, Any], *,
                   hang_up: str = "never", after_events: int = 1,
                   headers: dict[str, str] | None = None) -> RawResponse:
    """POST `payload`; hang up at a moment:
    "body": mid-body (before admission), "headers": right after the request is sent (before
    the response headers), "events": after `after_events` SSE events, "never": read it all.
    """
    reader, writer = await asyncio.open_connection(live.host, live.port)
    resp = RawResponse()
    try:
        body = json.dumps(payload).encode()
        raw = request_bytes(live.host, live.port, path, body, headers)
        if hang_up == "body":
            writer.write(raw[: len(raw) - len(body) // 2])  # headers and half the body
            await writer.drain()
            return resp
        writer.write(raw)
        await writer.drain()
        if hang_up == "headers":
            return resp
        await _read_head(reader, resp)
        await _read_body(reader, resp, after_events if hang_up == "events" else None)
        return resp
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def _read_head(reader: asyncio.StreamReader, resp: RawResponse) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    resp.status = int(status_line.split(" ")[1])
    for line in lines:
        if ":" in line:
            k, v = line.split(":", 1)
            resp.headers[k.strip().lower()] = v.strip()


async def _read_body(reader: asyncio.StreamReader, resp: RawResponse,
                     stop_after: int | None) -> None:
    """De-chunk the body (or read Content-Length bytes); stop after `stop_after` events."""
    if "content-length" in resp.headers:
        resp.body = await reader.readexactly(int(resp.headers["content-length"]))
        return
    pending = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return
        resp.body += chunk[:-2]
        pending += chunk[:-2]
        while b"\n\n" in pending:
            block, pending = pending.split(b"\n\n", 1)
            resp.events += [ln[6:].decode() for ln in block.split(b"\n")
                            if ln.startswith(b"data: ")]
        if stop_after is not None and len(resp.events) >= stop_after:
            return


