"""AsyncEngine: the LLMEngine's step loop on a thread of the caller's choosing, spoken to from
asyncio (the EngineClient).

One thread runs "drain inbox -> step()" until shutdown: whichever thread calls
`run_step_loop()` (the CLI's main thread, with HTTP on another; tests start a thread for
it the same way). Requests and aborts reach it through a thread-safe inbox; admissions and
each request's deltas come back to the event loop with one call_soon_threadsafe per step.
Closing a RequestStream early (a client disconnect) aborts its request, so its KV blocks are
freed at the next step. Tokenizer work for the API runs on a tokenizer thread of its own,
never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.client.client_side import STUCK_AFTER_S, ClientSide
from engine.client.stream_table import StreamTable
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.step_loop import StepLoop
from engine.outputs import RequestOutput
from engine.protocol import (
    EngineDeadError,
    RequestStream,
    ready_unless_ended,
)
from engine.structured_output.manager import GrammarFuture, param_error, settled_on
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.engine")

# shutdown() waits this long for the current step to end: the drain before it has already
# given requests --shutdown-timeout, and a step that takes longer is hung or compiling.
STOP_WAIT_S = 3.0


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    deadline: float | None


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Wake:
    """A grammar compile finished: a loop idling on its inbox steps again."""


@dataclass(frozen=True, slots=True)
class _Look:
    """The live view asks for a snapshot (answered between two steps)."""

    look_id: int
    since_step: int


class AsyncEngine(ClientSide):
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 stuck_after_s: float = STUCK_AFTER_S) -> None:
        super().__init__(config, clock, stuck_after_s)
        self.engine = engine if engine is not None else LLMEngine(config)
        self._inbox: queue.Queue[_Add | _Abort | _Wake | _Look | None] = queue.Queue()
        # Event-loop thread only: open streams, and submits waiting for their admission.
        self._table = StreamTable(self._close_stream)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._looping = threading.Event()  # run_step_loop() was called
        self._loaded = threading.Event()  # the model is loaded (or failed to)

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Wait until run_step_loop() (on another thread) has loaded the model."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._loaded.wait)
        if self._dead:
            raise EngineDeadError(self._dead)
        if self._stopped.is_set():
            raise EngineDeadError("the engine loop is not running")
        self._ready = True
        logger.info("engine ready: %s", self.model_name)

    def run_step_loop(self) -> None:
        """Load the model and run the step loop on the calling thread until shutdown().

        The CLI calls this from the main thread and serves HTTP from another: on this host
        torch ran the same steps 1.4-1.5x faster from the main thread than from a thread
        started later (OpenMP, 2 threads; measured, cause not pinned down)."""
        self._looping.set()
        try:
            self._load()
        except Exception:  # noqa: BLE001 - start() reports it; the server stays up to say so
            self._stopped.set()  # nothing runs: shutdown() must not wait for a step
            return
        finally:
            self._loaded.set()
        self._run()

    def request_stop(self) -> None:
        """Thread-safe: end the step loop after the current step (the HTTP side is gone)."""
        self._inbox.put(None)

    def _load(self) -> None:
        try:
            self.engine.load()
        except Exception as e:
            self._dead = f"model failed to load: {e}"
            logger.exception("model failed to load")
            raise
        tok = self.engine.tokenizer
        # HF fast tokenizers are not safe to share across threads: the API gets its own.
        self._set_tokenizers(lambda: copy.deepcopy(tok.hf), tok.eos_token_ids)
        self._limits = self.engine.limits
        self._stats = self.engine.stats()

    async def shutdown(self) -> None:
        self._ready = False
        if self._looping.is_set():
            self.request_stop()
            await asyncio.to_thread(self._stopped.wait, STOP_WAIT_S)
        self._loaded.set()  # a start() still waiting for a load that never came
        self._table.fail_all(EngineDeadError("server shutting down"))
        self._looks.fail_all(EngineDeadError("server shutting down"))
        self._stopped.set()  # also when the loop never ran: no more tokenizer work either
        self._stop_tokenizers()

    # ---- requests (event-loop side) -------------------------------------------------------

    async def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                     priority: int = 0, deadline: float | None = None) -> RequestStream:
        self._check_alive()
        assert self._loop is not None  # set by start(), which _check_alive saw finish
        stream, admitted = self._table.open(self._loop, request_id)
        try:
            grammar = self._start_compile(params)
        except BaseException:
            self._table.forget(request_id)
            raise
        self._inbox.put(_Add(request_id, prompt, params, priority, self._clock(), deadline))
        try:
            await admitted
        except asyncio.CancelledError:  # the client left while waiting: undo the add
            self._close_stream(request_id)
            raise
        except BaseException:
            self._table.forget(request_id)
            raise
        if grammar is not None:
            await self._await_grammar(request_id, params, grammar, stream)
        return stream

    def _start_compile(self, params: SamplingParams) -> GrammarFuture | None:
        """Start (or find cached) the compile of the request's grammar, off the step loop."""
        so = params.structured_outputs
        if so is None:
            return None
        grammar = self.engine.structured.compile(so)  # InvalidParamError if unavailable
        if not grammar.done():
            grammar.add_done_callback(lambda _: self._inbox.put(_Wake()))
        return grammar

    async def _await_grammar(self, request_id: str, params: SamplingParams,
                             grammar: GrammarFuture, stream: RequestStream) -> None:
        """The sequence waits in the scheduler while its grammar compiles; a spec that does
        not compile is a 400 naming its field before the caller sends any byte. If the engine
        ends the request first (deadline, shutdown) the stream, which holds that end, is
        returned at once; a caller that is cancelled (its client left) aborts the request,
        which leaves the scheduler's queue, and abandons the compile (other requests may
        share it; the daemon pool never waits for it at exit)."""
        so = params.structured_outputs
        assert so is not None and self._loop is not None
        try:
            if not await ready_unless_ended(settled_on(self._loop, grammar), stream):
                return
        except asyncio.CancelledError:
            self._close_stream(request_id)
            raise
        error = grammar.exception()
        if error is not None:  # GrammarError: the engine ends the request too
            self._close_stream(request_id)
            raise param_error(so, error) from None

    def _close_stream(self, request_id: str) -> None:
        """A stream closed before its end (or a cancelled submit): abort the request."""
        self._table.forget(request_id)
        self._inbox.put(_Abort(request_id))

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        """The step loop. Whatever ends it, every waiting client is told (never a hang)."""
        reason = "server shutting down"
        try:
            _EngineThread(self).run()
        except BaseException as e:
            logger.exception("engine loop crashed")
            self._dead = reason = f"engine loop crashed: {e}"
        finally:
            self._stopped.set()  # before telling clients: a submit after this is refused
            try:
                for request_id in list(self.engine.requests):  # free everything
                    self.engine.abort_request(request_id)
            finally:  # even if the engine's state is too broken to abort: nobody may hang
                self._on_loop(self._table.fail_all, EngineDeadError(reason))
                self._on_loop(self._looks.fail_all, EngineDeadError(reason))

    def _send_look(self, look_id: int, since_step: int) -> None:
        self._inbox.put(_Look(look_id, since_step))

    def _apply(self, cmd: _Add | _Abort | _Wake | _Look) -> None:
        """One inbox message, on the engine thread."""
        if isinstance(cmd, _Wake):
            return
        if isinstance(cmd, _Look):
            self._on_loop(self._looks.answer, cmd.look_id, self.engine.snapshot(cmd.since_step))
            return
        if isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_id)  # its stream is closed: nobody listens
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority,
                                    cmd.arrival_time, cmd.deadline)
        except Exception as e:  # noqa: BLE001 - PromptTooLongError, QueueFullError... -> submit()
            self._on_loop(self._table.admit, cmd.request_id, e)
        else:
            self._on_loop(self._table.admit, cmd.request_id, None)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn(*args) on the event loop's thread, which owns the stream tables."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody waits
                self._loop.call_soon_threadsafe(fn, *args)

    # ---- event-loop side of the engine thread's messages ----------------------------------

class _EngineThread(StepLoop):
    """AsyncEngine's step loop: its inbox, its stats, its stuck-step clock; deltas go back to
    the event loop, which owns the stream tables."""

    def __init__(self, owner: AsyncEngine) -> None:
        super().__init__(owner.engine, owner._inbox, owner._clock)
        self.owner = owner

    def apply(self, msg: Any) -> None:
        self.owner._apply(msg)

    def idle(self) -> None:
        self.owner._stats = self.stats()  # idle, or only aborts arrived: no step

    def step_started(self) -> None:
        self.owner._busy_since = self._clock()

    def step_ended(self) -> None:
        self.owner._busy_since = None
        self.owner._stuck_logged = False

    def stepped(self, outputs: list[RequestOutput]) -> None:
        owner = self.owner
        owner._stats = self.stats()
        if self.dead is not None and owner._dead is None:
            owner._dead = self.dead
        if outputs:
            owner._on_loop(owner._table.deliver, outputs)
