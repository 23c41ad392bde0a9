"""--batch-invariant through the server, in bfloat16: a seeded temperature-1 request gets
the same tokens and the same logprobs, bitwise, alone and while six other streams decode.

Busy, its prompt is also chunked (at most 4 prompt tokens join a step while others decode,
as the default preset's --decode-step-prefill-tokens 64 chunks longer prompts); alone it is
prefilled in one step. Without the mode, the real SmolLM2's logits differ from the first
token on here (a chunk's attention runs through a different kernel path)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.worker.model_runner import ModelRunner
from tests.support.livetools import Live, live_server

SEEDED = {"prompt": "Once upon a time, in a land far away, there lived", "max_tokens": 16, "temperature": 1.0, "seed": 4321,
          "ignore_eos": True,
          "logprobs": 1}  # the request, with a longer prompt
OTHERS = ["The history of Rome", "def fib(n):", "List of fruits:", "In 1492,",
          "Explain quantum physics to a child in detail", "Write a long story about a dragon"]
BACKGROUND_TOKENS = 100
BOUND = 60.0


def seeded(live: Live) -> tuple[list[str], list[float]]:
    r = httpx.post(live.url + "/v1/completions", json=SEEDED, timeout=BOUND)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def background(live: Live, i: int, started: threading.Event) -> int:
    """An unseeded stream that decodes long enough to overlap the seeded request; sets
    `started` at its first token. Returns its completion_tokens."""
    body = {"prompt": OTHERS[i], "max_tokens": BACKGROUND_TOKENS, "temperature": 1.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=BOUND) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                started.set()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


def busy(live: Live) -> tuple[list[str], list[float]]:
    starts = [threading.Event() for _ in range(6)]
    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(background, live, i, e) for i, e in enumerate(starts)]
        for e in starts:
            assert e.wait(BOUND), "a background stream did not start"
        result = seeded(live)
        # Each needs 100 steps from its first token, the seeded one ~20 from its arrival (it is
        # admitted at once: 8 sequences per step): all six decoded beside it throughout.
        overlapped = [not f.done() for f in others]
        counts = [f.result() for f in others]
        assert counts == [BACKGROUND_TOKENS] * 6, counts
    assert all(overlapped)
    return result


@pytest.mark.parametrize(("model", "trials"), [
    ("invariant_llama_runner", 3),
    # ~1 min on the 2-core box: the tiny model's case above keeps the contract in the
    # default run (which must stay under ~15 min); `pytest -m heavy` runs this one.
    pytest.param("invariant_smollm2_runner", 1, marks=pytest.mark.heavy)])
def test_seeded_request_ignores_the_batch(model: str, trials: int,
                                          request: pytest.FixtureRequest) -> None:
    """Busy trials against one alone run; the tiny model is fast but its small shapes are
    batch-invariant even without the mode here, the real one is what the issue saw. One busy
    trial on the real model: its logits differ from the first token without the mode, and
    each trial costs ~40 s of emulated bf16 on a CPU without native bf16."""
    runner: ModelRunner = request.getfixturevalue(model)
    with live_server(runner, delay=0.002, max_num_seqs=8, decode_step_prefill_tokens=4,
                     max_num_batched_tokens=64, max_model_len=256) as live:
        alone = seeded(live)
        assert seeded(live) == alone
        assert len(alone[0]) == SEEDED["max_tokens"]
        for _ in range(trials):
            assert busy(live) == alone
        live.wait_idle()


