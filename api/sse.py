"""Server-sent events framing: `data: {json}` per chunk, an error event if the stream fails
after it started (the status line is gone by then), and always `data: [DONE]` last."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from api.errors import APIError

logger = logging.getLogger("pagedserve.api")

PING_S = 15  # keep-alive comment lines (": ping") for proxies; clients ignore them
SEP = "\n"  # OpenAI frames events with bare newlines (sse-starlette defaults to CRLF)


class ClosingEventSourceResponse(EventSourceResponse):
    """Runs `on_close` however the response ends, even when the client left before the
    body generator ever started (its own `finally` would then never run)."""

    def __init__(self, content: AsyncIterator[ServerSentEvent],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, sep=SEP, ping=PING_S)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


def sse_response(events: AsyncGenerator[dict[str, Any], None],
                 on_close: Callable[[], Awaitable[None]]) -> ClosingEventSourceResponse:
    return ClosingEventSourceResponse(_framed(events), on_close)


async def _framed(events: AsyncGenerator[dict[str, Any], None],
                  ) -> AsyncIterator[ServerSentEvent]:
    async with contextlib.aclosing(events):
        try:
            async for payload in events:
                yield _event(payload)
        except APIError as e:
            yield _event(e.body())
        except Exception:  # a bug; the client still gets a well-formed end of stream
            logger.exception("stream failed")
            yield _event(APIError(500, "Internal server error", type="server_error",
                                  code="internal_error").body())
    yield ServerSentEvent(data="[DONE]", sep=SEP)


# Characters that are no line break to SSE or JSON but are to str.splitlines, which some
# clients split a stream with (httpx's aiter_lines): raw in a token's text, they cut its event
# in two there. Escaped, the JSON decodes to the same text.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _event(payload: dict[str, Any]) -> ServerSentEvent:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii():  # (the ASCII ones, below 0x20, json.dumps escapes itself)
        text = text.translate(_LINE_BREAKS)
    return ServerSentEvent(data=text, sep=SEP)
