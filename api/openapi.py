"""GET /openapi.json: an OpenAPI 3.1 document built from the same field tables the parsers
use, so the description cannot drift from what the server accepts."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.protocol_chat import CHAT_FIELDS
from api.protocol_completion import COMPLETION_FIELDS
from api.routes import DETOKENIZE_FIELDS, TOKENIZE_FIELDS

ERROR_STATUSES = {"400": "Invalid request (the error names the parameter)",
                  "401": "Missing or wrong API key", "404": "Unknown model or route",
                  "413": "Request body too large", "429": "Queue full, retry after Retry-After",
                  "503": "Model loading or engine not running"}

# (method, path, summary, request fields or None, required fields, response description)
ROUTES: list[tuple[str, str, str, dict[str, str] | None, tuple[str, ...], str]] = [
    ("post", "/v1/completions", "Text completion (OpenAI legacy completions)",
     COMPLETION_FIELDS, ("prompt",), "A text_completion, or SSE chunks when stream is true"),
    ("post", "/v1/chat/completions", "Chat completion", CHAT_FIELDS, ("messages",),
     "A chat.completion, or SSE chat.completion.chunk events when stream is true"),
    ("get", "/v1/models", "List the served model", None, (), "An OpenAI model list"),
    ("get", "/health", "200 when the engine is ready, 503 otherwise", None, (), "Ready"),
    ("get", "/metrics", "Prometheus metrics", None, (), "Prometheus text format"),
    ("post", "/tokenize", "Tokenize a prompt or chat messages", TOKENIZE_FIELDS, (),
     "{tokens, count, max_model_len}"),
    ("post", "/detokenize", "Token ids to text", DETOKENIZE_FIELDS, ("tokens",), "{prompt}"),
    ("get", "/openapi.json", "This document", None, (), "OpenAPI 3.1 JSON"),
]


def _json_type(spec: str) -> dict[str, Any]:
    types = [{"type": t} for t in spec.split("|")]
    return types[0] if len(types) == 1 else {"oneOf": types}


def _request_body(fields: dict[str, str], required: tuple[str, ...]) -> dict[str, Any]:
    schema = {"type": "object", "properties": {k: _json_type(v) for k, v in fields.items()},
              "required": list(required), "additionalProperties": True}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _operation(summary: str, fields: dict[str, str] | None, required: tuple[str, ...],
               ok: str) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": ok}}}
    if fields is not None:
        op["requestBody"] = _request_body(fields, required)
    for status, why in ERROR_STATUSES.items():
        op["responses"][status] = {"description": why, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/Error"}}}}
    return op


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
}}}


def build_openapi(title: str, version: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, fields, required, ok in ROUTES:
        paths.setdefault(path, {})[method] = _operation(summary, fields, required, ok)
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": {"Error": ERROR_SCHEMA}}}


async def openapi(request: Request) -> Response:
    return JSONResponse(build_openapi("pagedserve", "0.1.0"))
