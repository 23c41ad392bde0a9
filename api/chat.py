"""POST /v1/chat/completions: messages -> chat template -> engine requests -> response or SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.errors import CLIENT_CLOSED, bad_request, from_engine_error
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
from api.state import AppState, new_request_id, now, tokenize_text
from api.streams import Job, MergedStream, run_unless_disconnected, start_stream
from engine.protocol import EngineClient, EngineDeadError, EngineLimits

CHUNK = "chat.completion.chunk"


async def create_chat_completion(request: Request) -> Response:
    arrival = time.monotonic()
    app = AppState.of(request)
    req = parse_chat(await read_json(request, app.max_body_bytes))
    app.check_model(req.model)
    app.check_admitting()
    prompt = await render_chat(app.engine, req.messages, req.add_generation_prompt,
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


async def render_chat(engine: EngineClient, messages: list[dict[str, Any]],
                      add_generation_prompt: bool, add_special_tokens: bool = False,
                      limits: EngineLimits | None = None) -> list[int]:
    """The chat template's text, tokenized; by default without extra special tokens (the
    template has its own BOS where the model wants one). `messages` were validated by
    parse_messages; given the limits, a text too long to ever fit is refused untokenized."""
    try:
        text = await engine.apply_chat_template(messages,
                                                add_generation_prompt=add_generation_prompt)
    except EngineDeadError as e:
        raise from_engine_error(e, engine.stats()) from None
    except Exception as e:  # noqa: BLE001 - templates raise anything on the client's input
        raise bad_request(f"messages cannot be rendered by the chat template: {e}",
                          param="messages") from None
    return await tokenize_text(engine, text, add_special_tokens, "messages", limits)


def _jobs(app: AppState, req: ChatRequest, prompt: list[int], rid: str,
          deadline: float | None) -> list[Job]:
    max_tokens = check_context(len(prompt), req.sampling.max_tokens,
                               app.limits().max_model_len, "messages")
    params = build_params(req.sampling, max_tokens, logprobs=req.logprobs)
    app.metrics.observe_params(req.sampling.n, max_tokens)
    return [Job(f"{rid}-{i}", prompt, p, req.sampling.priority,
                app.metrics.tracker(len(prompt)), deadline) for i, p in enumerate(params)]


def _logprobs(req: ChatRequest, state_entries: list[Any]) -> dict[str, Any] | None:
    return chat_logprobs(state_entries, req.logprobs) if req.logprobs is not None else None


async def _collect(stream: MergedStream, req: ChatRequest, prompt_len: int,
                   head: tuple[str, int, str]) -> dict[str, Any]:
    states = [ChoiceState() for _ in range(req.sampling.n)]
    async for i, out in stream:
        states[i].add(out)
    choices = [chat_choice(i, s, _logprobs(req, s.logprobs)) for i, s in enumerate(states)]
    return envelope(*head, obj="chat.completion", choices=choices,
                    usage_=usage(prompt_len, sum(s.num_tokens for s in states)))


async def _events(stream: MergedStream, req: ChatRequest, prompt_len: int,
                  head: tuple[str, int, str]) -> AsyncGenerator[dict[str, Any], None]:
    states = [ChoiceState() for _ in range(req.sampling.n)]
    try:
        for i in range(req.sampling.n):  # OpenAI opens each choice with the role alone
            role = chat_chunk_choice(i, {"role": "assistant", "content": ""}, None, None)
            yield envelope(*head, obj=CHUNK, choices=[role])
        async for i, out in stream:
            states[i].add(out)
            entries = token_entries(out)
            if not out.new_text and not entries and not out.finished:
                continue  # nothing to say yet (prefill chunk, held-back partial text)
            delta = {"content": out.new_text} if out.new_text or not out.finished else {}
            choice = chat_chunk_choice(i, delta, _logprobs(req, entries), out.finish_reason,
                                       out.stop_reason)
            yield envelope(*head, obj=CHUNK, choices=[choice])
        if req.include_usage:
            total = sum(s.num_tokens for s in states)
            yield envelope(*head, obj=CHUNK, choices=[], usage_=usage(prompt_len, total))
    finally:
        await stream.close()
