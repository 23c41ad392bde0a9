"""POST /v1/chat/completions: messages -> chat template -> engine requests -> response or SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.chat_template import render_chat
from api.chat_tools import ToolCalls, finish_reason, make_parser, stream_delta
from api.errors import CLIENT_CLOSED
from api.params import read_json
from api.protocol_chat import ChatRequest, parse_chat
from api.responses import (
    ChoiceState,
    chat_choice,
    chat_chunk_choice,
    chat_logprobs,
    envelope,
    token_entries,
    usage,
)
from api.sampling import build_params, check_context
from api.sse import sse_response
from api.state import AppState, new_request_id, now
from api.streams import Job, MergedStream, run_unless_disconnected, start_stream
from engine.outputs import RequestOutput

CHUNK = "chat.completion.chunk"


async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    app = AppState.of(request)
    req = parse_chat(await read_json(request, app.max_body_bytes),
                     app.trust_request_chat_template)
    app.check_model(req.model)
    app.check_admitting()
    prompt = await render_chat(app.engine, req.messages, req.template, req.tools,
                               limits=app.limits())
    rid, created = new_request_id("chatcmpl"), now()
    deadline = app.deadline(arrival, req.sampling.timeout)
    stream = await start_stream(app.engine, _jobs(app, req, prompt, rid, deadline),
                                app.metrics, app.lifecycle)
    head = (rid, created, app.served_model_name)
    if req.stream:
        return sse_response(_events(stream, req, len(prompt), head), stream.close)
    try:
        body = await run_unless_disconnected(request.receive,
                                             _collect(stream, req, len(prompt), head))
    finally:
        await stream.close()
    return JSONResponse(body) if body is not None else Response(status_code=CLIENT_CLOSED)


def _jobs(app: AppState, req: ChatRequest, prompt: list[int], rid: str,
          deadline: float | None) -> list[Job]:
    max_tokens = check_context(len(prompt), req.sampling.max_tokens,
                               app.limits().max_model_len, "messages")
    params = build_params(req.sampling, max_tokens, logprobs=req.logprobs)
    return [Job(f"{rid}-{i}", prompt, p, req.sampling.priority,
                app.metrics.tracker(len(prompt)), deadline) for i, p in enumerate(params)]


def _logprobs(req: ChatRequest, state_entries: list[Any]) -> dict[str, Any] | None:
    return chat_logprobs(state_entries, req.logprobs) if req.logprobs is not None else None


async def _collect(stream: MergedStream, req: ChatRequest, prompt_len: int,
                   head: tuple[str, int, str]) -> dict[str, Any]:
    states = [ChoiceState() for _ in range(req.sampling.n)]
    async for i, out in stream:
        states[i].add(out)
    choices = [_choice(req, i, s) for i, s in enumerate(states)]
    return envelope(*head, obj="chat.completion", choices=choices,
                    usage_=usage(prompt_len, sum(s.num_tokens for s in states)))


def _choice(req: ChatRequest, index: int, state: ChoiceState) -> dict[str, Any]:
    choice = chat_choice(index, state, _logprobs(req, state.logprobs))
    parser = make_parser(req.tools)
    if parser is not None:
        calls = ToolCalls(parser)
        calls.feed("".join(state.text), finished=True)
        choice["message"] = calls.message()
        choice["finish_reason"] = finish_reason(state.finish_reason, bool(calls.calls))
    return choice


async def _events(stream: MergedStream, req: ChatRequest, prompt_len: int,
                  head: tuple[str, int, str]) -> AsyncGenerator[dict[str, Any], None]:
    states = [ChoiceState() for _ in range(req.sampling.n)]
    parsers = [make_parser(req.tools) for _ in range(req.sampling.n)]
    calls = [ToolCalls(p) if p is not None else None for p in parsers]
    try:
        for i in range(req.sampling.n):  # OpenAI opens each choice with the role alone
            role = chat_chunk_choice(i, {"role": "assistant", "content": ""}, None, None)
            yield envelope(*head, obj=CHUNK, choices=[role])
        async for i, out in stream:
            states[i].add(out)
            entries = token_entries(out)
            delta, reason = _delta(out, calls[i])
            if not (delta.get("content") or delta.get("tool_calls") or entries or out.finished):
                continue  # nothing to say yet (prefill chunk, held-back partial text)
            choice = chat_chunk_choice(i, delta, _logprobs(req, entries), reason,
                                       out.stop_reason)
            yield envelope(*head, obj=CHUNK, choices=[choice])
        if req.include_usage:
            total = sum(s.num_tokens for s in states)
            yield envelope(*head, obj=CHUNK, choices=[], usage_=usage(prompt_len, total))
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
