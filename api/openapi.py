"""GET /openapi.json: an OpenAPI 3.1 document built from the same field tables the parsers
use (api/requests/fields.py, api/routes.py), so the description cannot drift from what the server
accepts; request fields carry their value constraints, responses their schemas."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api import openapi_schemas as s
from api.live import DEFAULT_INTERVAL_MS, MAX_EVENTS, MAX_INTERVAL_MS, MIN_INTERVAL_MS
from api.requests.fields import CHAT_FIELDS, COMPLETION_FIELDS, Field, Status
from api.routes import DETOKENIZE_FIELDS, TOKENIZE_FIELDS

ERROR_STATUSES = {"400": "Invalid request (the error names the parameter)",
                  "401": "Missing or wrong API key", "404": "Unknown model or route",
                  "413": "Request body too large", "429": "Queue full, retry after Retry-After",
                  "503": "Model loading, engine not running, or shutting down"}
NO_BODY: dict[str, Any] = {}  # a 200 with an empty body (/health)


def _described(fields: dict[str, Field]) -> dict[str, dict[str, Any]]:
    """Each field's schema, with what we do with it in its description."""
    out = {}
    for name, f in fields.items():
        what = {Status.SUPPORTED: f.note, Status.OWNED: "",
                Status.NO_EFFECT: f"accepted, no effect: {f.note}",
                Status.REFUSED: f"not supported ({f.note}): only its default is accepted"}
        description = what[f.status]
        out[name] = {**f.schema, "description": description} if description else f.schema
    return out


# A documented example per POST route (schema-driven testers replay them first).
EXAMPLES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 8,
                        "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hello."}],
                             "max_tokens": 8},
    "/tokenize": {"prompt": "Hello world"},
    "/detokenize": {"tokens": [1, 2, 3]},
}

# Rules across fields that the parsers enforce with a 400 naming the field, in JSON Schema
# terms, so that a client or a schema-driven tester reads them from the document too.
_STREAM_OPTIONS_NEED_STREAM = {  # api/options.parse_stream_options
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
_TOP_LOGPROBS_NEED_LOGPROBS = {  # api/requests/chat._parse_logprobs
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
_PROMPT_OR_MESSAGES = {  # api/routes._tokens_of
    "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
RULES: dict[str, list[dict[str, Any]]] = {
    "/v1/completions": [_STREAM_OPTIONS_NEED_STREAM],
    "/v1/chat/completions": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS],
    "/tokenize": [_PROMPT_OR_MESSAGES],
}

# (method, path, summary, request field schemas or None, required fields, 200 content)
ROUTES: list[tuple[str, str, str, dict[str, dict[str, Any]] | None, tuple[str, ...],
                   dict[str, Any]]] = [
    ("post", "/v1/completions", "Text completion (OpenAI legacy completions)",
     _described(COMPLETION_FIELDS), ("prompt",), s.generation_content(s.COMPLETION)),
    ("post", "/v1/chat/completions", "Chat completion", _described(CHAT_FIELDS),
     ("messages",), s.generation_content(s.CHAT_COMPLETION)),
    ("get", "/v1/models", "List the served model", None, (), s.json_content(s.MODEL_LIST)),
    ("get", "/health", "200 when the engine is ready, 503 otherwise", None, (), NO_BODY),
    ("get", "/metrics", "Prometheus metrics", None, (),
     {"text/plain": {"schema": {"type": "string"}}}),
    ("post", "/tokenize", "Tokenize a prompt or chat messages", TOKENIZE_FIELDS, (),
     s.json_content(s.TOKENIZE)),
    ("post", "/detokenize", "Token ids to text", DETOKENIZE_FIELDS, ("tokens",),
     s.json_content(s.DETOKENIZE)),
    ("get", "/openapi.json", "This document", None, (), s.json_content({"type": "object"})),
]


def _request_body(fields: dict[str, dict[str, Any]], required: tuple[str, ...],
                  example: dict[str, Any] | None, rules: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    # Unknown fields are ignored (with a warning), as OpenAI's and vLLM's servers do.
    schema: dict[str, Any] = {"type": "object", "properties": fields,
                              "required": list(required), "additionalProperties": True}
    if rules:
        schema["allOf"] = rules
    content = s.json_content(schema)
    if example is not None:
        content["application/json"]["example"] = example
    return {"required": True, "content": content}


def _operation(path: str, summary: str, fields: dict[str, dict[str, Any]] | None,
               required: tuple[str, ...], ok: dict[str, Any]) -> dict[str, Any]:
    success: dict[str, Any] = {"description": "OK"}
    if ok:
        success["content"] = ok
    op: dict[str, Any] = {"summary": summary, "responses": {"200": success}}
    if fields is not None:
        op["requestBody"] = _request_body(fields, required, EXAMPLES.get(path),
                                          RULES.get(path, []))
    for status, why in ERROR_STATUSES.items():
        op["responses"][status] = {"description": why, "content": s.json_content(
            {"$ref": "#/components/schemas/Error"})}
    return op


def build_openapi(title: str, version: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, fields, required, ok in ROUTES:
        paths.setdefault(path, {})[method] = _operation(path, summary, fields, required, ok)
    paths["/v1/engine/events"] = {"get": _engine_events()}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": {"Error": s.ERROR, "EngineEvent": s.ENGINE_EVENT}}}


def _engine_events() -> dict[str, Any]:
    """The live view's event stream (api/live.py): its query parameters and events."""
    op = _operation("/v1/engine/events", "The live view's server-sent events: an `engine` "
                    "event per look at the engine (an `error` event if it stops)", None, (),
                    {"text/event-stream": {"schema": s.ENGINE_EVENTS_STREAM}})
    op["parameters"] = [
        {"name": "interval_ms", "in": "query", "required": False,
         "description": "milliseconds between looks",
         "schema": {"type": "integer", "minimum": MIN_INTERVAL_MS,
                    "maximum": MAX_INTERVAL_MS, "default": DEFAULT_INTERVAL_MS}},
        {"name": "max_events", "in": "query", "required": False,
         "description": "end the stream after this many events (default: until the client "
                        "leaves or the server shuts down)",
         "schema": {"type": "integer", "minimum": 1, "maximum": MAX_EVENTS}}]
    return op


async def openapi(request: Request) -> Response:
    return JSONResponse(build_openapi("pagedserve", "0.1.0"))
