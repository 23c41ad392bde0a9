"""GrammarTracker: the engine's per-request structured-output state (a pending compile, then
a matcher), and what it contributes to each step: which requests may now be admitted, the
step's bitmask, and which sequences their grammar has ended.

Engine thread only. It decides nothing about a sequence's status: it tells LLMEngine, which
asks the scheduler (the one writer of a Sequence's status).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.sample.sampling_batch import GrammarMasks
from engine.structured_output.grammar import Matcher
from engine.structured_output.manager import GrammarFuture, StructuredOutputs, param_error
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

logger = logging.getLogger("pagedserve.engine")


@dataclass(frozen=True, slots=True)
class Compiled:
    """The requests whose compile finished since the last poll."""

    ready: list[str]  # now have a matcher: the scheduler may admit them
    failed: list[tuple[str, str]]  # (request id, the 400 message naming the field)


class GrammarTracker:
    def __init__(self, structured: Callable[[], StructuredOutputs]) -> None:
        """`structured`: the compiler (raises InvalidParamError when it is unavailable)."""
        self._structured = structured
        self._compiling: dict[str, tuple[Sequence, GrammarFuture]] = {}
        self._matchers: dict[str, Matcher] = {}
        self._fed: dict[str, int] = {}  # output tokens each matcher has accepted

    def start(self, params: SamplingParams) -> GrammarFuture | None:
        """Start (or find in the cache) the compile of a request's grammar, if it has one;
        InvalidParamError when structured outputs are unavailable."""
        so = params.structured_outputs
        return None if so is None else self._structured().compile(so)

    def track(self, seq: Sequence, grammar: GrammarFuture) -> None:
        """seq (now in the scheduler, waiting for its grammar) gets a matcher once compiled."""
        self._compiling[seq.seq_id] = (seq, grammar)

    def forget(self, request_id: str) -> None:
        self._compiling.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._fed.pop(request_id, None)

    @property
    def num_compiling(self) -> int:
        """Requests whose compile has not finished (they cannot run yet)."""
        return sum(not f.done() for _, f in self._compiling.values())

    def wait(self, timeout: float | None = None) -> None:
        """Block until some pending compile finishes (or timeout)."""
        pending = [f for _, f in self._compiling.values()]
        if pending:
            concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)

    def poll(self) -> Compiled:
        """Matchers for the finished compiles; failures are reported, not raised."""
        result = Compiled([], [])
        for request_id, (seq, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is None:
                self._matchers[request_id] = self._structured().matcher(future.result())
                result.ready.append(request_id)
            else:
                so = seq.params.structured_outputs
                assert so is not None
                result.failed.append((request_id, str(param_error(so, error))))
        return result

    def masks(self, batch: SchedulerOutput) -> GrammarMasks | None:
        """The allowed tokens of the constrained sequences that sample this step: a row for
        each position a drafting one scores."""
        if not self._matchers:  # the common step: nothing constrained, no per-row lookups
            return None
        rows = []
        for i, seq in enumerate(batch.seqs):
            m = self._matchers.get(seq.seq_id)
            if m is not None and batch.samples(i):
                rows.append((seq.seq_id, m, batch.draft_token_ids.get(seq.seq_id, [])))
        return self._structured().fill(rows) if rows else None

    def valid_drafts(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts up to the first one seq's grammar refuses (all of them for a sequence
        without a grammar): a refused draft could never be kept, and neither could those
        after it. The matcher is left where it was."""
        m = self._matchers.get(seq.seq_id)
        if m is None:
            return drafts
        accepted = 0
        while accepted < len(drafts) and m.accept_token(drafts[accepted]):
            accepted += 1
        if accepted:
            m.rollback(accepted)
        return drafts[:accepted]

    def advance(self, updated: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Feed each constrained sequence its new token. Returns (ended, rejected): the
        unfinished ones whose grammar has now ended (nothing more may follow: the engine
        finishes them, "stop"), and those whose token the grammar refused (the mask allowed
        it: a bug, which fails that request only).

        A step may have appended several tokens (a verified run of drafts): each is fed in
        order. A recompute after preemption keeps every sampled token and samples nothing
        until its KV has caught up, so a matcher, which has seen exactly the output tokens,
        stays in step without a rollback or a replay."""
        ended: list[Sequence] = []
        rejected: list[Sequence] = []
        if not self._matchers:
            return ended, rejected
        for seq in updated:
            m = self._matchers.get(seq.seq_id)
            if m is None:
                continue
            fed = self._fed.get(seq.seq_id, 0)
            new = seq.token_ids[seq.num_prompt_tokens + fed:]  # this step's tokens only
            self._fed[seq.seq_id] = fed + len(new)
            refused = next((t for t in new if not m.accept_token(t)), None)
            if refused is not None:
                logger.error("grammar rejected token %d that its mask allowed (%r)", refused, seq)
                rejected.append(seq)
            elif new and m.is_terminated() and not seq.is_finished:
                ended.append(seq)
        return ended, rejected
