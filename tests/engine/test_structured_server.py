"""Structured outputs over the real stack (uvicorn + api/ + AsyncEngine + a tiny model): a
spec that does not compile is a 400 naming its field before any stream byte, in every
spelling; the openai client's parse() and stream() with a pydantic model; streamed n > 1."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine.worker.model_runner import ModelRunner
from tests.engine.test_structured_async import gated
from tests.support.errors import assert_error
from tests.support.livetools import Live, live_server

MSG = [{"role": "user", "content": "hi"}]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=4)
    indoor: bool


@pytest.fixture(scope="module")
def live(llama_runner: ModelRunner) -> Iterator[Live]:
    with live_server(llama_runner, max_num_seqs=8, max_num_batched_tokens=64) as server:
        yield server


@pytest.fixture
def oai(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="k", max_retries=0, timeout=60)


UNCOMPILABLE: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": BAD_SCHEMA}}},
     "response_format"),
    ({"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_json": '{"type": "object", "properties": 7}'}, "guided_json"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"guided_grammar": "not a grammar"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fields", "param"), UNCOMPILABLE)
def test_uncompilable_spec_is_a_400_naming_the_field(live: Live, fields: dict[str, Any],
                                                    param: str, stream: bool) -> None:
    for path, body in (("/v1/chat/completions", {"messages": MSG}),
                       ("/v1/completions", {"prompt": "hi", "n": 2})):
        r = httpx.post(f"{live.url}{path}", json={**body, **fields, "stream": stream,
                                                  "max_tokens": 4}, timeout=30)
        assert r.headers["content-type"].startswith("application/json")  # not an SSE stream
        error = assert_error(r, 400, param)
        assert error["message"].startswith(f"{param}: "), error
    live.wait_idle()


def test_openai_parse_with_a_pydantic_model(oai: openai.OpenAI, live: Live) -> None:
    for seed in range(3):
        c = oai.chat.completions.parse(model="tiny", messages=MSG,  # type: ignore[arg-type]
                                       response_format=Pet, max_tokens=60, seed=seed,
                                       temperature=1.0)
        choice = c.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet)
        assert Pet.model_validate_json(choice.message.content or "") == choice.message.parsed
    live.wait_idle()


def test_openai_stream_with_a_pydantic_model(oai: openai.OpenAI, live: Live) -> None:
    with oai.chat.completions.stream(model="tiny", messages=MSG,  # type: ignore[arg-type]
                                     response_format=Pet, max_tokens=60, seed=7) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1  # it really streamed
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, Pet) and final.choices[0].finish_reason == "stop"
    assert Pet.model_validate_json("".join(deltas)) == parsed
    live.wait_idle()


def test_streamed_completions_n2_each_follow_the_schema(live: Live) -> None:
    schema = {"type": "array", "items": {"enum": ["a", "b", 1, 2]}, "minItems": 2,
              "maxItems": 4}
    body = {"prompt": "hi", "n": 2, "stream": True, "max_tokens": 40, "seed": 3,
            "structured_outputs": {"json": schema}}
    texts = {0: "", 1: ""}
    finish = {}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                texts[ch["index"]] += ch["text"]
                if ch["finish_reason"]:
                    finish[ch["index"]] = ch["finish_reason"]
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)
    live.wait_idle()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_during_its_compile_leaves_the_queue(live: Live,
                                                                  route: str) -> None:
    """Issue 38: a plain (not streamed) request waiting for its grammar was not told its
    client had gone: it stayed queued until the compile ended. Now the hang-up aborts it
    while the compile is still held (gated), and the server is idle again."""
    gate = gated(live.engine)
    regex = f"[0-9]{{{len(route)}}}"  # a spec of its own: no cached compile
    text = {"prompt": "hi"} if route == "/v1/completions" else {"messages": MSG}
    body = json.dumps({**text, "guided_regex": regex, "max_tokens": 8}).encode()
    scheduler = live.engine.engine.scheduler
    try:
        with socket.create_connection((live.host, live.port)) as sock:
            sock.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_until(lambda: scheduler.num_waiting == 1, "the request to queue")
        wait_until(lambda: scheduler.num_waiting == 0, "the request to leave the queue")
        assert not gate.is_set()  # its compile has not ended: the hang-up did it
    finally:
        gate.set()
    live.blocks_all_free()


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
