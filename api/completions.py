"""POST /v1/completions: prompts -> engine requests (n per prompt) -> a response or SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.errors import CLIENT_CLOSED, bad_request, from_engine_error
from api.requests.completion import CompletionRequest, Prompt, parse_completion
from api.requests.options import fit_factor, truncate
from api.requests.params import read_json
from api.requests.sampling import build_params, check_context
from api.responses import (
    ChoiceState,
    LogprobEntry,
    completion_choice,
    completion_logprobs,
    envelope,
    prompt_logprobs,
    token_entries,
    token_name,
    usage,
)
from api.sse import sse_response
from api.state import AppState, now, request_ids, tokenize_text
from api.streams import Job, MergedStream, run_unless_disconnected, start_stream
from engine.outputs import RequestOutput
from engine.protocol import EngineClient, EngineDeadError


@dataclass(frozen=True, slots=True)
class _Group:
    """One prompt of the request, tokenized; its choices are n consecutive indices."""

    token_ids: list[int]
    echo_text: str  # "" unless echo


@dataclass(frozen=True, slots=True)
class _Meta:
    id: str
    created: int
    model: str


async def create_completion(request: Request) -> Response:
    arrival = time.monotonic()
    app = AppState.of(request)
    req = parse_completion(await read_json(request, app.max_body_bytes))
    app.check_model(req.model)
    app.check_admitting()
    groups = [await _prepare(app, p, req) for p in req.prompts]
    shown_id, engine_id = request_ids("cmpl", req.options.request_id)
    meta = _Meta(shown_id, now(), app.served_model_name)
    jobs = _jobs(app, req, groups, engine_id, app.deadline(arrival, req.sampling.timeout))
    # A client that leaves while its request waits (for admission, or its grammar's compile)
    # ends it there: the request leaves the queue.
    stream = await run_unless_disconnected(
        request.receive, start_stream(app.engine, jobs, app.metrics, app.lifecycle))
    if stream is None:
        return Response(status_code=CLIENT_CLOSED)
    if req.stream:
        return sse_response(_events(stream, req, groups, meta), stream.close)
    try:
        body = await run_unless_disconnected(request.receive, _collect(stream, req, groups, meta))
    finally:
        await stream.close()
    return JSONResponse(body) if body is not None else Response(status_code=CLIENT_CLOSED)


async def _prepare(app: AppState, prompt: Prompt, req: CompletionRequest) -> _Group:
    """The prompt's tokens (truncated when asked) and, with echo, the text they spell."""
    opts = req.options
    if isinstance(prompt, str):
        ids = await tokenize_text(app.engine, prompt, opts.add_special_tokens, "prompt",
                                  app.limits(), fit_factor(opts))
    else:
        ids = prompt
    kept = truncate(ids, opts, app.limits().max_model_len, req.sampling.max_tokens)
    if not req.echo or opts.token_ids:  # vLLM: with return_token_ids the ids are the echo
        return _Group(kept, "")
    if isinstance(prompt, str) and len(kept) == len(ids):
        return _Group(kept, prompt)
    try:  # token ids, or a truncated text: echo what the model was given
        return _Group(kept, await app.engine.detokenize(kept))
    except EngineDeadError as e:
        raise from_engine_error(e, app.engine.stats()) from None
    except (ValueError, IndexError, OverflowError, TypeError) as e:
        raise bad_request(f"prompt contains invalid token ids: {e}", param="prompt") from None


def _prompt_logprobs(req: CompletionRequest) -> int | None:
    """vLLM: prompt_logprobs when given, else with echo the logprobs count (echo scoring)."""
    if req.options.prompt_logprobs is not None:
        return req.options.prompt_logprobs
    return req.logprobs if req.echo else None


def _jobs(app: AppState, req: CompletionRequest, groups: list[_Group], rid: str,
          deadline: float | None) -> list[Job]:
    jobs: list[Job] = []
    for group in groups:
        max_tokens = check_context(len(group.token_ids), req.sampling.max_tokens,
                                   app.limits().max_model_len, "prompt")
        choices = app.metrics.observe_params(req.sampling.n, max_tokens)
        for params in build_params(req.sampling, max_tokens, logprobs=req.logprobs,
                                   prompt_logprobs=_prompt_logprobs(req)):
            tracker = app.metrics.tracker(len(group.token_ids), choices)
            jobs.append(Job(f"{rid}-{len(jobs)}", group.token_ids, params,
                            req.sampling.priority, tracker, deadline))
    return jobs


async def _echo_entries(engine: EngineClient, out: RequestOutput,
                        as_ids: bool) -> list[LogprobEntry]:
    """Prompt logprobs as entries; the first token has none, so its text is decoded here."""
    ids, lps = out.prompt_token_ids or (), out.prompt_logprobs or ()
    return [(await _first_token(engine, tid, as_ids) if lp is None
             else token_name(lp.chosen, as_ids), lp) for tid, lp in zip(ids, lps)]


async def _first_token(engine: EngineClient, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else await engine.detokenize([token_id])


async def _delta(engine: EngineClient, req: CompletionRequest, group: _Group, state: ChoiceState,
           out: RequestOutput) -> tuple[str, list[LogprobEntry]]:
    """The text and logprob entries this delta adds; the first one carries the echo."""
    as_ids = req.options.tokens_as_ids
    text, entries = out.new_text, token_entries(out, as_ids)
    if req.echo and not state.prompt_seen and out.prompt_token_ids is not None:
        text = group.echo_text + text
        if req.logprobs is not None:
            entries = await _echo_entries(engine, out, as_ids) + entries
    state.add(out)
    return text, entries


async def _collect(stream: MergedStream, req: CompletionRequest, groups: list[_Group],
                   meta: _Meta) -> dict[str, Any]:
    engine = stream.engine
    n = req.sampling.n
    states = [ChoiceState() for _ in range(len(groups) * n)]
    texts: list[list[str]] = [[] for _ in states]
    entries: list[list[LogprobEntry]] = [[] for _ in states]
    async for i, out in stream:
        text, new_entries = await _delta(engine, req, groups[i // n], states[i], out)
        texts[i].append(text)
        entries[i].extend(new_entries)
    choices = [_choice(req, i, "".join(texts[i]), _logprobs(req, entries[i], 0), s,
                       groups[i // n]) for i, s in enumerate(states)]
    return envelope(meta.id, meta.created, meta.model, "text_completion", choices,
                    _usage(groups, states, n))


def _choice(req: CompletionRequest, i: int, text: str, logprobs: dict[str, Any] | None,
            state: ChoiceState, group: _Group) -> dict[str, Any]:
    choice = completion_choice(i, text, logprobs, state)
    if _prompt_logprobs(req) is not None:  # vLLM returns them on each choice of the prompt
        choice["prompt_logprobs"] = prompt_logprobs(state.prompt_logprobs or ())
    return _with_ids(req, choice, group.token_ids, state.token_ids)


def _with_ids(req: CompletionRequest, choice: dict[str, Any], prompt_ids: list[int] | None,
              ids: Sequence[int]) -> dict[str, Any]:
    """return_token_ids: the prompt's ids (in a stream: on a choice's first chunk only) and
    the generated ones (in a stream: this chunk's)."""
    if req.options.token_ids:
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = list(ids)
    return choice


def _logprobs(req: CompletionRequest, entries: list[LogprobEntry],
              offset: int) -> dict[str, Any] | None:
    if req.logprobs is None:
        return None
    return completion_logprobs(entries, offset, req.options.tokens_as_ids)


def _usage(groups: list[_Group], states: list[ChoiceState], n: int) -> dict[str, Any]:
    # Each prompt is counted once however many choices share it (as vLLM does); its cached
    # tokens are its first choice's.
    return usage(sum(len(g.token_ids) for g in groups), sum(s.num_tokens for s in states),
                 sum(states[g * n].cached_tokens for g in range(len(groups))))


async def _events(stream: MergedStream, req: CompletionRequest, groups: list[_Group],
                  meta: _Meta) -> AsyncGenerator[dict[str, Any], None]:
    engine = stream.engine
    n = req.sampling.n
    states = [ChoiceState() for _ in range(len(groups) * n)]
    started: set[int] = set()  # choices that sent a chunk
    try:
        async for i, out in stream:
            state = states[i]
            text, entries = await _delta(engine, req, groups[i // n], state, out)
            ids_due = req.options.token_ids and out.new_token_ids
            if not text and not entries and not out.finished and not ids_due:
                continue  # e.g. a prefill chunk or held-back partial text: nothing to say
            logprobs = _logprobs(req, entries, state.text_offset)
            state.text_offset += sum(len(tok) for tok, _ in entries)
            prompt_ids = None if i in started else groups[i // n].token_ids
            started.add(i)
            choice = _with_ids(req, completion_choice(i, text, logprobs, state), prompt_ids,
                               out.new_token_ids)
            yield envelope(meta.id, meta.created, meta.model, "text_completion", [choice],
                           _chunk_usage(req, len(groups[i // n].token_ids), state))
        if req.options.include_usage:
            yield envelope(meta.id, meta.created, meta.model, "text_completion", [],
                           _usage(groups, states, n))
    finally:
        await stream.close()


def _chunk_usage(req: CompletionRequest, prompt_len: int,
                 state: ChoiceState) -> dict[str, Any] | None:
    """continuous_usage_stats: this choice's usage so far on each of its chunks (vLLM)."""
    return usage(prompt_len, state.num_tokens) if req.options.continuous_usage else None
