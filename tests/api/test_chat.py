"""/v1/chat/completions: shapes, content parts, logprobs, streaming chunks."""

from __future__ import annotations

from starlette.testclient import TestClient

from tests.support.apitools import sse_json
from tests.support.fake_engine import FakeEngine

USER = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]


def test_chat_shape_and_template(engine: FakeEngine, client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": USER,
                                                  "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "<sy"},
                                "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    prompt = engine.submitted[0].prompt
    assert prompt == engine.encode("<system>s\n<user>hi\n<assistant>", False)  # no extra BOS
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3,
                             "total_tokens": len(prompt) + 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_max_completion_tokens_wins_and_default_fills_context(engine: FakeEngine,
                                                              client: TestClient) -> None:
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5,
                                              "max_completion_tokens": 2})
    client.post("/v1/chat/completions", json={"messages": USER})
    first, second = (s.params.max_tokens for s in engine.submitted)
    assert first == 2 and second == engine.max_model_len - len(engine.submitted[1].prompt)


def test_text_parts_are_joined(engine: FakeEngine, client: TestClient) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert r.status_code == 200
    assert engine.submitted[0].prompt == engine.encode("<user>a\nb\n<assistant>", False)


def test_chat_logprobs(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2,
                                                  "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "<", "logprob": -0.5, "bytes": [60], "top_logprobs": [
        {"token": "<", "logprob": -0.5, "bytes": [60]},
        {"token": "=", "logprob": -1.5, "bytes": [61]}]}
    assert len(content) == 2


def test_chat_stream_chunks(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 3, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = sse_json(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    roles = chunks[:2]
    assert [c["choices"][0]["delta"] for c in roles] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in roles] == [0, 1]
    body, usage_chunk = chunks[2:-1], chunks[-1]
    for i in (0, 1):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == "<sy"
        assert [c["finish_reason"] for c in mine][-1] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
