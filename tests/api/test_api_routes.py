"""/v1/models, /health, /metrics, /tokenize, /detokenize, /openapi.json, the lifespan."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from api.app import create_app
from tests.support.apitools import serve
from tests.support.errors import assert_error
from tests.support.fake_engine import BOS, FakeEngine, tok


def test_models(engine: FakeEngine, client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == "fake-model" and card["object"] == "model"
    assert card["owned_by"] == "pagedserve" and card["max_model_len"] == engine.max_model_len


def test_served_model_name_overrides() -> None:
    with serve(FakeEngine(), served_model_name="alias") as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "alias"
        r = client.post("/v1/completions", json={"model": "alias", "prompt": "a",
                                                 "max_tokens": 1})
        assert r.json()["model"] == "alias"
        assert client.post("/v1/completions", json={"model": "fake-model",
                                                    "prompt": "a"}).status_code == 404


def test_health_and_lifespan() -> None:
    engine = FakeEngine()
    with serve(engine) as client:
        r = client.get("/health")
        assert r.status_code == 200 and engine.started
    assert engine.shut_down


def test_metrics_names(client: TestClient) -> None:
    client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "n": 2})
    text = client.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "admission_rejections_total",
                 "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert f"pagedserve:{name}" in text, name
    assert 'pagedserve:kv_cache_usage_perc{model_name="fake-model"} 0.25' in text
    assert ('pagedserve:request_success_total{finished_reason="length",model_name="fake-model"} '
            '2.0') in text
    assert 'pagedserve:generation_tokens_total{model_name="fake-model"} 6.0' in text
    assert 'pagedserve:time_to_first_token_seconds_count{model_name="fake-model"} 2.0' in text
    assert 'pagedserve:inter_token_latency_seconds_count{model_name="fake-model"} 4.0' in text


def test_registry_per_app() -> None:
    a, b = create_app(FakeEngine()), create_app(FakeEngine())
    assert a.state.pagedserve.metrics.registry is not b.state.pagedserve.metrics.registry


def test_tokenize_and_detokenize(client: TestClient) -> None:
    r = client.post("/tokenize", json={"prompt": "ab"})
    assert r.json() == {"count": 3, "max_model_len": 128, "tokens": [BOS, tok("a"), tok("b")]}
    r = client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False})
    assert r.json()["tokens"] == [tok("a"), tok("b")]
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]})
    assert r.json()["tokens"] == [tok(c) for c in "<user>a\n<assistant>"]
    r = client.post("/detokenize", json={"tokens": [tok("h"), tok("i")]})
    assert r.json() == {"prompt": "hi"}
    assert client.post("/detokenize", json={"tokens": [2**40]}).status_code == 400
    assert client.post("/detokenize", json={"tokens": "ab"}).json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={}).status_code == 400
    for special in (False, True):  # a template that refuses the messages is the client's 400
        r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "RAISE"}],
                                           "add_special_tokens": special})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_openapi_lists_every_route(client: TestClient) -> None:
    r = client.get("/openapi.json")
    spec = r.json()
    assert spec["openapi"].startswith("3.") and spec["info"]["title"]
    routes = {"/v1/completions": "post", "/v1/chat/completions": "post", "/v1/models": "get",
              "/health": "get", "/metrics": "get", "/tokenize": "post", "/detokenize": "post",
              "/openapi.json": "get", "/v1/engine/events": "get"}
    for path, method in routes.items():
        op = spec["paths"][path][method]
        assert "200" in op["responses"]
        for response in op["responses"].values():
            ref = response.get("content", {}).get("application/json", {}).get("schema", {})
            if "$ref" in ref:
                assert ref["$ref"].split("/")[-1] in spec["components"]["schemas"]
    app_paths = {route.path for route in client.app.routes}  # type: ignore[attr-defined]
    pages = {"/", "/dashboard", "/ui"}  # the built-in pages (docs/ui.md), not API routes
    assert app_paths == set(routes) | pages
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    props = body["application/json"]["schema"]["properties"]
    for field in ("prompt", "max_tokens", "logprobs", "echo", "stream_options", "logit_bias"):
        assert field in props


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "top_logprobs": 2}, "top_logprobs"),
])
def test_cross_field_rules_are_in_the_document(client: TestClient, path: str,
                                               body: dict[str, Any], param: str) -> None:
    """Issue 38: these bodies get a 400, and the OpenAPI document now says so (it did not:
    a schema-driven client took them for valid)."""
    schema = client.get("/openapi.json").json()["paths"][path]["post"]["requestBody"][
        "content"]["application/json"]["schema"]
    assert not jsonschema.Draft202012Validator(schema).is_valid(body)
    assert_error(client.post(path, json=body), 400, param)
    fixed = {"/tokenize": {"prompt": "a"},
             "/v1/completions": {**body, "stream": True},
             "/v1/chat/completions": {**body, "logprobs": True}}[path]
    assert jsonschema.Draft202012Validator(schema).is_valid(fixed)
    assert client.post(path, json=fixed).status_code == 200
