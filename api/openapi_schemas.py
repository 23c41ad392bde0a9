"""JSON schemas of the responses, for /openapi.json (so a schema-driven tester such as
schemathesis checks what comes back, not only what goes in). They describe api/responses.py's
shapes; tests/api/test_schemathesis.py holds real responses against them."""

from __future__ import annotations

from typing import Any

_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_NUM = {"type": "number"}
_NULL = {"type": "null"}


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "object", "required": list(required),
            "properties": {**required, **(optional or {})}}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, _NULL]}


USAGE = _obj({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
             {"prompt_tokens_details": _obj({"cached_tokens": _INT})})
FINISH = {"enum": ["stop", "length", "abort", "timeout", None]}
STOP_REASON = {"type": ["integer", "string", "null"]}

COMPLETION_LOGPROBS = _obj({
    "tokens": {"type": "array", "items": _STR},
    "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
    "top_logprobs": {"type": "array", "items": _nullable(
        {"type": "object", "additionalProperties": _NUM})},
    "text_offset": {"type": "array", "items": _INT}})

PROMPT_LOGPROBS = {"type": "array", "items": _nullable({
    "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": _obj({"logprob": _NUM, "rank": {"type": "integer", "minimum": 1},
                                  "decoded_token": {"type": ["string", "null"]}})})}

_CHAT_TOP = _obj({"token": _STR, "logprob": _NUM, "bytes": {"type": "array", "items": _INT}})
CHAT_LOGPROBS = _obj({"content": {"type": "array", "items": _obj({
    **_CHAT_TOP["properties"], "top_logprobs": {"type": "array", "items": _CHAT_TOP}})}})


def _envelope(obj: str, choice: dict[str, Any], extra: dict[str, Any] | None = None,
              ) -> dict[str, Any]:
    return _obj({"id": _STR, "object": {"const": obj}, "created": _INT, "model": _STR,
                 "choices": {"type": "array", "items": choice}, "usage": USAGE}, extra)


TOKEN_IDS = {"type": "array", "items": _INT}  # return_token_ids

COMPLETION = _envelope("text_completion", _obj({
    "index": _INT, "text": _STR, "logprobs": _nullable(COMPLETION_LOGPROBS),
    "finish_reason": FINISH}, {"stop_reason": STOP_REASON, "prompt_logprobs": PROMPT_LOGPROBS,
                               "prompt_token_ids": _nullable(TOKEN_IDS),
                               "token_ids": TOKEN_IDS}))

CHAT_COMPLETION = _envelope("chat.completion", _obj({
    "index": _INT, "message": _obj({"role": {"const": "assistant"}, "content": _STR}),
    "logprobs": _nullable(CHAT_LOGPROBS), "finish_reason": FINISH},
    {"stop_reason": STOP_REASON, "token_ids": TOKEN_IDS}),
    {"prompt_logprobs": PROMPT_LOGPROBS, "prompt_token_ids": TOKEN_IDS})

MODEL_LIST = _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _obj({
    "id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR},
    {"max_model_len": {"type": ["integer", "null"]}})}})

TOKENIZE = _obj({"count": _INT, "max_model_len": _INT,
                 "tokens": {"type": "array", "items": _INT}})
DETOKENIZE = _obj({"prompt": _STR})

ERROR = _obj({"error": _obj({"message": _STR, "type": _STR,
                             "param": {"type": ["string", "null"]},
                             "code": {"type": ["string", "null"]}})})

# One server-sent event of a streamed response (schema-driven testers check each event):
# `data` is a chunk (the response's shape with a `delta` or a text piece per choice, and
# `usage` on the usage chunk) or an {"error": ...} object, as JSON; the last is "[DONE]".
EVENT_STREAM = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "minLength": 1}, "event": {"const": "message"}}}


_NUM_OR_NULL = {"type": ["number", "null"]}
_STEP = _obj({"step": _INT, "time": _NUM, "duration_ms": _NUM, "decode_rows": _INT,
              "prefill_rows": _INT, "prefill_tokens": _INT, "preemptions": _INT})
_LIVE_REQUEST = _obj({"id": _STR, "state": {"enum": ["waiting", "running", "preempted",
                                                     "grammar"]},
                      "prompt_tokens": _INT, "output_tokens": _INT, "cached_tokens": _INT,
                      "age_ms": _NUM, "ttft_ms": _NUM_OR_NULL, "itl_ms": _NUM_OR_NULL})
_ENGINE_STATS = _obj({"num_running": _INT, "num_waiting": _INT, "num_kv_blocks": _INT,
                      "num_free_kv_blocks": _INT, "kv_cache_usage": _NUM,
                      "num_preemptions": _INT, "prefix_cache_queries": _INT,
                      "prefix_cache_hits": _INT, "num_steps": _INT,
                      "finish_rate": _NUM_OR_NULL})
# The `data` of one `engine` event of GET /v1/engine/events (api/live.py): per engine (one,
# or one per Ray replica) its stats, the steps since the previous event (all the engine still
# remembers, up to 512, in the first), the KV pool as one character per block ("0" free,
# "1" free but holding a reusable prefix, "2" in use) and up to 50 live requests, oldest
# first; `rejected` counts refusals at admission by reason since the server started.
ENGINE_EVENT = _obj({
    "model": _STR, "time": _NUM,
    "rejected": {"type": "object", "additionalProperties": _INT},
    "engines": {"type": "array", "items": _obj({
        "name": _STR, "stats": _ENGINE_STATS, "steps": {"type": "array", "items": _STEP},
        "kv_blocks": {"type": "string", "pattern": "^[012]*$"},
        "requests": {"type": "array", "items": _LIVE_REQUEST, "maxItems": 50},
        "num_requests": _INT})}})
ENGINE_EVENTS_STREAM = {"type": "object", "required": ["data"], "properties": {
    "event": {"enum": ["engine", "error"]},
    "data": {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"$ref": "#/components/schemas/EngineEvent"}}}}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def generation_content(schema: dict[str, Any]) -> dict[str, Any]:
    """A generation route's 200: JSON, or server-sent events when stream is true."""
    return {**json_content(schema), "text/event-stream": {"schema": EVENT_STREAM}}
