"""The HTTP side every baseline shares: pagedserve's `/v1/completions` protocol, `/health`,
`/v1/models`, and the command line.

Only what the load generator (and curl) needs: `prompt` (text or token ids), `max_tokens`,
greedy only (`temperature` absent or 0, anything else is a 400 with OpenAI's error body),
`stream` with `stream_options.include_usage`, `ignore_eos`; other fields are ignored.
Streamed chunks look like pagedserve's: one `text_completion` chunk per text delta (the last
one carries `finish_reason`), an optional usage chunk with empty `choices`, `data: [DONE]`.
A server plugs in a `submit` that turns a parsed request into a generation `Row` whose queue
the response reads; a client that leaves marks its row cancelled.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.baselines.generation import (
    DTYPES,
    CallerThreadExecutor,
    LoadedModel,
    Row,
    load_model,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class CompletionRequest:
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool


class RequestError(Exception):
    """A 400 with OpenAI's error body naming the offending parameter."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(400, str(self), self.param)


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status_code=status)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be a boolean", key)
    return value


def _prompt_ids(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one, as OpenAI clients send it
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        ids = prompt
        vocab = len(tokenizer)  # once: transformers 5.5's len() rebuilds the vocab (~6 ms)
        if any(t < 0 or t >= vocab for t in ids):
            raise RequestError("prompt token ids must be in the vocabulary", "prompt")
    else:
        raise RequestError("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise RequestError("prompt must not be empty", "prompt")
    return ids


def parse_completion(body: Any, lm: LoadedModel) -> CompletionRequest:
    """The request fields the baselines honour, validated (RequestError on bad input)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    ids = _prompt_ids(body["prompt"], lm.tokenizer)
    temperature = body.get("temperature")
    if temperature is not None and temperature != 0:
        raise RequestError("this baseline only decodes greedily: temperature must be 0",
                           "temperature")
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1", "n")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError("max_tokens must be a positive integer", "max_tokens")
    if len(ids) + max_tokens > lm.max_model_len:
        raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                           f"the context length {lm.max_model_len}", "max_tokens")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    return CompletionRequest(ids, max_tokens, _bool(body, "stream", False),
                             bool(options.get("include_usage", False)),
                             _bool(body, "ignore_eos", False))


class IncrementalDecoder:
    """Text deltas from a growing list of token ids, never splitting a multi-byte character:
    decode a short window and emit only what it adds over the previously read part
    (vLLM's prefix/read offsets), holding back text that ends in a partial UTF-8 sequence."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: one token of context before the unread part
        self.read = 0  # tokens already turned into text

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back (at the end of the stream)."""
        return self._emit(final=True) if self.read < len(self.ids) else ""

    def _emit(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


@dataclass(frozen=True)
class _Meta:
    id: str
    created: int
    model: str

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **extra}


def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(row: Row, req: CompletionRequest, lm: LoadedModel,
                  meta: _Meta) -> AsyncGenerator[str, None]:
    decoder = IncrementalDecoder(lm.tokenizer)
    try:
        while True:
            event = await row.queue.get()
            if isinstance(event, BaseException):
                yield _sse({"error": {"message": f"generation failed: {event}",
                                      "type": "server_error", "param": None,
                                      "code": "internal_error"}})
                break
            token, reason = event
            text = decoder.step(token) if token is not None else ""
            if reason is not None:
                text += decoder.flush()
            if text or reason is not None:
                yield _sse(meta.chunk([_choice(text, reason)]))
            if reason is not None:
                break
        if req.include_usage:
            yield _sse(meta.chunk([], usage=_usage(len(req.prompt_ids), len(decoder.ids))))
        yield "data: [DONE]\n\n"
    finally:
        if not row.finished:  # the client left (or the response failed): drop its tokens
            row.cancelled = True


async def _collect(row: Row, req: CompletionRequest, lm: LoadedModel, meta: _Meta) -> Response:
    ids: list[int] = []
    reason = None
    while reason is None:
        event = await row.queue.get()
        if isinstance(event, BaseException):
            return error_response(500, f"generation failed: {event}", type_="server_error",
                                  code="internal_error")
        token, reason = event
        if token is not None:
            ids.append(token)
    text = lm.tokenizer.decode(ids, skip_special_tokens=True)
    return JSONResponse(meta.chunk([_choice(text, reason)],
                                   usage=_usage(len(req.prompt_ids), len(ids))))


Submit = Callable[[CompletionRequest], Row]


def create_app(lm: LoadedModel, submit: Submit,
               lifespan: Callable[[Starlette], AbstractAsyncContextManager[None]] | None = None,
               ) -> Starlette:
    """The routes around `submit` (which schedules generation for one request)."""

    async def completions(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not valid JSON")
        try:
            req = parse_completion(body, lm)
        except RequestError as e:
            return e.response()
        meta = _Meta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), lm.name)
        row = submit(req)
        if req.stream:
            return StreamingResponse(_stream(row, req, lm, meta), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(row, req, lm, meta)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})  # the model is loaded before the app exists

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": lm.name, "object": "model", "created": 0, "owned_by": "baseline"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/health", health), Route("/v1/models", models)],
                     lifespan=lifespan)


def base_parser(description: str) -> argparse.ArgumentParser:
    """The flags every baseline takes (the same names as `pagedserve serve` where they exist)."""
    from api.cli import serving_threads

    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="safetensors model folder (with config.json)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-threads", type=int, default=serving_threads(),
                   help="torch threads (default: all usable cores, like `pagedserve serve`)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def serve(args: argparse.Namespace,
          build_app: Callable[[LoadedModel, CallerThreadExecutor], Starlette]) -> None:
    """Load the model, build the app around it, serve HTTP on a thread and run generate()
    on this, the main thread (a CallerThreadExecutor), until SIGTERM/SIGINT."""
    import signal
    import threading

    import torch
    import uvicorn

    torch.set_num_threads(args.num_threads)
    executor = CallerThreadExecutor()
    app = build_app(load_model(args.model, args.dtype), executor)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level))

    def run_http() -> None:
        try:
            server.run()
        finally:
            executor.shutdown()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    thread = threading.Thread(target=run_http, name="http")
    thread.start()
    executor.run()
    thread.join()
