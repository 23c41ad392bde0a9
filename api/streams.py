"""Fan-out of one HTTP request into engine requests, and fan-in of their deltas.

n > 1 and multiple prompts become several engine requests that run concurrently: they are
submitted together, then one asyncio task per engine stream pumps deltas into a shared queue,
so the client sees them interleaved as the engine produces them. One engine request (n = 1,
one prompt: the usual case) has nothing to merge: its stream is read in place, with no pump
task and no second queue, so a token costs one task wake-up on the event loop, not two.
`close()` (always reached through `finally`) cancels the pumps and closes every engine stream,
which aborts those that have not finished: that is how a client disconnect frees KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from starlette.types import Receive

from api.errors import APIError, from_engine_error
from api.lifecycle import Lifecycle
from api.metrics import RequestTracker, ServerMetrics
from engine.outputs import ErrorCode, RequestOutput
from engine.protocol import EngineClient, RequestStream, SamplingParams

T = TypeVar("T")

# An item on the merge queue: (choice index, a delta | the error that ended it | None = ended).
_Item = tuple[int, RequestOutput | BaseException | None]


@dataclass(frozen=True, slots=True)
class Job:
    """One engine request: one choice of the HTTP response."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    tracker: RequestTracker
    deadline: float | None = None  # time.monotonic(); see LLMEngine.add_request


class MergedStream:
    """The deltas of several engine requests, merged in arrival order."""

    def __init__(self, engine: EngineClient, jobs: list[Job],
                 lifecycle: Lifecycle | None = None) -> None:
        self.engine = engine
        self._jobs = jobs
        self._lifecycle = lifecycle  # told when the stream opens and closes (shutdown drain)
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams: dict[int, RequestStream] = {}  # choice index -> its admitted stream
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._failed: APIError | None = None  # set by fail()
        self._on_fail = asyncio.Event()

    async def start(self) -> None:
        """Submit every engine request at once (one trip to the engine thread); if any is
        refused (prompt too long, queue full, engine dead), the admitted ones are closed and
        the refusal becomes the HTTP status. Open for the lifecycle from here on: a drain
        waits for a request still being admitted (its grammar compiling) like a running one,
        and fail() ends the wait with the drain's error."""
        if self._lifecycle is not None:
            self._lifecycle.opened(self)
        try:
            results = await self._unless_failed(asyncio.gather(
                *(self._submit(i, job) for i, job in enumerate(self._jobs)),
                return_exceptions=True))
        except BaseException:  # cancelled or failed: close what was admitted (frees blocks)
            await self.close()
            raise
        refused = next((r for r in results if isinstance(r, BaseException)), None)
        if refused is not None:
            await self.close()
            if not isinstance(refused, Exception):
                raise refused
            raise from_engine_error(refused, self.engine.stats()) from refused
        if len(self._jobs) > 1:
            self._tasks = [asyncio.create_task(self._pump(i, s))
                           for i, s in self._streams.items()]

    async def _unless_failed(self, submits: asyncio.Future[list[T]]) -> list[T]:
        """The submits' results, unless fail() comes first: then they are cancelled (which
        aborts their engine requests) and the failure is raised."""
        done, results = await _first_or_cancel(submits, self._on_fail.wait())
        if done and results is not None:
            return results
        assert self._failed is not None
        raise self._failed

    async def _submit(self, i: int, job: Job) -> None:
        self._streams[i] = await self.engine.submit(job.request_id, job.prompt, job.params,
                                                    job.priority, job.deadline)

    async def _pump(self, i: int, stream: RequestStream) -> None:
        tracker = self._jobs[i].tracker
        try:
            async for out in stream:
                tracker.on_output(out)
                await self._queue.put((i, out))
            await self._queue.put((i, None))
        except Exception as e:  # noqa: BLE001 - the consumer decides what the client sees
            await self._queue.put((i, e))

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) until every choice has finished; a mid-stream engine
        error is raised as an APIError."""
        return self._read_one() if len(self._jobs) == 1 else self._read_merged()

    async def _read_one(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The one engine stream, read in place: what _pump and _read_merged do for it, in
        the same order (the tracker sees a delta before its error is raised)."""
        stream, tracker = self._streams[0], self._jobs[0].tracker
        while True:
            try:
                out = await anext(stream)
            except StopAsyncIteration:  # closed meanwhile: as the pump's loop, end quietly
                return
            except Exception as e:  # EngineDeadError, a failed step, or fail()'s APIError
                raise from_engine_error(e, self.engine.stats()) from e
            tracker.on_output(out)
            if out.error is not None:
                raise _output_error(out)
            yield 0, out
            if out.finished:
                return

    async def _read_merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        ended: set[int] = set()
        while len(ended) < len(self._jobs):
            i, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise from_engine_error(item, self.engine.stats()) from item
            if item is None:  # the stream ended (after its final delta)
                ended.add(i)
                continue
            if item.error is not None:
                raise _output_error(item)
            yield i, item

    def fail(self, error: APIError) -> None:
        """End the stream with `error` (graceful shutdown): the consumer raises it next, or
        start() does if the stream is still being admitted."""
        self._failed = error
        self._on_fail.set()
        if len(self._jobs) > 1:
            self._queue.put_nowait((-1, error))
        elif 0 in self._streams:  # read in place: the error goes through the stream itself
            self._streams[0].interrupt(error)

    async def close(self) -> None:
        """Cancel the pumps and close every engine stream (aborting what is unfinished);
        shielded, because it runs while the response's task is being cancelled (client
        gone)."""
        if self._closed:
            return
        self._closed = True
        if self._lifecycle is not None:
            self._lifecycle.closed(self)
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for i, stream in self._streams.items():
                if not stream.ended:
                    self._jobs[i].tracker.on_abort()
                await stream.aclose()


def _output_error(out: RequestOutput) -> APIError:
    if out.error_code == ErrorCode.QUEUE_TIMEOUT:
        return APIError(503, f"The server is overloaded: {out.error}", type="server_error",
                        code="queue_timeout")
    if out.error_code == ErrorCode.INVALID_PARAM:  # submit() normally refuses these first
        return APIError(400, out.error or "invalid request", type="invalid_request_error")
    return APIError(500, f"The engine failed this request: {out.error}",
                    type="server_error", code="internal_error")


async def start_stream(engine: EngineClient, jobs: list[Job], metrics: ServerMetrics,
                       lifecycle: Lifecycle) -> MergedStream:
    """A started MergedStream, registered with the lifecycle until closed; an admission
    refusal is counted, then raised as APIError."""
    stream = MergedStream(engine, jobs, lifecycle)
    try:
        await stream.start()
    except APIError as e:
        if e.reason is not None:
            metrics.reject(e.reason)
        raise
    return stream


async def run_unless_disconnected(receive: Receive,
                                  work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it and return None.

    Called after the body was read, so the next ASGI message can only be http.disconnect."""
    _, result = await _first_or_cancel(work, _wait_disconnect(receive))
    return result


async def _first_or_cancel(work: Awaitable[T], interrupt: Awaitable[Any]) -> tuple[bool, T | None]:
    """Run `work` unless `interrupt` completes first, in which case `work` is cancelled (and
    awaited). -> (whether work finished, its result). Cancelling the caller cancels both."""
    task = asyncio.ensure_future(work)
    other = asyncio.ensure_future(interrupt)
    try:
        await asyncio.wait({task, other}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        other.cancel()
        raise
    other.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
