"""The messages between the API process and the engine core process (engine/core/process.py),
encoded with msgspec's MessagePack.

One tagged union each way, so one decoder call yields the right type. The payload types
(SamplingParams, RequestOutput, EngineStats, EngineLimits) are the frozen dataclasses the
thread path already passes around: msgspec encodes and decodes them as they are, so the two
paths cannot drift apart. A refusal travels as RefusalInfo and is rebuilt as the same
exception type submit() raises on the thread path.

Torch-free: the API side imports this before any model is loaded.
"""

from __future__ import annotations

import msgspec

from engine.outputs import RequestOutput
from engine.protocol import EngineLimits, EngineStats
from engine.snapshot import EngineSnapshot
from scheduler.errors import InvalidParamError, PromptTooLongError, QueueFullError
from scheduler.sampling_params import SamplingParams


class RefusalInfo(msgspec.Struct, frozen=True):
    """An exception that refused a request, by kind: what submit() raises for it."""

    kind: str  # "too_long" | "queue_full" | "invalid_param" | "value" | "internal"
    message: str
    param: str = ""  # InvalidParamError.param
    limit: str = ""  # QueueFullError.limit


# ---- API process -> core ------------------------------------------------------------------

class AddRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float  # time.monotonic(): CLOCK_MONOTONIC is shared by the processes
    deadline: float | None


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    """Abort everything, then exit."""


class Look(msgspec.Struct, frozen=True, tag=True):
    """The live view asks for a snapshot: the steps after since_step and the state now."""

    look_id: int
    since_step: int


ToCore = AddRequest | AbortRequest | Shutdown | Look


# ---- core -> API process ------------------------------------------------------------------

class Ready(msgspec.Struct, frozen=True, tag=True):
    limits: EngineLimits
    stats: EngineStats
    tokenizer: bytes  # the HF tokenizer, pickled: the API tokenizes with its own copy
    eos_token_ids: list[int]


class LoadFailed(msgspec.Struct, frozen=True, tag=True):
    reason: str


class Admitted(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    refusal: RefusalInfo | None = None


class GrammarDone(msgspec.Struct, frozen=True, tag=True):
    """The request's grammar compiled (refusal None) or failed (a 400 naming its field)."""

    request_id: str
    refusal: RefusalInfo | None = None


class Busy(msgspec.Struct, frozen=True, tag=True):
    """A step is starting after an idle spell (for the stuck-step check of /health)."""


class StepDone(msgspec.Struct, frozen=True, tag=True):
    outputs: list[RequestOutput]
    stats: EngineStats
    busy: bool  # another step follows at once
    dead: str | None = None  # too many failed steps in a row: the engine serves no more


class Seen(msgspec.Struct, frozen=True, tag=True):
    """The answer to a Look, sent between two steps."""

    look_id: int
    snapshot: EngineSnapshot | None  # None: building it failed (the core logged why)


ToClient = Ready | LoadFailed | Admitted | GrammarDone | Busy | StepDone | Seen

_ENCODER = msgspec.msgpack.Encoder()
_TO_CORE = msgspec.msgpack.Decoder(ToCore)
_TO_CLIENT = msgspec.msgpack.Decoder(ToClient)


def encode(msg: ToCore | ToClient) -> bytes:
    return _ENCODER.encode(msg)


def decode_to_core(data: bytes) -> ToCore:
    return _TO_CORE.decode(data)


def decode_to_client(data: bytes) -> ToClient:
    return _TO_CLIENT.decode(data)


def refusal_info(error: BaseException) -> RefusalInfo:
    """What the core sends for an exception add_request raised."""
    if isinstance(error, PromptTooLongError):
        return RefusalInfo("too_long", str(error))
    if isinstance(error, QueueFullError):
        return RefusalInfo("queue_full", str(error), limit=error.limit)
    if isinstance(error, InvalidParamError):
        return RefusalInfo("invalid_param", str(error), param=error.param)
    if isinstance(error, ValueError):  # a duplicate request id
        return RefusalInfo("value", str(error))
    return RefusalInfo("internal", f"{type(error).__name__}: {error}")


def refusal_error(info: RefusalInfo) -> Exception:
    """The exception submit() raises for a refusal (the same types as the thread path's)."""
    if info.kind == "too_long":
        return PromptTooLongError(info.message)
    if info.kind == "queue_full":
        return QueueFullError(info.message, info.limit)
    if info.kind == "invalid_param":
        return InvalidParamError(info.param, info.message)
    if info.kind == "value":
        return ValueError(info.message)
    return RuntimeError(info.message)  # a bug in the core: a 500, as on the thread path
