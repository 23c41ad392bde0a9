"""create_app: the Starlette application around one EngineClient.

The lifespan owns the engine: it starts loading the model in the background (so /health
answers 503 until it is ready, instead of the port not being open) and shuts it down on
exit. Everything the routes share lives on app.state; there are no module globals.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from api.chat import create_chat_completion
from api.completions import create_completion
from api.errors import EXCEPTION_HANDLERS, APIError
from api.live import ui_routes
from api.metrics import DEFAULT_PREFIX, ServerMetrics
from api.openapi import openapi
from api.routes import detokenize, health, list_models, metrics, tokenize
from api.state import DEFAULT_MAX_BODY_BYTES, AppState
from engine.protocol import EngineClient

logger = logging.getLogger("pagedserve.api")


def create_app(engine: EngineClient, *, served_model_name: str | None = None,
               api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               request_timeout: float | None = None,
               trust_request_chat_template: bool = False,
               metrics_prefix: str = DEFAULT_PREFIX,
               enable_ui: bool = True) -> Starlette:
    """`enable_ui`: serve the playground (/), the live view (/dashboard) and its event stream
    (/v1/engine/events); --disable-ui turns them off."""
    routes: list[BaseRoute] = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    if enable_ui:
        routes += ui_routes()
    middleware = [Middleware(APIKeyMiddleware, api_key=api_key)] if api_key else []
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers=EXCEPTION_HANDLERS)  # type: ignore[arg-type]
    model_name = served_model_name or engine.model_name
    app.state.pagedserve = AppState(engine, ServerMetrics(engine, model_name, metrics_prefix),
                                    model_name, max_body_bytes, request_timeout,
                                    trust_request_chat_template=trust_request_chat_template)
    return app


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    engine = AppState.of_app(app).engine
    loading = asyncio.create_task(_start(engine))
    try:
        yield
    finally:
        if not loading.done():
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
        await engine.shutdown()


async def _start(engine: EngineClient) -> None:
    try:
        await engine.start()
    except Exception:  # the server stays up to say so: /health answers 503
        logger.exception("the engine failed to start")


class APIKeyMiddleware:
    """With --api-key, every route needs `Authorization: Bearer KEY` except /health and
    /metrics (open for probes and scrapers) and the built-in pages' static files (they hold
    no server data: what they show comes from guarded routes, see api/live.py). An
    allowlist, so a new route is protected by default; the key is compared in constant
    time."""

    OPEN = frozenset({"/health", "/metrics", "/", "/dashboard"})
    OPEN_PREFIX = "/ui/"

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in self.OPEN \
                and not path.startswith(self.OPEN_PREFIX):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError(401, "Incorrect or missing API key (Authorization: Bearer).",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
