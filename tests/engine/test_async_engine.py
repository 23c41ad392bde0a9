"""AsyncEngine on a real tiny model: concurrency, aborts free blocks, admission errors,
failed steps, a dead or stuck loop, seeded sampling inside a busy batch."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Awaitable
from typing import Any

import pytest

import engine.client.async_engine as async_engine_mod
import engine.core.llm_engine as llm_engine_module
from engine.client.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import step_loop
from engine.core.llm_engine import LLMEngine
from engine.outputs import ErrorCode, RequestOutput
from engine.protocol import EngineDeadError, PromptTooLongError, QueueFullError, RequestStream
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from tests.support.faults import FaultyRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make(runner: ModelRunner, *, loop: bool = True, **kwargs: Any) -> AsyncEngine:
    """An AsyncEngine over `runner` (the stuck-step knobs pass through) whose step loop runs
    on a thread of its own (loop=False: not yet, see start_step_loop)."""
    knobs = {k: kwargs.pop(k) for k in ("clock", "stuck_after_s") if k in kwargs}
    sc = SchedulerConfig(block_size=runner.block_size, max_model_len=128, **kwargs)
    cfg = EngineConfig(model=None, dtype="float32", device="cpu", enforce_eager=True, scheduler=sc)
    eng = AsyncEngine(cfg, LLMEngine(cfg, runner=runner), **knobs)
    if loop:
        start_step_loop(eng)
    return eng


def start_step_loop(eng: AsyncEngine) -> threading.Thread:
    """What the CLI does on its main thread, on a thread of the test's."""
    thread = threading.Thread(target=eng.run_step_loop, name="pagedserve-engine", daemon=True)
    thread.start()
    return thread


async def collect(submitted: Awaitable[RequestStream]) -> list[RequestOutput]:
    stream = await submitted
    async with contextlib.aclosing(stream):
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
            outs = await asyncio.gather(*(collect(eng.submit(f"r{i}", p, GREEDY))
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
            stream = await eng.submit("gone", [3, 4, 5, 6, 7], long)
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


def test_admission_errors_raise_from_submit(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner, max_num_queued_reqs=1, max_num_seqs=1)
        await eng.start()
        try:
            with pytest.raises(PromptTooLongError):
                await collect(eng.submit("long", [3] * 500, GREEDY))
            slow = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            running = asyncio.Event()

            async def first_request() -> None:
                async for o in await eng.submit("a", [3, 4], slow):
                    if o.new_token_ids:
                        running.set()

            first = asyncio.create_task(first_request())
            await running.wait()  # "a" holds the only seq slot: "b" must wait in the queue
            second = asyncio.create_task(collect(eng.submit("b", [3, 4], slow)))
            while eng.stats().num_waiting < 1:
                await asyncio.sleep(0.005)
            with pytest.raises(QueueFullError):
                await eng.submit("c", [3, 4], slow)
            # Nothing has finished yet: no drain rate for the API's Retry-After.
            assert eng.stats().finish_rate is None
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
            alone = tokens(await collect(eng.submit("alone", [8, 9, 10, 11], seeded)))
            others = [collect(eng.submit(f"n{i}", [20 + i] * (3 + i), noise)) for i in range(5)]
            busy = await asyncio.gather(*others[:2], collect(eng.submit("busy", [8, 9, 10, 11],
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
            final = (await collect(eng.submit("x", [3, 4, 5], GREEDY)))[-1]
            assert final.finished and final.error_code == ErrorCode.STEP_FAILED
            assert "engine step failed: injected fault" in (final.error or "")
            assert eng.is_ready()
            assert len(tokens(await collect(eng.submit("y", [3, 4, 5], GREEDY)))) == 8
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
            for i in range(step_loop.MAX_CONSECUTIVE_FAILURES):
                final = (await collect(eng.submit(f"x{i}", [3, 4, 5], GREEDY)))[-1]
                assert final.error_code == ErrorCode.STEP_FAILED
            assert not eng.is_ready()
            with pytest.raises(EngineDeadError):
                await collect(eng.submit("z", [3, 4, 5], GREEDY))
        finally:
            await eng.shutdown()

    run_async(main())


class FakeClock:
    """time.monotonic for the engine's stuck-step check, moved only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_stuck_step_fails_health(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        clock = FakeClock()
        faulty = FaultyRunner(llama_runner)
        eng = make(faulty, clock=clock, stuck_after_s=5.0)  # type: ignore[arg-type]
        await eng.start()
        try:
            assert eng.is_ready()
            faulty.stall()  # the next step hangs until unstall()
            task = asyncio.create_task(collect(eng.submit("s", [3, 4], dataclasses.replace(
                GREEDY, max_tokens=1))))
            assert await asyncio.to_thread(faulty.entered.wait, 30)  # the step is in flight
            clock.now += 4.9
            assert eng.is_ready()  # not yet past the threshold
            clock.now += 0.1
            assert not eng.is_ready()  # one step has run for stuck_after_s
            faulty.unstall()
            await task
            assert eng.is_ready()
        finally:
            faulty.unstall()
            await eng.shutdown()

    run_async(main())


def test_crash_outside_step_kills_engine_but_never_hangs_clients(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        try:
            def boom() -> None:
                raise RuntimeError("stats broke")

            eng.engine.stats = boom  # type: ignore[method-assign, assignment]  # a bug outside step()
            with pytest.raises(EngineDeadError):
                await collect(eng.submit("x", [3, 4, 5], GREEDY))
            assert not eng.is_ready()
            with pytest.raises(EngineDeadError):
                await collect(eng.submit("y", [3, 4, 5], GREEDY))
        finally:
            await eng.shutdown()

    run_async(main())


def test_duplicate_request_id_is_refused(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        try:
            slow = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            first = await eng.submit("same", [3, 4], slow)
            head = await first.__anext__()
            with pytest.raises(ValueError, match="already in use"):
                await collect(eng.submit("same", [3, 4], slow))
            assert len(tokens([head] + [o async for o in first])) == 30  # the first: untouched
            await wait_idle(eng)
        finally:
            await eng.shutdown()

    run_async(main())


def test_limits_are_none_until_loaded_then_the_engines(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner, loop=False)
        assert eng.limits is None
        start_step_loop(eng)
        await eng.start()
        try:
            assert eng.limits is eng.engine.limits
            assert eng.limits.max_model_len == 128 and eng.limits.block_size == 4
        finally:
            await eng.shutdown()

    run_async(main())


class _FailingLoad(LLMEngine):
    def load(self) -> None:
        raise RuntimeError("weights are corrupt")


def test_failed_load_reports_dead_and_shutdown_does_not_wait(llama_runner: ModelRunner) -> None:
    """A model that fails to load ends the step loop at once: shutdown() must not wait its
    STOP_WAIT_S (30 s, past Kubernetes' grace period) for a loop that never ran."""
    async def main() -> None:
        cfg = make(llama_runner, loop=False).config
        eng = AsyncEngine(cfg, _FailingLoad(cfg, runner=llama_runner))
        start_step_loop(eng)
        with pytest.raises(EngineDeadError, match="weights are corrupt"):
            await eng.start()
        assert not eng.is_ready()
        # Bounded well under STOP_WAIT_S, and the loop has nothing to wait for: it is done.
        await asyncio.wait_for(eng.shutdown(), async_engine_mod.STOP_WAIT_S / 3)

    run_async(main())


def test_submit_cancelled_while_waiting_for_admission_frees_the_request(
        llama_runner: ModelRunner) -> None:
    async def main() -> None:
        faulty = FaultyRunner(llama_runner)
        eng = make(faulty)  # type: ignore[arg-type]
        await eng.start()
        try:
            faulty.stall()  # a step hangs: the inbox is not read, so admission waits
            busy = asyncio.create_task(collect(eng.submit("busy", [3, 4], GREEDY)))
            assert await asyncio.to_thread(faulty.entered.wait, 30)
            waiting = asyncio.create_task(eng.submit("late", [5, 6], GREEDY))
            await asyncio.sleep(0)  # it is now awaiting admission
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            faulty.unstall()
            assert len(tokens(await busy)) == 8
            await wait_idle(eng)  # "late" was added, then aborted: nothing left behind
            assert "late" not in eng.engine.requests
        finally:
            faulty.unstall()
            await eng.shutdown()

    run_async(main())


def test_tokenizer_work_runs_off_the_event_loop(llama_runner: ModelRunner) -> None:
    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        try:
            loop_thread = threading.get_ident()
            seen: list[int] = []
            tok = eng._tokenizer
            assert tok is not None
            encode = tok.encode

            def spy(text: str, add_special_tokens: bool = True) -> list[int]:
                seen.append(threading.get_ident())
                return encode(text, add_special_tokens)

            tok.encode = spy  # type: ignore[method-assign]
            ids = await eng.tokenize("hello world")
            assert ids == eng.engine.tokenizer.encode("hello world")
            assert seen and loop_thread not in seen
            assert await eng.detokenize(ids) == eng.engine.tokenizer.decode(
                ids, skip_special_tokens=False)
        finally:
            await eng.shutdown()
        with pytest.raises(EngineDeadError):
            await eng.tokenize("after shutdown")

    run_async(main())


def test_long_texts_do_not_queue_ahead_of_short_ones(llama_runner: ModelRunner) -> None:
    """Issue 31: one tokenizer thread served everyone, so a few megabyte texts (/tokenize,
    truncate_prompt_tokens) made every new request wait seconds. Long texts have a lane of
    their own: a short text sent behind two long ones is tokenized first."""
    from engine.client.client_side import BULK_TEXT_CHARS

    long_text = "tokenize me " * (2 * 1024 * 1024 // 12)
    assert len(long_text) > BULK_TEXT_CHARS

    async def main() -> list[str]:
        eng = make(llama_runner)
        await eng.start()
        done: list[str] = []

        async def timed(name: str, text: str) -> None:
            await eng.tokenize(text)
            done.append(name)

        try:
            longs = [asyncio.create_task(timed(f"long{i}", long_text)) for i in range(2)]
            await asyncio.sleep(0.05)  # both long ones are on their lane
            await timed("short", "hello")
            await asyncio.gather(*longs)
        finally:
            await eng.shutdown()
        return done

    assert run_async(main())[0] == "short"


def test_a_failing_live_view_snapshot_fails_the_look_not_the_engine(
        llama_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 36: the snapshot is built on the engine thread; a bug there is the viewer's error,
    never a stopped step loop."""
    def broken(*args: object) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(llm_engine_module, "build_snapshot", broken)

    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        try:
            with pytest.raises(RuntimeError, match="could not build the live view"):
                await eng.live_view({})
            assert eng.is_ready()
            assert len(tokens(await collect(eng.submit("after", [5, 6, 7], GREEDY)))) == 8
        finally:
            await eng.shutdown()

    run_async(main())
