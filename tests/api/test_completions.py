"""/v1/completions: response shapes, prompt forms, echo/logprobs, SSE framing, n > 1."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from tests.support.apitools import serve, sse_events, sse_json
from tests.support.fake_engine import BOS, FakeEngine, tok


def test_plain_completion_shape(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "abc",
                                             "max_tokens": 4})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "abca", "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_default_max_tokens_is_16_and_null_fills_context(engine: FakeEngine,
                                                          client: TestClient) -> None:
    client.post("/v1/completions", json={"prompt": "abc"})
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": None})
    assert [s.params.max_tokens for s in engine.submitted] == [16, engine.max_model_len - 4]


def test_prompt_forms_and_choice_indices(engine: FakeEngine, client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": ["ab", "xy"], "n": 2, "max_tokens": 2})
    texts = {c["index"]: c["text"] for c in r.json()["choices"]}
    assert texts == {0: "ab", 1: "ab", 2: "xy", 3: "xy"}  # index = prompt_index * n + i
    assert r.json()["usage"]["prompt_tokens"] == 6  # each prompt once, not once per choice
    ids = [tok("q"), tok("r")]
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3})
    assert r.json()["choices"][0]["text"] == "qrq"
    r = client.post("/v1/completions", json={"prompt": [ids, [tok("z")]], "max_tokens": 1})
    assert [c["text"] for c in r.json()["choices"]] == ["q", "z"]
    assert engine.submitted[-1].prompt == [tok("z")]  # token ids reach the engine untouched


def test_seed_per_choice_and_params_forwarded(engine: FakeEngine, client: TestClient) -> None:
    client.post("/v1/completions", json={
        "prompt": "a", "n": 3, "seed": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "stop": ["x"], "stop_token_ids": [9], "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logit_bias": {"5": -100},
        "ignore_eos": True, "min_tokens": 1, "priority": 3, "user": "u",
        "include_stop_str_in_output": True, "skip_special_tokens": False, "best_of": 3})
    params = [s.params for s in engine.submitted]
    assert [p.seed for p in params] == [7, 8, 9]
    p = params[0]
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.9, 5, 0.1)
    assert p.stop == ("x",) and p.stop_token_ids == (9,) and p.logit_bias == {5: -100.0}
    assert p.ignore_eos and p.min_tokens == 1 and p.include_stop_str_in_output
    assert not p.skip_special_tokens and p.repetition_penalty == 1.1
    assert {s.priority for s in engine.submitted} == {3}


def test_stop_string_and_stop_token(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "abcd", "stop": "c", "max_tokens": 9})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("ab", "stop", "c")
    r = client.post("/v1/completions", json={"prompt": "abcd", "stop_token_ids": [tok("b")]})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == ("a", tok("b"))


def test_logprobs_object(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"] == [{"a": -0.5, "b": -1.5}, {"b": -0.5, "c": -1.5}]
    assert lp["text_offset"] == [0, 1]


def test_echo_with_prompt_logprobs(engine: FakeEngine, client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "echo": True,
                                             "logprobs": 0})
    choice = r.json()["choices"][0]
    assert choice["text"] == "aba"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["", "a", "b", "a"]  # BOS first: nothing predicts it
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [-0.5] * 3
    assert engine.submitted[0].params.prompt_logprobs == 0
    r = client.post("/v1/completions", json={"prompt": [BOS, tok("z")], "max_tokens": 0,
                                             "echo": True})
    assert r.json()["choices"][0]["text"] == "z"  # echo of a token prompt is its text
    assert r.json()["usage"]["completion_tokens"] == 0


def test_stream_framing_and_usage(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "\r" not in r.text
    chunks = sse_json(r.text)
    content, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in content) == "abc"  # no empty chunks
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in content)
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "length"]
    assert len({c["id"] for c in chunks}) == 1
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3


def test_stream_without_usage_and_with_echo(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "stream": True,
                                             "echo": True, "logprobs": 1})
    chunks = sse_json(r.text)
    assert all("usage" not in c for c in chunks)
    first, second = (c["choices"][0] for c in chunks)
    assert (first["text"], second["text"]) == ("ab", "a")  # the echo comes with the first
    assert first["logprobs"]["text_offset"] == [0, 0, 1]
    assert second["logprobs"]["text_offset"] == [2]


def test_n_streams_are_merged_not_sequential() -> None:
    engine = FakeEngine(token_delay=0.01)
    with serve(engine) as client:
        r = client.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 6, "n": 3,
                                                 "stream": True})
    order = [c["choices"][0]["index"] for c in sse_json(r.text)]
    assert sorted(order) == [0] * 6 + [1] * 6 + [2] * 6
    assert order[:3] != [0, 0, 0] and order != sorted(order)  # interleaved as produced
    finals = [c for c in sse_json(r.text) if c["choices"][0]["finish_reason"]]
    assert len(finals) == 3


def test_mid_stream_error_event_then_done() -> None:
    engine = FakeEngine(fail_after=2)
    with serve(engine) as client:
        r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5,
                                                 "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "boom" in error["message"]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == "ab"
        r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"


def test_mid_stream_exception_becomes_error_event() -> None:
    engine = FakeEngine(fail_after=1, mid_error=RuntimeError("engine step failed"))
    with serve(engine) as client:
        r = client.post("/v1/completions", json={"prompt": "abc", "n": 2, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and "engine step failed" in events[-2]
