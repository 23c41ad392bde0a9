"""AsyncEngine on a real tiny model: concurrency, aborts free blocks, admission errors,
failed steps, a dead or stuck loop, seeded sampling inside a busy batch."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
from faults import FaultyRunner

import engine.async_engine as async_engine_mod
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.drain import UNKNOWN_RETRY_S
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.outputs import ErrorCode, RequestOutput
from engine.protocol import EngineDeadError, PromptTooLongError, QueueFullError
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make(runner: ModelRunner, **sched: object) -> AsyncEngine:
    sc = SchedulerConfig(block_size=runner.block_size, max_model_len=128, **sched)  # type: ignore[arg-type]
    cfg = EngineConfig(model=None, dtype="float32", device="cpu", scheduler=sc)
    return AsyncEngine(cfg, LLMEngine(cfg, runner=runner))


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in stream]


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


async def wait_idle(eng: AsyncEngine, timeout: float = 10.0) -> None:
    """Until the engine holds no request and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if not eng.engine.has_unfinished() and s.num_free_kv_blocks == s.num_kv_blocks:
            eng.engine.scheduler.check_invariants()
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {eng.stats()}")


def run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_concurrent_requests_match_offline(llama_runner: ModelRunner) -> None:
    prompts = [[5 + i, 17, 33 + i, 9] * (1 + i % 3) for i in range(6)]

    async def main() -> list[list[int]]:
        eng = make(llama_runner)
        await eng.start()
        try:
            outs = await asyncio.gather(*(collect(eng.generate(f"r{i}", p, GREEDY))
                                          for i, p in enumerate(prompts)))
            await wait_idle(eng)
        finally:
            await eng.shutdown()
        assert all(o[-1].finish_reason == "length" for o in outs)
        return [tokens(o) for o in outs]

    got = run_async(main())
    ref = LLMEngine(make(llama_runner).config, runner=llama_runner)
    ref.load()
    for i, p in enumerate(prompts):
        ref.add_request(f"x{i}", p, GREEDY)
    want: dict[str, list[int]] = {f"x{i}": [] for i in range(len(prompts))}
    while ref.has_unfinished():
        for o in ref.step():
            want[o.request_id].extend(o.new_token_ids)
    assert got == [want[f"x{i}"] for i in range(len(prompts))]


def test_closing_the_stream_aborts_and_frees_blocks(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        try:
            long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
            stream = eng.generate("gone", [3, 4, 5, 6, 7], long)
            got = 0
            async for o in stream:
                got += len(o.new_token_ids)
                if got >= 2:
                    break
            await stream.aclose()  # what a client disconnect does to the SSE generator
            await wait_idle(eng)
            assert eng.stats().num_running == 0
        finally:
            await eng.shutdown()

    run_async(main())


def test_admission_errors_raise_before_first_delta(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner, max_num_queued_reqs=1, max_num_seqs=1)
        await eng.start()
        try:
            with pytest.raises(PromptTooLongError):
                await collect(eng.generate("long", [3] * 500, GREEDY))
            slow = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            running = asyncio.Event()

            async def first_request() -> None:
                async for o in eng.generate("a", [3, 4], slow):
                    if o.new_token_ids:
                        running.set()

            first = asyncio.create_task(first_request())
            await running.wait()  # "a" holds the only seq slot: "b" must wait in the queue
            second = asyncio.create_task(collect(eng.generate("b", [3, 4], slow)))
            while eng.stats().num_waiting < 1:
                await asyncio.sleep(0.005)
            with pytest.raises(QueueFullError) as info:
                await collect(eng.generate("c", [3, 4], slow))
            # Nothing has finished yet: no drain rate, so the fallback estimate.
            assert info.value.retry_after_s == UNKNOWN_RETRY_S
            await asyncio.gather(first, second)
            await wait_idle(eng)
        finally:
            await eng.shutdown()

    run_async(main())


def test_seeded_request_same_alone_and_in_busy_batch(llama_runner: ModelRunner) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12,
                            ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    async def main() -> tuple[list[int], list[int]]:
        eng = make(llama_runner, max_num_batched_tokens=16)
        await eng.start()
        try:
            alone = tokens(await collect(eng.generate("alone", [8, 9, 10, 11], seeded)))
            others = [collect(eng.generate(f"n{i}", [20 + i] * (3 + i), noise)) for i in range(5)]
            busy = await asyncio.gather(*others[:2], collect(eng.generate("busy", [8, 9, 10, 11],
                                                                          seeded)), *others[2:])
            await wait_idle(eng)
            return alone, tokens(busy[2])
        finally:
            await eng.shutdown()

    alone, busy = run_async(main())
    assert alone == busy and len(alone) == 12


def test_failed_step_fails_its_requests_and_server_recovers(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner)
        eng.engine.runner = FaultyRunner(llama_runner, fail=1)  # type: ignore[assignment]
        await eng.start()
        try:
            # The failed request ends with an error output (it used to raise RuntimeError).
            final = (await collect(eng.generate("x", [3, 4, 5], GREEDY)))[-1]
            assert final.finished and final.error_code == ErrorCode.STEP_FAILED
            assert "engine step failed: injected fault" in (final.error or "")
            assert eng.is_ready()
            assert len(tokens(await collect(eng.generate("y", [3, 4, 5], GREEDY)))) == 8
            await wait_idle(eng)
        finally:
            await eng.shutdown()

    run_async(main())


def test_repeated_failures_mark_engine_dead(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner)
        eng.engine.runner = FaultyRunner(llama_runner, fail=100)  # type: ignore[assignment]
        await eng.start()
        try:
            for i in range(async_engine_mod.MAX_CONSECUTIVE_FAILURES):
                final = (await collect(eng.generate(f"x{i}", [3, 4, 5], GREEDY)))[-1]
                assert final.error_code == ErrorCode.STEP_FAILED
            assert not eng.is_ready()
            with pytest.raises(EngineDeadError):
                await collect(eng.generate("z", [3, 4, 5], GREEDY))
        finally:
            await eng.shutdown()

    run_async(main())


def test_stuck_step_fails_health(llama_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(async_engine_mod, "STUCK_AFTER_S", 0.2)

    async def main() -> None:
        eng = make(llama_runner)
        eng.engine.runner = FaultyRunner(llama_runner, delay=0.6)  # type: ignore[assignment]
        await eng.start()
        try:
            assert eng.is_ready()
            task = asyncio.create_task(collect(eng.generate("s", [3, 4], dataclasses.replace(
                GREEDY, max_tokens=1))))
            await asyncio.sleep(0.4)
            assert not eng.is_ready()  # one step has run for longer than STUCK_AFTER_S
            await task
            assert eng.is_ready()
        finally:
            await eng.shutdown()

    run_async(main())


def test_crash_outside_step_kills_engine_but_never_hangs_clients(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        try:
            def boom() -> None:
                raise RuntimeError("stats broke")

            eng.engine.stats = boom  # type: ignore[method-assign]  # a bug outside step()
            with pytest.raises(EngineDeadError):
                await collect(eng.generate("x", [3, 4, 5], GREEDY))
            assert not eng.is_ready()
            with pytest.raises(EngineDeadError):
                await collect(eng.generate("y", [3, 4, 5], GREEDY))
        finally:
            await eng.shutdown()

    run_async(main())


def test_duplicate_request_id_is_refused(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        try:
            slow = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            first = eng.generate("same", [3, 4], slow)
            await first.__anext__()
            with pytest.raises(ValueError, match="already in use"):
                await collect(eng.generate("same", [3, 4], slow))
            assert len(tokens(await collect(first))) == 30  # the first one is untouched
            await wait_idle(eng)
        finally:
            await eng.shutdown()

    run_async(main())


def test_limits_are_none_until_loaded_then_the_engines(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner)
        assert eng.limits is None
        await eng.start()
        try:
            assert eng.limits is eng.engine.limits
            assert eng.limits.max_model_len == 128 and eng.limits.block_size == 4
        finally:
            await eng.shutdown()

    run_async(main())
