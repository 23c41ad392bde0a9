"""The engine core process (vLLM v1's EngineCore shape): scheduler, runner and detokenizer in a
process of their own, so the step loop shares no interpreter lock with the HTTP server.

`run_engine_core` is the child's entry point (engine/core_client.py starts it). A reader
thread turns the pipe's messages into an inbox; the main thread runs "drain inbox -> step ->
send the step's deltas and stats" exactly as AsyncEngine's step loop does, and the grammar
compiles wake it through the same inbox. The child ignores SIGINT/SIGTERM (the API process
drains and then sends Shutdown) and exits when the API process goes away (the pipe ends).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import pickle
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.async_engine import MAX_CONSECUTIVE_FAILURES
from engine.config import EngineConfig
from engine.core_messages import (
    AbortRequest,
    AddRequest,
    Admitted,
    Busy,
    GrammarDone,
    LoadFailed,
    Ready,
    Shutdown,
    StepDone,
    ToClient,
    decode_to_core,
    encode,
    refusal_info,
)
from engine.drain import DrainRate
from engine.llm_engine import LLMEngine
from engine.outputs import ErrorCode, RequestOutput
from engine.structured import param_error
from scheduler.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagedserve.engine")


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A request's grammar compile ended (on a compile thread)."""

    request_id: str
    so: StructuredOutputsParams
    future: concurrent.futures.Future  # type: ignore[type-arg]


_Inbox = queue.Queue[AddRequest | AbortRequest | Shutdown | _Compiled | None]


def run_engine_core(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The child process: load, say Ready (or LoadFailed), then step until Shutdown."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the API process decides when the core stops
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    logger.info("engine core process %d started", os.getpid())
    engine = LLMEngine(config)
    try:
        engine.load()
    except Exception as e:  # the API process reports it and stays up
        logger.exception("model failed to load")
        conn.send_bytes(encode(LoadFailed(f"model failed to load: {e}")))
        return
    tok = engine.tokenizer
    conn.send_bytes(encode(Ready(engine.limits, engine.stats(), pickle.dumps(tok.hf),
                                 sorted(tok.eos_token_ids))))
    EngineCore(engine, conn).run()


class EngineCore:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self._conn = conn
        self._inbox: _Inbox = queue.Queue()
        self._drain = DrainRate()
        self._dead: str | None = None
        self._idle = True  # no step since the last one that left nothing runnable

    def run(self) -> None:
        threading.Thread(target=self._read, name="pagedserve-core-reader", daemon=True).start()
        try:
            self._loop_steps()
        finally:
            for request_id in list(self.engine.requests):  # free everything
                self.engine.abort_request(request_id)

    def _read(self) -> None:
        """Pipe -> inbox; the end of the pipe (the API process is gone) stops the loop."""
        try:
            while True:
                msg = decode_to_core(self._conn.recv_bytes())
                self._inbox.put(msg)
                if isinstance(msg, Shutdown):
                    return
        except (EOFError, OSError):
            self._inbox.put(None)

    def _send(self, msg: ToClient) -> None:
        self._conn.send_bytes(encode(msg))

    def _loop_steps(self) -> None:
        while self._drain_inbox(block=not self.engine.has_runnable()):
            if not self.engine.has_unfinished():
                self._send_step([])  # only aborts arrived: the stats changed, no step
                continue
            if self._idle:
                self._send(Busy())
                self._idle = False
            outputs = self.engine.step()  # a failed step ends its requests, does not raise
            self._drain.record(time.monotonic(), sum(o.finished for o in outputs))
            self._check_failures(outputs)
            self._send_step(outputs)

    def _send_step(self, outputs: list[RequestOutput]) -> None:
        busy = self.engine.has_runnable()
        self._idle = not busy
        stats = dataclasses.replace(self.engine.stats(),
                                    finish_rate=self._drain.rate(time.monotonic()))
        self._send(StepDone(outputs, stats, busy, self._dead))

    def _check_failures(self, outputs: list[RequestOutput]) -> None:
        """As AsyncEngine: so many failed steps in a row and the engine is declared dead."""
        failures = self.engine.consecutive_failures
        if failures >= MAX_CONSECUTIVE_FAILURES and not self._dead:
            error = next((o.error for o in outputs if o.error_code == ErrorCode.STEP_FAILED),
                         None)
            self._dead = f"engine loop died: {failures} steps failed in a row ({error})"
            logger.error("%s: the engine is dead", self._dead)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued messages; when idle, wait for one. False = shut down."""
        try:
            msg = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if msg is None or isinstance(msg, Shutdown):
                return False
            self._apply(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, msg: AddRequest | AbortRequest | _Compiled) -> None:
        if isinstance(msg, AbortRequest):
            self.engine.abort_request(msg.request_id)
        elif isinstance(msg, _Compiled):
            error = msg.future.exception()
            refusal = None if error is None else refusal_info(param_error(msg.so, error))
            self._send(GrammarDone(msg.request_id, refusal))
        else:
            self._add(msg)

    def _add(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(msg.request_id, msg.prompt, msg.params, msg.priority,
                                    msg.arrival_time, msg.deadline)
        except Exception as e:  # noqa: BLE001 - PromptTooLongError, QueueFullError... -> submit()
            self._send(Admitted(msg.request_id, refusal_info(e)))
            return
        self._send(Admitted(msg.request_id))
        so = msg.params.structured_outputs
        if so is not None:  # the compile add_request started (a cache hit is done already)
            future = self.engine.structured.compile(so)
            future.add_done_callback(
                lambda f: self._inbox.put(_Compiled(msg.request_id, so, f)))
