"""OpenAI tools on chat: the request fields (tools, tool_choice, parallel_tool_calls), the
JSON Schema that forces a call, and the default tools prompt for templates without tools.

tool_choice, as in vLLM:
- "none": no call is parsed; the tools are still rendered into the prompt (vLLM's default
  since v0.10; it has --exclude-tools-when-tool-choice-none to drop them).
- "auto" (the default when tools are given): the output is parsed for Hermes-style
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (api/tools/parser.py).
- "required": the output is constrained to a JSON array of {"name", "parameters"} objects,
  one per call (anyOf over the tools; at most one item when parallel_tool_calls is false).
- {"type": "function", "function": {"name": N}}: the output is constrained to N's
  parameters schema; the output is that call's arguments object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from api.errors import bad_request
from api.requests.params import check_unicode_in, get_bool
from api.requests.structured import check_local_refs
from engine.protocol import StructuredOutputsParams

MAX_TOOLS = 128  # OpenAI's own cap
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Request fields that constrain the output too; one constraint per request.
CONSTRAINT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")

ChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """The validated tools of a request. `tools` are OpenAI tool objects with their
    function's parameters filled in (EMPTY_PARAMETERS when absent)."""

    tools: tuple[dict[str, Any], ...]
    mode: ChoiceMode
    forced_name: str | None  # mode "function": the function the output must call
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")

    def parameters(self, name: str) -> dict[str, Any]:
        return next(t["function"]["parameters"] for t in self.tools
                    if t["function"]["name"] == name)


def parse_tools(body: dict[str, Any]) -> ToolConfig | None:
    """tools, tool_choice and parallel_tool_calls; None when the request has no tools."""
    tools = _tools(body.get("tools"))
    parallel = get_bool(body, "parallel_tool_calls", True)
    mode, name = _tool_choice(body.get("tool_choice"), tools)
    if not tools:
        return None
    config = ToolConfig(tools, mode, name, parallel)
    if config.forced:
        _check_single_constraint(body)
    return config


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request("tools must be a list of tool objects", param="tools")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"tools accepts at most {MAX_TOOLS} tools", param="tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(value))
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad_request(f"tools: the function name {dup!r} is used twice", param="tools")
    return tools


def _tool(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or value.get("type") != "function":
        raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                          param=f"{where}.type")
    check_unicode_in(value, where)  # rendered into the prompt: named here, not as messages
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function must be an object", param=f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name must be a non-empty string",
                          param=f"{where}.function.name")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "an object"),
                            ("strict", bool, "a boolean")):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise bad_request(f"{where}.function.{key} must be {what}",
                              param=f"{where}.function.{key}")
    check_local_refs(fn.get("parameters"), f"{where}.function.parameters")
    function = {k: fn[k] for k in ("name", "description", "strict") if fn.get(k) is not None}
    function["parameters"] = fn.get("parameters") or EMPTY_PARAMETERS
    return {"type": "function", "function": function}


def _tool_choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[ChoiceMode, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise bad_request(f"tool_choice {value!r} requires tools", param="tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                          '"function", "function": {"name": ...}}', param="tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools",
                          param="tool_choice")
    return "function", name


def _check_single_constraint(body: dict[str, Any]) -> None:
    """A forced call is itself an output constraint: a second one cannot hold at once."""
    fmt = body.get("response_format")
    other = [f for f in CONSTRAINT_FIELDS if body.get(f) is not None]
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        other.insert(0, "response_format")
    if other:
        raise bad_request(f"tool_choice forces a function call, which cannot be combined with "
                          f"{other[0]}", param="tool_choice")


def forced_schema(config: ToolConfig) -> dict[str, Any] | None:
    """The JSON Schema the output must follow (None unless tool_choice forces a call)."""
    if config.mode == "function":
        assert config.forced_name is not None
        return config.parameters(config.forced_name)
    if config.mode != "required":
        return None
    defs: dict[str, Any] = {}
    items = [_call_schema(t["function"], defs) for t in config.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": items}}
    if not config.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _call_schema(function: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """{"name": const, "parameters": schema}. The parameters' $defs move to the root: inside
    the array schema a "#/$defs/X" reference resolves against the root, not the tool."""
    params = dict(function["parameters"])
    for key, schema in params.pop("$defs", {}).items():
        if defs.setdefault(key, schema) != schema:
            raise bad_request(f"tools: two functions define $defs/{key} differently, which "
                              "tool_choice \"required\" cannot combine", param="tools")
    return {"properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "parameters": params},
            "required": ["name", "parameters"]}


def structured_outputs(config: ToolConfig | None) -> StructuredOutputsParams | None:
    schema = forced_schema(config) if config is not None else None
    if schema is None:
        return None
    return StructuredOutputsParams(kind="json", spec=json.dumps(schema), param="tool_choice")


# The prompt used when the chat template has no tools section (docs/tool_calling.md): the
# Hermes format, which api/tools/parser.py reads back.
TOOLS_PROMPT = """You can call functions to help with the user's request. The functions \
are described as JSON Schemas inside <tools></tools>:
<tools>
{tools}
</tools>
To call a function, answer with one JSON object per call, each inside its own \
<tool_call></tool_call> tags, and nothing else:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments as a JSON object>}}}}
</tool_call>
Do not make up argument values: ask the user when one is missing."""


def tools_prompt(tools: tuple[dict[str, Any], ...]) -> str:
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                               for t in tools))
