"""Looks: the live view's snapshots a client has asked its engine for and not yet received
(event-loop thread only). The engine answers each between two steps; whatever ends the engine
fails the ones still waiting, so a viewer never hangs."""

from __future__ import annotations

import asyncio
import itertools

from engine.snapshot import EngineSnapshot


class Looks:
    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future[EngineSnapshot]] = {}
        self._ids = itertools.count(1)

    def ask(self, loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Future[EngineSnapshot]]:
        """A new look's id (sent to the engine with it) and the future its answer settles."""
        look_id = next(self._ids)
        answer: asyncio.Future[EngineSnapshot] = loop.create_future()
        self._waiting[look_id] = answer
        return look_id, answer

    def answer(self, look_id: int, snapshot: EngineSnapshot | None) -> None:
        """The engine's answer; None: building the snapshot failed (the engine logged why)."""
        waiting = self._waiting.pop(look_id, None)
        if waiting is None or waiting.done():  # the viewer has left
            return
        if snapshot is None:
            waiting.set_exception(RuntimeError("the engine could not build the live view"))
        else:
            waiting.set_result(snapshot)

    def forget(self, look_id: int) -> None:
        self._waiting.pop(look_id, None)

    def fail_all(self, error: BaseException) -> None:
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(error)
        self._waiting.clear()
