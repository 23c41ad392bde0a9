"""GracefulServer: uvicorn with a draining shutdown.

uvicorn's own SIGTERM handling closes the listening socket at once and then waits for open
connections, so a client arriving during the wait gets "connection refused" and a stream
that outlives the wait is cut without [DONE]. Here the first SIGTERM or SIGINT starts
Lifecycle.drain instead: the socket stays open and answers 503, running requests finish (up
to --shutdown-timeout), the rest end with an error event; only then does uvicorn stop. A
second signal cuts the wait short. The process exits 0 after a drain, so restart policies
see a clean stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from api.lifecycle import Lifecycle

logger = logging.getLogger("pagedserve.api")

DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0  # below Kubernetes' default 30 s grace period


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry = asyncio.Event()
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the signal handler: only hand work to the loop (thread-safe call)."""
        if self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # not serving yet: uvicorn's usual exit
            return
        self._loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self._draining is None:
            logger.info("%s: graceful shutdown (new requests get 503; waiting up to %.0f s "
                        "for running ones; send it again to stop now)", name,
                        self.shutdown_timeout)
            self._draining = asyncio.ensure_future(self._drain())
        else:
            logger.info("%s again: aborting running requests now", name)
            self._hurry.set()

    async def _drain(self) -> None:
        try:
            failed = await self.lifecycle.drain(self.shutdown_timeout, self._hurry)
            logger.info("drained (%d request(s) aborted); stopping", failed)
        finally:
            self.should_exit = True
