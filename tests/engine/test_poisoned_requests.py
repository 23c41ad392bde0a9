"""Requests cannot kill the engine (issue 38, items 1 and 2), through the real stack (uvicorn,
AsyncEngine, the tiny Llama):

- every float field of both routes, at the extremes JSON can carry, gets a 200 whose tokens
  are in the vocabulary or a 400 naming the field (never a 500);
- the issue's repro (top_p 5e-324 with logprobs, which underflowed to 0 in float32 and drew
  the id one past the vocabulary) is served, and /health stays 200;
- a request whose own inputs make its step fail (injected: a sampler that raises for one
  marked row, or returns an id outside the vocabulary) fails alone with a 500, the streams
  beside it get their tokens as if it had not been there, and twenty of them in a row leave
  /health at 200 and the next ordinary request served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

import engine.worker.model_runner
from engine.sample.sampling_batch import SamplingBatch
from engine.worker.model_runner import ModelRunner
from tests.engine.test_sampler import EXTREMES, FLOAT_FIELDS
from tests.support.livetools import Live, live_server

ROUTES = ("/v1/completions", "/v1/chat/completions")
BOUND = 30.0
POISON = 1.25  # the temperature that marks a poisoned request (exact in float32)


@pytest.fixture
def live(llama_runner: ModelRunner) -> Iterator[Live]:
    with live_server(llama_runner, max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=128) as server:
        yield server


def body(route: str, **fields: Any) -> dict[str, Any]:
    text = {"prompt": "hello there"} if route == ROUTES[0] else {
        "messages": [{"role": "user", "content": "hello there"}]}
    logprobs = {"logprobs": 1} if route == ROUTES[0] else {"logprobs": True, "top_logprobs": 1}
    return {**text, **logprobs, "max_tokens": 2, "temperature": 1.0, "return_token_ids": True,
            **fields}


def post(live: Live, route: str, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.url + route, json=payload, timeout=BOUND)


def token_ids(route: str, r: httpx.Response) -> list[int]:
    return list(r.json()["choices"][0]["token_ids"])


def assert_healthy(live: Live, vocab_size: int) -> None:
    assert httpx.get(live.url + "/health", timeout=BOUND).status_code == 200
    r = post(live, ROUTES[0], body(ROUTES[0], temperature=0))
    assert r.status_code == 200, r.text
    assert all(0 <= t < vocab_size for t in token_ids(ROUTES[0], r))


@pytest.mark.parametrize("route", ROUTES)
def test_extreme_floats_give_200_in_vocabulary_or_400_naming_the_field(
        live: Live, llama_runner: ModelRunner, route: str) -> None:
    vocab = llama_runner.vocab_size
    for name in (*FLOAT_FIELDS, "timeout", "length_penalty"):
        for value in EXTREMES:
            field = {"5": value} if name == "logit_bias" else value
            r = post(live, route, body(route, **{name: field}))
            if r.status_code == 400:
                assert r.json()["error"]["param"] == name, (name, value, r.text)
                continue
            if name == "timeout" and r.status_code == 503:  # its own deadline passed queued
                assert r.json()["error"]["code"] == "queue_timeout", r.text
                continue
            assert r.status_code == 200, (name, value, r.status_code, r.text)
            ids = token_ids(route, r)
            assert all(0 <= t < vocab for t in ids), (name, value, ids)
    assert_healthy(live, vocab)


def test_the_issues_repro_is_served_and_health_stays_up(live: Live,
                                                         llama_runner: ModelRunner) -> None:
    for _ in range(20):
        r = post(live, ROUTES[0], body(ROUTES[0], top_p=5e-324, max_tokens=1))
        assert r.status_code == 200, r.text
    assert_healthy(live, llama_runner.vocab_size)


@pytest.fixture(params=["raises", "out_of_vocabulary"])
def poisoned_sampler(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The runner's sampler, except for rows whose temperature is POISON: it raises, or it
    returns an id one past the vocabulary (what top_p 5e-324 did before the fix)."""
    real = engine.worker.model_runner.sample

    def poisoned(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list]:
        temps = [] if batch.temperature is None else batch.temperature.tolist()
        rows = [] if batch.sampled is None else batch.sampled.tolist()
        marked = [row for row, t in zip(rows, temps) if t == POISON]
        if marked and request.param == "raises":
            raise ValueError("injected: this request's inputs break the sampler")
        tokens, logprobs = real(logits, batch)
        for row in marked:
            tokens[row] = batch.vocab_size
        return tokens, logprobs

    monkeypatch.setattr(engine.worker.model_runner, "sample", poisoned)
    return str(request.param)


def test_twenty_poisoned_requests_in_a_row_fail_alone(live: Live, llama_runner: ModelRunner,
                                                      poisoned_sampler: str) -> None:
    for _ in range(20):
        r = post(live, ROUTES[0], body(ROUTES[0], temperature=POISON))
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "internal_error"
    assert live.engine.is_ready()
    assert_healthy(live, llama_runner.vocab_size)


def stream_ids(live: Live, prompt: str) -> list[int]:
    payload = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
               "stream": True, "return_token_ids": True}
    ids: list[int] = []
    with httpx.stream("POST", live.url + ROUTES[0], json=payload, timeout=BOUND) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                ids += event["choices"][0].get("token_ids") or []
    return ids


def test_a_poisoned_request_does_not_disturb_the_streams_beside_it(
        live: Live, poisoned_sampler: str) -> None:
    prompts = ["The history of Rome", "def fib(n):", "List of fruits:"]
    alone = [stream_ids(live, p) for p in prompts]
    live.slow_down(0.01)  # the streams decode long enough for the poisoned ones to land
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = [pool.submit(stream_ids, live, p) for p in prompts]
        poisoned = [post(live, ROUTES[0], body(ROUTES[0], temperature=POISON))
                    for _ in range(5)]
        busy = [f.result() for f in streams]
    assert [r.status_code for r in poisoned] == [500] * 5
    assert busy == alone
    assert all(len(ids) == 24 for ids in busy)
    live.blocks_all_free()
