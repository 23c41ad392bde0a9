"""The correctness contract through the server with the default flags but `--dtype float32`
(issue 30): the embedded GGUF under the default `--quantization auto`, greedy, at one stream
and at sixteen (so steps carry more than quant.DENSE_ABOVE_ROWS rows), in a pool small
enough to preempt, with prompts chunked: every completion equals HF `generate()` in float32,
and a request's tokens are the same alone and inside a batch of fifteen others.

Before the fix `auto` kept the GGUF's Q4_1 weights and ran steps of up to 8 rows through the
int4 kernel in bfloat16, so 8 of 12 completions left HF's after a few tokens. Eager: the
compiled step is held to the eager one token for token by tests/engine/test_compiled.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.config import EngineConfig
from engine.worker.loader import load_model
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from tests.engine.test_golden import MAX_NEW, SECOND_ROUND, SHARED_PREFIX, TEXTS, hf_greedy
from tests.support.livetools import Live, live_server
from tests.support.models import loaded_runner

pytestmark = pytest.mark.slow

PROMPTS = TEXTS + [SHARED_PREFIX + q for q in SECOND_ROUND]  # 16
POOL_BLOCKS = 24  # 16 streams need ~48 blocks of 16: the pool preempts
BOUND = 120.0


@pytest.fixture(scope="module")
def default_fp32_runner() -> ModelRunner:
    """The embedded SmolLM2 as `pagedserve serve --dtype float32` loads it: every load flag at
    its default (quantization auto among them) but the dtype, a small pool and eager steps."""
    sched = SchedulerConfig(max_num_seqs=16, max_model_len=256, block_size=16)
    return loaded_runner(EngineConfig(model=None, dtype="float32", device="cpu",
                                      enforce_eager=True, num_kv_blocks=POOL_BLOCKS,
                                      scheduler=sched))


@pytest.fixture(scope="module")
def hf_tokens(default_fp32_runner: ModelRunner) -> dict[str, list[int]]:
    """HF generate(), greedy, on the dense float32 weights of the same GGUF."""
    hf = load_model(None, device="cpu", dtype="float32", quantization="none").model
    tok = default_fp32_runner.tokenizer
    return {text: hf_greedy(hf, tok.encode(text), MAX_NEW) for text in PROMPTS}


def complete(live: Live, prompt: str) -> list[int]:
    body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=BOUND)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def complete_all(live: Live, prompts: list[str], concurrency: int) -> dict[str, list[int]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return dict(zip(prompts, pool.map(lambda p: complete(live, p), prompts), strict=True))


def preemptions(live: Live) -> int:
    return live.engine.stats().num_preemptions


@pytest.mark.parametrize("concurrency", [1, 16])
def test_default_flags_in_float32_give_hf_tokens(default_fp32_runner: ModelRunner,
                                                 hf_tokens: dict[str, list[int]],
                                                 concurrency: int) -> None:
    # 16 prompt tokens a step beside decodes: the longer prompts are chunked.
    with live_server(default_fp32_runner, max_num_seqs=16, max_model_len=256,
                     max_num_batched_tokens=64, decode_step_prefill_tokens=16) as live:
        got = complete_all(live, PROMPTS, concurrency)
        if concurrency > 1:
            assert preemptions(live) > 0, "the pool was meant to preempt"
    assert got == hf_tokens


def test_each_request_alone_and_among_fifteen_gets_the_same_tokens(
        default_fp32_runner: ModelRunner) -> None:
    with live_server(default_fp32_runner, max_num_seqs=16, max_model_len=256,
                     max_num_batched_tokens=256) as live:
        alone = complete_all(live, PROMPTS, 1)
        busy = complete_all(live, PROMPTS, 16)
    assert busy == alone
