"""The engine-API contract: the only engine surface api/ may use (so API tests can use a fake
engine, and the same contract tests run against both).

A request is admitted explicitly: `await engine.submit(...)` returns its RequestStream or
raises a typed refusal (PromptTooLongError, QueueFullError, InvalidParamError,
EngineDeadError); the caller then iterates the stream's deltas and closes it.

Torch-free on purpose: importing this module must not load torch or transformers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.outputs import ErrorCode, RequestOutput
from engine.snapshot import EngineSnapshot
from scheduler.errors import InvalidParamError, PromptTooLongError, QueueFullError, SchedulerError
from scheduler.limits import EngineLimits
from scheduler.sampling_params import (
    FLOAT32_MAX,
    MAX_LOGPROBS,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "FLOAT32_MAX",
    "ITERATION_TOKEN_BUCKETS",
    "MAX_LOGPROBS",
    "REPETITION_PENALTY_RANGE",
    "ChatTemplateArgs",
    "EngineClient",
    "EngineDeadError",
    "EngineLimits",
    "EngineStats",
    "ErrorCode",
    "InvalidParamError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SchedulerError",
    "StructuredOutputsParams",
]


def check_token_ids(field: str, ids: Iterable[int], vocab_size: int) -> None:
    """Token ids must exist in the model (InvalidParamError naming `field`)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParamError(field, f"{field} token id {bad} is out of range "
                                f"[0, {vocab_size})")


class EngineDeadError(Exception):
    """The engine loop died or is not running; requests cannot be served (HTTP 503)."""


# Upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens_total); +Inf follows.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class ChatTemplateArgs:
    """How to render chat messages (vLLM's chat-template request fields). `tools`: OpenAI
    tool objects for the template's `tools` variable; `chat_template`: a Jinja template that
    replaces the model's; `kwargs`: extra template variables (chat_template_kwargs)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of engine state and cumulative counters, read by /metrics."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_steps: int = 0
    # Requests finished per second over the last half minute (None: too few to tell); the
    # API turns it into a 429's Retry-After.
    finish_rate: float | None = None
    # Tokens per step: cumulative counts per ITERATION_TOKEN_BUCKETS bound, then +Inf (empty
    # before the first step), and the sum of all steps' tokens.
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # The KV cache's configuration (static; /metrics shows it as cache_config_info).
    cache_dtype: str = ""
    enable_prefix_caching: bool = False
    # Where the engine's resident memory goes once ready, (kind, bytes) in the order
    # engine/worker/memory.py logs them (static; /metrics serves it as memory_bytes).
    memory: tuple[tuple[str, int], ...] = ()
    # Speculative decoding (scheduler/speculative.py; vLLM's spec_decode_* counters): drafts
    # (one sequence's drafts in one step), draft tokens, kept drafts, and per draft position
    # how many drafts kept it; () while speculation is off.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        if self.num_kv_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as the live view sees it: its name ("engine", or a Ray replica's id), its
    stats and its snapshot (engine/snapshot.py)."""

    name: str
    stats: EngineStats
    snapshot: EngineSnapshot


class _Interrupt(Exception):
    """RequestStream.interrupt's error on its way through the queue."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


class RequestStream:
    """The deltas of one admitted request, in order, ending with a finished one.

    Iterating raises what ended the request without a final delta (EngineDeadError on
    shutdown or an engine crash). `aclose()` before the end aborts the request, which frees
    its KV blocks: every consumer must close it (`contextlib.aclosing`). Event-loop side
    only: the engine hands deltas over with `put()` on the loop's thread."""

    def __init__(self, request_id: str, on_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._on_abort = on_abort
        self._ended = False  # the final delta or an error was taken, or it was closed
        self._has_item = asyncio.Event()  # the engine has put something (see wait_item)

    @property
    def ended(self) -> bool:
        """The final delta (or the error that ended it) was taken, or it was closed."""
        return self._ended

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)
        self._has_item.set()

    def interrupt(self, error: BaseException) -> None:
        """Raise `error` in the consumer once it has taken what is already queued, without
        ending the request: the consumer still closes the stream, which aborts it. (The API's
        graceful shutdown ends a stream it reads in place this way.)"""
        self._queue.put_nowait(_Interrupt(error))

    async def wait_item(self) -> None:
        """Until the engine has put a delta or an error here (taken or not)."""
        await self._has_item.wait()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            if isinstance(item, _Interrupt):
                raise item.error
            self._ended = True
            raise item
        self._ended = item.finished
        return item

    async def aclose(self) -> None:
        if not self._ended:
            self._ended = True
            self._on_abort(self.request_id)


async def ready_unless_ended(ready: asyncio.Future[Any], stream: RequestStream) -> bool:
    """Wait for `ready` (a request's grammar compile) unless the engine ends the request first:
    its deadline passed or the server shuts down while it compiles, and the stream holds that
    end. True when `ready` settled first. `ready` is never cancelled here, so a cancelled
    waiter (the client left) abandons the compile and does not cancel it."""
    ended = asyncio.ensure_future(stream.wait_item())
    try:
        await asyncio.wait({ready, ended}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
    return ready.done()


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine."""

    model_name: str  # the id served in /v1/models (known before the model is loaded)

    @property
    def limits(self) -> EngineLimits | None:
        """Resolved once the model is loaded (None before): max_model_len, KV pool,
        vocabulary, EOS."""
        ...

    async def start(self) -> None:
        """Wait until the model is loaded and the step loop runs. The app's lifespan runs
        this as a background task, so the server answers /health with 503 while loading."""
        ...

    async def shutdown(self) -> None:
        """Stop the loop; every unfinished request's stream raises EngineDeadError."""
        ...

    async def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
    ) -> RequestStream:
        """Admit one request, or raise PromptTooLongError / QueueFullError /
        InvalidParamError / EngineDeadError. `deadline` (time.monotonic()): see
        LLMEngine.add_request."""
        ...

    def is_ready(self) -> bool:
        """Loaded and the step loop alive and not stuck."""
        ...

    # Tokenizer work runs off the event loop (a multi-megabyte text takes seconds), so these
    # are coroutines.
    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    async def detokenize(self, token_ids: list[int]) -> str: ...

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  args: ChatTemplateArgs | None = None) -> str:
        """Render messages already validated by the API (content is a string; tool_calls'
        arguments are objects). Raises ValueError when the template cannot render them."""
        ...

    def stats(self) -> EngineStats: ...

    async def live_view(self, since: dict[str, int]) -> list[EngineView]:
        """What /v1/engine/events shows: one EngineView per engine (one, or one per Ray
        replica), each with the steps after `since[its name]` (0 when absent). Built between
        two steps, only when asked; EngineDeadError when the engine is gone."""
        ...
