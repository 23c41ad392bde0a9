"""LLMEngine: the synchronous core. One step = schedule() -> runner.execute() -> postprocess(),
then per-request deltas (new token ids, text, logprobs, finish reason).

Single-threaded by contract: AsyncEngine calls every method from its one engine thread.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.outputs import ErrorCode, Logprob, RequestOutput, TokenLogprobs
from engine.protocol import EngineStats
from engine.runner_output import RunnerOutput, TokenLogprobIds
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus

logger = logging.getLogger("pagedserve.engine")


@dataclass(slots=True)
class _Request:
    """Engine-side state of one request: what has been sent, text, prompt logprobs."""

    seq: Sequence
    detok: IncrementalDetokenizer
    num_sent_tokens: int = 0
    sent_first: bool = False
    prompt_logprobs: list[TokenLogprobIds] = field(default_factory=list)
    deadline: float | None = None  # time.monotonic() after which the request times out


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """`runner`: an already-loaded ModelRunner to share (tests, benchmarks); the
        scheduler then uses config.num_kv_blocks of its pool when that is smaller."""
        self.config = config
        self._owns_runner = runner is None
        self.runner = runner if runner is not None else ModelRunner(config)
        self.requests: dict[str, _Request] = {}
        self.num_steps = 0
        self.clock: Callable[[], float] = time.monotonic  # deadlines are on this clock
        self._deadlines: list[tuple[float, str]] = []  # min-heap; stale entries are skipped
        self._tokenizer: Tokenizer | None = None
        self._scheduler: Scheduler | None = None

    def load(self) -> None:
        """Load the model, size the KV pool and build the scheduler around it."""
        if self._owns_runner:
            self.runner.load()
        r = self.runner
        self._tokenizer = Tokenizer(r.tokenizer, r.eos_token_ids)
        max_len = min(self.config.scheduler.max_model_len, r.max_model_len)
        sched_cfg = replace(self.config.scheduler, max_model_len=max_len, block_size=r.block_size)
        num_blocks = min(self.config.num_kv_blocks or r.num_kv_blocks, r.num_kv_blocks)
        self._scheduler = Scheduler(sched_cfg, num_blocks, r.eos_token_ids)
        logger.info("KV cache: %d blocks x %d tokens = %d token slots; max_model_len %d",
                    num_blocks, r.block_size, num_blocks * r.block_size, max_len)

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._tokenizer is not None, "load() first"
        return self._tokenizer

    @property
    def scheduler(self) -> Scheduler:
        assert self._scheduler is not None, "load() first"
        return self._scheduler

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) servable: the model's or the KV pool's limit."""
        return self.scheduler.max_len

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    deadline: float | None = None) -> None:
        """Queue a request. Raises PromptTooLongError / QueueFullError / ValueError.

        `deadline` (time.monotonic()): past it, a request never scheduled fails with
        error_code "queue_timeout"; a started one finishes with what it has and
        finish_reason "timeout". Checked at the start of every step."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        self.check_token_ids("prompt", ids)
        self.check_token_ids("logit_bias", params.logit_bias)
        self.check_token_ids("stop_token_ids", params.stop_token_ids)
        seq = Sequence(request_id, ids, params, priority, arrival_time)
        req = _Request(seq, IncrementalDetokenizer(self.tokenizer, ids, params),
                       deadline=deadline)
        self.scheduler.add(seq)  # last: nothing after it may fail and orphan the sequence
        self.requests[request_id] = req
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, request_id))
            if len(self._deadlines) > 2 * len(self.requests) + 64:
                self._compact_deadlines()  # finished requests leave stale entries behind

    def _compact_deadlines(self) -> None:
        self._deadlines = [(r.deadline, rid) for rid, r in self.requests.items()
                           if r.deadline is not None]
        heapq.heapify(self._deadlines)

    def check_token_ids(self, field: str, ids: Iterable[int]) -> None:
        """Token ids must exist in the model; the message starts with the field's name."""
        vocab = self.runner.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{field} token id {bad} is out of range [0, {vocab})")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort in any state; returns the final (abort) delta, None if unknown or done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        self.runner.release([request_id])
        return self._final(req, "", None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        expired = self._expire_deadlines(self.clock()) if self._deadlines else []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return expired
        result = self.runner.execute(batch)
        self._collect_prompt_logprobs(batch, result)
        updated = self.scheduler.postprocess(batch, result.sampled_token_ids)
        self.num_steps += 1
        outputs = [self._make_output(seq, result) for seq in updated]
        return expired + [o for o in outputs if o is not None]

    def _expire_deadlines(self, now: float) -> list[RequestOutput]:
        """Finish every request whose deadline has passed (its blocks are freed at once)."""
        outputs = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            req = self.requests.get(request_id)
            # The id may have finished and been reused since: check the request's own deadline.
            if req is not None and req.deadline is not None and req.deadline <= now:
                outputs.append(self._time_out(req, now))
        return outputs

    def _time_out(self, req: _Request, now: float) -> RequestOutput:
        seq = req.seq
        never_scheduled = seq.first_scheduled_time is None
        del self.requests[seq.seq_id]
        self.scheduler.abort(seq.seq_id)
        self.runner.release([seq.seq_id])
        if never_scheduled:
            waited = now - seq.arrival_time
            return replace(self._final(req, "", None), error_code=ErrorCode.QUEUE_TIMEOUT,
                           error=f"request timed out after {waited:.1f} s in the queue")
        return replace(self._final(req, req.detok.flush(), None), finish_reason="timeout")

    def _collect_prompt_logprobs(self, batch: SchedulerOutput, result: RunnerOutput) -> None:
        for seq in batch.seqs:
            req = self.requests.get(seq.seq_id)
            chunk = result.prompt_logprobs.get(seq.seq_id)
            # The runner reports each prompt position once, also across a recompute after
            # preemption, so chunks simply append.
            if req is not None and chunk is not None and not req.sent_first:
                req.prompt_logprobs.extend(chunk)

    def _make_output(self, seq: Sequence, result: RunnerOutput) -> RequestOutput | None:
        req = self.requests.get(seq.seq_id)
        if req is None:
            return None
        new_ids = seq.token_ids[seq.num_prompt_tokens + req.num_sent_tokens:]
        # Stop strings count only from min_tokens on (vLLM), like EOS and stop token ids.
        check_stops = seq.num_output_tokens >= seq.params.min_tokens
        text, stop_str = req.detok.step(self._text_ids(seq, new_ids), check_stops)
        if stop_str is not None and not seq.is_finished:
            self.scheduler.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED, stop_str)
        elif stop_str is not None:  # finished by length in the same step: the stop string wins
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_str
        logprobs = self._sampled_logprobs(seq, result, len(new_ids))
        req.num_sent_tokens += len(new_ids)
        if seq.is_finished:
            tail = "" if stop_str is not None else req.detok.flush()
            del self.requests[seq.seq_id]
            self.runner.release([seq.seq_id])
            return self._final(req, text + tail, logprobs, tuple(new_ids))
        return self._delta(req, tuple(new_ids), text, logprobs)

    def _text_ids(self, seq: Sequence, new_ids: list[int]) -> list[int]:
        """Ids fed to the detokenizer: a stop *token* is not part of the text (as vLLM)."""
        stopped_by_id = (seq.status == SequenceStatus.FINISHED_STOPPED
                         and isinstance(seq.stop_reason, int))
        if stopped_by_id and new_ids and not seq.params.include_stop_str_in_output:
            return new_ids[:-1]
        return new_ids

    def _sampled_logprobs(self, seq: Sequence, result: RunnerOutput,
                          num_new: int) -> tuple[TokenLogprobs, ...] | None:
        if seq.params.logprobs is None or num_new == 0:
            return None
        lp = result.logprobs.get(seq.seq_id)
        return (self._to_logprobs(lp),) if lp is not None else None

    def _to_logprobs(self, lp: TokenLogprobIds) -> TokenLogprobs:
        text = self.tokenizer.token_text
        top = tuple(Logprob(t, text(t), v) for t, v in zip(lp.top_ids, lp.top_logprobs))
        return TokenLogprobs(Logprob(lp.token_id, text(lp.token_id), lp.logprob), lp.rank, top)

    def _delta(self, req: _Request, new_ids: tuple[int, ...], text: str,
               logprobs: tuple[TokenLogprobs, ...] | None) -> RequestOutput:
        seq = req.seq
        first = not req.sent_first
        req.sent_first = True
        return RequestOutput(
            request_id=seq.seq_id, new_token_ids=new_ids, new_text=text, logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(req) if first else None,
            prompt_token_ids=tuple(seq.prompt_token_ids) if first else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens)

    def _final(self, req: _Request, text: str, logprobs: tuple[TokenLogprobs, ...] | None,
               new_ids: tuple[int, ...] = ()) -> RequestOutput:
        seq = req.seq
        if not seq.is_finished:
            seq.status = SequenceStatus.FINISHED_ABORTED
        base = self._delta(req, new_ids, text, logprobs)
        queue_time = (None if seq.first_scheduled_time is None
                      else seq.first_scheduled_time - seq.arrival_time)
        return replace(base, finish_reason=seq.status.finish_reason,
                       stop_reason=self._stop_reason(seq), queue_time=queue_time)

    def _stop_reason(self, seq: Sequence) -> int | str | None:
        """As vLLM: None for EOS, the token id for a stop_token_ids hit, or the stop string."""
        r = seq.stop_reason
        if isinstance(r, int) and r not in seq.params.stop_token_ids:
            return None
        return r

    def _prompt_logprobs(self, req: _Request) -> tuple[TokenLogprobs | None, ...] | None:
        if req.seq.params.prompt_logprobs is None:
            return None
        rest = tuple(self._to_logprobs(lp) for lp in req.prompt_logprobs)
        return (None, *rest)

    # ---- stats ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        bm = s.block_manager
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_kv_blocks=bm.num_blocks, num_free_kv_blocks=bm.num_free_blocks,
            num_preemptions=s.num_preemptions, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, num_steps=self.num_steps)
