"""What the live view (/dashboard, its event stream /v1/engine/events) shows of the engine:
the steps since the viewer's last look, the KV pool block by block and the live requests.
Pure data, no torch: the API imports it, the core process sends it down its pipe.

Built only when asked (engine/core/live_view.py), between two steps, so that a server nobody
watches pays nothing for it but one small record per step.
"""

from __future__ import annotations

from dataclasses import dataclass

# Block states in EngineSnapshot.kv_blocks, one character per block.
BLOCK_FREE = "0"  # holds nothing
BLOCK_CACHED = "1"  # free, but holds a published prefix a new request may reuse
BLOCK_USED = "2"  # in some sequence's block table

SINGLE_ENGINE = "engine"  # the live view's name for the engine of a server without replicas
STEP_LOG_LEN = 512  # steps the engine remembers for a viewer that looks at most 10 times a second
MAX_REQUEST_ROWS = 50  # live requests in one snapshot (the oldest first)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, as the scheduler formed it and as long as it ran."""

    step: int  # 1, 2, ... (EngineStats.num_steps after it)
    time: float  # wall-clock end (time.time()), for the timeline's axis
    duration_ms: float  # schedule + forward + sampling + deltas
    decode_rows: int  # sequences that produced one token from one input token
    prefill_rows: int  # sequences that computed prompt (or recomputed) tokens
    prefill_tokens: int
    preemptions: int  # sequences preempted to make room for this step


@dataclass(frozen=True, slots=True)
class RequestRow:
    """One live request (waiting, running or preempted)."""

    request_id: str
    state: str  # "waiting", "running", "preempted" or "grammar" (its grammar is compiling)
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache served
    age_ms: float  # since it arrived
    ttft_ms: float | None  # arrival -> first token (None before it)
    itl_ms: float | None  # mean gap between its output tokens so far (None before a second)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    steps: tuple[StepRecord, ...] = ()  # after the asked-for step, oldest first
    kv_blocks: str = ""  # one of BLOCK_* per block, by block id
    requests: tuple[RequestRow, ...] = ()  # at most MAX_REQUEST_ROWS
    num_requests: int = 0  # all live requests (the table may show fewer)
