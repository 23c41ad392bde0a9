"""The ingress deployment: api/app.py's Starlette app, unchanged in validation, SSE and
errors, behind Ray Serve's HTTP proxy. Its engine is a ReplicaClient over the engine
deployment; /metrics has a row per engine replica; /health is 200 while one is ready."""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve
from starlette.applications import Starlette

from api.app import create_app
from api.replicas.client import ReplicaClient
from api.replicas.collector import ReplicaCollector
from api.state import AppState
from engine.replicas.board import REPORT_PERIOD_S
from engine.replicas.loopback import keep_replica_on_loopback


@serve.ingress()
class Ingress:
    """`app_options`: create_app's keyword arguments (api key, body limit, timeouts...)."""

    async def __init__(self, engine: Any, board: Any, app_options: dict[str, Any]) -> None:  # type: ignore[misc]
        keep_replica_on_loopback()
        model_name = await _model_name(board)
        client = ReplicaClient(engine, board, model_name)
        self._app = create_app(client, **app_options)
        metrics = AppState.of_app(self._app).metrics
        metrics.use_engine_collector(ReplicaCollector(client, metrics.prefix,
                                                      metrics.model_name))

    def __serve_build_asgi_app__(self) -> Starlette:
        return self._app

    async def drain(self, timeout_s: float) -> int:
        """Graceful shutdown, as one process does it on SIGTERM: new requests and /health get
        503, open streams get `timeout_s` to finish, the rest end with an error event and
        [DONE]. -> how many were cut. The launcher calls it before stopping Serve, whose own
        shutdown would close the proxy's connections mid-stream."""
        return await AppState.of_app(self._app).lifecycle.drain(timeout_s)


async def _model_name(board: Any) -> str:
    """The served model's id, from the first replica report: the engine derives it where the
    model is (its node), which the ingress may not share."""
    while True:
        reports = await board.fresh.remote()
        if reports:
            name: str = reports[0].model_name
            return name
        await asyncio.sleep(REPORT_PERIOD_S)
