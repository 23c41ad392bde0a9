"""The small routes: /v1/models, /health, /metrics, /tokenize, /detokenize."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.chat_template import parse_template_fields, render_chat
from api.errors import bad_request, not_ready
from api.lifecycle import shutting_down
from api.requests.chat import parse_messages
from api.requests.fields import check_field_types
from api.requests.params import INT64_MAX, get_bool, get_int_list, get_str, read_json
from api.requests.tools import parse_tools
from api.state import AppState, now, tokenize_text

# Field -> JSON schema (served in /openapi.json). `model`, when present, must be a string:
# these are not OpenAI routes, and null has no "default model" meaning here.
_MESSAGES = {"type": "array", "minItems": 1, "items": {"type": "object"}}
TOKENIZE_FIELDS: dict[str, dict[str, Any]] = {
    "model": {"type": "string"}, "prompt": {"type": "string"}, "messages": _MESSAGES,
    "add_special_tokens": {"type": ["boolean", "null"]},
    "add_generation_prompt": {"type": ["boolean", "null"]},
    "continue_final_message": {"type": ["boolean", "null"]},
    "chat_template": {"type": ["string", "null"]},
    "chat_template_kwargs": {"type": ["object", "null"]},
    "tools": {"type": ["array", "null"]},
    "tool_choice": {"type": ["string", "object", "null"]}}
DETOKENIZE_FIELDS: dict[str, dict[str, Any]] = {
    "model": {"type": "string"},
    "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                          "maximum": INT64_MAX}}}


async def list_models(request: Request) -> Response:
    app = AppState.of(request)
    engine = app.engine
    limits = engine.limits if engine.is_ready() else None
    card = {"id": app.served_model_name, "object": "model", "created": now(),
            "owned_by": "pagedserve", "root": engine.model_name, "parent": None,
            "max_model_len": limits.max_model_len if limits is not None else None}
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    app = AppState.of(request)
    if app.lifecycle.draining:
        return shutting_down().response()
    if not app.engine.is_ready():
        return not_ready().response()
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    return Response(AppState.of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def tokenize(request: Request) -> Response:
    app = AppState.of(request)
    body = await read_json(request, app.max_body_bytes)
    check_field_types(body, TOKENIZE_FIELDS, "/tokenize")
    app.check_model(_model(body))
    app.check_ready()
    tokens = await _tokens_of(app, body)
    return JSONResponse({"count": len(tokens), "max_model_len": app.limits().max_model_len,
                         "tokens": tokens})


def _model(body: dict[str, Any]) -> str | None:
    """`model` may be left out, not null (a 400, as any other non-string)."""
    if "model" in body and not isinstance(body["model"], str):
        raise bad_request("model must be a string", param="model")
    return get_str(body, "model")


async def _tokens_of(app: AppState, body: dict[str, Any]) -> list[int]:
    """`prompt` (special tokens added by default) or `messages` (through the chat template,
    which has its own special tokens: none added by default), as vLLM does."""
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if "prompt" in body:
        prompt = get_str(body, "prompt")
        if prompt is None:
            raise bad_request("prompt must be a string", param="prompt")
        # A text no context can hold is refused before it is tokenized, as on the
        # generation routes: it could only cost the tokenizer seconds.
        return await tokenize_text(app.engine, prompt,
                                   get_bool(body, "add_special_tokens", True), "prompt",
                                   app.limits())
    messages = parse_messages(body["messages"])
    return await render_chat(app.engine, messages,
                             parse_template_fields(body, app.trust_request_chat_template),
                             parse_tools(body), get_bool(body, "add_special_tokens", False),
                             app.limits())


async def detokenize(request: Request) -> Response:
    app = AppState.of(request)
    body = await read_json(request, app.max_body_bytes)
    check_field_types(body, DETOKENIZE_FIELDS, "/detokenize")
    app.check_model(_model(body))
    tokens = get_int_list(body, "tokens", 0, INT64_MAX)
    if tokens is None:
        raise bad_request("tokens is required", param="tokens")
    app.check_ready()
    try:
        text = await app.engine.detokenize(tokens)
    except (ValueError, IndexError, OverflowError, TypeError) as e:
        raise bad_request(f"tokens contains invalid token ids: {e}", param="tokens") from None
    return JSONResponse({"prompt": text})
