"""Every error class: status, OpenAI body, the parameter named; never 422, never 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from api.errors import UNKNOWN_RETRY_S
from engine.protocol import EngineDeadError, PromptTooLongError, QueueFullError
from tests.support.apitools import serve, sse_events
from tests.support.errors import assert_error
from tests.support.fake_engine import FakeEngine

MSG = [{"role": "user", "content": "hi"}]




BAD_COMPLETIONS = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[1], "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 1000}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": 10**400}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "min_p": 2}, "min_p"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 1000}, "n"),
    ({"prompt": "a", "stop": [1]}, "stop"),
    ({"prompt": "a", "stop": ["x"] * 17}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop_token_ids": [-3]}, "stop_token_ids"),
    ({"prompt": "a", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"prompt": "a", "seed": 2**70}, "seed"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "a", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "echo": 1}, "echo"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "user": 3}, "user"),
    ({"prompt": "a", "priority": 1.5}, "priority"),
    ({"prompt": "a", "model": 3}, "model"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(client: TestClient, body: dict[str, Any], param: str) -> None:
    assert_error(client.post("/v1/completions", json=body), 400, param)


BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [3]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "RAISE"}]}, "messages"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": MSG, "logprobs": 1}, "logprobs"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_requests(client: TestClient, body: dict[str, Any], param: str) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'"x"', b"null", b'{"prompt": NaN}',
                                 b'{"prompt": "a", "temperature": Infinity}', b"\xff\xfe",
                                 b"[" * 100_000, b'{"prompt": "a", "n": ' + b"9" * 5000 + b"}"])
def test_malformed_bodies_are_400(client: TestClient, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert_error(client.post(path, content=raw), 400)


def test_lone_surrogate_is_400(client: TestClient) -> None:
    """Valid JSON, but not Unicode text: a 400 that says so, naming where it is, without
    the tokenizer's own exception text."""
    raw = b'{"prompt": "a\\ud800"}'
    error = assert_error(client.post("/v1/completions", content=raw), 400, "prompt")
    assert error["message"] == ("prompt is not valid Unicode text: it contains a lone UTF-16 "
                                "surrogate (U+D800) at character 1")
    raw = b'{"messages": [{"role": "user", "content": "\\udfff"}]}'
    error = assert_error(client.post("/v1/chat/completions", content=raw), 400,
                         "messages[0].content")
    assert "surrogate" in error["message"] and "encode" not in error["message"]
    raw = b'{"prompt": "\\ud800"}'
    assert_error(client.post("/tokenize", content=raw), 400, "prompt")


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", b'{"prompt": "a", "stop": "x\\ud800"}', "stop"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["ok", "\\udc00"]}', "stop"),
    ("/v1/completions", b'{"prompt": "a", "guided_choice": ["a", "\\ud800\\ud800"]}',
     "guided_choice[1]"),
    ("/v1/completions", b'{"prompt": "a", "structured_outputs": {"regex": "\\ud800+"}}',
     "structured_outputs.regex"),
    ("/v1/chat/completions", (b'{"messages": [{"role": "user", "content": "a"}], "tools": '
     b'[{"type": "function", "function": {"name": "f\\ud800"}}]}'), "tools[0].function.name"),
    ("/v1/chat/completions", (b'{"messages": [{"role": "user", "content": "a"}], '
     b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
     b'{"enum": ["\\udfff"]}}}}'), "response_format.json_schema.schema.enum[0]"),
])
def test_lone_surrogates_are_400_naming_their_field(client: TestClient, path: str, raw: bytes,
                                                     param: str) -> None:
    """Issue 38: they passed in stop and guided_choice (which then answered three U+FFFD),
    and one in a tool name was reported as messages (the tools are rendered into them)."""
    error = assert_error(client.post(path, content=raw), 400, param)
    assert "surrogate" in error["message"]


REMOTE = {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"guided_json": REMOTE}, "guided_json"),
    ("/v1/completions", {"guided_json": json.dumps(REMOTE)}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"json": {"$ref": "other.json#/x"}}},
     "structured_outputs.json"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": REMOTE}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": REMOTE}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
])
def test_a_remote_ref_is_400_not_any_value(client: TestClient, path: str,
                                           extra: dict[str, Any], param: str) -> None:
    """Issue 38: a $ref outside the schema was compiled as "any value": the constraint
    silently did nothing. Nothing is fetched: a 400 naming the field."""
    base: dict[str, Any] = ({"prompt": "a"} if path == "/v1/completions"
                            else {"messages": [{"role": "user", "content": "a"}]})
    error = assert_error(client.post(path, json={**base, **extra}), 400, param)
    assert "$ref" in error["message"]


def test_a_local_ref_is_kept(client: TestClient) -> None:
    schema = {"$defs": {"n": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/n"}}}
    r = client.post("/v1/completions", json={"prompt": "a", "guided_json": schema})
    assert r.status_code == 200, r.text


def test_unknown_fields_are_ignored(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "frobnicate": 1})
    assert r.status_code == 200


def test_context_length(client: TestClient) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": "x" * 200}), 400, "prompt",
                 "context_length_exceeded")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 127}), 400,
                 "max_tokens", "context_length_exceeded")
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 126}).status_code \
        == 200


def test_unknown_model_route_and_method(client: TestClient) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": "a", "model": "gpt-9"}), 404,
                 "model", "model_not_found")
    assert_error(client.get("/v2/nothing"), 404)
    r = client.get("/v1/completions")
    assert_error(r, 405)
    assert "POST" in r.headers["allow"]


def test_body_too_large() -> None:
    with serve(FakeEngine(), max_body_bytes=100) as client:
        assert_error(client.post("/v1/completions", json={"prompt": "a" * 200}), 413)
        assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 200


def test_api_key() -> None:
    with serve(FakeEngine(), api_key="sekrit") as client:
        body = {"prompt": "a", "max_tokens": 1}
        assert_error(client.post("/v1/completions", json=body), 401, code="invalid_api_key")
        bad = {"Authorization": "Bearer nope"}
        assert_error(client.post("/v1/completions", json=body, headers=bad), 401)
        assert_error(client.get("/v1/models"), 401)
        assert_error(client.post("/tokenize", json={"prompt": "a"}), 401)
        good = {"Authorization": "Bearer sekrit"}
        assert client.post("/v1/completions", json=body, headers=good).status_code == 200
        assert client.get("/health").status_code == 200  # probes stay open
        assert client.get("/metrics").status_code == 200


def _queue_full(limit: str) -> QueueFullError:
    return QueueFullError("waiting queue is full", limit=limit)


@pytest.mark.parametrize(("error", "status", "code", "reason"), [
    (_queue_full("max_num_queued_reqs"), 429, "rate_limit_exceeded", "max_num_queued_reqs"),
    (_queue_full("max_num_queued_tokens"), 429, "rate_limit_exceeded",
     "max_num_queued_tokens"),
    (PromptTooLongError("needs 900 blocks"), 400, "context_length_exceeded", "prompt_too_long"),
    (EngineDeadError("gone"), 503, "engine_dead", "engine_dead"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_admission_errors(error: Exception, status: int, code: str, reason: str,
                          stream: bool) -> None:
    engine = FakeEngine(admission_error=error)
    with serve(engine) as client:
        r = client.post("/v1/completions", json={"prompt": "a", "stream": stream, "n": 2})
        assert_error(r, status, code=code)
        if status == 429:  # from the engine's stats: 3 waiting at 0.4 finished/s -> 7.5 s
            assert r.headers["retry-after"] == str(UNKNOWN_RETRY_S)  # no rate known yet
            engine.finish_rate, engine.num_waiting = 0.4, 3
            r = client.post("/v1/completions", json={"prompt": "a", "stream": stream})
            assert_error(r, status, code=code)
            assert r.headers["retry-after"] == "8"
            engine.finish_rate = None
        count = 2.0 if status == 429 else 1.0
        assert f'admission_rejections_total{{model_name="fake-model",reason="{reason}"}} {count}' in \
            client.get("/metrics").text
        r = client.post("/v1/chat/completions", json={"messages": MSG, "stream": stream})
        assert_error(r, status, code=code)
        # A refused request was never running: it is neither aborted nor counted as one.
        assert not engine.aborted
        assert 'finished_reason="abort"' not in client.get("/metrics").text


def test_503_while_loading_and_when_dead() -> None:
    engine = FakeEngine(load_delay=30)
    with serve(engine, wait_ready=False) as client:
        assert_error(client.get("/health"), 503)
        assert_error(client.post("/v1/completions", json={"prompt": "a"}), 503)
        assert_error(client.post("/tokenize", json={"prompt": "a"}), 503)
    engine = FakeEngine()
    with serve(engine) as client:
        assert client.get("/health").status_code == 200
        engine.dead = True
        assert_error(client.get("/health"), 503)
        assert_error(client.post("/v1/chat/completions", json={"messages": MSG}), 503)


def test_start_failure_keeps_server_up_with_503() -> None:
    with serve(FakeEngine(start_error=RuntimeError("no weights")), wait_ready=False) as client:
        assert_error(client.get("/health"), 503)


def test_error_event_framing_is_json() -> None:
    engine = FakeEngine(fail_after=0)
    with serve(engine) as client:
        r = client.post("/v1/chat/completions", json={"messages": MSG, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error"
