"""Chat messages -> prompt tokens through the chat template, with vLLM's template fields
(add_generation_prompt, continue_final_message, chat_template, chat_template_kwargs) and
the request's tools.

Tools go to the template's `tools` variable when the template renders them. Whether it
does is found by rendering the request with and without its tools (a probe tool when only
the history has tool calls): the same text means the template ignores tools (SmolLM2's
does). Then the default tools prompt (api/requests/tools.py) is put in the system message, and the
history's tool calls and results are written in the Hermes format the model is asked to
use. The cost is one or two extra template renders, only for requests with tools.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from api.errors import bad_request, from_engine_error
from api.requests.params import get_bool, get_dict, get_str
from api.requests.tools import ToolConfig, tools_prompt
from api.state import tokenize_text
from engine.protocol import ChatTemplateArgs, EngineClient, EngineDeadError, EngineLimits

TEMPLATE_FIELDS: dict[str, str] = {
    "add_generation_prompt": "boolean", "continue_final_message": "boolean",
    "chat_template": "string", "chat_template_kwargs": "object"}
# Names transformers' apply_chat_template takes itself: a template variable cannot use them.
RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})
_PROBE_TOOL = {"type": "function", "function": {
    "name": "pagedserve_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}


def parse_template_fields(body: dict[str, Any], trusted: bool) -> ChatTemplateArgs:
    """The template fields; a request's own chat_template only when the server trusts
    them (--trust-request-chat-template, as vLLM): a template is code the server runs."""
    add = get_bool(body, "add_generation_prompt", True)
    cont = get_bool(body, "continue_final_message", False)
    if add and cont:
        raise bad_request("continue_final_message requires add_generation_prompt to be false "
                          "(the final message is continued, not answered)",
                          param="continue_final_message")
    kwargs = get_dict(body, "chat_template_kwargs") or {}
    clash = sorted(RESERVED_KWARGS & set(kwargs))
    if clash:
        raise bad_request(f"chat_template_kwargs must not set {', '.join(clash)} (a request "
                          "field or a rendering option)", param="chat_template_kwargs")
    template = get_str(body, "chat_template")
    if template is not None and not trusted:
        raise bad_request("chat_template in a request is refused: the server does not run "
                          "with --trust-request-chat-template", param="chat_template")
    return ChatTemplateArgs(add, cont, None, template, kwargs)


async def render_chat(engine: EngineClient, messages: list[dict[str, Any]],
                      args: ChatTemplateArgs, tools: ToolConfig | None = None,
                      add_special_tokens: bool = False,
                      limits: EngineLimits | None = None, fit_factor: int = 1) -> list[int]:
    """The chat template's text, tokenized; by default without extra special tokens (the
    template has its own BOS where the model wants one). `messages` were validated by
    parse_messages; given the limits, a text too long to ever fit (fit_factor times over)
    is refused untokenized."""
    text = await _render_tools(engine, messages, args, tools)
    return await tokenize_text(engine, text, add_special_tokens, "messages", limits,
                               fit_factor)


async def _render_tools(engine: EngineClient, messages: list[dict[str, Any]],
                        args: ChatTemplateArgs, tools: ToolConfig | None) -> str:
    """Rendered with tools (and tool history) by the template itself, or when the text does
    not change with the tools, by the Hermes fallback."""
    tool_list = [dict(t) for t in tools.tools] if tools is not None else []
    native = [_for_template(m) for m in messages]
    plain = await _render(engine, native, args)
    if not tool_list and not _has_tool_history(messages):
        return plain
    probe = dataclasses.replace(args, tools=tool_list or [_PROBE_TOOL])
    with_tools = await _render(engine, native, probe)
    if with_tools != plain:  # the template renders tools: history and tools are its job
        return with_tools if tool_list else plain
    # tool_choice "none": a template that ignores tools shows none (as in vLLM, where the
    # template is the only way in); a prompt asking for calls would only be misread.
    prompted = tools if tools is not None and tools.mode != "none" else None
    return await _render(engine, hermes_history(messages, prompted), args)


async def _render(engine: EngineClient, messages: list[dict[str, Any]],
                  args: ChatTemplateArgs) -> str:
    try:
        return await engine.apply_chat_template(messages, args)
    except EngineDeadError as e:
        raise from_engine_error(e, engine.stats()) from None
    except Exception as e:  # noqa: BLE001 - templates raise anything on the client's input
        # The request's own template is the likelier culprit when it has one.
        param = "chat_template" if args.chat_template is not None else "messages"
        raise bad_request(f"messages cannot be rendered by the chat template: {e}",
                          param=param) from None


def _has_tool_history(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """Templates read tool_calls' arguments as a mapping (they `tojson` it themselves)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in calls]}


def hermes_history(messages: list[dict[str, Any]],
                   tools: ToolConfig | None) -> list[dict[str, Any]]:
    """For a template without tools: the tools prompt in the system message, assistant
    calls as <tool_call> blocks and tool results as <tool_response> blocks."""
    out = [_hermes_message(m) for m in messages]
    if tools is None:
        return out
    prompt = tools_prompt(tools.tools)
    if out[0]["role"] in ("system", "developer"):
        return [{**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]


def _hermes_message(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{message['content']}\n"
                                           "</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [json.dumps({"name": c["function"]["name"],
                          "arguments": json.loads(c["function"]["arguments"])},
                         ensure_ascii=False) for c in calls]
    text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
    content = f"{message['content']}\n{text}" if message["content"] else text
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
