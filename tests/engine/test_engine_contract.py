"""The engine-API contract (engine/protocol.py), run against both engines the API is tested
with: the torch-free FakeEngine of the API tests, the real AsyncEngine on a tiny model and the
EngineCoreClient with that engine in a child process.
What the API relies on must hold for both, or the API tests prove nothing."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from engine.client.async_engine import AsyncEngine
from engine.client.core_client import EngineCoreClient
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.protocol import (
    ChatTemplateArgs,
    EngineClient,
    EngineDeadError,
    InvalidParamError,
    PromptTooLongError,
    RequestOutput,
    RequestStream,
)
from engine.snapshot import BLOCK_USED, SINGLE_ENGINE
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from tests.support.fake_engine import FakeEngine

MAX_MODEL_LEN = 64
PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)


def real_engine(runner: ModelRunner) -> AsyncEngine:
    sc = SchedulerConfig(block_size=runner.block_size, max_model_len=MAX_MODEL_LEN)
    cfg = EngineConfig(model=None, dtype="float32", device="cpu", enforce_eager=True, scheduler=sc)
    return AsyncEngine(cfg, LLMEngine(cfg, runner=runner))


def process_engine(model: str) -> EngineCoreClient:
    """The engine core in a child process (--engine-core process): it loads the model itself."""
    sc = SchedulerConfig(block_size=4, max_model_len=MAX_MODEL_LEN)
    cfg = EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=128,
                       num_threads=1, enforce_eager=True, scheduler=sc)
    return EngineCoreClient(cfg)


async def start(engine: EngineClient) -> None:
    """The real engine's step loop runs on a thread the caller gives it (as the CLI's main
    thread); start() then waits for the load."""
    if isinstance(engine, AsyncEngine):
        threading.Thread(target=engine.run_step_loop, daemon=True).start()
    await engine.start()


@pytest.fixture(params=["fake", "real", "process"])
def make_engine(request: pytest.FixtureRequest) -> Callable[[], EngineClient]:
    if request.param == "fake":
        return lambda: FakeEngine(max_model_len=MAX_MODEL_LEN, token_delay=0.005)
    if request.param == "process":
        model = str(request.getfixturevalue("tiny_llama"))
        return lambda: process_engine(model)
    runner = request.getfixturevalue("llama_runner")
    return lambda: real_engine(runner)


def run(make_engine: Callable[[], EngineClient],
        body: Callable[[EngineClient], Awaitable[None]]) -> None:
    """Start an engine, run `body` against it, shut it down; bounded in time."""
    async def main() -> None:
        engine = make_engine()
        await start(engine)
        try:
            await body(engine)
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


async def collect(stream: RequestStream) -> list[RequestOutput]:
    async with contextlib.aclosing(stream):
        return [o async for o in stream]


async def tokens_out(stream: RequestStream, n: int) -> None:
    """Read the stream until it has given n tokens (it stays open)."""
    got = 0
    async for out in stream:
        got += len(out.new_token_ids)
        if got >= n:
            return


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_limits_and_readiness_follow_start_and_shutdown(
        make_engine: Callable[[], EngineClient]) -> None:
    async def main() -> None:
        engine = make_engine()
        assert engine.limits is None and not engine.is_ready()
        with pytest.raises(EngineDeadError):
            await engine.submit("early", PROMPT, GREEDY)
        await start(engine)
        assert engine.is_ready()
        assert engine.limits is not None and engine.limits.max_model_len == MAX_MODEL_LEN
        await engine.shutdown()
        assert not engine.is_ready()
        with pytest.raises(EngineDeadError):
            await engine.submit("late", PROMPT, GREEDY)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_an_admitted_request_streams_deltas_to_one_final(
        make_engine: Callable[[], EngineClient]) -> None:
    async def body(engine: EngineClient) -> None:
        outs = await collect(await engine.submit("r", PROMPT, GREEDY))
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert outs[-1].finish_reason == "length" and outs[-1].error is None
        assert sum(len(o.new_token_ids) for o in outs) == 6
        assert outs[-1].num_output_tokens == 6
        prompts = [o.prompt_token_ids for o in outs if o.prompt_token_ids is not None]
        assert prompts == [tuple(PROMPT)]  # sent once

    run(make_engine, body)


def test_refusals_are_raised_by_submit(make_engine: Callable[[], EngineClient]) -> None:
    async def body(engine: EngineClient) -> None:
        with pytest.raises(PromptTooLongError):
            await engine.submit("long", [5] * MAX_MODEL_LEN, GREEDY)
        assert engine.limits is not None
        with pytest.raises(InvalidParamError) as info:
            await engine.submit("oov", [engine.limits.vocab_size], GREEDY)
        assert info.value.param == "prompt"
        stream = await engine.submit("dup", PROMPT, LONG)
        with pytest.raises(ValueError, match="already in use"):
            await engine.submit("dup", PROMPT, LONG)
        await stream.aclose()
        outs = await collect(await engine.submit("after", PROMPT, GREEDY))
        assert outs[-1].finish_reason == "length"  # refusals left nothing behind

    run(make_engine, body)


def test_closing_a_stream_early_aborts_its_request(
        make_engine: Callable[[], EngineClient]) -> None:
    async def body(engine: EngineClient) -> None:
        stream = await engine.submit("gone", PROMPT, LONG)
        await tokens_out(stream, 2)
        await stream.aclose()
        await until(lambda: engine.stats().num_running == 0, "the aborted request still runs")
        outs = await collect(await engine.submit("next", PROMPT, GREEDY))
        assert outs[-1].finish_reason == "length"

    run(make_engine, body)


def test_shutdown_ends_open_streams_with_engine_dead(
        make_engine: Callable[[], EngineClient]) -> None:
    async def main() -> None:
        engine = make_engine()
        await start(engine)
        # As long as the context allows: after its first token, 59 more steps to go.
        longest = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - len(PROMPT),
                                 ignore_eos=True)
        stream = await engine.submit("open", PROMPT, longest)
        running = asyncio.Event()

        async def drain(s: AsyncIterator[RequestOutput]) -> None:
            async for _ in s:
                running.set()

        reader = asyncio.create_task(drain(stream))
        # Shut down as soon as the request is running, not after a fixed sleep: on a fast box
        # a 50-token request could end within a 50 ms sleep, and its stream with it.
        await asyncio.wait_for(running.wait(), 30)
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await reader

    asyncio.run(asyncio.wait_for(main(), 60))


def test_tokenizer_calls_are_coroutines(make_engine: Callable[[], EngineClient]) -> None:
    async def body(engine: EngineClient) -> None:
        ids = await engine.tokenize("hello world", add_special_tokens=False)
        assert ids and await engine.detokenize(ids) == "hello world"
        text = await engine.apply_chat_template([{"role": "user", "content": "hi"}])
        assert isinstance(text, str) and "hi" in text
        # The template arguments arrive: without the generation prompt, the text is shorter.
        bare = await engine.apply_chat_template([{"role": "user", "content": "hi"}],
                                                ChatTemplateArgs(add_generation_prompt=False))
        assert text.startswith(bare) and len(bare) < len(text)
        with pytest.raises(ValueError):  # a template that cannot render: a ValueError
            await engine.apply_chat_template([{"role": "user", "content": "hi"}],
                                             ChatTemplateArgs(chat_template="RAISE{{ x.y.z }}"))

    run(make_engine, body)


def test_live_view_shows_steps_blocks_and_running_requests(
        make_engine: Callable[[], EngineClient]) -> None:
    """issue 36: what /v1/engine/events shows, between two steps, on every engine."""
    async def body(engine: EngineClient) -> None:
        [idle] = await engine.live_view({})
        assert idle.name == SINGLE_ENGINE and idle.snapshot.requests == ()
        assert len(idle.snapshot.kv_blocks) == idle.stats.num_kv_blocks
        stream = await engine.submit("watched", PROMPT, LONG)
        await tokens_out(stream, 3)
        [view] = await engine.live_view({})
        await stream.aclose()
        [row] = view.snapshot.requests
        assert (row.request_id, row.state, row.prompt_tokens) == ("watched", "running", 4)
        assert row.output_tokens >= 3 and view.snapshot.num_requests == 1
        assert BLOCK_USED in view.snapshot.kv_blocks
        steps = view.snapshot.steps
        assert len(steps) >= 3 and [s.step for s in steps] == sorted(s.step for s in steps)
        assert all(s.duration_ms >= 0 for s in steps) and steps[-1].decode_rows == 1
        # Only the steps after the one a viewer has seen come again.
        [later] = await engine.live_view({SINGLE_ENGINE: steps[-1].step})
        assert all(s.step > steps[-1].step for s in later.snapshot.steps)
        await until(lambda: engine.stats().num_running == 0, "the aborted request still runs")

    run(make_engine, body)


def test_live_view_after_shutdown_is_engine_dead(make_engine: Callable[[], EngineClient]) -> None:
    async def main() -> None:
        engine = make_engine()
        await start(engine)
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await engine.live_view({})

    asyncio.run(asyncio.wait_for(main(), 60))
