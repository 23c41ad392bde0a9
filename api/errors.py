"""Typed API errors and the one place that maps them (and engine errors) to HTTP.

Every error body has OpenAI's shape: {"error": {"message", "type", "param", "code"}} with
`code` a string or null (vLLM puts the HTTP status there; OpenAI clients expect a string).
Anything a client can send ends as a 4xx; a 500 means a bug in the server.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from engine.protocol import (
    EngineDeadError,
    EngineStats,
    InvalidParamError,
    PromptTooLongError,
    QueueFullError,
)

logger = logging.getLogger("pagedserve.api")

CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody reads it
# A 429's Retry-After: about when the requests queued ahead have drained, clamped so a burst
# right after start (no history) or a stalled engine never asks for more than a minute.
MIN_RETRY_S = 1
MAX_RETRY_S = 60
UNKNOWN_RETRY_S = 5  # nothing finished lately: no rate to estimate from


@dataclass(eq=False)
class APIError(Exception):
    """An error answered to the client with `status` and the OpenAI error body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # The label of pagedserve:admission_rejections when this error refuses a request
    # (None: not an admission refusal). Not part of the body.
    reason: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


class ErrorResponse(JSONResponse):
    """An error body with non-ASCII escaped: messages may quote the client's own text, and
    JSON lets that carry a lone surrogate ("\\ud800"), which UTF-8 cannot encode (a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def retry_after_s(stats: EngineStats) -> int:
    """Whole seconds until the requests waiting now are expected to have drained."""
    if not stats.finish_rate:
        return UNKNOWN_RETRY_S
    wait = math.ceil(max(stats.num_waiting, 1) / stats.finish_rate)
    return max(MIN_RETRY_S, min(MAX_RETRY_S, wait))


def not_ready() -> APIError:
    return APIError(503, "The model is still loading or the engine is not running.",
                    type="server_error", code="engine_not_ready")


def from_engine_error(exc: BaseException, stats: EngineStats) -> APIError:
    """Map what EngineClient.submit raises (or a stream raises) to the client's answer;
    `stats` gives a 429 its Retry-After. None of these are bugs but the last."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param="prompt", code="context_length_exceeded",
                        reason="prompt_too_long")
    if isinstance(exc, QueueFullError):
        return APIError(429, f"The server is overloaded, retry later: {exc}",
                        type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(retry_after_s(stats))}, reason=exc.limit)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not available: {exc}", type="server_error",
                        code="engine_dead", reason="engine_dead")
    if isinstance(exc, InvalidParamError):
        return bad_request(str(exc), param=exc.param)
    logger.error("request failed in the engine", exc_info=exc)
    return APIError(500, f"The engine failed this request: {exc}", type="server_error",
                    code="internal_error")


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (unknown route) and 405 (wrong method) in the OpenAI shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = APIError(404, f"Not found: {request.url.path}", code="not_found")
    elif exc.status_code == 405:
        err = APIError(405, f"Method {request.method} not allowed on {request.url.path}",
                       code="method_not_allowed", headers=dict(exc.headers or {}))
    else:
        err = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    return err.response()


async def server_error_handler(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return APIError(500, "Internal server error", type="server_error",
                    code="internal_error").response()


async def client_gone_handler(request: Request, exc: Exception) -> Response:
    """The client hung up while its body was being read: its doing, not a server error
    (nothing reached the engine; the answer goes nowhere)."""
    logger.debug("client went away while sending %s", request.url.path)
    return Response(status_code=CLIENT_CLOSED)


EXCEPTION_HANDLERS = {
    APIError: api_error_handler,
    HTTPException: http_error_handler,
    ClientDisconnect: client_gone_handler,
    Exception: server_error_handler,
}
