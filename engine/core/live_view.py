"""The engine side of the live view (/dashboard): a bounded log of step records, written every
step, and the snapshot a viewer asks for (steps since its last look, the KV pool block by
block, the live requests), built only when asked, between two steps, on the thread that owns
the engine.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable

from engine.core.request_outputs import RequestState
from engine.snapshot import MAX_REQUEST_ROWS, STEP_LOG_LEN, EngineSnapshot, RequestRow, StepRecord
from scheduler.output import SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus


class StepLog:
    """The last STEP_LOG_LEN steps. One small record a step is all a server nobody watches
    pays (measured in docs/performance.md)."""

    def __init__(self) -> None:
        self._records: collections.deque[StepRecord] = collections.deque(maxlen=STEP_LOG_LEN)

    def record(self, step: int, batch: SchedulerOutput, started: float) -> None:
        """`started`: time.perf_counter() when the step began; its shape is read from the
        batch as scheduled (one-token rows are decodes)."""
        decode_rows = batch.num_scheduled_tokens.count(1)
        prefill_tokens = batch.total_num_scheduled_tokens - decode_rows
        self._records.append(StepRecord(
            step, time.time(), (time.perf_counter() - started) * 1e3, decode_rows,
            len(batch.seqs) - decode_rows, prefill_tokens, len(batch.preempted_ids)))

    def since(self, step: int) -> tuple[StepRecord, ...]:
        """The records after `step`, oldest first."""
        out = []
        for record in reversed(self._records):
            if record.step <= step:
                break
            out.append(record)
        return tuple(reversed(out))


def build_snapshot(log: StepLog, scheduler: Scheduler, requests: dict[str, RequestState],
                   since_step: int) -> EngineSnapshot:
    now = time.monotonic()
    live = [*scheduler.running, *scheduler.waiting]
    live.sort(key=lambda seq: seq.arrival_time)
    return EngineSnapshot(
        steps=log.since(since_step), kv_blocks=scheduler.block_manager.block_states(),
        requests=tuple(_rows(live[:MAX_REQUEST_ROWS], requests, now)), num_requests=len(live))


def _rows(seqs: Iterable[Sequence], requests: dict[str, RequestState],
          now: float) -> Iterable[RequestRow]:
    for seq in seqs:
        req = requests.get(seq.seq_id)
        first = req.first_token_time if req is not None else None
        last = req.last_token_time if req is not None else None
        n_out = seq.num_output_tokens
        itl = (last - first) / (n_out - 1) * 1e3 if first and last and n_out > 1 else None
        yield RequestRow(
            seq.seq_id, _state(seq), seq.num_prompt_tokens, n_out, seq.num_cached_tokens,
            (now - seq.arrival_time) * 1e3,
            None if first is None else (first - seq.arrival_time) * 1e3, itl)


def _state(seq: Sequence) -> str:
    if seq.status == SequenceStatus.RUNNING:
        return "running"
    if seq.waiting_for_grammar:
        return "grammar"
    return "preempted" if seq.num_preemptions else "waiting"
