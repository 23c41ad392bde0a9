"""The /v1/chat/completions request: JSON body -> ChatRequest (types checked, nothing run)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from api.chat_template import parse_template_fields
from api.errors import bad_request
from api.requests.fields import CHAT, check_fields
from api.requests.options import Options, parse_options
from api.requests.params import check_unicode, get_bool, get_int, get_str
from api.requests.sampling import MAX_LOGPROBS, SamplingArgs, check_max_tokens, parse_sampling
from api.requests.tools import ToolConfig, parse_tools, structured_outputs
from engine.protocol import ChatTemplateArgs

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]  # normalized: content is always a string
    template: ChatTemplateArgs  # its tools are set at rendering, from `tools`
    tools: ToolConfig | None  # None: no tools (the output is plain content)
    echo: str  # vLLM's echo: the last message's content when it is the assistant's, else ""
    sampling: SamplingArgs
    logprobs: int | None  # top-N per token when logprobs=true, else None
    stream: bool
    options: Options


def parse_chat(body: dict[str, Any], trust_template: bool = False) -> ChatRequest:
    check_fields(body, CHAT)
    if "messages" not in body:
        raise bad_request("messages is required", param="messages")
    messages = parse_messages(body["messages"])
    tools = parse_tools(body)
    # max_completion_tokens is OpenAI's newer name; it wins when both are given.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = get_int(body, name, None, lo=0)
    check_max_tokens(max_tokens, allow_zero=False, param=name)
    stream = get_bool(body, "stream", False)
    return ChatRequest(
        model=get_str(body, "model"), messages=messages,
        template=parse_template_fields(body, trust_template), tools=tools,
        echo=_echo(messages) if get_bool(body, "echo", False) else "",
        sampling=_with_tools(parse_sampling(body, max_tokens), tools),
        logprobs=_parse_logprobs(body), stream=stream,
        options=parse_options(body, stream, add_special_tokens=False),
    )


def _echo(messages: list[dict[str, Any]]) -> str:
    last = messages[-1]
    return str(last["content"]) if last["role"] == "assistant" else ""


def _with_tools(sampling: SamplingArgs, tools: ToolConfig | None) -> SamplingArgs:
    """A forced call constrains the output with the tools' schema (the structured-outputs
    contract of scheduler/sampling_params.py)."""
    constraint = structured_outputs(tools)
    if constraint is None:
        return sampling
    return dataclasses.replace(sampling, fields={**sampling.fields,
                                                 "structured_outputs": constraint})


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
    content = _content(value.get("content"), role, f"{where}.content")
    check_unicode(content, f"{where}.content")
    message: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):
        if value.get(key) is not None:
            if not isinstance(value[key], str):
                raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
            message[key] = value[key]
    if role == "tool" and "tool_call_id" not in message:
        raise bad_request(f"{where}.tool_call_id is required in a tool message (a string)",
                          param=f"{where}.tool_call_id")
    if role == "assistant" and value.get("tool_calls") is not None:
        message["tool_calls"] = _tool_calls(value["tool_calls"], f"{where}.tool_calls")
    return message


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, in OpenAI's shape; arguments must be a JSON object."""
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a list", param=where)
    return [_tool_call(c, f"{where}[{j}]") for j, c in enumerate(value)]


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function":
        raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": "
                          "{\"name\": ..., \"arguments\": ...}}", param=where)
    if not isinstance(call.get("id"), str):
        raise bad_request(f"{where}.id must be a string", param=f"{where}.id")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{where}.function.name must be a non-empty string",
                          param=f"{where}.function.name")
    args = fn.get("arguments")
    try:
        ok = isinstance(args, str) and isinstance(json.loads(args), dict)
    except (ValueError, RecursionError):
        ok = False
    if not ok:
        raise bad_request(f"{where}.function.arguments must be a JSON object, as a string",
                          param=f"{where}.function.arguments")
    return {"id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


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

