"""Scheduler: forms the batch of every engine step (vLLM v1 style, nano-vllm size).

There are no prefill/decode phases. A step hands out one token budget: first to `running`
sequences (one decode token, or the next prefill chunk), then, if nothing was preempted, to
`waiting` ones in FCFS (or priority) order while `max_num_seqs` and free blocks allow. When a
running sequence cannot get a block, the newest (or worst-priority) running sequence is
preempted: its blocks are freed and it is recomputed later from the front of `waiting`.

What must stay true: waiting sequences hold no blocks; running ones are in admission order;
every sequence the scheduler knows is unfinished; a sequence that fits the pool alone always
runs eventually (the oldest running sequence is never the victim while another exists).
Admission only spends budget left after every running sequence got its share, and a
sequence's share never grows, so every running decode gets its token each step.

While sequences decode, the prompt work of a step (running chunks of more than one token and
every admission) is bounded by an allowance: a token cap (decode_step_prefill_tokens), or with
--target-itl-ms the time the step-time budget (scheduler/step_budget.py) leaves beside the
decodes, of which the first chunk always gets a block's worth. A refused chunk closes the
allowance, so a later prompt never overtakes an earlier one.

With --speculative-config a decoding sequence may carry drafts (scheduler/speculative.py):
its row is its pending token plus the drafts, paid from the token budget but not from the
prompt allowance, and never at the price of a preemption; postprocess() keeps the tokens
the model verified.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping

from scheduler import stop_policy
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.errors import PromptTooLongError, QueueFullError, SchedulerError
from scheduler.limits import EngineLimits
from scheduler.output import SchedulerOutput
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.speculative import NgramProposer, Proposer, SpecDecodeStats, draft_room
from scheduler.step_budget import Allowance, StepBudget, TokenAllowance
from scheduler.step_cost import StepShape
from scheduler.suffix_decoding import SuffixProposer


class Scheduler:
    def __init__(self, config: SchedulerConfig, limits: EngineLimits) -> None:
        """`config`: the batching policy; `limits`: the model's and the pool's facts. The
        sequence length, KV pool and EOS ids come from `limits` only (config.max_model_len
        and config.block_size are inputs the engine already resolved into it)."""
        # A sequence must fit the pool alone, or it could never run after a preemption.
        if limits.max_model_len > limits.num_kv_blocks * limits.block_size:
            raise ValueError(f"max_model_len {limits.max_model_len} does not fit the KV pool "
                             f"({limits.num_kv_blocks} blocks of {limits.block_size} tokens)")
        self.config = config
        self.limits = limits
        self.block_manager = BlockManager(limits.num_kv_blocks, limits.block_size,
                                          config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self._order: dict[str, int] = {}  # arrival tie-break
        self._counter = itertools.count()
        self._waiting_tokens = 0
        self.step_budget = (StepBudget(config.target_itl_ms / 1e3, config.prefill_stretch,
                                       floor=limits.block_size)
                            if config.target_itl_ms > 0 else None)
        # This step's prompt-work allowance (set by schedule()).
        self._allowance: Allowance = TokenAllowance(0)
        spec = config.speculative
        self.proposer: Proposer | None = None
        if spec is not None:
            self.proposer = (SuffixProposer if spec.method == "suffix" else NgramProposer)(spec)
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)
        # The engine's cut of a sequence's drafts (at the first its grammar refuses); None:
        # drafts are kept as proposed.
        self.draft_filter: Callable[[Sequence, list[int]], list[int]] | None = None

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id: str) -> Sequence | None:
        """The unfinished sequence with this id (finished ones are forgotten)."""
        return self._seqs.get(seq_id)

    # -- requests in and out -----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise SchedulerError(f"request id {seq.seq_id!r} is already in use")
        if seq.status != SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"add() takes a fresh sequence, got {seq!r}")
        self._check_fits(seq.num_prompt_tokens)
        self._check_queue(seq.num_prompt_tokens)
        self._seqs[seq.seq_id] = seq
        self._order[seq.seq_id] = next(self._counter)
        self._push_waiting(seq)

    def _check_fits(self, n: int) -> None:
        # max_model_len never exceeds the pool (checked in __init__), so a prompt below it
        # fits the pool with its first new token.
        lim = self.limits
        if n <= lim.max_prompt_len:
            return
        pool = lim.num_kv_blocks * lim.block_size
        why = (f" (the KV cache holds {lim.num_kv_blocks} blocks of {lim.block_size} tokens)"
               if lim.max_model_len == pool else "")
        raise PromptTooLongError(f"prompt has {n} tokens, but max_model_len is "
                                 f"{lim.max_model_len}{why} and at least one token must be "
                                 f"generated")

    def _check_queue(self, n: int) -> None:
        cfg = self.config
        # Arrivals that the next step can start (free sequence slots) are not queued yet: an
        # idle server must not refuse a burst it can run at once.
        queued = len(self.waiting) - max(0, cfg.max_num_seqs - len(self.running))
        if 0 < cfg.max_num_queued_reqs <= queued:
            raise QueueFullError(f"waiting queue is full: {queued} requests "
                                 f"(max_num_queued_reqs={cfg.max_num_queued_reqs})",
                                 limit="max_num_queued_reqs")
        # An empty queue takes any prompt, so no prompt is refused forever.
        if cfg.max_num_queued_tokens > 0 and self.waiting \
                and self._waiting_tokens + n > cfg.max_num_queued_tokens:
            raise QueueFullError(
                f"waiting queue is full: {self._waiting_tokens} queued tokens + {n} > "
                f"max_num_queued_tokens={cfg.max_num_queued_tokens}",
                limit="max_num_queued_tokens")

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish seq_id (any state) as aborted and free its blocks; None if unknown."""
        return self.finish(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish(
        self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> Sequence | None:
        """Finish seq_id with a finished status (e.g. a stop string matched); frees its blocks."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a finished status, got {status.name}")
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status == SequenceStatus.WAITING:
            self._remove_waiting(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, status, stop_reason)
        return seq

    def grammar_ready(self, seq_id: str) -> None:
        """The engine compiled seq_id's grammar: it may be admitted from now on."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise SchedulerError(f"grammar_ready() for unknown request {seq_id!r}")
        seq.waiting_for_grammar = False

    def stop_on_string(self, seq: Sequence, stop: str, num_output_tokens: int | None = None) -> None:
        """A stop string matched in seq's newest text. It also wins over a length or EOS finish
        the same step gave seq (its text ends at the stop string either way).
        `num_output_tokens`: the output up to the token that completed the stop string, when
        a step appended tokens after it (a verified run of drafts): those are dropped."""
        if num_output_tokens is not None and num_output_tokens < seq.num_output_tokens:
            del seq.token_ids[seq.num_prompt_tokens + num_output_tokens:]
        if self._seqs.get(seq.seq_id) is seq:
            self.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED, stop)
        elif seq.is_finished:  # by postprocess() in this step: freed already, only relabelled
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        else:
            raise ValueError(f"stop_on_string() needs a sequence of this scheduler, got {seq!r}")

    def _finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None) -> None:
        seq.status = status
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        del self._seqs[seq.seq_id]
        del self._order[seq.seq_id]
        if self.proposer is not None:
            self.proposer.finish(seq)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._allowance = self._prefill_allowance()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_ids:  # a step that preempted has no blocks to spare
            self._schedule_waiting(out, budget)
        return out

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """A step's shape (scheduler.step_cost.shape_of, taken before postprocess) and wall
        time, for the step-time budget's fit; a no-op while the budget is off."""
        if self.step_budget is not None:
            self.step_budget.observe(shape, seconds)

    def _prefill_allowance(self) -> Allowance:
        """The prompt work this step may take in all: the step's token budget when nothing
        decodes; else the step-time budget's allowance, or the token cap (see
        decode_step_prefill_tokens) while the budget is off or not fitted yet."""
        cfg = self.config
        decoding = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        if not decoding:
            return TokenAllowance(cfg.max_num_batched_tokens)
        if self.step_budget is not None:
            context = sum(seq.num_computed_tokens for seq in decoding) + len(decoding)
            drawn = sum(not seq.params.greedy for seq in decoding)
            forming = min(cfg.max_num_seqs, len(self.running) + len(self.waiting))
            shape = StepShape(len(decoding), 0, context, sampled_rows=drawn)
            timed = self.step_budget.allowance(shape, forming)
            if timed is not None:
                return timed
        return TokenAllowance(cfg.decode_step_prefill_cap(len(decoding))
                              or cfg.max_num_batched_tokens)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        speculating = self._speculating()
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or (defensive) no budget left
            n = min(seq.num_uncomputed_tokens, self.config.prefill_chunk_cap, budget)
            assert n > 0, f"running sequence with nothing to compute: {seq!r}"
            if n > 1:  # a prefill chunk: within this step's allowance
                n = self._allowance.fit(seq.num_computed_tokens, n)
                if n == 0:
                    continue  # its next chunk waits for a step with room
            elif speculating and seq.num_uncomputed_tokens == 1:
                n += self._draft(out, seq, budget - 1)
            while not self.block_manager.can_allocate(seq, n):
                victim = self._pick_victim()
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            else:  # no break: there is room for seq now
                self.block_manager.allocate(seq, n)
                self._take(out, seq, n)
                budget -= n
        return budget

    def _take(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """Schedule n tokens of a running seq. The prompt allowance is debited only here, once
        the chunk has its blocks: a chunk that is preempted gives it back (see _preempt)."""
        out.seqs.append(seq)
        out.num_scheduled_tokens.append(n)
        if n > 1 and seq.seq_id not in out.draft_token_ids:
            self._allowance.debit(seq.num_computed_tokens, n)

    def _speculating(self) -> bool:
        """Drafts are proposed this step: speculation is on and the batch is narrow enough."""
        if self.proposer is None:
            return False
        limit = self.proposer.config.disable_by_batch_size
        return limit == 0 or len(self.running) <= limit

    def _draft(self, out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        """Propose drafts for a decoding seq; returns how many it carries this step (0: none).
        They are bounded by the step's budget, the output seq may still produce (short of its
        min_tokens gate, before it) and its context, and dropped if their blocks are not free
        (a draft never preempts)."""
        assert self.proposer is not None
        room = min(budget, draft_room(seq), self.limits.max_model_len - seq.num_tokens - 1)
        drafts = self.proposer.propose(seq, room) if room > 0 else []
        if drafts and self.draft_filter is not None:
            drafts = self.draft_filter(seq, drafts)
        if not drafts:
            return 0
        # Blocks for drafts only while every running sequence could still get a block this
        # step: a decode must never be preempted for another sequence's drafts.
        bm = self.block_manager
        needed = bm.num_blocks_needed(seq, 1 + len(drafts))
        if needed > bm.num_blocks_needed(seq, 1) and bm.num_free_blocks - needed < len(self.running):
            return 0
        out.draft_token_ids[seq.seq_id] = drafts
        return len(drafts)

    def _pick_victim(self) -> Sequence:
        if self.config.policy == "priority":
            return max(self.running, key=self._priority_key)
        return self.running[-1]

    def _priority_key(self, seq: Sequence) -> tuple[int, float, int]:
        return (seq.priority, seq.arrival_time, self._order[seq.seq_id])

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Recompute preemption; returns the budget seq had taken in this step (if any)."""
        computed = seq.num_computed_tokens
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(seq, front=True)
        out.preempted_ids.append(seq.seq_id)
        if seq not in out.seqs:
            return 0
        i = out.seqs.index(seq)
        del out.seqs[i]
        n = out.num_scheduled_tokens.pop(i)
        drafted = out.draft_token_ids.pop(seq.seq_id, None) is not None
        if n > 1 and not drafted:  # its prefill chunk no longer counts against the allowance
            self._allowance.credit(computed, n)
        return n

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        queue = list(self.waiting)
        if self.config.policy == "priority":
            queue.sort(key=self._priority_key)
        for seq in queue:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if seq.waiting_for_grammar:
                continue  # its grammar compiles off the step loop; the others go ahead
            n = self._admit(seq, budget)
            if n == 0:
                return  # head of line: later sequences wait behind it
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(n)
            budget -= n

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Move seq to running with its prefix hits and first chunk; 0 if blocks are short or
        the step's prompt allowance has no room for it."""
        bm = self.block_manager
        hits = bm.get_computed_blocks(seq)
        num_cached = len(hits) * bm.block_size
        n = self._allowance.fit(num_cached, min(seq.num_tokens - num_cached,
                                                self.config.prefill_chunk_cap, budget))
        if n == 0 or not bm.can_allocate(seq, n, hits):
            return 0
        bm.allocate(seq, n, hits)
        self._allowance.debit(num_cached, n)
        seq.num_computed_tokens = num_cached
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
            seq.num_cached_tokens = num_cached
        self._remove_waiting(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return n

    def _push_waiting(self, seq: Sequence, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self._waiting_tokens += seq.num_tokens

    def _remove_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self._waiting_tokens -= seq.num_tokens

    # -- after the forward -------------------------------------------------------------------

    def postprocess(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, int],
        verified_token_ids: Mapping[str, list[int]] | None = None,
    ) -> list[Sequence]:
        """Advance the step's sequences; returns those that got a token or finished.
        `verified_token_ids`: for each speculating sequence, the drafts the model kept and
        its own token after them (engine/worker/model_runner.py)."""
        done: list[Sequence] = []
        for i, seq in enumerate(output.seqs):
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted or finished between schedule() and postprocess()
            drafts = output.draft_token_ids.get(seq.seq_id)
            if drafts is not None:
                assert verified_token_ids is not None, "a speculating step without its tokens"
                self._on_verified(seq, len(drafts), verified_token_ids[seq.seq_id])
                done.append(seq)
                continue
            sampled = output.samples(i)  # before advancing: it compares computed with total
            self._advance(seq, output.num_scheduled_tokens[i])
            if sampled:
                self._on_sample(seq, sampled_token_ids[seq.seq_id])
                done.append(seq)
        return done

    def _on_verified(self, seq: Sequence, num_drafts: int, tokens: list[int]) -> None:
        """Append a speculating seq's verified tokens (its kept drafts, then the model's next
        token) as decoding would have, one at a time, up to a stop. Every appended token but
        the newest has its K/V in the cache now: the pending token's and the kept drafts'.
        The rejected drafts' slots hold stale K/V that no query reads: positions past
        num_computed_tokens are written again before they are attended to."""
        assert 1 <= len(tokens) <= num_drafts + 1, (tokens, num_drafts)
        self.spec_stats.observe(num_drafts, len(tokens) - 1)
        assert self.proposer is not None
        self.proposer.observe(seq.seq_id, num_drafts, len(tokens) - 1)
        finish = None
        appended = 0
        for token_id in tokens:
            seq.append_token(token_id)
            appended += 1
            finish = stop_policy.after_token(seq, token_id, self.limits.eos_token_ids,
                                             self.limits.max_model_len)
            if finish is not None:
                break
        self._advance(seq, appended)
        if finish is not None:
            self._finish_running(seq, *finish)

    def _advance(self, seq: Sequence, num_computed: int) -> None:
        """num_computed more of seq's tokens have their K/V: publish the blocks they filled
        and release those that fell out of a sliding window."""
        seq.num_computed_tokens += num_computed
        self.block_manager.cache_full_blocks(seq)
        if self.limits.sliding_window:
            self.block_manager.release_out_of_window(seq, self.limits.sliding_window)

    def _on_sample(self, seq: Sequence, token_id: int) -> None:
        params = seq.params
        if params.max_tokens == 0:  # echo-only scoring: the prompt was all it wanted
            self._finish_running(seq, SequenceStatus.FINISHED_LENGTH, None)
            return
        seq.append_token(token_id)
        finish = stop_policy.after_token(seq, token_id, self.limits.eos_token_ids,
                                         self.limits.max_model_len)
        if finish is not None:
            self._finish_running(seq, *finish)

    def _finish_running(
        self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None
    ) -> None:
        self.running.remove(seq)
        self._finish(seq, status, stop_reason)

    # -- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Queues and block pool agree (raises AssertionError with details)."""
        self.block_manager.check_invariants()
        for seq in self.waiting:
            assert seq.status == SequenceStatus.WAITING and not seq.block_table \
                and seq.num_computed_tokens == 0, repr(seq)
        for seq in self.running:
            assert seq.status == SequenceStatus.RUNNING and seq.num_uncomputed_tokens > 0, seq
        assert len(self.running) <= self.config.max_num_seqs, len(self.running)
        ids = [s.seq_id for s in itertools.chain(self.waiting, self.running)]
        assert sorted(ids) == sorted(self._seqs), f"queues {ids} != known {list(self._seqs)}"
        assert self._waiting_tokens == sum(s.num_tokens for s in self.waiting)
