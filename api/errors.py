"""Typed API errors and the one place that maps them (and engine errors) to HTTP.

Every error body has OpenAI's shape: {"error": {"message", "type", "param", "code"}} with
`code` a string or null (vLLM puts the HTTP status there; OpenAI clients expect a string).
Anything a client can send ends as a 4xx; a 500 means a bug in the server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.protocol import EngineDeadError, PromptTooLongError, QueueFullError

logger = logging.getLogger("pagedserve.api")

RETRY_AFTER_S = 1  # what a 429 tells the client to wait; the queue drains at step speed


@dataclass(eq=False)
class APIError(Exception):
    """An error answered to the client with `status` and the OpenAI error body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(exc: ValueError) -> APIError:
    """SamplingParams (and our parsers) start every message with the field's name."""
    message = str(exc)
    return bad_request(message, param=_leading_word(message) or None)


def not_ready() -> APIError:
    return APIError(503, "The model is still loading or the engine is not running.",
                    type="server_error", code="engine_not_ready")


def from_engine_error(exc: BaseException) -> APIError:
    """Map what EngineClient.generate raises to the client's answer (None of these are bugs)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), param="prompt", code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return APIError(429, f"The server is overloaded, retry later: {exc}",
                        type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not available: {exc}", type="server_error",
                        code="engine_dead")
    if isinstance(exc, ValueError):  # the engine refused a request parameter
        return bad_request(str(exc), param=_named_param(str(exc)))
    logger.error("request failed in the engine", exc_info=exc)
    return APIError(500, f"The engine failed this request: {exc}", type="server_error",
                    code="internal_error")


# Parameters the engine itself checks (against the model's vocabulary); its ValueError
# messages start with the parameter's name.
ENGINE_CHECKED_PARAMS = ("prompt", "logit_bias", "stop_token_ids")


def _named_param(message: str) -> str | None:
    first = _leading_word(message)
    return first if first in ENGINE_CHECKED_PARAMS else None


def _leading_word(message: str) -> str:
    return message.split(" ", 1)[0]


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


EXCEPTION_HANDLERS = {
    APIError: api_error_handler,
    HTTPException: http_error_handler,
    Exception: server_error_handler,
}
