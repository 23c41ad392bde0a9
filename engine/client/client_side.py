"""The API-process half every EngineClient shares, whichever way it reaches its step loop
(AsyncEngine: a thread here; EngineCoreClient: a child process): readiness and the stuck-step
/health rule, the alive check before a submit, the latest stats and limits, and tokenizer
work on a tokenizer thread of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from engine.client.looks import Looks
from engine.config import EngineConfig
from engine.protocol import (
    ChatTemplateArgs,
    EngineDeadError,
    EngineLimits,
    EngineStats,
    EngineView,
    check_token_ids,
)
from engine.snapshot import SINGLE_ENGINE
from engine.tokenizer import Tokenizer

logger = logging.getLogger("pagedserve.engine")

STUCK_AFTER_S = 120.0  # a step running longer than this makes /health fail
BULK_TEXT_CHARS = 64 * 1024  # longer texts are tokenized on the bulk lane (see ClientSide)

T = TypeVar("T")


def default_model_name(model: str | None) -> str:
    """The id served in /v1/models when --served-model-name is not given."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else (p.name if p.exists() else model)


class ClientSide:
    """State the subclass's step-loop side fills in: _tokenizer, _limits, _stats once loaded,
    _ready, _dead, _busy_since while a step runs, _stopped when the loop is gone."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                 stuck_after_s: float = STUCK_AFTER_S) -> None:
        self.config = config
        self.model_name = config.served_model_name or default_model_name(config.model)
        self._clock = clock  # time.monotonic unless a test drives it
        self._stuck_after_s = stuck_after_s
        # Two lanes, one thread and one tokenizer copy each (an HF tokenizer must not be used
        # by two threads at once): texts up to BULK_TEXT_CHARS on one, longer ones on the
        # other, so five 4 MB prompts (~17 s of encoding) queue behind each other, not ahead
        # of every ordinary request.
        self._tok_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagedserve-tokenizer")
        self._bulk_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagedserve-tokenizer-bulk")
        self._tokenizer: Tokenizer | None = None  # the tokenizer thread's own copy
        self._bulk_tokenizer: Tokenizer | None = None  # the bulk thread's own copy
        self._limits: EngineLimits | None = None  # set once loaded
        self._stats = EngineStats()
        self._ready = False
        self._dead: str | None = None  # why the engine can serve no more (load, crash, failures)
        self._busy_since: float | None = None
        self._stuck_logged = False
        self._stopped = threading.Event()  # the step loop has ended (or never will run)
        self._looks = Looks()  # live-view snapshots asked for (event-loop thread only)

    def is_ready(self) -> bool:
        if not self._ready or self._dead or self._stopped.is_set():
            return False
        busy = self._busy_since
        stuck = busy is not None and self._clock() - busy >= self._stuck_after_s
        if stuck and not self._stuck_logged:
            self._stuck_logged = True  # once per stuck step: /health is polled often
            logger.error("engine step running for %.0f s (limit %.0f s): /health answers 503 "
                         "until it returns", self._clock() - (busy or 0.0), self._stuck_after_s)
        return not stuck

    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        if self._stopped.is_set():
            raise EngineDeadError("the engine loop is not running")
        if not self._ready:
            raise EngineDeadError("the engine is not ready (model still loading)")

    def stats(self) -> EngineStats:
        return self._stats

    async def live_view(self, since: dict[str, int]) -> list[EngineView]:
        """One view: this engine's stats and its snapshot, built by the step loop between two
        steps (`_send_look` asks; the loop's answer settles the look)."""
        self._check_alive()
        look_id, answer = self._looks.ask(asyncio.get_running_loop())
        try:
            self._send_look(look_id, since.get(SINGLE_ENGINE, 0))
            snapshot = await answer
        finally:
            self._looks.forget(look_id)
        return [EngineView(SINGLE_ENGINE, self._stats, snapshot)]

    def _send_look(self, look_id: int, since_step: int) -> None:
        """Ask the step loop for a snapshot; it answers with self._looks.answer(look_id, ..)
        on the event loop's thread."""
        raise NotImplementedError

    @property
    def limits(self) -> EngineLimits | None:
        """The engine's limits once the model is loaded; None before."""
        return self._limits

    # ---- tokenizer work -------------------------------------------------------------------

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._on_tokenizer(lambda tok: tok.encode(text, add_special_tokens),
                                        bulk=len(text) > BULK_TEXT_CHARS)

    async def detokenize(self, token_ids: list[int]) -> str:
        if self._limits is not None:  # before the load, _on_tokenizer refuses anyway
            check_token_ids("tokens", token_ids, self._limits.vocab_size)
        return await self._on_tokenizer(lambda tok: tok.decode(token_ids,
                                                               skip_special_tokens=False),
                                        bulk=len(token_ids) > BULK_TEXT_CHARS // 4)

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  args: ChatTemplateArgs | None = None) -> str:
        chat = args if args is not None else ChatTemplateArgs()
        size = sum(len(str(m.get("content") or "")) for m in messages)
        return await self._on_tokenizer(lambda tok: tok.render_chat(messages, chat),
                                        bulk=size > BULK_TEXT_CHARS)

    async def _on_tokenizer(self, work: Callable[[Tokenizer], T], bulk: bool = False) -> T:
        """Run tokenizer work on a tokenizer thread (the bulk one for long inputs): HF
        tokenizers release the GIL while they encode, so a 4 MB prompt (3.5 s here) stalls
        neither other streams nor, on its own lane, other requests' tokenizing."""
        tok = self._tokenizer
        if tok is None:
            raise EngineDeadError("the engine is not ready (model still loading)")
        if self._stopped.is_set():
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        if bulk and self._bulk_tokenizer is not None:
            return await loop.run_in_executor(self._bulk_pool, work, self._bulk_tokenizer)
        return await loop.run_in_executor(self._tok_pool, work, tok)

    def _stop_tokenizers(self) -> None:
        """At shutdown: queued tokenizer work is cancelled on both lanes."""
        self._tok_pool.shutdown(wait=False, cancel_futures=True)
        self._bulk_pool.shutdown(wait=False, cancel_futures=True)

    def _set_tokenizers(self, hf_copy: Callable[[], Any], eos_token_ids: Any) -> None:
        """The two lanes' tokenizers: one copy each, made here, before any lane runs (a
        tokenizer is not to be copied while another thread encodes with it)."""
        self._bulk_tokenizer = Tokenizer(hf_copy(), eos_token_ids)
        self._tokenizer = Tokenizer(hf_copy(), eos_token_ids)
