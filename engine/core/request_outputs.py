"""Per-request engine state and the deltas built from it: new token ids, text and logprobs,
and on the final delta the finish reason, stop reason, queue time and timings.

These only build what is sent; LLMEngine decides when a request ends (and asks the scheduler
to finish its sequence) before it asks for the final delta.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from engine.outputs import ErrorCode, Logprob, RequestOutput, RequestTimings, TokenLogprobs
from engine.tokenizer import IncrementalDetokenizer
from engine.worker.runner_output import RunnerOutput, TokenLogprobIds
from scheduler.output import SchedulerOutput
from scheduler.sequence import Sequence, SequenceStatus

TokenText = Callable[[int], str]  # a token id's own text (Tokenizer.token_text)


@dataclass(slots=True)
class RequestState:
    """Engine-side state of one request: what has been sent, text, prompt logprobs."""

    seq: Sequence
    detok: IncrementalDetokenizer
    num_sent_tokens: int = 0
    sent_first: bool = False
    prompt_logprobs: list[TokenLogprobIds] = field(default_factory=list)
    deadline: float | None = None  # time.monotonic() after which the request times out
    first_token_time: float | None = None  # time.monotonic() of its first and latest token
    last_token_time: float | None = None


def collect_prompt_logprobs(requests: Mapping[str, RequestState], batch: SchedulerOutput,
                            result: RunnerOutput) -> None:
    """Keep the step's prompt logprobs until the request's first delta sends them."""
    for seq in batch.seqs:
        req = requests.get(seq.seq_id)
        chunk = result.prompt_logprobs.get(seq.seq_id)
        # The runner reports each prompt position once, also across a recompute after
        # preemption, so chunks simply append.
        if req is not None and chunk is not None and not req.sent_first:
            req.prompt_logprobs.extend(chunk)


def text_ids(seq: Sequence, new_ids: list[int]) -> list[int]:
    """Ids fed to the detokenizer: a stop *token* is not part of the text (as vLLM)."""
    stopped_by_id = (seq.status == SequenceStatus.FINISHED_STOPPED
                     and isinstance(seq.stop_reason, int))
    if stopped_by_id and new_ids and not seq.params.include_stop_str_in_output:
        return new_ids[:-1]
    return new_ids


def sampled_logprobs(seq: Sequence, result: RunnerOutput, num_new: int,
                     token_text: TokenText) -> tuple[TokenLogprobs, ...] | None:
    """The logprobs of the step's num_new tokens: one sampled token's, or the first num_new
    of a verified run's (a stop inside the run cuts its tokens and their logprobs alike)."""
    if seq.params.logprobs is None or num_new == 0:
        return None
    verified = result.verified_logprobs.get(seq.seq_id)
    if verified is not None:
        return tuple(to_logprobs(lp, token_text) for lp in verified[:num_new])
    lp = result.logprobs.get(seq.seq_id)
    return (to_logprobs(lp, token_text),) if lp is not None else None


def to_logprobs(lp: TokenLogprobIds, token_text: TokenText) -> TokenLogprobs:
    top = tuple(Logprob(t, token_text(t), v) for t, v in zip(lp.top_ids, lp.top_logprobs))
    return TokenLogprobs(Logprob(lp.token_id, token_text(lp.token_id), lp.logprob), lp.rank, top)


def delta(req: RequestState, new_ids: tuple[int, ...], text: str,
          logprobs: tuple[TokenLogprobs, ...] | None, token_text: TokenText) -> RequestOutput:
    """One delta; the first a request sends also carries its prompt (ids and logprobs)."""
    seq = req.seq
    first = not req.sent_first
    req.sent_first = True
    return RequestOutput(
        request_id=seq.seq_id, new_token_ids=new_ids, new_text=text, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs(req, token_text) if first else None,
        prompt_token_ids=tuple(seq.prompt_token_ids) if first else None,
        num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.num_cached_tokens)


def final_delta(req: RequestState, new_ids: tuple[int, ...], text: str,
                logprobs: tuple[TokenLogprobs, ...] | None, token_text: TokenText, *,
                finish_reason: str | None, error: str | None,
                error_code: ErrorCode | None) -> RequestOutput:
    """The last delta of a request whose sequence has finished. `finish_reason` overrides the
    status's ("timeout"); `error` marks an engine failure."""
    seq = req.seq
    base = delta(req, new_ids, text, logprobs, token_text)
    queue_time = (None if seq.first_scheduled_time is None
                  else seq.first_scheduled_time - seq.arrival_time)
    return replace(base, finish_reason=finish_reason or seq.status.finish_reason,
                   stop_reason=stop_reason(seq), queue_time=queue_time, error=error,
                   error_code=error_code, timings=timings(req))


def stop_reason(seq: Sequence) -> int | str | None:
    """As vLLM: None for EOS, the token id for a stop_token_ids hit, or the stop string."""
    r = seq.stop_reason
    if isinstance(r, int) and r not in seq.params.stop_token_ids:
        return None
    return r


def prompt_logprobs(req: RequestState,
                    token_text: TokenText) -> tuple[TokenLogprobs | None, ...] | None:
    if req.seq.params.prompt_logprobs is None:
        return None
    rest = tuple(to_logprobs(lp, token_text) for lp in req.prompt_logprobs)
    return (None, *rest)


def timings(req: RequestState) -> RequestTimings:
    """The request's intervals from the timestamps taken as things happened (see
    RequestTimings); the scheduler stamps first_scheduled_time, LLMEngine the tokens."""
    seq = req.seq
    scheduled, first, last = seq.first_scheduled_time, req.first_token_time, req.last_token_time
    if scheduled is None:
        return RequestTimings()
    queue = scheduled - seq.arrival_time
    if first is None or last is None:
        return RequestTimings(queue=queue)
    return RequestTimings(queue=queue, prefill=first - scheduled, decode=last - first,
                          inference=last - scheduled)
