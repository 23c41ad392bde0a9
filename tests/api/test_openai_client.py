"""The official openai client against the app: in-process, and over a real uvicorn socket."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from openai.types.chat import ChatCompletionMessageParam
from starlette.testclient import TestClient

from api.app import create_app
from tests.support.fake_engine import FakeEngine

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                         max_retries=0)


def test_completions_plain_and_streamed(oai: openai.OpenAI) -> None:
    c = oai.completions.create(model="fake-model", prompt="abc", max_tokens=4, logprobs=1)
    assert c.choices[0].text == "abca" and c.choices[0].finish_reason == "length"
    assert c.usage is not None and c.usage.total_tokens == 8
    assert c.choices[0].logprobs is not None and c.choices[0].logprobs.tokens == list("abca")
    chunks = list(oai.completions.create(model="fake-model", prompt="abc", max_tokens=4,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "abca"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_chat_plain_and_streamed(oai: openai.OpenAI) -> None:
    c = oai.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3,
                                    logprobs=True, top_logprobs=1)
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content == "<us"
    assert c.choices[0].logprobs is not None and len(c.choices[0].logprobs.content or []) == 3
    stream = oai.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3, n=2,
                                         stream=True)
    text: dict[int, str] = {0: "", 1: ""}
    finish = {}
    for ch in stream:
        for choice in ch.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert text == {0: "<us", 1: "<us"} and finish == {0: "length", 1: "length"}


def test_client_sees_typed_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="fake-model", prompt="a", temperature=-1)
    assert e.value.body["param"] == "temperature"  # type: ignore[index]


@pytest.fixture
def live() -> Iterator[tuple[str, FakeEngine]]:
    """A real uvicorn on an ephemeral port of 127.0.0.1."""
    engine = FakeEngine(token_delay=0.02)
    config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not (server.started and engine.is_ready()) and time.monotonic() < deadline:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(5)


def test_live_stream_and_disconnect(live: tuple[str, FakeEngine]) -> None:
    url, engine = live
    oai = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    chunks = list(oai.completions.create(model="fake-model", prompt="ab", max_tokens=3,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "aba"
    body = {"prompt": "abcdef", "max_tokens": 100, "n": 3, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # generation is under way: hang up
    deadline = time.monotonic() + 5
    while len(set(engine.aborted)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    ids = {s.request_id for s in engine.submitted[1:]}
    assert set(engine.aborted) == ids and not engine.active
