"""POST /v1/chat/completions: messages -> chat template -> engine requests -> response or SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.chat_template import render_chat
from api.errors import CLIENT_CLOSED
from api.requests.chat import ChatRequest, parse_chat
from api.requests.options import fit_factor, truncate
from api.requests.params import read_json
from api.requests.sampling import build_params, check_context
from api.responses import (
    ChoiceState,
    chat_choice,
    chat_chunk_choice,
    chat_logprobs,
    envelope,
    prompt_logprobs,
    token_entries,
    usage,
)
from api.sse import sse_response
from api.state import AppState, now, request_ids
from api.streams import Job, MergedStream, run_unless_disconnected, start_stream
from api.tools.answers import ToolCalls, finish_reason, make_parser, stream_delta
from engine.outputs import RequestOutput

CHUNK = "chat.completion.chunk"


async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    app = AppState.of(request)
    req = parse_chat(await read_json(request, app.max_body_bytes),
                     app.trust_request_chat_template)
    app.check_model(req.model)
    app.check_admitting()
    opts = req.options
    prompt = await render_chat(app.engine, req.messages, req.template, req.tools,
                               opts.add_special_tokens, app.limits(), fit_factor(opts))
    prompt = truncate(prompt, opts, app.limits().max_model_len, req.sampling.max_tokens)
    shown_id, engine_id = request_ids("chatcmpl", opts.request_id)
    deadline = app.deadline(arrival, req.sampling.timeout)
    # A client that leaves while its request waits (for admission, or its grammar's compile)
    # ends it there: the request leaves the queue.
    stream = await run_unless_disconnected(request.receive, start_stream(
        app.engine, _jobs(app, req, prompt, engine_id, deadline), app.metrics, app.lifecycle))
    if stream is None:
        return Response(status_code=CLIENT_CLOSED)
    head = (shown_id, now(), app.served_model_name)
    if req.stream:
        return sse_response(_events(stream, req, prompt, head), stream.close)
    try:
        body = await run_unless_disconnected(request.receive,
                                             _collect(stream, req, prompt, head))
    finally:
        await stream.close()
    return JSONResponse(body) if body is not None else Response(status_code=CLIENT_CLOSED)


def _jobs(app: AppState, req: ChatRequest, prompt: list[int], rid: str,
          deadline: float | None) -> list[Job]:
    max_tokens = check_context(len(prompt), req.sampling.max_tokens,
                               app.limits().max_model_len, "messages")
    params = build_params(req.sampling, max_tokens, logprobs=req.logprobs,
                          prompt_logprobs=req.options.prompt_logprobs)
    choices = app.metrics.observe_params(req.sampling.n, max_tokens)
    return [Job(f"{rid}-{i}", prompt, p, req.sampling.priority,
                app.metrics.tracker(len(prompt), choices), deadline)
            for i, p in enumerate(params)]


def _logprobs(req: ChatRequest, state_entries: list[Any]) -> dict[str, Any] | None:
    if req.logprobs is None:
        return None
    return chat_logprobs(state_entries, req.logprobs, req.options.tokens_as_ids)


def _usage(prompt_len: int, states: list[ChoiceState]) -> dict[str, Any]:
    # One prompt shared by every choice: its cached tokens are the first choice's.
    return usage(prompt_len, sum(s.num_tokens for s in states), states[0].cached_tokens)


async def _collect(stream: MergedStream, req: ChatRequest, prompt: list[int],
                   head: tuple[str, int, str]) -> dict[str, Any]:
    states = [ChoiceState() for _ in range(req.sampling.n)]
    async for i, out in stream:
        states[i].add(out)
    choices = [_with_ids(req, _choice(req, i, s), s.token_ids) for i, s in enumerate(states)]
    if req.echo:  # the answer continues the assistant's last message
        for choice in choices:
            choice["message"]["content"] = req.echo + (choice["message"]["content"] or "")
    body = envelope(*head, obj="chat.completion", choices=choices,
                    usage_=_usage(len(prompt), states))
    if req.options.prompt_logprobs is not None:  # vLLM: once, on the response
        body["prompt_logprobs"] = prompt_logprobs(states[0].prompt_logprobs or ())
    if req.options.token_ids:
        body["prompt_token_ids"] = prompt
    return body


def _choice(req: ChatRequest, index: int, state: ChoiceState) -> dict[str, Any]:
    choice = chat_choice(index, state, _logprobs(req, state.logprobs))
    parser = make_parser(req.tools)
    if parser is not None:
        calls = ToolCalls(parser)
        calls.feed("".join(state.text), finished=True)
        choice["message"] = calls.message()
        choice["finish_reason"] = finish_reason(state.finish_reason, bool(calls.calls))
    return choice


def _with_ids(req: ChatRequest, choice: dict[str, Any], ids: Sequence[int]) -> dict[str, Any]:
    """return_token_ids: the choice's generated ids (in a stream: this chunk's)."""
    if req.options.token_ids:
        choice["token_ids"] = list(ids)
    return choice


def _chunk_usage(req: ChatRequest, prompt_len: int, num_tokens: int) -> dict[str, Any] | None:
    """continuous_usage_stats: this choice's usage so far on each of its chunks (vLLM)."""
    return usage(prompt_len, num_tokens) if req.options.continuous_usage else None


async def _events(stream: MergedStream, req: ChatRequest, prompt: list[int],
                  head: tuple[str, int, str]) -> AsyncGenerator[dict[str, Any], None]:
    states = [ChoiceState() for _ in range(req.sampling.n)]
    prompt_len = len(prompt)
    parsers = [make_parser(req.tools) for _ in range(req.sampling.n)]
    calls = [ToolCalls(p) if p is not None else None for p in parsers]
    try:
        for i in range(req.sampling.n):  # OpenAI opens each choice with the role alone
            role = chat_chunk_choice(i, {"role": "assistant", "content": ""}, None, None)
            chunk = envelope(*head, obj=CHUNK, choices=[role],
                             usage_=_chunk_usage(req, prompt_len, 0))
            if req.options.token_ids:  # vLLM: on the opening chunks
                chunk["prompt_token_ids"] = prompt
            yield chunk
        for i in range(req.sampling.n if req.echo else 0):  # vLLM: the echo, as a chunk
            echo = chat_chunk_choice(i, {"content": req.echo}, None, None)
            yield envelope(*head, obj=CHUNK, choices=[echo],
                           usage_=_chunk_usage(req, prompt_len, 0))
        async for i, out in stream:
            states[i].add(out)
            entries = token_entries(out)
            ids_due = req.options.token_ids and out.new_token_ids
            delta, reason = _delta(out, calls[i])
            if not (delta.get("content") or delta.get("tool_calls") or entries
                    or out.finished or ids_due):
                continue  # nothing to say yet (prefill chunk, held-back partial text)
            choice = chat_chunk_choice(i, delta, _logprobs(req, entries), reason,
                                       out.stop_reason)
            yield envelope(*head, obj=CHUNK, choices=[_with_ids(req, choice, out.new_token_ids)],
                           usage_=_chunk_usage(req, prompt_len, states[i].num_tokens))
        if req.options.include_usage:
            yield envelope(*head, obj=CHUNK, choices=[], usage_=_usage(prompt_len, states))
    finally:
        await stream.close()


def _delta(out: RequestOutput, calls: ToolCalls | None) -> tuple[dict[str, Any], str | None]:
    """The chunk's delta and finish_reason; with tools, the parser decides what is content."""
    if calls is None:
        # The last chunk of a choice has no content key unless it brings text.
        return ({"content": out.new_text} if out.new_text or not out.finished else {},
                out.finish_reason)
    delta = stream_delta(calls.feed(out.new_text, out.finished))
    return delta, finish_reason(out.finish_reason, bool(calls.calls))
