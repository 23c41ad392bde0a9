"""Lifecycle: whether the server admits requests, and the streams it must drain on shutdown.

Graceful shutdown (SIGTERM, see api/server.py) is: stop admitting (new requests get 503 and
/health turns 503, so load balancers move away), let the open streams finish for up to
--shutdown-timeout, then end the rest with a clear error event (and [DONE]) or a 503 body.
Every response that talks to the engine registers its MergedStream here while it is open.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from api.errors import APIError

logger = logging.getLogger("pagedserve.api")


class Failable(Protocol):
    def fail(self, error: APIError) -> None: ...


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; retry on another replica.",
                    type="server_error", code="server_shutting_down", reason="shutting_down")


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self._open: set[Failable] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_open(self) -> int:
        return len(self._open)

    def check_admitting(self) -> None:
        if self.draining:
            raise shutting_down()

    def opened(self, stream: Failable) -> None:
        self._open.add(stream)
        self._idle.clear()

    def closed(self, stream: Failable) -> None:
        self._open.discard(stream)
        if not self._open:
            self._idle.set()

    async def drain(self, timeout_s: float, hurry: asyncio.Event | None = None) -> int:
        """Refuse new requests, wait up to timeout_s (or until `hurry` is set) for the open
        streams to finish, then fail the rest. -> how many were failed."""
        self.draining = True
        logger.info("draining: %d open request(s), up to %.0f s", len(self._open), timeout_s)
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        left = list(self._open)
        if left:
            logger.warning("shutdown: aborting %d request(s) still running", len(left))
        error = APIError(503, "The server shut down before this request finished.",
                         type="server_error", code="server_shutting_down")
        for stream in left:
            stream.fail(error)
        if left:  # let the responses send their error and [DONE] before the server closes
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=5.0)
            except TimeoutError:
                logger.warning("shutdown: %d request(s) did not close", len(self._open))
        return len(left)
