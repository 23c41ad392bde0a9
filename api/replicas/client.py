"""ReplicaClient: the EngineClient the ingress's Starlette app talks to. It forwards each call
to the engine deployment through a DeploymentHandle (engine requests as streaming calls, so
deltas arrive as they are generated) and reads replica state from the ReplicaBoard.

Faults: a request whose replica dies before admitting it is sent again (nothing of it ran);
one whose replica dies mid-stream ends with EngineDeadError, which the API turns into an SSE
error event then [DONE] (or a 503 before the first byte). Only that replica's requests see it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from engine.protocol import (
    ChatTemplateArgs,
    EngineDeadError,
    EngineLimits,
    EngineStats,
    RequestOutput,
    RequestStream,
    SamplingParams,
)
from engine.replicas.board import REPORT_PERIOD_S
from engine.replicas.messages import GenerateRequest, Refusal, ReplicaReport, StreamFailed

logger = logging.getLogger("pagedserve.replicas")

REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
SUBMIT_ATTEMPTS = 3  # sends of a request whose replica died before admitting it


class ReplicaClient:
    def __init__(self, handle: Any, board: Any, model_name: str) -> None:
        self.model_name = model_name
        self._handle = handle  # DeploymentHandle of the engine deployment
        self._board = board  # ActorHandle of the ReplicaBoard
        self._reports: list[ReplicaReport] = []
        self._poller: asyncio.Task[None] | None = None
        self._feeds: dict[str, tuple[Any, asyncio.Task[None], RequestStream]] = {}
        self._closed = False

    # ---- lifecycle and state --------------------------------------------------------------

    async def start(self) -> None:
        """Poll the board until a replica is ready (the app's lifespan runs this)."""
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_forever())
        while not self.is_ready():
            await asyncio.sleep(REPORT_PERIOD_S)

    async def refresh(self) -> None:
        self._reports = await self._board.fresh.remote()

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                logger.warning("cannot read the replica board", exc_info=True)
            await asyncio.sleep(REPORT_PERIOD_S)

    async def shutdown(self) -> None:
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
        for request_id in list(self._feeds):
            self._cancel(request_id, EngineDeadError("server shutting down"))

    def reports(self) -> list[ReplicaReport]:
        """Replicas that reported within STALE_AFTER_S, by id."""
        return list(self._reports)

    def is_ready(self) -> bool:
        return not self._closed and any(r.ready for r in self._reports)

    @property
    def limits(self) -> EngineLimits | None:
        return next((r.limits for r in self._reports if r.limits is not None), None)

    def stats(self) -> EngineStats:
        """All replicas together (the API's Retry-After reads waiting requests and drain
        rate); /metrics shows them one by one (api/replicas/collector.py)."""
        return sum_stats([r.stats for r in self._reports])

    # ---- requests -------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     priority: int = 0, deadline: float | None = None) -> RequestStream:
        if not self.is_ready():
            raise EngineDeadError("no engine replica is ready")
        timeout = None if deadline is None else deadline - time.monotonic()
        req = GenerateRequest(request_id, prompt, params, priority, timeout)
        gen, first = await self._admit(req)
        if isinstance(first, Refusal):
            raise first.error()
        stream = RequestStream(request_id, self._abort)
        self._feeds[request_id] = (gen, asyncio.create_task(self._feed(gen, stream)), stream)
        return stream

    async def _admit(self, req: GenerateRequest) -> tuple[Any, Any]:
        """Send the request; (its response stream, Admitted or Refusal)."""
        for attempt in range(1, SUBMIT_ATTEMPTS + 1):
            gen = self._handle.options(stream=True).generate.remote(req)
            try:
                return gen, await gen.__anext__()
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except REPLICA_GONE as e:
                if attempt == SUBMIT_ATTEMPTS:
                    raise EngineDeadError(f"engine replicas unavailable: {brief(e)}") from None
                logger.warning("replica gone before admitting %s, sending again: %s",
                               req.request_id, brief(e))
            except StopAsyncIteration:
                raise EngineDeadError("the replica ended the request unanswered") from None
        raise AssertionError("unreachable")

    async def _feed(self, gen: Any, stream: RequestStream) -> None:
        """Replica stream -> the API's RequestStream, until the final delta or a failure."""
        try:
            async for item in gen:
                if isinstance(item, StreamFailed):
                    stream.put(EngineDeadError(item.message))
                    return
                assert isinstance(item, RequestOutput)
                stream.put(item)
                if item.finished:
                    return
            stream.put(EngineDeadError("the replica ended the stream early"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - its replica died: this request only
            logger.warning("request %s lost its replica: %s", stream.request_id, brief(e))
            stream.put(EngineDeadError(f"the replica serving this request failed: {brief(e)}"))
        finally:
            self._feeds.pop(stream.request_id, None)

    def _abort(self, request_id: str) -> None:
        """The API closed the stream early (client gone): cancel the call, which aborts the
        request in its replica (engine/replicas/deployment.py)."""
        self._cancel(request_id, None)

    def _cancel(self, request_id: str, error: BaseException | None) -> None:
        """Stop relaying a request and cancel its call; `error` ends its stream (shutdown)."""
        entry = self._feeds.pop(request_id, None)
        if entry is None:
            return
        gen, task, stream = entry
        task.cancel()
        gen.cancel()
        if error is not None:
            stream.put(error)

    # ---- tokenizer calls (any replica answers alike) -------------------------------------

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        result: list[int] = await self._call("tokenize", text, add_special_tokens)
        return result

    async def detokenize(self, token_ids: list[int]) -> str:
        result: str = await self._call("detokenize", token_ids)
        return result

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  args: ChatTemplateArgs | None = None) -> str:
        result: str = await self._call("apply_chat_template", messages, args)
        return result

    async def _call(self, method: str, *args: Any) -> Any:
        if not self.is_ready():
            raise EngineDeadError("no engine replica is ready")
        try:
            return await getattr(self._handle, method).remote(*args)
        except REPLICA_GONE as e:
            raise EngineDeadError(f"engine replica unavailable: {brief(e)}") from None


def brief(exc: BaseException) -> str:
    """The first line of an error (Ray's carry whole remote tracebacks)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def sum_stats(all_stats: list[EngineStats]) -> EngineStats:
    """Counts and counters added up; rates added (None only when none is known)."""
    if not all_stats:
        return EngineStats()
    total: dict[str, Any] = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in all_stats]
        if f.name == "finish_rate":
            known = [v for v in values if v is not None]
            total[f.name] = sum(known) if known else None
        elif f.name == "iteration_tokens":
            rows = [v for v in values if v]
            total[f.name] = tuple(map(sum, zip(*rows, strict=True))) if rows else ()
        elif isinstance(values[0], bool | str):
            total[f.name] = values[0]
        else:
            total[f.name] = sum(values)
    return EngineStats(**total)
