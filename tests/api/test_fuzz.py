"""Fuzzing the POST routes from the server's own /openapi.json (fake engine, fast).

Bodies are drawn by schemafuzz from the served document: valid-shaped, mutated (wrong types,
boundary numbers, unknown fields, NaN) and broken bytes. Whatever comes in, the answer is
never a 5xx; every 4xx has the OpenAI error body, and a parameter it names is a documented
field; a 200 stream is well framed and ends with [DONE].
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from tests.api.schemafuzz import bodies, encoded, error_param_root, plausible, request_schema
from tests.support.apitools import serve, sse_events
from tests.support.errors import check_error_body
from tests.support.fake_engine import OFFSET, FakeEngine

ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
EXAMPLES = 200  # per route: ~2 s each on 2 cores
# The fake engine's token ids are code points + OFFSET; a real tokenizer never decodes to a
# lone surrogate, so plausible ids stop below U+D800 (out-of-range ids still come from the
# typed and any-JSON pools).
FAKE_VOCAB = 0xD800 - 16 + OFFSET
ONE_OF = {"/tokenize": ("prompt", "messages")}


def check_response(r: Any, schema: dict[str, Any]) -> None:
    """The contract for any input: no 5xx; 4xx in the OpenAI shape; 200 well formed."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.status_code in (400, 404, 413), r.text
        error = check_error_body(r.json())
        if error["param"] is not None:
            assert error_param_root(error["param"]) in schema["properties"], error
        return
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text)
        assert events[-1] == "[DONE]", events[-3:]
        for event in map(json.loads, events[:-1]):
            assert "error" not in event, event  # the fake engine never fails mid-stream
    else:
        assert isinstance(r.json(), dict)




@pytest.fixture(scope="module")
def fuzz_client() -> Any:
    with serve(FakeEngine()) as client:
        yield client


def fuzz(client: TestClient, path: str, mutated: bool, examples: int) -> Counter[int]:
    """POST `examples` bodies drawn from the served schema of `path`; the status counts."""
    schema = request_schema(client.get("/openapi.json").json(), path)
    hints = plausible("fake-model", FAKE_VOCAB, chat=path == "/v1/chat/completions")
    statuses: Counter[int] = Counter()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(raw=encoded(bodies(schema, hints, ONE_OF.get(path, ()), mutated), mutated))
    def one(raw: bytes) -> None:
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        statuses[r.status_code] += 1
        check_response(r, schema)

    one()
    return statuses


@pytest.mark.parametrize("path", ROUTES)
def test_fuzz_route_from_openapi(fuzz_client: TestClient, path: str) -> None:
    valid = fuzz(fuzz_client, path, mutated=False, examples=EXAMPLES // 2)
    mutated = fuzz(fuzz_client, path, mutated=True, examples=EXAMPLES // 2)
    # Both sides of validation must be reached, or the run proves little: valid-shaped
    # bodies mostly pass (their plausible values include a few bad ones), mutated mostly not.
    assert valid[200] >= EXAMPLES // 10, valid
    assert mutated[400] + mutated[404] >= EXAMPLES // 5, mutated


def test_openapi_lists_every_post_route(fuzz_client: TestClient) -> None:
    """The fuzzer covers what the document lists; the document must list every POST route."""
    openapi = fuzz_client.get("/openapi.json").json()
    posted = {p for p, ops in openapi["paths"].items() if "post" in ops}
    app_routes = {r.path for r in fuzz_client.app.routes  # type: ignore[attr-defined]
                  if "POST" in (getattr(r, "methods", None) or ())}
    assert posted == app_routes == set(ROUTES)
