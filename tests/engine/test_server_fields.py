"""vLLM's fields through the real stack (uvicorn + AsyncEngine + the tiny Llama on 127.0.0.1):
cached_tokens from the prefix cache, prompt_logprobs, truncate_prompt_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.worker.model_runner import ModelRunner
from tests.support.livetools import Live, live_server

PROMPT = [(7 * i) % 250 + 5 for i in range(30)]  # 30 token ids: 7 full blocks of 4


@pytest.fixture
def live(llama_runner: ModelRunner) -> Iterator[Live]:
    with live_server(llama_runner) as server:
        yield server


def post(live: Live, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        return [json.loads(line[6:]) for line in r.text.splitlines()  # type: ignore[return-value]
                if line.startswith("data: {")][-1]  # the usage chunk
    result: dict[str, Any] = r.json()
    return result


def test_cached_tokens_count_prefix_cache_hits(live: Live) -> None:
    block = live.engine.engine.limits.block_size
    greedy = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    first = post(live, "/v1/completions", greedy)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = post(live, "/v1/completions", greedy)["usage"]
    # Every full block but the one holding the last prompt token (it must be computed to
    # sample from): exactly what the scheduler skipped.
    want = (len(PROMPT) - 1) // block * block
    assert second["prompt_tokens_details"] == {"cached_tokens": want} and want > 0
    streamed = post(live, "/v1/completions", {**greedy, "stream": True,
                                              "stream_options": {"include_usage": True}})
    assert streamed["usage"]["prompt_tokens_details"]["cached_tokens"] == want
    chat = {"messages": [{"role": "user", "content": "The quick brown fox jumps over"}],
            "max_tokens": 2, "temperature": 0}
    assert post(live, "/v1/chat/completions", chat)["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0}
    cached = post(live, "/v1/chat/completions", chat)["usage"]["prompt_tokens_details"]
    assert cached["cached_tokens"] > 0 and cached["cached_tokens"] % block == 0
    live.wait_idle()


def test_prompt_logprobs_match_echo_scoring(live: Live) -> None:
    body = {"prompt": PROMPT[:9], "max_tokens": 1, "temperature": 0}
    plp = post(live, "/v1/completions", {**body, "prompt_logprobs": 2})["choices"][0][
        "prompt_logprobs"]
    echo = post(live, "/v1/completions", {**body, "echo": True, "logprobs": 2})["choices"][0][
        "logprobs"]
    assert plp[0] is None and len(plp) == 9
    for i, (token_id, position) in enumerate(zip(PROMPT[1:9], plp[1:]), start=1):
        chosen = position[str(token_id)]  # the prompt token itself is always there
        assert chosen["logprob"] == pytest.approx(echo["token_logprobs"][i], abs=1e-5)
        assert chosen["decoded_token"] == echo["tokens"][i]
        # ... with the top 2 (ranks 1 and 2), which may include it.
        top = {v["rank"] for k, v in position.items() if k != str(token_id)}
        in_top = chosen["rank"] <= 2
        assert len(position) == (2 if in_top else 3)
        assert top | ({chosen["rank"]} if in_top else set()) == {1, 2}
    chat = post(live, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 1,
        "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    live.wait_idle()


def test_truncation_feeds_the_model_the_last_tokens(live: Live) -> None:
    greedy = {"max_tokens": 4, "temperature": 0}
    cut = post(live, "/v1/completions", {**greedy, "prompt": PROMPT,
                                         "truncate_prompt_tokens": 6})
    direct = post(live, "/v1/completions", {**greedy, "prompt": PROMPT[-6:]})
    assert cut["usage"]["prompt_tokens"] == 6
    assert cut["choices"][0]["text"] == direct["choices"][0]["text"]
    live.wait_idle()


def test_return_token_ids_are_what_was_generated(live: Live) -> None:
    body = {"prompt": PROMPT[:8], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = post(live, "/v1/completions", body)
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT[:8]
    assert len(choice["token_ids"]) == r["usage"]["completion_tokens"] == 6
    text = post(live, "/detokenize", {"tokens": choice["token_ids"]})["prompt"]
    assert text == choice["text"]
    live.wait_idle()
