"""EngineClient: the only engine surface api/ may use (so API tests can use a fake engine).

Torch-free on purpose: importing this module must not load torch or transformers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.outputs import RequestOutput
from scheduler.errors import PromptTooLongError, QueueFullError, SchedulerError
from scheduler.limits import EngineLimits
from scheduler.sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = [
    "MAX_LOGPROBS",
    "EngineClient",
    "EngineDeadError",
    "EngineLimits",
    "EngineStats",
    "PromptTooLongError",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerError",
]


class EngineDeadError(Exception):
    """The engine loop died or is not running; requests cannot be served (HTTP 503)."""


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

    @property
    def kv_cache_usage(self) -> float:
        if self.num_kv_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine."""

    model_name: str  # the id served in /v1/models (known before the model is loaded)
    # Resolved once the model is loaded (None before): max_model_len, KV pool, vocabulary, EOS.
    limits: EngineLimits | None

    async def start(self) -> None:
        """Load the model and start the step loop. The app's lifespan runs this as a
        background task, so the server answers /health with 503 while loading."""
        ...

    async def shutdown(self) -> None:
        """Stop the loop; every unfinished request ends with finish_reason "abort"."""
        ...

    def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas for one request. Raises PromptTooLongError / QueueFullError /
        EngineDeadError before the first delta; closing the iterator early aborts it.
        `deadline` (time.monotonic()): see LLMEngine.add_request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def is_ready(self) -> bool:
        """Loaded and the step loop alive and not stuck."""
        ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenize(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str: ...

    def stats(self) -> EngineStats: ...
