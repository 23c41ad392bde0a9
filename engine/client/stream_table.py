"""StreamTable: a client's open requests on the event-loop side, written once for the thread
client (AsyncEngine), the process client (EngineCoreClient) and the Ray replica client
(api/replicas/client.py): each request's admission
(pending until the engine takes or refuses it) and its RequestStream, by request id; the
routing of a step's deltas to their streams; and failing everything when the engine ends.
Event-loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from engine.outputs import RequestOutput
from engine.protocol import RequestStream


class StreamTable:
    def __init__(self, on_close: Callable[[str], None]) -> None:
        """`on_close(request_id)`: a stream closed before its end (its consumer left): the
        client forgets it here and tells its engine to abort the request."""
        self._on_close = on_close
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[str, asyncio.Future[None]] = {}

    def __bool__(self) -> bool:
        return bool(self._streams or self._pending)

    def open(self, loop: asyncio.AbstractEventLoop,
             request_id: str) -> tuple[RequestStream, asyncio.Future[None]]:
        """A new request's stream and its admission (ValueError if the id is in use)."""
        if request_id in self._streams or request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, self._on_close)
        admitted: asyncio.Future[None] = loop.create_future()
        self._streams[request_id] = stream
        self._pending[request_id] = admitted
        return stream, admitted

    def admit(self, request_id: str, error: BaseException | None) -> None:
        """The engine took the request (error None) or refused it."""
        admitted = self._pending.pop(request_id, None)
        if admitted is None or admitted.done():  # the submit was cancelled meanwhile
            return
        if error is None:
            admitted.set_result(None)
        else:
            admitted.set_exception(error)

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._pending.pop(request_id, None)

    def deliver(self, outputs: Iterable[RequestOutput]) -> None:
        """Each delta to its stream; a finished request leaves the table."""
        for o in outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue  # closed by its consumer; the engine has been told to abort it
            stream.put(o)
            if o.finished:
                del self._streams[o.request_id]

    def fail(self, request_id: str, error: BaseException) -> None:
        """One request ends with `error` (the replica serving it died): its admission if the
        engine has not answered yet, else its stream."""
        admitted = self._pending.pop(request_id, None)
        if admitted is not None and not admitted.done():
            admitted.set_exception(error)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)

    def fail_all(self, error: BaseException) -> None:
        """Every waiting admission and open stream gets `error` (the engine has ended)."""
        for admitted in self._pending.values():
            if not admitted.done():
                admitted.set_exception(error)
        for stream in self._streams.values():
            stream.put(error)
        self._pending.clear()
        self._streams.clear()
