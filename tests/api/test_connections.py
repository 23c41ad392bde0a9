"""Connection limits on a real uvicorn server (loopback, the fake engine): a slow body is cut
while real requests go on, partial headers (and sockets that never send a byte) are closed,
idle sockets block nothing, past --limit-concurrency requests in progress new ones get a JSON
503 while /health and /metrics answer, and the server recovers. Small timeouts; every wait is on an observable event
(a socket's EOF, the server's connection count) with a bound."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from api.app import create_app
from api.connections import ConnectionLimits, uvicorn_config
from api.server import GracefulServer
from api.state import AppState
from tests.support.fake_engine import FakeEngine

HOST = "127.0.0.1"
HEADER_TIMEOUT, BODY_TIMEOUT = 0.4, 0.6
BOUND = 10.0  # no wait in these tests may take longer
# uvloop's (libuv's) timers run on a millisecond clock read once per loop iteration, so a
# timer may fire up to ~1 ms before its delay has passed on time.monotonic() (CI saw 0.39988
# s for 0.4): a cut counts as on time from this much before its timeout.
TIMER_SLACK = 0.01


@contextmanager
def http_server(limits: ConnectionLimits) -> Iterator[tuple[int, GracefulServer]]:
    app = create_app(FakeEngine())
    server = GracefulServer(uvicorn_config(app, HOST, 0, "warning", limits),
                            AppState.of_app(app).lifecycle)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, "the server to start")
        port = server.servers[0].sockets[0].getsockname()[1]
        wait_for(lambda: httpx.get(f"http://{HOST}:{port}/health").status_code == 200,
                 "the engine to be ready")
        yield port, server
    finally:
        server.should_exit = True
        thread.join(BOUND)
        assert not thread.is_alive()


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    sock.settimeout(BOUND)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length (head and body), leaving the connection open."""
    sock.settimeout(BOUND)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def completion(port: int) -> httpx.Response:
    return httpx.post(f"http://{HOST}:{port}/v1/completions", timeout=BOUND,
                      json={"prompt": "ab", "max_tokens": 2})


def limits(**kw: object) -> ConnectionLimits:
    opts: dict[str, object] = {"header_timeout": HEADER_TIMEOUT, "body_timeout": BODY_TIMEOUT}
    opts.update(kw)
    return ConnectionLimits(**opts)  # type: ignore[arg-type]


def test_slow_body_is_cut_while_real_requests_are_served() -> None:
    with http_server(limits()) as (port, _):
        slow = socket.create_connection((HOST, port))
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: "
                "application/json\r\nContent-Length: 1000\r\n\r\n{").encode()
        start = time.monotonic()
        slow.sendall(head)
        stop = threading.Event()

        def drip() -> None:  # one more byte every 50 ms: the body never completes in time
            while not stop.wait(0.05):
                try:
                    slow.sendall(b" ")
                except OSError:
                    return

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        served = [completion(port).status_code for _ in range(3)]  # while the drip goes on
        reply = read_until_closed(slow)
        elapsed = time.monotonic() - start
        stop.set()
        dripper.join(BOUND)
        slow.close()
        assert served == [200, 200, 200]
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:100]
        assert b'"code":"request_timeout"' in reply
        assert BODY_TIMEOUT - TIMER_SLACK <= elapsed < BOUND
        assert completion(port).status_code == 200


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_partial_headers_are_closed_after_the_header_timeout(sent: bytes) -> None:
    with http_server(limits()) as (port, _):
        start = time.monotonic()
        with socket.create_connection((HOST, port)) as sock:
            sock.sendall(sent)
            assert read_until_closed(sock) == b""  # closed, nothing said
        assert HEADER_TIMEOUT - TIMER_SLACK <= time.monotonic() - start < BOUND
        assert completion(port).status_code == 200


def test_a_complete_request_is_never_cut_by_the_timeouts() -> None:
    """A body sent slowly but within the body timeout, and a long keep-alive connection
    whose requests arrive between pauses, are served."""
    with http_server(limits()) as (port, _):
        body = b'{"prompt": "ab", "max_tokens": 2}'
        with socket.create_connection((HOST, port)) as sock:
            for _ in range(2):  # two requests on one connection, a pause between them
                sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: "
                             f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode())
                sock.sendall(body[:10])
                time.sleep(BODY_TIMEOUT / 3)
                sock.sendall(body[10:])
                assert read_response(sock).startswith(b"HTTP/1.1 200 ")
                time.sleep(HEADER_TIMEOUT / 2)


def held_request(port: int) -> socket.socket:
    """A request in progress that stays so: its head sent, its body promised but withheld."""
    sock = socket.create_connection((HOST, port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: "
                 "application/json\r\nContent-Length: 100\r\n\r\n".encode())
    return sock


def test_idle_sockets_past_the_limit_block_nothing() -> None:
    """Issue 38: more sockets that never send a byte than --limit-concurrency; requests, the
    health probe and a scrape are all served (uvicorn's limit counted them: all got 503)."""
    with http_server(limits(limit_concurrency=3, header_timeout=30.0)) as (port, server):
        idle = [socket.create_connection((HOST, port)) for _ in range(12)]
        wait_for(lambda: len(server.server_state.connections) >= 12, "twelve idle sockets")
        try:
            assert [completion(port).status_code for _ in range(3)] == [200] * 3
            for path in ("/health", "/metrics"):
                assert httpx.get(f"http://{HOST}:{port}{path}", timeout=BOUND).status_code == 200
        finally:
            for sock in idle:
                sock.close()


def test_past_the_limit_of_requests_in_progress_a_json_503_then_it_recovers() -> None:
    with http_server(limits(limit_concurrency=3, header_timeout=30.0,
                            body_timeout=30.0)) as (port, server):
        state = server.server_state
        held = [held_request(port) for _ in range(3)]
        wait_for(lambda: len(state.tasks) == 3, "three requests in progress")
        try:
            refused = completion(port)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "too_many_requests_in_progress"
            assert refused.headers["retry-after"] == "1"
            for path in ("/health", "/metrics"):  # exempt: a probe and a scrape still answer
                assert httpx.get(f"http://{HOST}:{port}{path}", timeout=BOUND).status_code == 200
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: not state.tasks, "the held requests to end")
        assert completion(port).status_code == 200
