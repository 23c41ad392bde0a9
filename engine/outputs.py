"""What the engine hands back per request per step. Pure data, no torch: api/ imports it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorCode(enum.StrEnum):
    """Why the engine ended a request with an error (RequestOutput.error_code); the API maps
    each to an HTTP status in one place (api/errors.py)."""

    QUEUE_TIMEOUT = "queue_timeout"  # the deadline passed before it was ever scheduled (503)
    STEP_FAILED = "step_failed"  # the step it was in raised (500: a bug or a device fault)
    ENGINE_DEAD = "engine_dead"  # the engine loop stopped or crashed (503)
    INVALID_PARAM = "invalid_param"  # e.g. a grammar that does not compile (400)


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    token: str  # the token's own text (as the tokenizer spells it, decoded to a str)
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprob of one chosen token (sampled or from the prompt) and the top-N alternatives."""

    chosen: Logprob
    rank: int  # 1 = the most likely token
    top: tuple[Logprob, ...]  # best first; empty when N = 0


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where one request's time went, measured by the engine as it happened (seconds, one
    monotonic clock), sent with the final delta. Intervals as vLLM defines them: queue =
    arrival to first scheduled; prefill = first scheduled to first token; decode = first to
    last token; inference = first scheduled to last token. None: that event never came (a
    request that was never scheduled, or that produced no token)."""

    queue: float | None = None
    prefill: float | None = None
    decode: float | None = None
    inference: float | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One step's delta for one request. Deltas concatenate to the full answer."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per new token when asked
    # Sent once, with the first delta, when prompt_logprobs was asked: one per prompt token,
    # the first is None (nothing predicts the first token).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # sent once, with the first delta
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduling (final delta)
    timings: RequestTimings | None = None  # final delta only
    error: str | None = None  # set when the engine failed this request
    error_code: ErrorCode | None = None  # why, when error is set

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
