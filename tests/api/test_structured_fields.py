"""Structured-output request fields on both routes: every spelling becomes one
StructuredOutputsParams naming its field; malformed, unsupported or doubled constraints are a
400 naming the parameter (the compile itself is tested against a real engine in
tests/engine/test_structured_server.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from api.openapi import build_openapi
from engine.protocol import StructuredOutputsParams
from tests.support.errors import assert_error
from tests.support.fake_engine import FakeEngine

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MSG = [{"role": "user", "content": "hi"}]

ACCEPTED: list[tuple[dict[str, Any], StructuredOutputsParams | None]] = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}},
     StructuredOutputsParams("json_object", "", "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams("json", json.dumps(SCHEMA), "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     StructuredOutputsParams("json_object", "", "response_format")),
    ({"structured_outputs": {"json": SCHEMA}},
     StructuredOutputsParams("json", json.dumps(SCHEMA), "structured_outputs.json")),
    ({"structured_outputs": {"json": '{"type": "integer"}', "disable_fallback": True}},
     StructuredOutputsParams("json", '{"type": "integer"}', "structured_outputs.json")),
    ({"structured_outputs": {"regex": "[ab]+"}},
     StructuredOutputsParams("regex", "[ab]+", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["x", "y"]}},
     StructuredOutputsParams("choice", '["x", "y"]', "structured_outputs.choice")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOutputsParams("grammar", 'root ::= "a"', "structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}},
     StructuredOutputsParams("json_object", "", "structured_outputs.json_object")),
    ({"structured_outputs": {"json_object": False}}, None),
    ({"guided_json": SCHEMA}, StructuredOutputsParams("json", json.dumps(SCHEMA), "guided_json")),
    ({"guided_regex": "a|b"}, StructuredOutputsParams("regex", "a|b", "guided_regex")),
    ({"guided_choice": ["a"]}, StructuredOutputsParams("choice", '["a"]', "guided_choice")),
    ({"guided_grammar": 'root ::= "a"'},
     StructuredOutputsParams("grammar", 'root ::= "a"', "guided_grammar")),
    ({"guided_json_object": True},
     StructuredOutputsParams("json_object", "", "guided_json_object")),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
     StructuredOutputsParams("regex", "a", "guided_regex")),
]

REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "strict": "yes"}}},
     "response_format"),
    ({"structured_outputs": []}, "structured_outputs"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": 3}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": [1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": ["a"]}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"disable_fallback": "no"}}, "structured_outputs.disable_fallback"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": "\\s"}, "guided_whitespace_pattern"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex"),
]


def _route(route: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"messages": MSG} if route == "chat" else {"prompt": "hi"}
    body.update(max_tokens=2, **fields)
    return ("/v1/chat/completions" if route == "chat" else "/v1/completions"), body


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize(("fields", "expected"), ACCEPTED)
def test_each_spelling_reaches_the_engine(client: TestClient, engine: FakeEngine, route: str,
                                          fields: dict[str, Any],
                                          expected: StructuredOutputsParams | None) -> None:
    path, body = _route(route, {**fields, "n": 2})
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert [s.params.structured_outputs for s in engine.submitted] == [expected, expected]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_malformed_unsupported_or_doubled_constraints_are_refused(
        client: TestClient, engine: FakeEngine, route: str, fields: dict[str, Any],
        param: str) -> None:
    path, body = _route(route, fields)
    assert_error(client.post(path, json=body), 400, param)
    assert engine.submitted == []


def test_openapi_documents_the_fields() -> None:
    doc = build_openapi("t", "0")
    for path in ("/v1/completions", "/v1/chat/completions"):
        props = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"][
            "schema"]["properties"]
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar"):
            assert name in props, (path, name)
