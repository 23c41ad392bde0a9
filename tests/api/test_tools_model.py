"""Tool calling with the real SmolLM2 over HTTP (slow): auto mode answers well-formed whichever
way the model goes, streamed and not alike; the openai client's tools round trip; forced
calls (required / named) that parse and validate, which need the structured-outputs engine
(branch `so`): until the engine applies the grammar those are expected to fail."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from tests.support.livetools import Live, live_server
from tests.support.models import loaded_runner

pytestmark = pytest.mark.slow

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": [
        "UTC", "CET", "PST"]}}, "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are a weather bot. Always answer by calling a tool."},
    {"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=2048,
                            block_size=16)
    runner: ModelRunner = loaded_runner(EngineConfig(
        model=None, dtype="float32", device="cpu", enforce_eager=True, num_kv_blocks=512,
        quantization="none", scheduler=sched))  # the dense model these draws were made on
    with live_server(runner, max_model_len=2048, max_num_seqs=8,
                     max_num_batched_tokens=512) as server:
        yield server


@pytest.fixture
def oai(live: Live) -> Any:  # Any: the SDK's overloads do not type plain dict tools
    return openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0, timeout=120)


def check_call(call: Any, validate: bool) -> dict[str, Any]:
    """A well-formed OpenAI tool call; its arguments validate when the output was forced."""
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    if validate:
        jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_auto_is_well_formed_streamed_or_not(oai: Any) -> None:
    c = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                    temperature=0, max_tokens=40)
    choice = c.choices[0]
    calls = choice.message.tool_calls or []
    for call in calls:
        check_call(call, validate=False)
    if calls:
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str)
    # Greedy: the same tokens streamed; the parsed answer must be the same.
    content, finish = "", None
    streamed: dict[int, list[str]] = {}
    for chunk in oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                             temperature=0, max_tokens=40, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = streamed.setdefault(d.index, ["", ""])
            entry[0] += (d.function.name or "") if d.function else ""
            entry[1] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == (choice.message.content or "") and finish == choice.finish_reason
    assert [tuple(v) for _, v in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_openai_client_round_trip(oai: Any) -> None:
    """Send tools, get the calls (the model's, or one we make if it answered in text), send
    the result back as a tool message, get an answer."""
    first = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                        temperature=0, max_tokens=40)
    message = first.choices[0].message
    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in message.tool_calls or []]
    if not calls:
        calls = [{"id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]
    history = [*MESSAGES, {"role": "assistant", "content": message.content, "tool_calls": calls},
               *({"role": "tool", "tool_call_id": c["id"], "content": "18 degrees, sunny"}
                 for c in calls)]
    second = oai.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                         temperature=0, max_tokens=20)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_forces_valid_calls(oai: Any, parallel: bool) -> None:
    c = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=parallel,
                                    temperature=1.0, seed=7, n=2, max_tokens=80)
    for choice in c.choices:
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and calls, choice
        assert len(calls) == 1 or parallel
        for call in calls:
            check_call(call, validate=True)


def test_named_forces_valid_arguments_streamed(oai: Any) -> None:
    for seed in range(2):
        args, names = "", []
        for chunk in oai.chat.completions.create(
                model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed,
                tool_choice={"type": "function", "function": {"name": "get_time"}},
                max_tokens=40, stream=True):
            for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                names += [d.function.name] if d.function and d.function.name else []
                args += d.function.arguments or "" if d.function else ""
        assert names == ["get_time"]
        jsonschema.validate(json.loads(args), SCHEMAS["get_time"])
