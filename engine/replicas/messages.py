"""What the ingress and the engine replicas send each other through Ray. Torch-free (the
ingress imports it) and plain data, so it pickles across processes.

Refusals travel as data, not as raised exceptions: our typed errors take constructor
arguments that pickle does not restore (InvalidParamError's `param`), and the ingress must
raise exactly the type the API maps to an HTTP status.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.protocol import (
    EngineDeadError,
    EngineLimits,
    EngineStats,
    InvalidParamError,
    PromptTooLongError,
    QueueFullError,
    SamplingParams,
)
from engine.snapshot import EngineSnapshot


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One engine request. `prompt` is what the prefix-aware router hashes. `timeout_s` is
    the deadline as seconds left when it was sent: monotonic clocks differ per process."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int = 0
    timeout_s: float | None = None

    def deadline(self) -> float | None:
        """The deadline on this process's time.monotonic() clock."""
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s


@dataclass(frozen=True, slots=True)
class Admitted:
    """The first item of an admitted request's stream: deltas follow."""

    replica: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """The first (and only) item of a refused request's stream: which error, its message,
    and the field that carries data (InvalidParamError.param, QueueFullError.limit)."""

    kind: str  # "prompt_too_long" | "queue_full" | "invalid_param" | "engine_dead"
    message: str
    detail: str = ""

    def error(self) -> Exception:
        """The typed error the engine raised, rebuilt on this side."""
        if self.kind == "prompt_too_long":
            return PromptTooLongError(self.message)
        if self.kind == "queue_full":
            return QueueFullError(self.message, self.detail or "max_num_queued_reqs")
        if self.kind == "invalid_param":
            return InvalidParamError(self.detail, self.message)
        return EngineDeadError(self.message)


def refusal_of(exc: BaseException) -> Refusal | None:
    """The Refusal for an error submit() raises by design; None for anything else (a bug)."""
    if isinstance(exc, PromptTooLongError):
        return Refusal("prompt_too_long", str(exc))
    if isinstance(exc, QueueFullError):
        return Refusal("queue_full", str(exc), exc.limit)
    if isinstance(exc, InvalidParamError):
        return Refusal("invalid_param", str(exc), exc.param)
    if isinstance(exc, EngineDeadError):
        return Refusal("engine_dead", str(exc))
    return None


@dataclass(frozen=True, slots=True)
class StreamFailed:
    """The last item of a stream the engine ended without a final delta (its loop died or
    it is shutting down): the ingress raises EngineDeadError(message) to the API."""

    message: str


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A replica's state, pushed to the ReplicaBoard every REPORT_PERIOD_S. `sent_at` is
    time.time() (wall clock: comparable across processes on synchronised hosts)."""

    replica: str  # Serve's unique replica id: the `replica` label in /metrics
    model_name: str  # the id the engine serves (derived where the model is, on its node)
    actor_name: str  # the Ray actor's name (tests kill a replica by it)
    ready: bool
    stats: EngineStats
    limits: EngineLimits | None
    sent_at: float
    # While the live view is watched: the replica's snapshot, with its last
    # REPORTED_STEPS steps (a window, so a report the ingress never read loses nothing).
    snapshot: EngineSnapshot | None = None
