"""Grammar compiles are bounded (issue 31): a spec whose compile runs for minutes or takes
gigabytes is refused within the bound, its worker process killed, and the next compile works.
Tried as an attacker would: one request at a time, through the real stack too."""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Iterator

import httpx
import pytest
import xgrammar as xgr

from engine.structured_output import worker as grammar_worker
from engine.structured_output.worker import CompileLimitError, CompileWorker
from engine.worker.model_runner import ModelRunner
from tests.support.livetools import Live, live_server

# On the tiny test vocabulary: 1.4 s and ~600 MB (a 10k-value enum); past 5 minutes (5k
# required properties). Real vocabularies (49k tokens) make both far worse.
BIG_ENUM = {"enum": [f"value{i}" for i in range(10_000)]}
MANY_PROPERTIES = {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                    for i in range(5_000)},
                   "required": [f"p{i}" for i in range(5_000)]}
SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def info_json(llama_runner: ModelRunner) -> str:
    info = xgr.TokenizerInfo.from_huggingface(llama_runner.tokenizer,
                                              vocab_size=llama_runner.vocab_size)
    return str(info.serialize_json())


def test_a_compile_past_its_time_is_cut_and_the_worker_replaced(info_json: str) -> None:
    worker = CompileWorker(info_json, timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(CompileLimitError, match="longer than 1 s"):
            worker.compile("json", json.dumps(MANY_PROPERTIES))
        assert time.monotonic() - t0 < 5
        assert worker.compile("json", json.dumps(SMALL))  # a new worker, at once
        with pytest.raises(ValueError, match="regex|Regex|parse|Unclosed|Expect"):
            worker.compile("regex", "(x")  # a bad spec is not a limit
    finally:
        worker.close()


def test_a_compile_past_its_memory_is_refused_and_the_worker_replaced(info_json: str) -> None:
    worker = CompileWorker(info_json, memory_bytes=64 << 20)
    try:
        with pytest.raises(CompileLimitError, match="more than 0.0625 GiB"):
            worker.compile("json", json.dumps(BIG_ENUM))
        assert worker.compile("json", json.dumps(SMALL))
    finally:
        worker.close()


@pytest.fixture
def live(llama_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> Iterator[Live]:
    monkeypatch.setattr(grammar_worker, "COMPILE_TIMEOUT_S", 2.0)
    with live_server(llama_runner, max_num_seqs=4, max_num_batched_tokens=64) as server:
        yield server


def test_a_costly_schema_is_a_400_naming_its_field_within_the_bound(live: Live) -> None:
    """The server's own memory stays put (the compile ran elsewhere), the answer comes in
    the bound, and an ordinary constrained request is served after it."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    r = httpx.post(live.url + "/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 4, "guided_json": MANY_PROPERTIES})
    assert time.monotonic() - t0 < 2.0 + 8
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_json" and "too costly" in error["message"]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown < 200 * 1024, f"{grown} KiB"  # ru_maxrss is in KiB on Linux
    ok = httpx.post(live.url + "/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 8, "guided_json": SMALL})
    assert ok.status_code == 200, ok.text
    live.blocks_all_free()
