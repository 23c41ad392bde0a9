"""EngineCoreClient: the EngineClient whose engine core runs in a child process
(engine/core/process.py), vLLM v1's AsyncLLM -> EngineCore shape (`--engine-core process`).

The API process keeps the stream tables, the tokenizer for the API's own work (a copy the
core sends once loaded) and the last stats; the core process owns the scheduler, runner and
detokenizer. Messages go over a pipe, MessagePack-encoded by msgspec (engine/core/messages.py):
the event loop writes requests and aborts; a reader thread decodes what the core sends and
hands each message to the event loop with one call_soon_threadsafe.

A core process that dies (killed, out of memory, a crash) ends the pipe: every open stream
raises EngineDeadError and new requests are refused (503), as when the thread's loop dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from engine.client.async_engine import STOP_WAIT_S
from engine.client.client_side import STUCK_AFTER_S, ClientSide
from engine.client.stream_table import StreamTable
from engine.config import EngineConfig
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
    ToCore,
    decode_to_client,
    encode,
    refusal_error,
)
from engine.core.process import run_engine_core
from engine.protocol import (
    EngineDeadError,
    RequestStream,
    ready_unless_ended,
)
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.engine")

KILL_WAIT_S = 5.0  # after STOP_WAIT_S without an exit, terminate; then this long, then kill
# forkserver: each core is forked from a clean server process that has imported the engine
# once (no threads, no OpenMP pool yet), so a core starts without re-importing torch; a fork of
# this process would copy its threads' locks and torch's thread pool mid-use. transformers'
# modeling code is imported lazily at the first load (~6 CPU s here): preloaded too, or every
# core started pays it again.
PRELOAD = ["engine.core.process", "transformers.modeling_utils",
           "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama"]



class EngineCoreClient(ClientSide):
    def __init__(self, config: EngineConfig, *, clock: Callable[[], float] = time.monotonic,
                 stuck_after_s: float = STUCK_AFTER_S) -> None:
        super().__init__(config, clock, stuck_after_s)
        self._table = StreamTable(self._close_stream)  # event-loop thread only
        self._grammars: dict[str, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._closing = False  # shutdown() began: the pipe's end is expected
        self._loaded = asyncio.Event()  # _stopped (ClientSide): the core process is gone
        self._stop_requested = threading.Event()

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the core process and wait until its model is loaded."""
        self._loop = asyncio.get_running_loop()
        if self._stopped.is_set():
            raise EngineDeadError("the engine loop is not running")
        parent, child = multiprocessing.Pipe()
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (the first core)
        # Not a daemon: a daemonic process may not start processes, and the core starts its
        # grammar-compile workers (engine/structured_output/worker.py). shutdown() joins, terminates
        # and then kills it; if this process dies first, the core's reads end and so does it.
        proc = ctx.Process(target=run_engine_core, name="pagedserve-engine-core",
                           args=(self.config, child, logging.getLogger().getEffectiveLevel()),
                           daemon=False)
        await asyncio.to_thread(proc.start)
        child.close()  # only the child holds its end now: its exit ends our reads
        self._proc, self._conn = proc, parent
        threading.Thread(target=self._read, name="pagedserve-core-client", daemon=True).start()
        await self._loaded.wait()
        if self._dead:
            raise EngineDeadError(self._dead)
        self._ready = True
        logger.info("engine ready: %s (engine core in process %d)", self.model_name, proc.pid)

    def run_step_loop(self) -> None:
        """The CLI's main thread waits here until request_stop(): the steps run in the core
        process, which shutdown() stops."""
        self._stop_requested.wait()

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def shutdown(self) -> None:
        self._ready = False
        self._closing = True
        self._loaded.set()  # a start() still waiting for a load that never came
        if self._conn is not None and not self._stopped.is_set():
            self._send(Shutdown())
        await asyncio.to_thread(self._reap)
        self._fail_all(EngineDeadError("server shutting down"))
        self._stopped.set()
        self._stop_requested.set()
        self._stop_tokenizers()

    def _reap(self) -> None:
        """Wait for the core to exit; terminate, then kill, one that does not."""
        proc = self._proc
        if proc is None:
            return
        proc.join(STOP_WAIT_S)
        if proc.is_alive():
            logger.warning("engine core did not exit in %.0f s: terminating it", STOP_WAIT_S)
            proc.terminate()
            proc.join(KILL_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(KILL_WAIT_S)

    @property
    def core_pid(self) -> int | None:
        """The core process's id (tests kill it to see the API survive)."""
        return None if self._proc is None else self._proc.pid

    # ---- requests -------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     priority: int = 0, deadline: float | None = None) -> RequestStream:
        self._check_alive()
        assert self._loop is not None
        stream, admitted = self._table.open(self._loop, request_id)
        if params.structured_outputs is not None:
            self._grammars[request_id] = self._loop.create_future()
        self._send(AddRequest(request_id, list(prompt), params, priority, self._clock(),
                              deadline))
        try:
            await admitted
            grammar = self._grammars.get(request_id)
            # Unless the core ends the request first (deadline, shutdown: the stream holds
            # that end), a spec that does not compile is a 400 before any byte is sent.
            if grammar is not None and await ready_unless_ended(grammar, stream):
                grammar.result()
        except BaseException:  # refused, or the client left while waiting: undo the add
            self._close_stream(request_id)
            raise
        finally:
            self._grammars.pop(request_id, None)
        return stream

    def _close_stream(self, request_id: str) -> None:
        """A stream closed before its end (or a cancelled or refused submit): abort it."""
        self._table.forget(request_id)
        if not self._stopped.is_set():
            self._send(AbortRequest(request_id))

    def _send(self, msg: ToCore) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            with self._send_lock:
                conn.send_bytes(encode(msg))
        except OSError:  # the core is gone: the reader thread reports it
            pass

    # ---- the reader thread and the event-loop side of its messages ------------------------

    def _read(self) -> None:
        """Decode the core's messages until its end; then tell everyone waiting."""
        conn = self._conn
        assert conn is not None
        try:
            while True:
                self._on_loop(self._handle, decode_to_client(conn.recv_bytes()))
        except (EOFError, OSError):
            pass
        proc = self._proc
        if proc is not None:
            proc.join(1.0)  # for its exit code
        code = None if proc is None else proc.exitcode
        self._on_loop(self._core_gone, code)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _handle(self, msg: ToClient) -> None:
        if isinstance(msg, StepDone):
            self._on_step(msg)
        elif isinstance(msg, Admitted):
            self._table.admit(msg.request_id, None if msg.refusal is None
                              else refusal_error(msg.refusal))
        elif isinstance(msg, GrammarDone):
            self._settle(self._grammars.get(msg.request_id), msg)
        elif isinstance(msg, Seen):
            self._looks.answer(msg.look_id, msg.snapshot)
        elif isinstance(msg, Busy):
            self._busy_since = self._clock()
        elif isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, LoadFailed):
            self._dead = msg.reason
            self._loaded.set()

    def _on_ready(self, msg: Ready) -> None:
        self._set_tokenizers(lambda: pickle.loads(msg.tokenizer), msg.eos_token_ids)
        self._limits, self._stats = msg.limits, msg.stats
        self._loaded.set()

    @staticmethod
    def _settle(waiter: asyncio.Future[None] | None, msg: Admitted | GrammarDone) -> None:
        if waiter is None or waiter.done():  # the submit was cancelled meanwhile
            return
        if msg.refusal is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(refusal_error(msg.refusal))

    def _on_step(self, msg: StepDone) -> None:
        self._stats = msg.stats
        self._busy_since = self._clock() if msg.busy else None
        self._stuck_logged = False
        if msg.dead and not self._dead:
            self._dead = msg.dead
        self._table.deliver(msg.outputs)

    def _core_gone(self, exit_code: int | None) -> None:
        self._stopped.set()
        self._loaded.set()
        if self._closing:
            return  # shutdown() fails what is left
        self._dead = self._dead or f"engine core process died (exit code {exit_code})"
        logger.error("%s: the engine is dead", self._dead)
        self._fail_all(EngineDeadError(self._dead))

    def _send_look(self, look_id: int, since_step: int) -> None:
        self._send(Look(look_id, since_step))

    def _fail_all(self, error: BaseException) -> None:
        for waiter in self._grammars.values():
            if not waiter.done():
                waiter.set_exception(error)
        self._table.fail_all(error)
        self._looks.fail_all(error)
