"""Tool calling on /v1/chat/completions with a scripted FakeEngine: field validation, the
forced-call schema, rendering (template tools or the default prompt), tool history, the
Hermes parser, and tool_calls in answers and streams. Chat-template fields at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from api.requests.tools import MAX_TOOLS, TOOLS_PROMPT, ToolConfig, forced_schema
from api.tools.parser import CallDelta, HermesParser, Parsed
from tests.support.apitools import serve, sse_json
from tests.support.errors import assert_error
from tests.support.fake_engine import FakeEngine

URL = "/v1/chat/completions"
MSG = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"$ref": "#/$defs/zone"}}, "required": ["tz"],
    "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]
TIME_PARAMS = TIME["function"]["parameters"]  # type: ignore[index]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096)  # room for the tools prompt (a token: a character)


def post(client: TestClient, **body: Any) -> Any:
    return client.post(URL, json={"messages": MSG, "max_tokens": 200, **body})


# --- validation ---------------------------------------------------------------------------

def _history(msg: dict[str, Any]) -> list[dict[str, Any]]:
    return [*MSG, msg]


def _call(**fn: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", **fn}}]}


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "function", "function": {}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "guided_json": {"type": "object"}}, "tool_choice"),
    ({"tools": [TIME, {"type": "function", "function": {"name": "g", "parameters": {
        "$defs": {"zone": {"type": "integer"}}}}}], "tool_choice": "required"}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": _history({"role": "tool", "content": "18C"})}, "messages[1].tool_call_id"),
    ({"messages": _history({"role": "assistant", "tool_calls": {"id": "x"}})},
     "messages[1].tool_calls"),
    ({"messages": _history(_call(arguments="{oops"))},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": _history(_call(arguments='["a list"]'))},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": _history(_call(name=""))}, "messages[1].tool_calls[0].function.name"),
    ({"messages": _history({"role": "assistant", "tool_calls": [{"type": "function", "function":
        {"name": "f", "arguments": "{}"}}]})}, "messages[1].tool_calls[0].id"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tool_fields_name_the_param(client: TestClient, engine: FakeEngine,
                                        body: dict[str, Any], param: str) -> None:
    assert_error(post(client, **body), 400, param=param)
    assert not engine.submitted


# --- the forced-call schema ---------------------------------------------------------------

def _config(mode: str, parallel: bool = True, name: str | None = None) -> ToolConfig:
    from api.requests.tools import parse_tools
    choice: Any = {"type": "function", "function": {"name": name}} if name else mode
    config = parse_tools({"tools": TOOLS, "tool_choice": choice,
                          "parallel_tool_calls": parallel})
    assert config is not None
    return config


def test_required_schema_is_an_array_of_named_calls() -> None:
    schema = forced_schema(_config("required"))
    assert schema is not None
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}},
          {"name": "get_time", "parameters": {"tz": "CET"}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],  # city is required
                [{"name": "get_time", "parameters": {"tz": "PST"}}],  # $defs enum, via root
                [{"name": "nope", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = forced_schema(_config("required", parallel=False))
    assert single is not None and single["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)


def test_named_schema_is_the_parameters() -> None:
    assert forced_schema(_config("", name="get_time")) == TIME_PARAMS
    assert forced_schema(_config("auto")) is None


def test_forced_choice_sets_the_structured_outputs_contract(client: TestClient,
                                                           engine: FakeEngine) -> None:
    post(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    post(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    post(client, tools=TOOLS)
    post(client, tools=TOOLS, tool_choice="none")
    required, named, auto, none = (s.params.structured_outputs for s in engine.submitted)
    assert required is not None and (required.kind, required.param) == ("json", "tool_choice")
    assert json.loads(required.spec) == forced_schema(_config("required", parallel=False))
    assert named is not None and json.loads(named.spec) == TIME_PARAMS
    assert auto is None and none is None


# --- rendering ----------------------------------------------------------------------------

def _prompt(engine: FakeEngine, k: int = -1) -> str:
    prompt = engine.submitted[k].prompt
    assert isinstance(prompt, list)
    return "".join(chr(t - 2) for t in prompt)


def test_template_with_tools_section_gets_the_tools(client: TestClient,
                                                    engine: FakeEngine) -> None:
    engine.renders_tools = True
    assert post(client, tools=TOOLS, tool_choice="none").status_code == 200
    assert engine.templates[-1].tools == TOOLS  # tool_choice none still renders them (vLLM)
    assert _prompt(engine) == f"<tools>{json.dumps(TOOLS)}\n<user>weather in Paris?\n<assistant>"


def test_template_without_tools_gets_the_default_prompt(client: TestClient,
                                                        engine: FakeEngine) -> None:
    assert post(client, tools=[WEATHER]).status_code == 200
    prompt = _prompt(engine)
    assert prompt.startswith("<system>You can call functions")
    assert json.dumps(WEATHER) in prompt and prompt.endswith("<user>weather in Paris?\n<assistant>")
    assert engine.templates[-1].tools is None
    system = [{"role": "system", "content": "Be brief."}, *MSG]
    post(client, tools=[WEATHER], messages=system)
    assert _prompt(engine).startswith("<system>Be brief.\n\nYou can call functions")
    assert TOOLS_PROMPT.split("\n")[0] in _prompt(engine)
    post(client, tools=[WEATHER], tool_choice="none")  # no call wanted: no prompt asking
    assert _prompt(engine) == "<user>weather in Paris?\n<assistant>"


HISTORY = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}]


def test_tool_history_with_a_tools_template(client: TestClient, engine: FakeEngine) -> None:
    engine.renders_tools = True
    assert post(client, messages=HISTORY, tools=[WEATHER]).status_code == 200
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert f"<assistant><calls>{json.dumps(calls)}\n<tool>18C, sunny\n" in _prompt(engine)


def test_tool_history_without_a_tools_template_is_hermes_text(client: TestClient,
                                                             engine: FakeEngine) -> None:
    assert post(client, messages=HISTORY).status_code == 200  # history alone, no tools
    assert _prompt(engine) == (
        "<user>weather in Paris?\n<assistant><tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        "<tool><tool_response>\n18C, sunny\n</tool_response>\n<assistant>")


# --- the Hermes parser --------------------------------------------------------------------

def _parse(chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    parser = HermesParser()
    total = Parsed()
    for c in chunks:
        total += parser.feed(c)
    total += parser.finish()
    return total.content, [(c.name or "", c.arguments) for c in total.calls]


TWO = CALL + '\n<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    (CALL, "", [("get_weather", '{"city": "Paris"}')]),
    (TWO, "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]),
    ("Let me check.\n" + CALL + "\nDone.", "Let me check.\n\nDone.",
     [("get_weather", '{"city": "Paris"}')]),
    ("a <tool_call>{not json}</tool_call> b", "a <tool_call>{not json}</tool_call> b", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("x < y and <tool_ca", "x < y and <tool_ca", []),
    ('<tool_call>{"name": "f"}', "", [("f", "{}")]),  # EOS before the closing tag
    ('<tool_call>{"name": "f", "parameters": {"a": [1]}}</tool_call>', "", [("f", '{"a": [1]}')]),
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
    ("  plain answer \n", "  plain answer \n", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_hermes_parser(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    assert _parse([text]) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_hermes_parser_any_split(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    """Streaming in two pieces split at every boundary, or one character at a time, gives
    the same content and calls as the whole text."""
    for cut in range(len(text) + 1):
        assert _parse([text[:cut], text[cut:]]) == (content, calls), cut
    assert _parse(list(text)) == (content, calls)


def test_hermes_holds_back_a_partial_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Hi <tool") == Parsed("Hi")
    assert parser.feed("_c") == Parsed()
    first = parser.feed('all>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert first.content == "" and len(first.calls) == 1
    call = first.calls[0]
    assert (call.index, call.name, call.arguments) == (0, "f", '{"a": 1}')
    assert call.id is not None and call.id.startswith("call_") and len(call.id) > 10
    assert parser.finish() == Parsed()
    assert CallDelta(0, "x").to_json() == {"index": 0, "function": {"arguments": "x"}}


# --- answers ------------------------------------------------------------------------------

def _message(r: Any, i: int = 0) -> tuple[dict[str, Any], str]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][i]
    return choice["message"], choice["finish_reason"]


def test_auto_parses_calls(client: TestClient, engine: FakeEngine) -> None:
    engine.replies = ["Sure.\n" + CALL, "It is sunny."]
    message, finish = _message(post(client, tools=TOOLS, n=2))
    assert finish == "tool_calls" and message["content"] == "Sure."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    message, finish = _message(post(client, tools=TOOLS, n=2), 1)  # request 2, choice 1
    assert finish == "stop" and message == {"role": "assistant", "content": "It is sunny."}


def test_auto_cut_short_and_none_mode(client: TestClient, engine: FakeEngine) -> None:
    engine.replies = [CALL]
    message, finish = _message(post(client, tools=TOOLS, max_tokens=20))
    assert finish == "length" and "tool_calls" not in message
    assert message["content"] == CALL[:20]
    message, finish = _message(post(client, tools=TOOLS, tool_choice="none"))
    assert finish == "stop" and message == {"role": "assistant", "content": CALL}
    message, _ = _message(post(client))  # no tools: never parsed
    assert message["content"] == CALL


def test_required_and_named(client: TestClient, engine: FakeEngine) -> None:
    engine.replies = [('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                       '{"name": "get_time", "parameters": {"tz": "UTC"}}]'), '{"tz": "CET"}']
    message, finish = _message(post(client, tools=TOOLS, tool_choice="required"))
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris"}),
                                                ("get_time", {"tz": "UTC"})]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    named = {"type": "function", "function": {"name": "get_time"}}
    message, finish = _message(post(client, tools=TOOLS, tool_choice=named))
    assert finish == "tool_calls" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"tz": "CET"}'}


def test_required_without_a_call_keeps_the_text(client: TestClient, engine: FakeEngine) -> None:
    engine.replies = ["no json here"]
    message, finish = _message(post(client, tools=TOOLS, tool_choice="required"))
    assert (message, finish) == ({"role": "assistant", "content": "no json here"}, "stop")


def test_openai_client_round_trip(client: TestClient, engine: FakeEngine) -> None:
    """The SDK parses our tool_calls (plain and streamed) and sends a tool result back."""
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                        max_retries=0)
    engine.replies = [CALL, CALL, "It is 18C."]
    first = oai.chat.completions.create(model="fake-model", messages=MSG,  # type: ignore[arg-type]
                                        tools=[WEATHER])  # type: ignore[list-item]
    [call] = first.choices[0].message.tool_calls or []
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    with oai.chat.completions.stream(model="fake-model", messages=MSG,  # type: ignore[arg-type]
                                     tools=[WEATHER]) as stream:  # type: ignore[list-item]
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls or []
    assert streamed.function.arguments == call.function.arguments
    history = [*MSG, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    second = oai.chat.completions.create(model="fake-model", messages=history,  # type: ignore[arg-type]
                                         tools=[WEATHER])  # type: ignore[list-item]
    assert second.choices[0].message.content == "It is 18C."
    assert "<tool><tool_response>\n18C\n</tool_response>" in _prompt(engine)


def test_openai_client_parse_with_a_pydantic_tool(client: TestClient,
                                                  engine: FakeEngine) -> None:
    """client.chat.completions.parse(tools=[pydantic_function_tool(Model)]) reads our calls
    into the model (the strict tool the SDK builds is accepted)."""
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: str

    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                        max_retries=0)
    engine.replies = ['{"city": "Paris"}']
    r = oai.chat.completions.parse(
        model="fake-model", messages=MSG,  # type: ignore[arg-type]
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    [call] = r.choices[0].message.tool_calls or []
    assert call.function.parsed_arguments == GetWeather(city="Paris")
    assert engine.submitted[0].params.structured_outputs is not None


# --- streams ------------------------------------------------------------------------------

def _stream(client: TestClient, **body: Any) -> dict[int, dict[str, Any]]:
    """Per choice: content, tool calls rebuilt from their deltas, finish_reason; each call
    delta checked against OpenAI's shape on the way."""
    r = post(client, stream=True, **body)
    assert r.status_code == 200, r.text
    out: dict[int, dict[str, Any]] = {}
    for chunk in sse_json(r.text):
        for choice in chunk["choices"]:
            seen = out.setdefault(choice["index"], {"content": "", "calls": [], "finish": None})
            delta = choice["delta"]
            seen["content"] += delta.get("content") or ""
            for d in delta.get("tool_calls", []):
                _add_call_delta(seen["calls"], d)
            if choice["finish_reason"] is not None:
                assert seen["finish"] is None
                seen["finish"] = choice["finish_reason"]
    return out


def _add_call_delta(calls: list[dict[str, Any]], d: dict[str, Any]) -> None:
    if d["index"] == len(calls):  # a new call: everything but arguments comes once
        assert d["id"].startswith("call_") and d["type"] == "function"
        calls.append({"id": d["id"], "name": d["function"]["name"],
                      "arguments": d["function"]["arguments"]})
    else:
        assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        calls[d["index"]]["arguments"] += d["function"]["arguments"]


def test_stream_auto_n2(client: TestClient, engine: FakeEngine) -> None:
    engine.replies = ["Sure.\n" + TWO + "\n", "No call <tool_ here."]
    out = _stream(client, tools=TOOLS, n=2)
    assert out[0]["content"] == "Sure." and out[0]["finish"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in out[0]["calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert out[1] == {"content": "No call <tool_ here.", "calls": [], "finish": "stop"}


def test_auto_keeps_one_call_when_parallel_tool_calls_is_false(client: TestClient,
                                                               engine: FakeEngine) -> None:
    """Issue 38: parallel_tool_calls false had no effect in auto mode (two calls came back);
    the first call is kept, streamed or not, and the later ones are dropped."""
    engine.replies = ["Sure.\n" + TWO + "\n"]
    message, finish = _message(post(client, tools=TOOLS, parallel_tool_calls=False))
    assert finish == "tool_calls" and message["content"] == "Sure."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    out = _stream(client, tools=TOOLS, parallel_tool_calls=False)
    assert [c["name"] for c in out[0]["calls"]] == ["get_weather"]
    assert out[0]["content"] == "Sure." and out[0]["finish"] == "tool_calls"
    message, _ = _message(post(client, tools=TOOLS))  # parallel (the default): both
    assert len(message["tool_calls"]) == 2


def test_stream_matches_non_stream(client: TestClient, engine: FakeEngine) -> None:
    engine.replies = ["a\n" + CALL + "\nb <tool_call>bad</tool_call>"]
    streamed = _stream(client, tools=TOOLS)[0]
    message, finish = _message(post(client, tools=TOOLS))
    assert streamed["content"] == message["content"] and streamed["finish"] == finish
    assert [c["arguments"] for c in streamed["calls"]] == [
        c["function"]["arguments"] for c in message["tool_calls"]]


def test_stream_named_streams_argument_fragments(client: TestClient,
                                                 engine: FakeEngine) -> None:
    engine.replies = ['{"city": "Paris"}']
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = post(client, tools=TOOLS, tool_choice=named, stream=True)
    deltas = [c["choices"][0]["delta"] for c in sse_json(r.text) if c["choices"]]
    fragments = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert len(fragments) == len('{"city": "Paris"}')  # one per token
    assert fragments[0]["function"] == {"name": "get_weather", "arguments": "{"}
    out = _stream(client, tools=TOOLS, tool_choice=named)[0]
    assert out["content"] == "" and out["finish"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in out["calls"]] == [
        ("get_weather", '{"city": "Paris"}')]


def test_stream_required(client: TestClient, engine: FakeEngine) -> None:
    engine.replies = ['[{"name": "get_time", "parameters": {"tz": "U}T\\"C"}}]']
    out = _stream(client, tools=TOOLS, tool_choice="required", n=2)
    for i in (0, 1):
        assert out[i]["finish"] == "tool_calls" and out[i]["content"] == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in out[i]["calls"]] == [
            ("get_time", {"tz": 'U}T"C'})]


# --- chat-template fields -----------------------------------------------------------------

@pytest.fixture
def trusting(engine: FakeEngine) -> Iterator[TestClient]:
    """A server run with --trust-request-chat-template."""
    with serve(engine, trust_request_chat_template=True) as c:
        yield c


def test_request_template_needs_trust(client: TestClient, engine: FakeEngine) -> None:
    error = assert_error(post(client, chat_template="{{ x }}"), 400, param="chat_template")
    assert "--trust-request-chat-template" in error["message"] and not engine.templates


def test_template_fields_reach_the_template(trusting: TestClient, engine: FakeEngine) -> None:
    r = post(trusting, chat_template="{{ my template }}",
             chat_template_kwargs={"enable_thinking": False}, add_generation_prompt=False)
    assert r.status_code == 200
    args = engine.templates[-1]
    assert (args.chat_template, args.kwargs, args.add_generation_prompt) == (
        "{{ my template }}", {"enable_thinking": False}, False)
    assert _prompt(engine) == "[{{ my template }}][enable_thinking=False]<user>weather in Paris?\n"


def test_continue_final_message(client: TestClient, engine: FakeEngine) -> None:
    messages = [*MSG, {"role": "assistant", "content": "It is"}]
    r = post(client, messages=messages, continue_final_message=True,
             add_generation_prompt=False, max_tokens=2)
    assert r.status_code == 200
    assert _prompt(engine).endswith("<assistant>It is") and engine.templates[-1] \
        .continue_final_message


@pytest.mark.parametrize(("body", "param"), [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default gen prompt
    ({"chat_template": 3}, "chat_template"),
    ({"chat_template": "RAISE"}, "chat_template"),  # fails to render
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"add_generation_prompt": 1}, "add_generation_prompt"),
])
def test_bad_template_fields(trusting: TestClient, engine: FakeEngine, body: dict[str, Any],
                             param: str) -> None:
    assert_error(post(trusting, **body), 400, param=param)
    assert not engine.submitted


def test_tokenize_route_takes_the_template_fields(client: TestClient,
                                                  engine: FakeEngine) -> None:
    r = client.post("/tokenize", json={"messages": MSG, "add_generation_prompt": False,
                                       "chat_template_kwargs": {"k": 1}, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    text = "".join(chr(t - 2) for t in r.json()["tokens"])
    assert text.startswith("[k=1]<system>You can call functions")
    assert text.endswith("<user>weather in Paris?\n")
