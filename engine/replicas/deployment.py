"""EngineReplica: one replica of the engine deployment. It owns an AsyncEngine (its step loop
on a thread of the replica's) and so its own KV pool, and streams each request's deltas back
to the ingress through Ray.

A request's stream: first Admitted or a Refusal, then RequestOutput deltas, the last one
finished (or StreamFailed when the engine ended it without one). The ingress cancelling the
stream (its client left) cancels the generator here, whose `aclosing` aborts the request, so
its KV blocks are freed at the next step, exactly as in the single-process server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import ray
from ray import serve

from engine.config import EngineConfig
from engine.protocol import ChatTemplateArgs, EngineDeadError
from engine.replicas.board import REPORT_PERIOD_S
from engine.replicas.loopback import keep_replica_on_loopback
from engine.replicas.messages import (
    Admitted,
    GenerateRequest,
    Refusal,
    ReplicaReport,
    StreamFailed,
    refusal_of,
)
from engine.snapshot import SINGLE_ENGINE, EngineSnapshot

if TYPE_CHECKING:
    from engine.client.async_engine import AsyncEngine

logger = logging.getLogger("pagedserve.replica")

REPORTED_STEPS = 256  # steps in a watched report: more than a report period's worth

StreamItem = Admitted | Refusal | StreamFailed | Any  # Any: engine.outputs.RequestOutput


class EngineReplica:
    """Serve builds one per replica (`serve.deployment(EngineReplica)`, see
    api/replicas/launch.py). The constructor returns once the model is loaded, so Serve
    counts the replica as running only when it can serve."""

    async def __init__(self, config: EngineConfig, board: Any) -> None:  # type: ignore[misc]
        from engine.client.async_engine import AsyncEngine  # torch loads here, in the replica only

        keep_replica_on_loopback()

        self._engine: AsyncEngine = AsyncEngine(config)
        self._loop_thread = threading.Thread(target=self._engine.run_step_loop,
                                             name="pagedserve-engine", daemon=True)
        self._loop_thread.start()
        await self._engine.start()  # EngineDeadError when the model cannot load: Serve retries
        self._replica = serve.get_replica_context().replica_id.unique_id
        self._actor_name = ray.get_runtime_context().get_actor_name() or ""
        self._board = board
        self._reporter = asyncio.create_task(self._report_forever())
        logger.info("replica %s ready: %s", self._replica, self._engine.model_name)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamItem]:
        """Admit one request and stream its deltas (see the module docstring)."""
        try:
            stream = await self._engine.submit(req.request_id, req.prompt, req.params,
                                               req.priority, req.deadline())
        except Exception as e:
            refusal = refusal_of(e)
            if refusal is None:
                raise
            yield refusal
            return
        yield Admitted(self._replica)
        async with contextlib.aclosing(stream):
            try:
                async for out in stream:
                    yield out
            except EngineDeadError as e:
                yield StreamFailed(str(e))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._engine.tokenize(text, add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._engine.detokenize(token_ids)

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  args: ChatTemplateArgs | None = None) -> str:
        return await self._engine.apply_chat_template(messages, args)

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s: a dead or stuck engine loop fails
        it, and Serve replaces the replica."""
        if not self._engine.is_ready():
            raise RuntimeError("the engine loop is dead or stuck")

    def report(self, snapshot: EngineSnapshot | None = None) -> ReplicaReport:
        e = self._engine
        return ReplicaReport(self._replica, e.model_name, self._actor_name, e.is_ready(),
                             e.stats(), e.limits, time.time(), snapshot)

    async def _report_forever(self) -> None:
        watched = False
        while True:
            snapshot = await self._snapshot() if watched else None
            try:  # the board answers whether the live view is watched
                watched = await self._board.post.remote(self.report(snapshot))
            except Exception:  # noqa: BLE001 - the board is gone (shutdown): keep serving
                watched = False
            await asyncio.sleep(REPORT_PERIOD_S)

    async def _snapshot(self) -> EngineSnapshot | None:
        """The live view's snapshot with the last REPORTED_STEPS steps (None: engine gone)."""
        since = max(0, self._engine.stats().num_steps - REPORTED_STEPS)
        try:
            [view] = await self._engine.live_view({SINGLE_ENGINE: since})
        except Exception:  # noqa: BLE001 - engine gone, or the snapshot failed (logged)
            return None
        return view.snapshot

    async def __del__(self) -> None:
        """Serve's graceful shutdown (after in-flight requests drained or the timeout)."""
        self._reporter.cancel()
        self._board.remove.remote(self._replica)
        await self._engine.shutdown()
        await asyncio.to_thread(self._loop_thread.join, 10.0)
