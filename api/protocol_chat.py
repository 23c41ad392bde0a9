"""The /v1/chat/completions request: JSON body -> ChatRequest (types checked, nothing run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.errors import bad_request
from api.params import get_bool, get_int, get_str, warn_unknown
from api.sampling import (
    MAX_LOGPROBS,
    SAMPLING_FIELDS,
    SamplingArgs,
    check_max_tokens,
    parse_sampling,
    parse_stream_options,
)

ROLES = ("system", "developer", "user", "assistant", "tool", "function")

CHAT_FIELDS: dict[str, str] = {
    **SAMPLING_FIELDS, "messages": "array", "max_completion_tokens": "integer",
    "logprobs": "boolean", "top_logprobs": "integer", "add_generation_prompt": "boolean",
    "tools": "array", "tool_choice": "string|object",
    "functions": "array", "parallel_tool_calls": "boolean",
}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]  # normalized: content is always a string
    add_generation_prompt: bool
    sampling: SamplingArgs
    logprobs: int | None  # top-N per token when logprobs=true, else None
    stream: bool
    include_usage: bool


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    warn_unknown(body, CHAT_FIELDS, "/v1/chat/completions")
    if "messages" not in body:
        raise bad_request("messages is required", param="messages")
    messages = parse_messages(body["messages"])
    _check_unsupported(body)
    # max_completion_tokens is OpenAI's newer name; it wins when both are given.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = get_int(body, name, None, lo=0)
    check_max_tokens(max_tokens, allow_zero=False, param=name)
    stream = get_bool(body, "stream", False)
    return ChatRequest(
        model=get_str(body, "model"), messages=messages,
        add_generation_prompt=get_bool(body, "add_generation_prompt", True),
        sampling=parse_sampling(body, max_tokens), logprobs=_parse_logprobs(body),
        stream=stream, include_usage=parse_stream_options(body, stream),
    )


def _parse_logprobs(body: dict[str, Any]) -> int | None:
    wanted = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    return (top or 0) if wanted else None


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", param="messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be an object", param=where)
    role = value.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role")
    message: dict[str, Any] = {"role": role, "content": _content(value.get("content"), role,
                                                                 f"{where}.content")}
    for key in ("name", "tool_call_id"):
        if isinstance(value.get(key), str):
            message[key] = value[key]
    return message


def _content(value: Any, role: str, where: str) -> str:
    """A string, or a list of text parts (joined by newlines, as vLLM does)."""
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":
        return ""
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}] must be {{\"type\": \"text\", \"text\": ...}}; "
                              "only text content is supported", param=f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _check_unsupported(body: dict[str, Any]) -> None:
    """Fields that would change the answer's meaning are refused rather than ignored."""
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad_request(f"{name} is not supported", param=name)
