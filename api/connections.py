"""Connection limits: how many connections are served, and how long a client may take to
send a request.

uvicorn bounds concurrency (`limit_concurrency`: past it a new request gets 503) and idle
keep-alive connections (`timeout_keep_alive`), but its h11 protocol has no read timeout: a
client that sends half its headers, or a body at 1 byte/s, holds its connection (and a
place under limit_concurrency) forever. GuardedH11Protocol adds two, per request:

- header timeout: from the connection's first byte (or its opening, or the first byte after
  a keep-alive pause) until the request head is complete; past it the connection is closed.
- body timeout: from the end of the head until the whole body has arrived (a total, not a
  per-read, timeout: a per-read one never fires on a 1 byte/s drip). Past it the client
  gets 408 when no response has started, and the connection is closed; the app sees a
  disconnect, as for a client that went away.

A request that is complete is never cut, however long its answer streams.

And a concurrency limit that idle sockets cannot exhaust. uvicorn's `limit_concurrency`
counts open connections, so 1,100 sockets that never send a byte made every request, and
/health, answer a plain-text 503 until the header timeout reaped them (and a client that
re-opened them kept it so). Here the limit counts requests in progress (a head received,
the answer not finished), not connections; past it a new request gets the JSON 503
(`too_many_requests_in_progress`, with Retry-After), and /health and /metrics are exempt, so
a probe and a scrape still see the server. Idle and half-sent connections are bounded in
time by the header timeout, which runs from the moment the connection is accepted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("pagedserve.api")

DEFAULT_LIMIT_CONCURRENCY = 1000
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0  # uvicorn's default
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0  # a 4 MiB body (--max-body-bytes) at ~0.6 Mbit/s
EXEMPT_PATHS = frozenset({"/health", "/metrics"})  # answerable at the concurrency limit
_BUSY_BODY = (b'{"error":{"message":"too many requests in progress; retry shortly",'
              b'"type":"server_error","param":null,"code":"too_many_requests_in_progress"}}')
_TIMEOUT_BODY = (b'{"error":{"message":"request body not received in time",'
                 b'"type":"invalid_request_error","param":null,"code":"request_timeout"}}')
REQUEST_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                            b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                            % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY  # None: unbounded
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError("limit_concurrency must be >= 1")
        for name in ("timeout_keep_alive", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


def uvicorn_config(app: Any, host: str, port: int, log_level: str,
                   limits: ConnectionLimits) -> uvicorn.Config:
    """The one place the CLI's HTTP server settings are made (the live tests in
    tests/support/livetools.py run uvicorn's defaults, without these limits)."""
    # uvicorn's own limit_concurrency stays off: it counts connections (see the docstring).
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=10, http=guarded_protocol(limits),
                          timeout_keep_alive=int(max(1, round(limits.timeout_keep_alive))))


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": limits.header_timeout, "body_timeout": limits.body_timeout,
                 "max_requests": limits.limit_concurrency})


class GuardedH11Protocol(H11Protocol):
    header_timeout = DEFAULT_HEADER_TIMEOUT_S
    body_timeout = DEFAULT_BODY_TIMEOUT_S
    max_requests: int | None = DEFAULT_LIMIT_CONCURRENCY  # requests in progress; None: any
    _timer: asyncio.TimerHandle | None = None
    _timing: str = ""  # "head" | "body" | "": what the running timer waits for

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.max_requests is not None:
            self.app = _limited(self.app, self.tasks, self.max_requests)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head", self.header_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # idle now: uvicorn's keep-alive timeout takes over until a byte comes

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Set the timer for what the request still owes after the bytes just parsed."""
        state = self.conn.their_state
        if state is h11.IDLE and self._timing != "head":
            self._arm("head", self.header_timeout)
        elif state is h11.SEND_BODY and self._timing != "body":
            self._arm("body", self.body_timeout)
        elif state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the request is complete (or the connection is going away)

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self._timing = what
        self._timer = self.loop.call_later(seconds, self._expired, what)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timing = None, ""

    def _expired(self, what: str) -> None:
        self._timer, self._timing = None, ""
        if self.transport.is_closing():
            return
        logger.info("closing a connection from %s: request %s not received in time",
                    _peer(self.client), "head" if what == "head" else "body")
        if what == "body" and (self.cycle is None or not self.cycle.response_started):
            self.transport.write(REQUEST_TIMEOUT_RESPONSE)
        if self.cycle is not None:  # the app's receive() and send() see a client gone away
            self.cycle.disconnected = True
        self.transport.close()


def _limited(app: Any, tasks: set[Any], limit: int) -> Any:
    """`app` behind the limit on requests in progress. uvicorn adds a request's task to the
    server's shared `tasks` before the app runs, so the count includes this request."""

    async def limited(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or len(tasks) <= limit
                or scope.get("path") in EXEMPT_PATHS):
            await app(scope, receive, send)
            return
        logger.warning("%d requests in progress (--limit-concurrency %d): 503 for %s",
                       len(tasks), limit, scope.get("path"))
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"retry-after", b"1"),
            (b"connection", b"close"), (b"content-length", str(len(_BUSY_BODY)).encode())]})
        await send({"type": "http.response.body", "body": _BUSY_BODY})

    return limited


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
