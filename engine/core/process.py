"""The engine core process (vLLM v1's EngineCore shape): scheduler, runner and detokenizer in a
process of their own, so the step loop shares no interpreter lock with the HTTP server.

`run_engine_core` is the child's entry point (engine/client/core_client.py starts it). A reader
thread turns the pipe's messages into an inbox; the main thread runs "drain inbox -> step ->
send the step's deltas and stats" exactly as AsyncEngine's step loop does, and the grammar
compiles wake it through the same inbox: both are engine/core/step_loop.py's StepLoop. The child ignores SIGINT/SIGTERM (the API process
drains and then sends Shutdown) and exits when the API process goes away (the pipe ends).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import queue
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.messages import (
    AbortRequest,
    AddRequest,
    Admitted,
    Busy,
    GrammarDone,
    LoadFailed,
    Look,
    Ready,
    Seen,
    Shutdown,
    StepDone,
    ToClient,
    decode_to_core,
    encode,
    refusal_info,
)
from engine.core.step_loop import StepLoop
from engine.outputs import RequestOutput
from engine.structured_output.manager import param_error
from scheduler.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagedserve.engine")


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A request's grammar compile ended (on a compile thread)."""

    request_id: str
    so: StructuredOutputsParams
    future: concurrent.futures.Future  # type: ignore[type-arg]


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


class EngineCore(StepLoop):
    """The core's step loop: messages come from the pipe (a reader thread feeds the inbox),
    each step's deltas and stats go back down it."""

    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        super().__init__(engine, queue.Queue())
        self._conn = conn
        self._idle = True  # no step since the last one that left nothing runnable

    def run(self) -> None:
        threading.Thread(target=self._read, name="pagedserve-core-reader", daemon=True).start()
        try:
            super().run()
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

    # ---- StepLoop's hooks ---------------------------------------------------------------

    def is_stop(self, msg: Any) -> bool:
        return isinstance(msg, Shutdown)

    def idle(self) -> None:
        self._send_step([])  # only aborts arrived: the stats changed, no step

    def step_started(self) -> None:
        if self._idle:
            self._send(Busy())
            self._idle = False

    def stepped(self, outputs: list[RequestOutput]) -> None:
        self._send_step(outputs)

    def _send_step(self, outputs: list[RequestOutput]) -> None:
        busy = self.engine.has_runnable()
        self._idle = not busy
        self._send(StepDone(outputs, self.stats(), busy, self.dead))

    def apply(self, msg: AddRequest | AbortRequest | Look | _Compiled) -> None:
        if isinstance(msg, AbortRequest):
            self.engine.abort_request(msg.request_id)
        elif isinstance(msg, Look):
            self._send(Seen(msg.look_id, self.engine.snapshot(msg.since_step)))
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
