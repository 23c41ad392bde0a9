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

from engine.client.stream_table import StreamTable
from engine.protocol import (
    ChatTemplateArgs,
    EngineDeadError,
    EngineLimits,
    EngineStats,
    EngineView,
    RequestOutput,
    RequestStream,
    SamplingParams,
)
from engine.replicas.board import REPORT_PERIOD_S
from engine.replicas.messages import GenerateRequest, Refusal, ReplicaReport, StreamFailed
from engine.snapshot import EngineSnapshot

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
        self._table = StreamTable(self._abort)  # the open requests, by id
        self._calls: dict[str, asyncio.Task[None]] = {}  # each request's relay, by id
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
        self._table.fail_all(EngineDeadError("server shutting down"))
        for call in list(self._calls.values()):
            call.cancel()

    def reports(self) -> list[ReplicaReport]:
        """Replicas that reported within STALE_AFTER_S, by id."""
        return list(self._reports)

    def is_ready(self) -> bool:
        return not self._closed and any(r.ready for r in self._reports)

    @property
    def limits(self) -> EngineLimits | None:
        return next((r.limits for r in self._reports if r.limits is not None), None)

    async def live_view(self, since: dict[str, int]) -> list[EngineView]:
        """One view per replica, from its latest report; asking tells the board someone
        watches, so the replicas' next reports carry their snapshots (one report period
        later: until then a replica's view has only its stats)."""
        if not self.is_ready():
            raise EngineDeadError("no engine replica is ready")
        self._board.watch.remote()  # fire and forget
        return [EngineView(r.replica, r.stats, _after(r.snapshot, since.get(r.replica, 0)))
                for r in self._reports]

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
        stream, admitted = self._table.open(asyncio.get_running_loop(), request_id)
        self._calls[request_id] = asyncio.create_task(self._relay(req))
        try:
            await admitted
        except BaseException:  # refused, or the client left while waiting: cancel the call
            self._abort(request_id)
            raise
        return stream

    async def _relay(self, req: GenerateRequest) -> None:
        """Send the request, then relay its replica's stream into the table, until the final
        delta or a failure (which ends this request only)."""
        rid = req.request_id
        try:
            gen, first = await self._admit(req)
            if isinstance(first, Refusal):
                self._table.admit(rid, first.error())
                return
            self._table.admit(rid, None)
            await self._feed(rid, gen)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - its replica died or the send failed
            logger.warning("request %s lost its replica: %s", rid, brief(e))
            self._table.fail(rid, e if isinstance(e, EngineDeadError) else EngineDeadError(
                f"the replica serving this request failed: {brief(e)}"))
        finally:
            self._calls.pop(rid, None)

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

    async def _feed(self, rid: str, gen: Any) -> None:
        """Replica stream -> the table; cancelling this (the client left) cancels the call,
        which aborts the request in its replica (engine/replicas/deployment.py)."""
        try:
            async for item in gen:
                if isinstance(item, StreamFailed):
                    self._table.fail(rid, EngineDeadError(item.message))
                    return
                assert isinstance(item, RequestOutput)
                self._table.deliver((item,))
                if item.finished:
                    return
            self._table.fail(rid, EngineDeadError("the replica ended the stream early"))
        except asyncio.CancelledError:
            gen.cancel()
            raise

    def _abort(self, request_id: str) -> None:
        """The API closed the stream early, or a submit was refused or cancelled: forget the
        request and cancel its call."""
        self._table.forget(request_id)
        call = self._calls.pop(request_id, None)
        if call is not None:
            call.cancel()

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


def _after(snapshot: EngineSnapshot | None, step: int) -> EngineSnapshot:
    """The snapshot with only the steps after `step` (an empty one before the first)."""
    if snapshot is None:
        return EngineSnapshot()
    return dataclasses.replace(snapshot, steps=tuple(s for s in snapshot.steps if s.step > step))


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
        elif f.name in ("iteration_tokens", "spec_accepted_per_pos"):  # added bucket by bucket
            rows = [v for v in values if v]
            total[f.name] = tuple(map(sum, zip(*rows, strict=True))) if rows else ()
        elif f.name == "memory":  # (kind, bytes) pairs: added kind by kind
            sums: dict[str, int] = {}
            for pairs in values:
                for kind, nbytes in pairs:
                    sums[kind] = sums.get(kind, 0) + nbytes
            total[f.name] = tuple(sums.items())
        elif isinstance(values[0], bool | str):
            total[f.name] = values[0]
        else:
            total[f.name] = sum(values)
    return EngineStats(**total)
