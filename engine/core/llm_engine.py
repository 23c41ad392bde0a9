"""LLMEngine: the synchronous core. One step = schedule() -> runner.execute() -> postprocess(),
then per-request deltas (new token ids, text, logprobs, finish reason), built from each
request's RequestState by engine/core/request_outputs.py; the step statistics behind stats() are
counted in engine/core/step_stats.py.

Every way a request ends (EOS or length, stop string, abort, timeout, a failed step) goes
through `_end`, which asks the scheduler to finish its sequence (the scheduler alone writes a
Sequence's status), forgets the request and builds its final delta. A step whose forward or
postprocessing raises does not raise out of step(). Where the runner can tell whose inputs
failed (RequestFault: a row's sampling, its prompt logprobs, an id outside the vocabulary)
or a request's own text or stop check raised, those requests alone end with STEP_FAILED and
the others run on; any other failure ends the step's requests and counts in
`consecutive_failures`, which tells the caller when to give up.

Single-threaded by contract: AsyncEngine calls every method from its one engine thread.
"""

from __future__ import annotations

import heapq
import logging
import time
import traceback
from collections.abc import Callable, Iterable

from engine.config import EngineConfig
from engine.core.grammar_tracker import GrammarTracker
from engine.core.live_view import StepLog, build_snapshot
from engine.core.request_outputs import (
    RequestState,
    collect_prompt_logprobs,
    delta,
    final_delta,
    sampled_logprobs,
    text_ids,
)
from engine.core.step_stats import IterationTokens, SpecDecodeLog, engine_stats
from engine.outputs import ErrorCode, RequestOutput, TokenLogprobs
from engine.protocol import EngineLimits, EngineStats, InvalidParamError, check_token_ids
from engine.snapshot import EngineSnapshot
from engine.stream_detokenizer import new_detokenizer
from engine.structured_output.manager import StructuredOutputs
from engine.tokenizer import Tokenizer
from engine.worker.calibration import calibrate
from engine.worker.families import released_window
from engine.worker.model_runner import ModelRunner
from engine.worker.runner_output import RequestFault, RunnerOutput
from scheduler import stop_policy
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.step_cost import StepShape, shape_of

logger = logging.getLogger("pagedserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """`runner`: an already-loaded ModelRunner to share (tests, benchmarks); the
        scheduler then uses config.num_kv_blocks of its pool when that is smaller."""
        self.config = config
        self._owns_runner = runner is None
        self.runner = runner if runner is not None else ModelRunner(config)
        self.requests: dict[str, RequestState] = {}
        self.num_steps = 0
        self.clock: Callable[[], float] = time.monotonic  # deadlines are on this clock
        self._deadlines: list[tuple[float, str]] = []  # min-heap; stale entries are skipped
        self.consecutive_failures = 0  # failed steps since the last one that succeeded
        self._tokenizer: Tokenizer | None = None
        self._scheduler: Scheduler | None = None
        self._memory: tuple[tuple[str, int], ...] = ()
        self._limits: EngineLimits | None = None
        self._iterations = IterationTokens()
        self._spec_log = SpecDecodeLog()
        self.step_log = StepLog()  # the live view's timeline
        self._structured: StructuredOutputs | None = None
        self._structured_error = "not loaded"  # why _structured is None
        self.grammars = GrammarTracker(lambda: self.structured)

    def load(self) -> None:
        """Load the model, size the KV pool, resolve the limits and build the scheduler."""
        if self._owns_runner:
            self.runner.load()
        r = self.runner
        self._tokenizer = Tokenizer(r.tokenizer, r.eos_token_ids)
        self._limits = limits = self._resolve_limits()
        self._scheduler = Scheduler(self.config.scheduler, limits)
        self._scheduler.draft_filter = self.grammars.valid_drafts
        self._calibrate_step_budget(limits)
        account = getattr(self.runner, "memory", None)  # (a test's fake runner has none)
        self._memory = account.items() if account is not None else ()
        self._load_structured()
        logger.info("KV cache: %d blocks x %d tokens = %d token slots; max_model_len %d",
                    limits.num_kv_blocks, limits.block_size,
                    limits.num_kv_blocks * limits.block_size, limits.max_model_len)

    def _calibrate_step_budget(self, limits: EngineLimits) -> None:
        """With --target-itl-ms: the cost model's first fit, from synthetic steps of varied
        shapes timed now (engine/worker/calibration.py says why), not from the first live
        ones."""
        budget = self.scheduler.step_budget
        if budget is None:
            return
        s = self.config.scheduler
        try:
            points = calibrate(self.runner, s.max_num_seqs, s.max_num_batched_tokens,
                               limits.max_model_len, limits.num_kv_blocks)
        except Exception as e:  # noqa: BLE001 - the server can serve without it
            logger.warning("step-time budget: the start-up calibration failed (%s: %s); the "
                           "cost model is fitted from the first live steps",
                           type(e).__name__, e)
            return
        if budget.calibrate(points):
            self._log_fit("calibrated at start-up")
        else:  # e.g. a tiny model, whose step times are noise: prompt tokens priced at nothing
            logger.info("step-time budget: the start-up steps gave no usable cost model; it "
                        "is fitted from the first live steps, the token caps applying until then")

    def _resolve_limits(self) -> EngineLimits:
        """The one place the limits are derived: a shared runner's pool may be larger than this
        engine's config wants, and a sequence must fit the pool alone (or it could never run
        again after a preemption), so the pool also caps max_model_len."""
        r = self.runner
        num_blocks = min(self.config.num_kv_blocks or r.num_kv_blocks, r.num_kv_blocks)
        max_len = min(self.config.scheduler.max_model_len, r.max_model_len,
                      num_blocks * r.block_size)
        # Every token covers at most max_token_bytes of text; the 2x margin leaves room for a
        # normalizer that drops characters before tokenizing.
        max_bytes = 2 * self.tokenizer.max_token_bytes() * max_len
        return EngineLimits(max_model_len=max_len, num_kv_blocks=num_blocks,
                            block_size=r.block_size, vocab_size=r.vocab_size,
                            eos_token_ids=frozenset(r.eos_token_ids),
                            max_prompt_bytes=max_bytes,
                            sliding_window=released_window(r.windows))

    def _load_structured(self) -> None:
        """The grammar backend's token table (on this thread: it reads the tokenizer). A
        tokenizer it cannot read leaves the server up, refusing structured outputs only."""
        r = self.runner
        try:
            self._structured = StructuredOutputs(r.tokenizer, r.vocab_size, r.eos_token_ids)
        except Exception as e:  # noqa: BLE001 - whatever the backend raises, serve the rest
            self._structured_error = f"{type(e).__name__}: {e}"
            logger.warning("structured outputs are unavailable: %s", self._structured_error)

    @property
    def structured(self) -> StructuredOutputs:
        """The grammar compiler; InvalidParamError (a 400) when the backend is unavailable."""
        if self._structured is None:
            raise InvalidParamError("structured_outputs", "structured outputs are unavailable "
                                    f"for this model: {self._structured_error}")
        return self._structured

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._tokenizer is not None, "load() first"
        return self._tokenizer

    @property
    def scheduler(self) -> Scheduler:
        assert self._scheduler is not None, "load() first"
        return self._scheduler

    @property
    def limits(self) -> EngineLimits:
        assert self._limits is not None, "load() first"
        return self._limits

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    deadline: float | None = None) -> None:
        """Queue a request. Raises PromptTooLongError / QueueFullError / InvalidParamError.

        `deadline` (time.monotonic()): past it, a request never scheduled fails with
        error_code "queue_timeout"; a started one finishes with what it has and
        finish_reason "timeout". Checked at the start of every step."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if priority != 0 and self.config.scheduler.policy != "priority":
            # vLLM's answer too: a priority that would silently be ignored is refused.
            raise InvalidParamError("priority", f"priority {priority} was given, but priority "
                                    "scheduling is not enabled (start the server with "
                                    "--scheduling-policy priority)")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidParamError("prompt", "prompt must not be empty")
        self.check_token_ids("prompt", ids)
        self.check_token_ids("logit_bias", params.logit_bias)
        self.check_token_ids("stop_token_ids", params.stop_token_ids)
        grammar = self.grammars.start(params)  # in the pool; a cache hit is done already
        seq = Sequence(request_id, ids, params, priority, arrival_time)
        req = RequestState(seq, new_detokenizer(self.tokenizer, ids, params),
                       deadline=deadline)
        self.scheduler.add(seq)  # nothing after these may fail and orphan the sequence
        self.requests[request_id] = req
        if grammar is not None:
            self.grammars.track(seq, grammar)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, request_id))
            if len(self._deadlines) > 2 * len(self.requests) + 64:
                self._compact_deadlines()  # finished requests leave stale entries behind

    def _compact_deadlines(self) -> None:
        self._deadlines = [(r.deadline, rid) for rid, r in self.requests.items()
                           if r.deadline is not None]
        heapq.heapify(self._deadlines)

    def check_token_ids(self, field: str, ids: Iterable[int]) -> None:
        """Token ids must exist in the model (InvalidParamError naming `field`)."""
        check_token_ids(field, ids, self.limits.vocab_size)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort in any state; returns the final (abort) delta, None if unknown or done."""
        req = self.requests.get(request_id)
        return None if req is None else self._end(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_runnable(self) -> bool:
        """Some request can make progress now: unfinished, and not waiting for a compile."""
        return len(self.requests) > self.grammars.num_compiling

    def wait_for_grammars(self, timeout: float | None = None) -> None:
        """Block until some pending compile finishes (a synchronous caller with nothing
        runnable; the AsyncEngine waits on its inbox instead)."""
        self.grammars.wait(timeout)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step's deltas. Never raises for a failed forward: see _fail_step."""
        started = time.perf_counter()
        # Deadlines first: a request past its own answers timeout even if this step fails.
        outputs = self._expire_deadlines(self.clock()) if self._deadlines else []
        outputs += self._install_grammars()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        # The step-time budget learns from the step's shape, taken before postprocess.
        shape = shape_of(batch) if self.scheduler.step_budget is not None else None
        try:
            self._run(batch, outputs)
        except RequestFault as e:  # some requests' own inputs: theirs alone, not the engine's
            outputs += self._fail_requests(e.seq_ids, e)
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
            outputs += self._fail_step(batch, e)
        else:
            self.consecutive_failures = 0
            if shape is not None:  # the whole step, as a stream waits for it
                self._observe_step(shape, time.perf_counter() - started)
        self.step_log.record(self.num_steps, batch, started)
        return outputs

    def _run(self, batch: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        """Forward, postprocess and deltas. Each delta is appended as soon as it is built: if a
        later one raises, the requests already ended keep their final delta."""
        result = self.runner.execute(batch, self.grammars.masks(batch))
        collect_prompt_logprobs(self.requests, batch, result)
        updated = self.scheduler.postprocess(batch, result.sampled_token_ids,
                                             result.verified_token_ids)
        self.num_steps += 1
        self._iterations.count(batch.total_num_scheduled_tokens)
        if batch.draft_token_ids:
            self._spec_log.maybe_log(self.scheduler.spec_stats)
        ended, rejected = self.grammars.advance(updated)
        for seq in ended:  # its grammar has ended: nothing more may follow
            self.scheduler.finish(seq.seq_id, stop_policy.GRAMMAR_END, seq.last_token_id)
        for seq in rejected:
            outputs.append(self._end(self.requests[seq.seq_id], error_code=ErrorCode.STEP_FAILED,
                                     error="the grammar refused a token its mask allowed"))
        for seq in updated:
            try:
                out = self._make_output(seq, result)
            except Exception as e:  # noqa: BLE001 - its text or stops failed: it alone ends
                outputs += self._fail_requests([seq.seq_id], e)
                continue
            if out is not None:
                outputs.append(out)

    def _observe_step(self, shape: StepShape, seconds: float) -> None:
        budget = self.scheduler.step_budget
        assert budget is not None
        fitted = budget.model is not None
        self.scheduler.observe_step(shape, seconds)
        if not fitted and budget.model is not None:
            self._log_fit("fitted to the first steps")

    def _log_fit(self, how: str) -> None:
        budget = self.scheduler.step_budget
        assert budget is not None and budget.model is not None
        m = budget.model
        logger.info("step-time budget: cost model %s (%.1f ms a step, %.2f ms a decode row, "
                    "%.3f ms a prompt token, %.2f ms a prompt chunk); steps that carry decodes "
                    "take the prompt work that fits %.0f ms or %.1fx the decode step of the "
                    "batch being formed", how, 1e3 * m.fixed, 1e3 * m.per_decode,
                    1e3 * m.per_prefill, 1e3 * m.per_prefill_seq, 1e3 * budget.target_s,
                    budget.stretch)

    def _install_grammars(self) -> list[RequestOutput]:
        """Requests whose compile finished may be admitted; a spec that failed ends its request
        (the AsyncEngine's submit has already answered 400 from the same future)."""
        done = self.grammars.poll()
        for request_id in done.ready:
            self.scheduler.grammar_ready(request_id)
        return [self._end(self.requests[rid], error=why, error_code=ErrorCode.INVALID_PARAM)
                for rid, why in done.failed]

    def _fail_step(self, batch: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """End every request of the failed step that has not ended yet with STEP_FAILED, which
        frees its blocks. A bug or a device fault: the others (waiting, or preempted by this
        step) go on, and the caller decides from consecutive_failures when to stop."""
        self.consecutive_failures += 1
        logger.error("engine step failed (%d in a row): %s", self.consecutive_failures,
                     "".join(traceback.format_exception(error)))
        reqs = [self.requests.get(seq.seq_id) for seq in batch.seqs]
        return [self._end(req, error=f"engine step failed: {error}",
                          error_code=ErrorCode.STEP_FAILED)
                for req, seq in zip(reqs, batch.seqs) if req is not None and req.seq is seq]

    def _fail_requests(self, seq_ids: list[str], error: Exception) -> list[RequestOutput]:
        """End these requests with STEP_FAILED (a 500 for each): the step failed on their own
        inputs. The rest of the step, if it did not complete, is scheduled again (nothing
        was advanced: the scheduler moves sequences only in postprocess), and the engine's
        failure count is untouched, so requests cannot drive it to be declared dead."""
        logger.warning("request(s) %s failed: %s", ", ".join(seq_ids),
                       "".join(traceback.format_exception(error)))
        reqs = [self.requests.get(seq_id) for seq_id in seq_ids]
        return [self._end(req, error=f"request failed in the engine: {error}",
                          error_code=ErrorCode.STEP_FAILED) for req in reqs if req is not None]

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

    def _time_out(self, req: RequestState, now: float) -> RequestOutput:
        seq = req.seq
        if seq.first_scheduled_time is None:
            waited = now - seq.arrival_time
            return self._end(req, error_code=ErrorCode.QUEUE_TIMEOUT,
                             error=f"request timed out after {waited:.1f} s in the queue")
        return self._end(req, req.detok.flush(), finish_reason="timeout")

    def _make_output(self, seq: Sequence, result: RunnerOutput) -> RequestOutput | None:
        req = self.requests.get(seq.seq_id)
        if req is None:
            return None
        new_ids = seq.token_ids[seq.num_prompt_tokens + req.num_sent_tokens:]
        check_stops = stop_policy.may_stop(seq)  # stop strings too wait for min_tokens
        text, stop_str, kept = self._detokenize(req, new_ids, check_stops)
        if stop_str is not None:
            if kept < len(new_ids):  # a verified run went past the stop string: cut it there
                new_ids = new_ids[:kept]
                self.scheduler.stop_on_string(seq, stop_str, req.num_sent_tokens + kept)
            else:
                self.scheduler.stop_on_string(seq, stop_str)
        token_text = self.tokenizer.token_text
        logprobs = sampled_logprobs(seq, result, len(new_ids), token_text)
        req.num_sent_tokens += len(new_ids)
        if new_ids:  # timestamps for the request's timings (time.monotonic, as the scheduler)
            req.last_token_time = time.monotonic()
            req.first_token_time = req.first_token_time or req.last_token_time
        if seq.is_finished:
            tail = "" if stop_str is not None else req.detok.flush()
            return self._end(req, text + tail, logprobs, tuple(new_ids))
        return delta(req, tuple(new_ids), text, logprobs, token_text)

    @staticmethod
    def _detokenize(req: RequestState, new_ids: list[int],
                    check_stops: bool) -> tuple[str, str | None, int]:
        """(text, stop string, how many of new_ids it covers). Several new tokens with stop
        strings to look for (a speculating step's verified run) go one at a time, so a stop
        string ends the output at the token that completed it, as decoding would."""
        ids = text_ids(req.seq, new_ids)
        if len(ids) < 2 or not (check_stops and req.seq.params.stop):
            return (*req.detok.step(ids, check_stops), len(new_ids))
        text = ""
        for i, token_id in enumerate(ids):
            piece, stop_str = req.detok.step([token_id], check_stops)
            text += piece
            if stop_str is not None:
                return text, stop_str, i + 1
        return text, None, len(new_ids)

    def _end(self, req: RequestState, text: str = "",
             logprobs: tuple[TokenLogprobs, ...] | None = None, new_ids: tuple[int, ...] = (),
             *, finish_reason: str | None = None, error: str | None = None,
             error_code: ErrorCode | None = None) -> RequestOutput:
        """The one way a request ends (finish, stop string, abort, timeout, failed step): its
        final delta. The scheduler finishes the sequence as aborted unless it finished it
        already (EOS, length, stop string), which frees its blocks; the request is forgotten.
        `finish_reason` overrides the status's ("timeout"); `error` marks an engine failure."""
        seq = req.seq
        if not seq.is_finished:
            self.scheduler.abort(seq.seq_id)
        assert seq.is_finished, f"the scheduler did not finish {seq!r}"
        del self.requests[seq.seq_id]
        self.grammars.forget(seq.seq_id)
        return final_delta(req, new_ids, text, logprobs, self.tokenizer.token_text,
                           finish_reason=finish_reason, error=error, error_code=error_code)

    # ---- stats ----------------------------------------------------------------------------

    def snapshot(self, since_step: int) -> EngineSnapshot | None:
        """What the live view shows: the steps after `since_step`, the KV pool, the live
        requests (engine/core/live_view.py). Between steps, on the engine's thread. None if
        it fails: a bug there is logged and must never stop the step loop."""
        try:
            return build_snapshot(self.step_log, self.scheduler, self.requests, since_step)
        except Exception:  # the viewer gets an error; the engine goes on
            logger.exception("building the live view's snapshot failed")
            return None

    def stats(self) -> EngineStats:
        return engine_stats(
            self.scheduler, self._iterations, self.num_steps,
            cache_dtype=str(getattr(self.runner, "dtype", "")).removeprefix("torch."),
            enable_prefix_caching=self.config.scheduler.enable_prefix_caching,
            memory=self._memory)
