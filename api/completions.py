"""POST /v1/completions: prompts -> engine requests (n per prompt) -> a response or SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.errors import CLIENT_CLOSED, bad_request, from_engine_error
from api.params import read_json
from api.protocol_completion import CompletionRequest, Prompt, parse_completion
from api.responses import (
    ChoiceState,
    LogprobEntry,
    completion_choice,
    completion_logprobs,
    envelope,
    token_entries,
    usage,
)
from api.sampling import build_params, check_context
from api.sse import sse_response
from api.state import AppState, new_request_id, now, tokenize_text
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
    groups = [await _prepare(app, p, req.echo) for p in req.prompts]
    meta = _Meta(new_request_id("cmpl"), now(), app.served_model_name)
    jobs = _jobs(app, req, groups, meta.id, app.deadline(arrival, req.sampling.timeout))
    stream = await start_stream(app.engine, jobs, app.metrics, app.lifecycle)
    if req.stream:
        return sse_response(_events(stream, req, groups, meta), stream.close)
    try:
        body = await run_unless_disconnected(request.receive, _collect(stream, req, groups, meta))
    finally:
        await stream.close()
    return JSONResponse(body) if body is not None else Response(status_code=CLIENT_CLOSED)


async def _prepare(app: AppState, prompt: Prompt, echo: bool) -> _Group:
    if isinstance(prompt, str):
        ids = await tokenize_text(app.engine, prompt, True, "prompt", app.limits())
        return _Group(ids, prompt if echo else "")
    if not echo:
        return _Group(prompt, "")
    try:
        return _Group(prompt, await app.engine.detokenize(prompt))
    except EngineDeadError as e:
        raise from_engine_error(e, app.engine.stats()) from None
    except (ValueError, IndexError, OverflowError, TypeError) as e:
        raise bad_request(f"prompt contains invalid token ids: {e}", param="prompt") from None


def _jobs(app: AppState, req: CompletionRequest, groups: list[_Group], rid: str,
          deadline: float | None) -> list[Job]:
    jobs: list[Job] = []
    for group in groups:
        max_tokens = check_context(len(group.token_ids), req.sampling.max_tokens,
                                   app.limits().max_model_len, "prompt")
        prompt_logprobs = req.logprobs if req.echo else None
        app.metrics.observe_params(req.sampling.n, max_tokens)
        for params in build_params(req.sampling, max_tokens, logprobs=req.logprobs,
                                   prompt_logprobs=prompt_logprobs):
            tracker = app.metrics.tracker(len(group.token_ids))
            jobs.append(Job(f"{rid}-{len(jobs)}", group.token_ids, params,
                            req.sampling.priority, tracker, deadline))
    return jobs


async def _echo_entries(engine: EngineClient, out: RequestOutput) -> list[LogprobEntry]:
    """Prompt logprobs as entries; the first token has none, so its text is decoded here."""
    ids, lps = out.prompt_token_ids or (), out.prompt_logprobs or ()
    return [(lp.chosen.token if lp is not None else await engine.detokenize([tid]), lp)
            for tid, lp in zip(ids, lps)]


async def _delta(engine: EngineClient, req: CompletionRequest, group: _Group, state: ChoiceState,
           out: RequestOutput) -> tuple[str, list[LogprobEntry]]:
    """The text and logprob entries this delta adds; the first one carries the echo."""
    text, entries = out.new_text, token_entries(out)
    if req.echo and not state.prompt_seen and out.prompt_token_ids is not None:
        text = group.echo_text + text
        if req.logprobs is not None:
            entries = await _echo_entries(engine, out) + entries
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
    choices = [completion_choice(i, "".join(texts[i]), _logprobs(req, entries[i], 0), s)
               for i, s in enumerate(states)]
    return envelope(meta.id, meta.created, meta.model, "text_completion", choices,
                    _usage(groups, states, n))


def _logprobs(req: CompletionRequest, entries: list[LogprobEntry],
              offset: int) -> dict[str, Any] | None:
    return completion_logprobs(entries, offset) if req.logprobs is not None else None


def _usage(groups: list[_Group], states: list[ChoiceState], n: int) -> dict[str, int]:
    # Each prompt is counted once however many choices share it (as vLLM does).
    return usage(sum(len(g.token_ids) for g in groups), sum(s.num_tokens for s in states))


async def _events(stream: MergedStream, req: CompletionRequest, groups: list[_Group],
                  meta: _Meta) -> AsyncGenerator[dict[str, Any], None]:
    engine = stream.engine
    n = req.sampling.n
    states = [ChoiceState() for _ in range(len(groups) * n)]
    try:
        async for i, out in stream:
            state = states[i]
            text, entries = await _delta(engine, req, groups[i // n], state, out)
            if not text and not entries and not out.finished:
                continue  # e.g. a prefill chunk or held-back partial text: nothing to say
            logprobs = _logprobs(req, entries, state.text_offset)
            state.text_offset += sum(len(tok) for tok, _ in entries)
            choice = completion_choice(i, text, logprobs, state)
            yield envelope(meta.id, meta.created, meta.model, "text_completion", [choice])
        if req.include_usage:
            yield envelope(meta.id, meta.created, meta.model, "text_completion", [],
                           _usage(groups, states, n))
    finally:
        await stream.close()
