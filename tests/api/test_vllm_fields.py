"""vLLM's request fields on both routes (fake engine): every refused field is a 400 naming it,
its inert values pass, unknown fields cost one warning line; prompt_logprobs,
truncate_prompt_tokens, return_tokens_as_token_ids, add_special_tokens, request_id,
stream_options.continuous_usage_stats and usage.prompt_tokens_details.cached_tokens."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from starlette.testclient import TestClient

from api.requests.fields import CHAT, CMPL, FIELDS, Status
from tests.support.apitools import sse_json
from tests.support.errors import assert_error
from tests.support.fake_engine import BOS, FakeEngine, tok

PATHS = {CMPL: "/v1/completions", CHAT: "/v1/chat/completions"}
BASE: dict[str, dict[str, Any]] = {
    CMPL: {"prompt": "abc", "max_tokens": 2},
    CHAT: {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 2}}
REFUSED = [(route, f) for f in FIELDS if f.status is Status.REFUSED for route in sorted(f.routes)]


@pytest.mark.parametrize(("route", "field"), REFUSED, ids=lambda x: getattr(x, "name", x))
def test_refused_field_is_400_naming_it(client: TestClient, route: str, field: Any) -> None:
    r = client.post(PATHS[route], json={**BASE[route], field.name: field.example})
    error = assert_error(r, 400, field.name)
    assert field.name in error["message"]
    for inert in (None, *field.inert):  # vLLM's defaults ask for nothing: accepted
        assert client.post(PATHS[route], json={**BASE[route], field.name: inert}).status_code \
            == 200, (field.name, inert)


def test_the_field_list_covers_vllm_and_marks_the_other_branches(client: TestClient) -> None:
    names = {f.name for f in FIELDS}
    assert {"prompt_logprobs", "truncate_prompt_tokens", "return_tokens_as_token_ids",
            "use_beam_search", "cache_salt", "bad_words", "allowed_token_ids",
            "structured_outputs", "guided_choice", "chat_template_kwargs",
            "continue_final_message"} <= names
    owned = {f.name for f in FIELDS if f.status is Status.OWNED}
    assert {"guided_json", "response_format", "tools", "chat_template"} <= owned


def test_unknown_fields_are_ignored_with_one_warning(client: TestClient,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    for route in (CMPL, CHAT):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedserve.api"):
            r = client.post(PATHS[route], json={**BASE[route], "frobnicate": 1, "zork": {},
                                                "top_k": 3, "guided_regex": None})
        assert r.status_code == 200
        lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
        want = (f"{PATHS[route]}: the following fields were present in the request but "
                "ignored: frobnicate, zork")
        assert lines == [want]


def test_no_effect_fields_are_type_checked(client: TestClient) -> None:
    assert client.post(PATHS[CHAT], json={**BASE[CHAT], "store": True,
                                          "length_penalty": 1.5}).status_code == 200
    assert_error(client.post(PATHS[CHAT], json={**BASE[CHAT], "store": 1}), 400, "store")
    assert_error(client.post(PATHS[CMPL], json={**BASE[CMPL], "length_penalty": True}), 400,
                 "length_penalty")


def test_prompt_logprobs_on_completions(engine: FakeEngine, client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "n": 2,
                                             "prompt_logprobs": 1})
    assert engine.submitted[0].params.prompt_logprobs == 1
    for choice in r.json()["choices"]:  # vLLM: on every choice, the first entry null
        a, b = tok("a"), tok("b")
        assert choice["prompt_logprobs"] == [
            None, {str(a): {"logprob": -0.5, "rank": 1, "decoded_token": "a"}},
            {str(b): {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]
        assert choice["logprobs"] is None
    plain = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1})
    assert "prompt_logprobs" not in plain.json()["choices"][0]


def test_prompt_logprobs_on_chat_and_with_stream(engine: FakeEngine, client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={**BASE[CHAT], "prompt_logprobs": 2})
    plp = r.json()["prompt_logprobs"]
    prompt = engine.submitted[0].prompt
    assert plp[0] is None and len(plp) == len(prompt)
    second = int(prompt[1])
    assert list(plp[1]) == [str(second), str(second + 1)]  # the token, then the top-2
    assert plp[1][str(second + 1)]["rank"] == 2
    for path, route in PATHS.items():  # vLLM: only the 0 form streams
        r = client.post(route, json={**BASE[path], "stream": True, "prompt_logprobs": 1})
        assert_error(r, 400, "prompt_logprobs")
        r = client.post(route, json={**BASE[path], "stream": True, "prompt_logprobs": 0})
        assert r.status_code == 200


def test_truncate_prompt_tokens(engine: FakeEngine, client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 1,
                                             "truncate_prompt_tokens": 2, "echo": True})
    assert engine.submitted[-1].prompt == [tok("e"), tok("f")]
    assert r.json()["usage"]["prompt_tokens"] == 2
    assert r.json()["choices"][0]["text"].startswith("ef")  # the echo is what the model saw
    r = client.post("/v1/chat/completions", json={**BASE[CHAT], "truncate_prompt_tokens": 3})
    assert engine.submitted[-1].prompt == engine.encode("<assistant>", False)[-3:]
    assert r.json()["usage"]["prompt_tokens"] == 3
    long = "x" * 500  # longer than the fake's 128-token context: -1 keeps what fits
    r = client.post("/v1/completions", json={"prompt": long, "max_tokens": 8,
                                             "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 128 - 8
    for bad in (0, -2, 128):  # 128 leaves no room for max_tokens: refused, as vLLM
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 8,
                                                 "truncate_prompt_tokens": bad})
        assert_error(r, 400, "truncate_prompt_tokens")


def test_return_tokens_as_token_ids(client: TestClient) -> None:
    a, b = tok("a"), tok("b")
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "echo": True,
                                             "logprobs": 2, "return_tokens_as_token_ids": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{BOS}", f"token_id:{a}", f"token_id:{b}",
                            f"token_id:{a}"]
    assert lp["top_logprobs"][1] == {f"token_id:{a}": -0.5, f"token_id:{a + 1}": -1.5}
    assert lp["text_offset"] == [0, 10, 21, 33]  # lengths of the shown tokens, as vLLM
    r = client.post("/v1/chat/completions", json={
        **BASE[CHAT], "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True})
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    assert first["token"].startswith("token_id:") and first["bytes"] == list(b"<")
    assert first["top_logprobs"][0]["token"] == first["token"]


def test_add_special_tokens(engine: FakeEngine, client: TestClient) -> None:
    client.post("/v1/completions", json={"prompt": "ab", "add_special_tokens": False})
    assert engine.submitted[-1].prompt == [tok("a"), tok("b")]
    client.post("/v1/chat/completions", json={**BASE[CHAT], "add_special_tokens": True})
    assert engine.submitted[-1].prompt[0] == BOS


def test_request_id_names_the_response(engine: FakeEngine, client: TestClient) -> None:
    ids = [client.post("/v1/completions", json={**BASE[CMPL], "request_id": "job-7"}).json()
           ["id"] for _ in range(2)]
    assert ids == ["cmpl-job-7", "cmpl-job-7"]
    r = client.post("/v1/chat/completions", json={**BASE[CHAT], "request_id": "job-7"})
    assert r.json()["id"] == "chatcmpl-job-7"
    assert len({s.request_id for s in engine.submitted}) == 3  # engine ids stay unique


@pytest.mark.parametrize("route", [CMPL, CHAT])
def test_continuous_usage_stats(engine: FakeEngine, client: TestClient, route: str) -> None:
    engine.cached_tokens = 2
    body = {**BASE[route], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_json(client.post(PATHS[route], json=body).text)
    *content, final = chunks
    prompt_len = len(engine.submitted[-1].prompt)
    for choice in (0, 1):
        mine = [c for c in content if c["choices"][0]["index"] == choice]
        counts = [c["usage"]["completion_tokens"] for c in mine]
        assert counts == ([0, 1, 2, 3] if route == CHAT else [1, 2, 3])  # chat: role chunk
        assert all(c["usage"]["prompt_tokens"] == prompt_len for c in mine)
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": prompt_len, "completion_tokens": 6, "total_tokens": prompt_len + 6,
        "prompt_tokens_details": {"cached_tokens": 2}}
    body["stream_options"] = {"continuous_usage_stats": True}  # needs include_usage (vLLM)
    chunks = sse_json(client.post(PATHS[route], json=body).text)
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("route", [CMPL, CHAT])
def test_cached_tokens_in_usage(engine: FakeEngine, client: TestClient, route: str) -> None:
    engine.cached_tokens = 5
    body = client.post(PATHS[route], json={**BASE[route], "n": 3}).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}  # the prompt once
    if route == CMPL:  # two prompts: each counted once
        body = client.post(PATHS[route], json={"prompt": ["ab", "cd"], "n": 2}).json()
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 10}


def test_detokenize_and_tokenize_refuse_a_null_model(client: TestClient) -> None:
    assert_error(client.post("/detokenize", json={"model": None, "tokens": [5]}), 400, "model")
    assert_error(client.post("/tokenize", json={"model": None, "prompt": "a"}), 400, "model")
    assert client.post("/detokenize", json={"tokens": [tok("a")]}).json() == {"prompt": "a"}


@pytest.mark.parametrize(("route", "extra", "param"), [
    (CMPL, {"logit_bias": {" 5": 1}}, "logit_bias"),  # int() takes it; the schema does not
    (CMPL, {"logit_bias": {"\uff15": 1}}, "logit_bias"),  # a fullwidth digit
    (CMPL, {"request_id": ""}, "request_id"),
    (CMPL, {"request_id": "x" * 257}, "request_id"),
    (CHAT, {"request_id": "\ud800"}, "request_id"),  # echoed in the id: must be encodable
    (CHAT, {"messages": [{"role": "user", "content": "a", "name": 5}]}, "messages[0].name"),
    (CHAT, {"tool_choice": 5}, "tool_choice"),  # owned elsewhere: its JSON type is checked
])
def test_what_the_document_forbids_is_refused(client: TestClient, route: str,
                                              extra: dict[str, Any], param: str) -> None:
    raw = json.dumps({**BASE[route], **extra}).encode()  # ASCII: "\\ud800" stays escaped
    assert_error(client.post(PATHS[route], content=raw), 400, param)


def test_return_token_ids(engine: FakeEngine, client: TestClient) -> None:
    a, b = tok("a"), tok("b")
    body = {"prompt": [a, b], "max_tokens": 3, "return_token_ids": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == [a, b] and choice["token_ids"] == [a, b, a]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == "aba"  # vLLM: the ids stand for the echoed prompt
    chunks = sse_json(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[a], [b], [a]]
    assert [c["choices"][0]["prompt_token_ids"] for c in chunks] == [[a, b], None, None]
    chat = {**BASE[CHAT], "max_tokens": 2, "return_token_ids": True}
    r = client.post("/v1/chat/completions", json=chat).json()
    prompt = engine.submitted[-1].prompt
    assert r["prompt_token_ids"] == prompt and r["choices"][0]["token_ids"] == list(prompt[:2])
    chunks = sse_json(client.post("/v1/chat/completions", json={**chat, "stream": True}).text)
    assert chunks[0]["prompt_token_ids"] == prompt  # on the opening role chunk
    assert [c["choices"][0]["token_ids"] for c in chunks[1:]] == [[prompt[0]], [prompt[1]]]
    plain = client.post("/v1/completions", json={"prompt": "ab"}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_chat_echo_prepends_the_assistants_last_message(client: TestClient) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    body = {"messages": messages, "max_tokens": 2, "echo": True}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"][
        "content"]
    assert content.startswith("Sure: ") and len(content) == len("Sure: ") + 2
    chunks = sse_json(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert chunks[1]["choices"][0]["delta"] == {"content": "Sure: "}  # after the role chunk
    user_last = {"messages": messages[:1], "max_tokens": 2, "echo": True}
    assert len(client.post("/v1/chat/completions", json=user_last).json()["choices"][0][
        "message"]["content"]) == 2  # nothing to echo
