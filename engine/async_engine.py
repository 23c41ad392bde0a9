"""AsyncEngine: the LLMEngine on its own thread, spoken to from asyncio (the EngineClient).

One engine thread runs "drain inbox -> step()" until shutdown: a thread start() spawns, or
the caller's own thread in run_step_loop() (the CLI's main thread, HTTP then runs on another). Requests and aborts reach it through
a thread-safe inbox; each request's deltas come back to the event loop on its own
asyncio.Queue (delivered with one call_soon_threadsafe per step). A request whose consumer
goes away (client disconnect closes the async generator) is aborted in `finally`, so its KV
blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.drain import DrainRate
from engine.llm_engine import LLMEngine
from engine.outputs import ErrorCode, RequestOutput
from engine.protocol import EngineDeadError, EngineLimits, EngineStats, QueueFullError
from engine.tokenizer import Tokenizer
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.engine")

STUCK_AFTER_S = 120.0  # a step running longer than this makes /health fail
MAX_CONSECUTIVE_FAILURES = 3  # then the engine is declared dead


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    deadline: float | None
    out: asyncio.Queue[RequestOutput | BaseException]


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None, *,
                 step_loop_on_caller: bool = False) -> None:
        self.config = config
        self.engine = engine if engine is not None else LLMEngine(config)
        self.model_name = config.served_model_name or default_model_name(config.model)
        self._inbox: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tokenizer: Tokenizer | None = None  # a copy for the event-loop thread
        self._limits: EngineLimits | None = None  # set once loaded
        self._stats = EngineStats()
        self._ready = False
        self._dead: str | None = None
        self._busy_since: float | None = None
        self._stuck_logged = False
        self._drain = DrainRate()  # engine thread only
        self._step_loop_on_caller = step_loop_on_caller
        self._loaded = threading.Event()  # the model is loaded (or failed to)
        self._stopped = threading.Event()  # the step loop has ended

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model and start the step loop on a thread of its own; with
        step_loop_on_caller=True, wait instead for run_step_loop() (another thread) to do so."""
        self._loop = asyncio.get_running_loop()
        if self._step_loop_on_caller:
            await asyncio.to_thread(self._loaded.wait)
            if self._dead:
                raise EngineDeadError(self._dead)
        else:
            await asyncio.to_thread(self._load)
            self._thread = threading.Thread(target=self._run, name="pagedserve-engine",
                                            daemon=True)
            self._thread.start()
        self._ready = True
        logger.info("engine ready: %s", self.model_name)

    def run_step_loop(self) -> None:
        """Load the model and run the step loop on the calling thread until shutdown().

        The CLI calls this from the main thread and serves HTTP from another: on this host
        torch ran the same steps 1.4-1.5x faster from the main thread than from a thread
        started later (OpenMP, 2 threads; measured, cause not pinned down)."""
        assert self._step_loop_on_caller, "construct with step_loop_on_caller=True"
        self._thread = threading.current_thread()
        try:
            self._load()
        except Exception:  # noqa: BLE001 - start() reports it; the server stays up to say so
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
        self._tokenizer = Tokenizer(copy.deepcopy(tok.hf), tok.eos_token_ids)
        self._limits = self.engine.limits
        self._stats = self.engine.stats()

    async def shutdown(self) -> None:
        self._ready = False
        if self._thread is not None:
            self.request_stop()
            await asyncio.to_thread(self._stopped.wait, 30)
        self._loaded.set()  # a start() still waiting for a load that never came
        for q in self._queues.values():
            q.put_nowait(EngineDeadError("server shutting down"))

    def is_ready(self) -> bool:
        if not self._ready or self._dead or self._thread is None or not self._thread.is_alive():
            return False
        busy = self._busy_since
        stuck = busy is not None and time.monotonic() - busy >= STUCK_AFTER_S
        if stuck and not self._stuck_logged:
            self._stuck_logged = True  # once per stuck step: /health is polled often
            logger.error("engine step running for %.0f s (limit %.0f s): /health answers 503 "
                         "until it returns", time.monotonic() - (busy or 0.0), STUCK_AFTER_S)
        return not stuck

    # ---- requests (event-loop side) -------------------------------------------------------

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0,
                       deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        out: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = out
        self._inbox.put(_Add(request_id, prompt, params, priority, time.monotonic(), deadline,
                             out))
        finished = False
        try:
            while not finished:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._inbox.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        if self._thread is not None and not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        if not self._ready:
            raise EngineDeadError("the engine is not ready (model still loading)")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        self.engine.check_token_ids("tokens", token_ids)
        return self._tok.decode(token_ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        return self._tok.apply_chat_template(messages, add_generation_prompt)

    @property
    def _tok(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineDeadError("the engine is not ready (model still loading)")
        return self._tokenizer

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def limits(self) -> EngineLimits | None:
        """The engine's limits once the model is loaded; None before."""
        return self._limits

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread. Whatever ends it, every waiting client is told (never a hang)."""
        reason: BaseException = EngineDeadError("server shutting down")
        try:
            self._loop_steps()
        except BaseException as e:
            logger.exception("engine loop crashed")
            self._dead = f"engine loop crashed: {e}"
            reason = EngineDeadError(self._dead)
        finally:
            for request_id in list(self.engine.requests):  # free everything
                self.engine.abort_request(request_id)
            self._fail_on_loop(None, reason)
            self._stopped.set()

    def _loop_steps(self) -> None:
        while self._drain_inbox(block=not self.engine.has_unfinished()):
            if not self.engine.has_unfinished():
                self._stats = self.engine.stats()  # idle, or only aborts arrived: no step
                continue
            self._busy_since = time.monotonic()
            try:
                # A failed step does not raise: its requests get final outputs with an error.
                outputs = self.engine.step()
            finally:
                self._busy_since = None
                self._stuck_logged = False
            self._drain.record(time.monotonic(), sum(o.finished for o in outputs))
            self._stats = self.engine.stats()
            self._check_failures(outputs)  # before delivering: a failed client sees it dead
            if outputs:
                self._deliver(outputs)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds/aborts; when idle, wait for work. False = shut down."""
        try:
            cmd = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is None:
                return False
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            final = self.engine.abort_request(cmd.request_id)
            if final is not None:
                self._deliver([final])
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority,
                                    cmd.arrival_time, cmd.deadline)
        except QueueFullError as e:
            e.retry_after_s = self._drain.retry_after_s(time.monotonic(),
                                                        self.engine.scheduler.num_waiting)
            self._send(cmd.out, e)
            return
        except Exception as e:  # noqa: BLE001 - PromptTooLongError, QueueFullError, ValueError... -> the caller
            self._send(cmd.out, e)
            return
        # An empty delta says "accepted": the API can start the response (and learn of
        # admission errors) without waiting for the first token.
        self._deliver([RequestOutput(cmd.request_id, (), "")])

    def _check_failures(self, outputs: list[RequestOutput]) -> None:
        """LLMEngine ended a failed step's requests and logged it ("engine step failed (N in a
        row)"); after MAX_CONSECUTIVE_FAILURES in a row the engine is declared dead."""
        failures = self.engine.consecutive_failures
        if failures >= MAX_CONSECUTIVE_FAILURES and not self._dead:
            error = next((o.error for o in outputs if o.error_code == ErrorCode.STEP_FAILED),
                         None)
            self._dead = f"engine loop died: {failures} steps failed in a row ({error})"
            logger.error("%s: the engine is dead", self._dead)

    def _fail_on_loop(self, request_ids: list[str] | None, error: BaseException) -> None:
        """Send `error` to these requests' queues (None: all), on the event loop's thread,
        which owns the queue table."""
        def fail() -> None:
            ids = list(self._queues) if request_ids is None else request_ids
            for request_id in ids:
                q = self._queues.get(request_id)
                if q is not None:
                    q.put_nowait(error)

        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody waits
                self._loop.call_soon_threadsafe(fail)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)

    def _send(self, q: asyncio.Queue[RequestOutput | BaseException], item: BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(q.put_nowait, item)



def default_model_name(model: str | None) -> str:
    """The id served in /v1/models when --served-model-name is not given."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else (p.name if p.exists() else model)
