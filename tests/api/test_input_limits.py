"""Input limits beyond the per-parameter table of test_api_errors.py:
body size, context length naming the limit, n / logprobs / prompt-list bounds, encodings,
wrong types and huge numbers on every numeric field, and the API key on every route."""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from api import app as app_module
from api.requests.completion import MAX_CHOICES, MAX_PROMPTS
from api.requests.options import TRUNCATED_TEXT_FACTOR
from api.requests.sampling import MAX_LOGPROBS, MAX_N
from api.state import DEFAULT_MAX_BODY_BYTES
from tests.support.apitools import serve
from tests.support.errors import assert_error
from tests.support.fake_engine import FakeEngine

MSG = [{"role": "user", "content": "hi"}]
POST_ROUTES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "a", "max_tokens": 1},
    "/v1/chat/completions": {"messages": MSG, "max_tokens": 1},
    "/tokenize": {"prompt": "a"}, "/detokenize": {"tokens": [70]},
}




# ------------------------------------------------------------------------- body size


@pytest.mark.parametrize("path", list(POST_ROUTES))
def test_body_over_limit_is_413_declared_or_chunked(path: str) -> None:
    with serve(FakeEngine(), max_body_bytes=1000) as client:
        big = json.dumps({**POST_ROUTES[path], "pad": "x" * 1000}).encode()
        error = assert_error(client.post(path, content=big), 413)
        assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
            for i in range(0, len(big), 100):
                yield big[i:i + 100]

        assert_error(client.post(path, content=chunks()), 413)
        assert client.post(path, json=POST_ROUTES[path]).status_code == 200


def test_default_body_limit() -> None:
    with serve(FakeEngine()) as client:
        body = b'{"prompt": "a", "pad": "' + b"x" * DEFAULT_MAX_BODY_BYTES + b'"}'
        assert_error(client.post("/v1/completions", content=body), 413)


def test_lying_content_length_is_not_trusted() -> None:
    """A small declared length does not let a bigger body through."""
    with serve(FakeEngine(), max_body_bytes=100) as client:
        body = json.dumps({"prompt": "a" * 500}).encode()
        r = client.post("/v1/completions", content=iter([body]),
                        headers={"content-type": "application/json"})
        assert_error(r, 413)


# ------------------------------------------------------------------- context length


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x" * 200}, "prompt"),
    ("/v1/completions", {"prompt": [70] * 128}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "x" * 200]}, "prompt"),
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 28}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200}]},
     "messages"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 500}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 500},
     "max_tokens"),
])
def test_context_length_names_the_limit(client: TestClient, path: str, body: dict[str, Any],
                                        param: str) -> None:
    error = assert_error(client.post(path, json=body), 400, param)
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 128 tokens" in error["message"], error


def test_context_length_boundary(client: TestClient) -> None:
    # 1 BOS + 100 characters = 101 prompt tokens; 27 more fill the 128-token context.
    assert client.post("/v1/completions",
                       json={"prompt": "x" * 100, "max_tokens": 27}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": [70] * 127, "max_tokens": 1}
                       ).status_code == 200


# ------------------------------------------------------------ n, logprobs, prompt lists


def test_n_bounds(client: TestClient) -> None:
    ok = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "n": MAX_N})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == MAX_N
    for path, base in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions",
                                                                {"messages": MSG})):
        for n in (0, -1, MAX_N + 1, 2**70, 1.0, "2", True):
            assert_error(client.post(path, json={**base, "n": n}), 400, "n")


def test_logprobs_bounds(client: TestClient) -> None:
    ok = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1,
                                              "logprobs": MAX_LOGPROBS})
    assert ok.status_code == 200, ok.text
    for value in (-1, MAX_LOGPROBS + 1, 2**70, 1.5, "1", True):
        assert_error(client.post("/v1/completions", json={"prompt": "a", "logprobs": value}),
                 400, "logprobs")
    chat = {"messages": MSG, "max_tokens": 1, "logprobs": True}
    assert client.post("/v1/chat/completions",
                       json={**chat, "top_logprobs": MAX_LOGPROBS}).status_code == 200
    for value in (-1, MAX_LOGPROBS + 1, 2**70, 1.5, "1", True):
        assert_error(client.post("/v1/chat/completions", json={**chat, "top_logprobs": value}),
                 400, "top_logprobs")


@pytest.mark.parametrize("prompt", [["a"] * (MAX_PROMPTS + 1), [[70]] * (MAX_PROMPTS + 1)])
def test_prompt_list_is_capped(client: TestClient, engine: FakeEngine,
                               prompt: list[Any]) -> None:
    error = assert_error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}),
                     400, "prompt")
    assert str(MAX_PROMPTS) in error["message"]
    assert not engine.submitted  # refused before anything reached the engine


def test_prompt_list_at_the_cap_and_choices_cap(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": ["a"] * MAX_PROMPTS, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_PROMPTS
    # A long token-id prompt is one prompt, not a list of prompts.
    assert client.post("/v1/completions", json={"prompt": [70] * 120, "max_tokens": 1}
                       ).status_code == 200
    assert_error(client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": MAX_N}),
             400, "n")
    assert 3 * MAX_N > MAX_CHOICES


# --------------------------------------------------------- encodings and bad bodies


@pytest.mark.parametrize("raw", [
    '{"prompt": "a"}'.encode("utf-16"),  # json.loads(bytes) would guess UTF-16
    '{"prompt": "a"}'.encode("utf-32"),
    b'{"prompt": "caf\xe9"}',  # Latin-1
    b'{"prompt": "\xc3"}',  # truncated UTF-8 sequence
    b"",
    b'{"prompt": "a"} trailing',
    b'{"prompt": 1e400, "messages": 1e400, "tokens": 1e400}',  # parses as float inf
    b'{"prompt": "a", "temperature": -Infinity}',
    b'{"prompt": "a", "n": 1' + b"0" * 4400 + b"}",  # past Python's int digit limit
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
])
@pytest.mark.parametrize("path", list(POST_ROUTES))
def test_unreadable_bodies_are_400(client: TestClient, path: str, raw: bytes) -> None:
    assert_error(client.post(path, content=raw), 400)


def test_utf8_bom_is_tolerated(client: TestClient) -> None:
    r = client.post("/v1/completions", content=b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 1}')
    assert r.status_code == 200, r.text


def test_lone_surrogate_in_an_echoed_value_is_400_not_500(client: TestClient) -> None:
    """Error messages quote the client's text; a lone surrogate in it must not break the
    error response itself (it did: UnicodeEncodeError -> 500)."""
    r = client.post("/v1/completions", content=b'{"prompt": "a", "model": "\\ud800"}')
    error = assert_error(r, 404, "model")
    assert "\ud800" in error["message"]  # escaped on the wire, the same text once parsed
    r = client.post("/tokenize", content=b'{"model": "\\udfff", "prompt": "a"}')
    assert_error(r, 404, "model")


INT_FIELDS = ["max_tokens", "n", "seed", "logprobs", "top_k", "min_tokens", "priority",
              "best_of"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"]
WRONG = ["1", [1], {"a": 1}, True, 1.5]
HUGE = [2**70, -(2**70), 2**63, 10**30]


@pytest.mark.parametrize("field", INT_FIELDS)
def test_integer_fields_refuse_wrong_types_and_huge_values(client: TestClient,
                                                           field: str) -> None:
    for value in [*WRONG, *HUGE]:
        r = client.post("/v1/completions", json={"prompt": "a", field: value})
        assert_error(r, 400, field)
    raw = b'{"prompt": "a", "' + field.encode() + b'": 1e400}'
    assert_error(client.post("/v1/completions", content=raw), 400, field)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_number_fields_refuse_wrong_types_and_huge_values(client: TestClient,
                                                          field: str) -> None:
    for value in ["1", [1], {"a": 1}, True, 10**400, -(10**400)]:  # 10**400: not a float
        assert_error(client.post("/v1/completions", json={"prompt": "a", field: value}),
                 400, field)
    for raw_value in (b"1e400", b"-1e400", b"NaN", b"Infinity"):
        raw = b'{"prompt": "a", "' + field.encode() + b'": ' + raw_value + b"}"
        assert_error(client.post("/v1/completions", content=raw), 400)


@pytest.mark.parametrize("bias", [
    {"1e400": 1}, {str(2**70): 1}, {"-1": 1}, {"1.5": 1}, {"": 1}, {"9" * 5000: 1},
    {"70": 2**70}, {"70": "1"}, {"70": [1]}, {"70": True}, {"70": 101},
])
def test_logit_bias_keys_and_values(client: TestClient, bias: dict[str, Any]) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": "a", "logit_bias": bias}), 400,
             "logit_bias")


def test_logit_bias_huge_float_value(client: TestClient) -> None:
    raw = b'{"prompt": "a", "logit_bias": {"70": 1e400}}'
    assert_error(client.post("/v1/completions", content=raw), 400, "logit_bias")


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, None),  # fake engine: BOS only, so it is not empty; see below
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [""] * 2, "max_tokens": 1}, None),
    ({"prompt": [[70], "a"]}, "prompt"),
    ({"prompt": [[70, [71]]]}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": [2**70]}, "prompt"),
    ({"prompt": [70.0]}, "prompt"),
    ({"prompt": "a", "stop": {"x": 1}}, "stop"),
    ({"prompt": "a", "stop": [["x"]]}, "stop"),
    ({"prompt": "a", "stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"prompt": "a", "stop_token_ids": 5}, "stop_token_ids"),
    ({"prompt": "a", "stream_options": [1], "stream": True}, "stream_options"),
])
def test_completion_shapes(client: TestClient, body: dict[str, Any], param: str | None) -> None:
    r = client.post("/v1/completions", json=body)
    if param is None:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 400, param)


def test_empty_prompt_after_tokenization_is_400() -> None:
    class NoBos(FakeEngine):
        async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return self.encode(text, add_special_tokens=False)

    with serve(NoBos()) as client:
        assert_error(client.post("/v1/completions", json={"prompt": ""}), 400, "prompt")


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    (None, "messages"),
    ({"role": "user", "content": "x"}, "messages"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "User", "content": "x"}], "messages[0].role"),
    ([{"role": ["user"], "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": {"text": "x"}}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [[]]}], "messages[0].content[0]"),
    ([*MSG, "x"], "messages[1]"),
])
def test_chat_message_shapes(client: TestClient, messages: Any, param: str) -> None:
    assert_error(client.post("/v1/chat/completions", json={"messages": messages}), 400, param)


@pytest.mark.parametrize(("body", "param"), [
    ({}, "prompt"),
    ({"prompt": "a", "messages": MSG}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
])
def test_tokenize_shapes(client: TestClient, body: dict[str, Any], param: str) -> None:
    assert_error(client.post("/tokenize", json=body), 400, param)


@pytest.mark.parametrize("tokens", [None, "70", [70, "71"], [-1], [2**70], [70.0], [[70]],
                                    [True]])
def test_detokenize_shapes(client: TestClient, tokens: Any) -> None:
    assert_error(client.post("/detokenize", json={"tokens": tokens}), 400, "tokens")


# ---------------------------------------------------------------------------- API key

# Open without a key: the probes (/health for load balancers, /metrics for scrapers) and
# /openapi.json. The document only describes the public API, and tools that read it
# (client generators, schemathesis) expect it unauthenticated; vLLM leaves its docs open too.
# Probes, scrapers and the built-in pages' static files (they hold no server data).
OPEN_PATHS = {"/health", "/metrics", "/", "/dashboard"}
QUERY = {"/v1/engine/events": "?max_events=1"}  # a finite event stream
KEY = "s3cr3t-key"


def _call(client: TestClient, route: Route, headers: dict[str, str]) -> Any:
    method = min(route.methods - {"HEAD"})  # type: ignore[operator]
    body = POST_ROUTES.get(route.path)
    return client.request(method, route.path + QUERY.get(route.path, ""),
                          json=body if method == "POST" else None, headers=headers)


def _routes(client: TestClient) -> list[Route]:
    routes = [r for r in client.app.routes if isinstance(r, Route)]  # type: ignore[attr-defined]
    assert len(routes) >= 8
    return routes


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer "},
    {"Authorization": f"bearer{KEY}"}, {"X-API-Key": KEY},
])
def test_api_key_guards_every_route_but_the_open_ones(headers: dict[str, str]) -> None:
    with serve(FakeEngine(), api_key=KEY) as client:
        for route in _routes(client):
            r = _call(client, route, headers)
            if route.path in OPEN_PATHS:
                assert r.status_code == 200, (route.path, r.text)
            else:
                error = assert_error(r, 401)
                assert error["code"] == "invalid_api_key", route.path
        assert_error(client.get("/v1/no-such-route", headers=headers), 401)
        assert client.get("/ui/style.css", headers=headers).status_code == 200


def test_api_key_accepted_on_every_route() -> None:
    with serve(FakeEngine(), api_key=KEY) as client:
        for route in _routes(client):
            r = _call(client, route, {"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, (route.path, r.text)


def test_api_key_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key is checked with hmac.compare_digest (a plain == leaks its prefix length
    through timing), once per protected request."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    with serve(FakeEngine(), api_key=KEY) as client:
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}
                          ).status_code == 200
        assert_error(client.get("/v1/models", headers={"Authorization": "Bearer no"}), 401)
    assert calls == [(f"Bearer {KEY}".encode(), f"Bearer {KEY}".encode()),
                     (b"Bearer no", f"Bearer {KEY}".encode())]


def test_without_api_key_everything_is_open() -> None:
    with serve(FakeEngine()) as client:
        for route in _routes(client):
            assert _call(client, route, {}).status_code == 200, route.path


class Counting(FakeEngine):
    """Records the length of every text it tokenizes."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenized: list[int] = []

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.tokenized.append(len(text))
        return await super().tokenize(text, add_special_tokens)


def test_prompt_text_too_long_to_fit_is_refused_before_tokenizing() -> None:
    engine = Counting()  # max_model_len 128; max_prompt_bytes 4 * 128 (a token: a character)
    with serve(engine) as client:
        for path, body, param in (
                ("/v1/completions", {"prompt": "x" * 513}, "prompt"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "é" * 300}]},
                 "messages"),
                # issue 31: /tokenize skipped the gate (five 4 MB texts held the tokenizer)
                ("/tokenize", {"prompt": "x" * 513}, "prompt"),
                ("/tokenize", {"messages": [{"role": "user", "content": "é" * 300}]},
                 "messages")):
            r = client.post(path, json=body)
            assert assert_error(r, 400, param)["code"] == "context_length_exceeded"
        assert engine.tokenized == []  # neither text reached the tokenizer
        # Under the bound, the text is tokenized and the usual context check answers.
        r = client.post("/v1/completions", json={"prompt": "x" * 512})
        assert assert_error(r, 400, "prompt")["code"] == "context_length_exceeded"
        assert engine.tokenized == [512]


def test_text_to_truncate_is_refused_past_its_bound_before_tokenizing() -> None:
    """issue 31: truncate_prompt_tokens skipped the size gate. A prompt to be truncated may
    exceed the context, up to TRUNCATED_TEXT_FACTOR contexts' worth of text."""
    engine = Counting()  # max_prompt_bytes 4 * 128: the bound is 4 * 512 bytes
    bound = TRUNCATED_TEXT_FACTOR * 512
    with serve(engine) as client:
        for path, body, param in (
                ("/v1/completions", {"prompt": "x" * (bound + 1)}, "prompt"),
                ("/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "é" * (bound // 2)}]}, "messages")):
            r = client.post(path, json={**body, "truncate_prompt_tokens": 8, "max_tokens": 2})
            err = assert_error(r, 400, param)
            assert err["code"] == "context_length_exceeded" and "4 times" in err["message"]
        assert engine.tokenized == []
        r = client.post("/v1/completions", json={"prompt": "x" * bound, "max_tokens": 2,
                                                 "truncate_prompt_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 8
        assert engine.tokenized == [bound]
