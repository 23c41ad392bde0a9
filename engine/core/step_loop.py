"""StepLoop: "drain the inbox -> step -> report", the engine thread's loop, written once for
both drivers: AsyncEngine (the loop on a thread of the server process) and EngineCore (the
loop in a process of its own, engine/core/process.py). A driver says what its messages do and
where a step's results go; the loop owns the order of things, the drain rate behind
Retry-After and the rule that declares the engine dead.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from engine.core.drain import DrainRate
from engine.core.llm_engine import LLMEngine
from engine.outputs import ErrorCode, RequestOutput
from engine.protocol import EngineStats

_log = logging.getLogger("pagedserve.engine")

MAX_CONSECUTIVE_FAILURES = 3  # failed steps no request explains, in a row: the engine is dead
IDLE_WAKE_S = 1.0  # an idle loop still wakes this often (deadlines, a lost wake-up)


class StepLoop:
    """Single-threaded: run() is called from the thread (or process) that owns `engine`."""

    def __init__(self, engine: LLMEngine, inbox: queue.Queue[Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self._inbox = inbox
        self._clock = clock
        self._drain = DrainRate()
        self.dead: str | None = None  # why the engine is declared dead, once it is

    # ---- what a driver says -------------------------------------------------------------

    def apply(self, msg: Any) -> None:
        """One inbox message (an add, an abort, a wake-up...)."""
        raise NotImplementedError

    def is_stop(self, msg: Any) -> bool:
        """Whether `msg` ends the loop (None always does)."""
        return False

    def idle(self) -> None:
        """Messages were applied but nothing is left to run (the stats changed)."""

    def step_started(self) -> None: ...

    def step_ended(self) -> None:
        """After every step, also one that raised out of LLMEngine.step."""

    def stepped(self, outputs: list[RequestOutput]) -> None:
        """A step's deltas, once the loop has counted them (and `dead` is up to date)."""

    # ---- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        # Block on the inbox while nothing can run (idle, or only compiles pending: a wake-up
        # comes when one ends); a step with only compiles pending just installs grammars.
        while self._drain_inbox(block=not self.engine.has_runnable()):
            if not self.engine.has_unfinished():
                self.idle()
                continue
            self.step_started()
            try:
                # A failed step does not raise: its requests get final outputs with an error.
                outputs = self.engine.step()
            finally:
                self.step_ended()
            self._drain.record(self._clock(), sum(o.finished for o in outputs))
            self._check_failures(outputs)  # before the driver delivers: a client sees it dead
            self.stepped(outputs)

    def stats(self) -> EngineStats:
        """The engine's stats with the drain rate (finished requests per second)."""
        return dataclasses.replace(self.engine.stats(),
                                   finish_rate=self._drain.rate(self._clock()))

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued messages; when idle, wait for one. False = stop."""
        try:
            msg = self._inbox.get(timeout=IDLE_WAKE_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if msg is None or self.is_stop(msg):
                return False
            self.apply(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _check_failures(self, outputs: list[RequestOutput]) -> None:
        """LLMEngine ended a failed step's requests and logged it ("engine step failed (N in a
        row)"); after MAX_CONSECUTIVE_FAILURES in a row the engine is declared dead."""
        failures = self.engine.consecutive_failures
        if failures >= MAX_CONSECUTIVE_FAILURES and self.dead is None:
            error = next((o.error for o in outputs if o.error_code == ErrorCode.STEP_FAILED),
                         None)
            self.dead = f"engine loop died: {failures} steps failed in a row ({error})"
            _log.error("%s: the engine is dead", self.dead)

