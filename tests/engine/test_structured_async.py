"""The AsyncEngine while a grammar compiles: the request waits in the scheduler, other streams
run on, the step loop idles instead of spinning, and a spec that fails is InvalidParamError
naming its field from submit() (before any output)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import pytest

from engine.outputs import ErrorCode
from engine.protocol import InvalidParamError
from engine.structured_output.grammar import CompiledGrammar
from engine.worker.model_runner import ModelRunner
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.test_async_engine import collect, make, run_async, tokens, wait_idle

FREE = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def gated(eng: Any) -> threading.Event:
    """Make every compile wait for the returned event (the test decides when it ends)."""
    gate = threading.Event()
    backend = eng.engine.structured.backend
    compile_now = backend.compile

    def slow_compile(so: StructuredOutputsParams) -> CompiledGrammar:
        assert gate.wait(60), "the test never opened the gate"
        return compile_now(so)
    backend.compile = slow_compile
    return gate


def count_steps(eng: Any) -> list[int]:
    calls = [0]
    step = eng.engine.step

    def counted() -> Any:
        calls[0] += 1
        return step()
    eng.engine.step = counted
    return calls


def test_a_compiling_request_waits_while_others_run(llama_runner: ModelRunner) -> None:
    so = StructuredOutputsParams("regex", r"[0-9]{4}", "guided_regex")

    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        try:
            gate = gated(eng)
            constrained = asyncio.create_task(
                collect(eng.submit("g", [5, 6, 7], SamplingParams(structured_outputs=so))))
            free = await collect(eng.submit("f", [5, 6, 7], FREE))
            assert len(tokens(free)) == 6 and not constrained.done()
            seq = eng.engine.scheduler.get("g")
            assert seq is not None and seq.waiting_for_grammar and seq.block_table == []
            calls = count_steps(eng)
            await asyncio.sleep(0.3)  # only a compile pending: the loop must idle
            assert calls[0] <= 2, calls
            gate.set()
            outs = await constrained
            assert outs[-1].finish_reason == "stop"
            assert re.fullmatch(r"[0-9]{4}", "".join(o.new_text for o in outs))
            await wait_idle(eng)
        finally:
            await eng.shutdown()

    run_async(main())


@pytest.mark.parametrize(("kind", "spec"), [("regex", "(x"), ("choice", "[]")])
def test_a_failed_compile_is_refused_by_submit(llama_runner: ModelRunner, kind: str,
                                               spec: str) -> None:
    so = StructuredOutputsParams(kind, spec, "structured_outputs.x")  # type: ignore[arg-type]

    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        try:
            gate = gated(eng)
            refused = asyncio.create_task(eng.submit("bad", [5, 6], SamplingParams(
                structured_outputs=so)))
            free = await collect(eng.submit("f", [5, 6, 7], FREE))
            assert len(tokens(free)) == 6 and not refused.done()
            gate.set()
            with pytest.raises(InvalidParamError) as e:
                await refused
            assert e.value.param == "structured_outputs.x"
            assert str(e.value).startswith("structured_outputs.x: ")
            await wait_idle(eng)
        finally:
            await eng.shutdown()

    run_async(main())


def test_a_deadline_that_passes_while_compiling_answers_at_once(
        llama_runner: ModelRunner) -> None:
    """Issue 38: the engine times the request out in the queue; submit() returns then, with
    the stream holding that end, instead of waiting for the compile (which never ends
    here), and the request is gone from the scheduler."""
    so = StructuredOutputsParams("regex", r"[0-9]{5}", "guided_regex")

    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        gate = gated(eng)
        try:
            t0 = time.monotonic()
            outs = await collect(eng.submit("late", [5, 6, 7], SamplingParams(
                structured_outputs=so), deadline=time.monotonic() + 0.3))
            assert time.monotonic() - t0 < 5
            assert [o.error_code for o in outs] == [ErrorCode.QUEUE_TIMEOUT]
            assert eng.engine.scheduler.num_waiting == 0 and not eng.engine.has_unfinished()
        finally:
            gate.set()
            await eng.shutdown()

    run_async(main())


def test_a_cancelled_submit_leaves_the_queue_while_its_compile_runs(
        llama_runner: ModelRunner) -> None:
    """The client left: the request is aborted and leaves the scheduler's queue at once; the
    compile, which another request with the same spec shares, is abandoned, not cancelled."""
    so = StructuredOutputsParams("regex", r"[a-c]{3}", "guided_regex")

    async def main() -> None:
        eng = make(llama_runner)
        await eng.start()
        gate = gated(eng)
        try:
            left = asyncio.create_task(eng.submit("left", [5, 6], SamplingParams(
                structured_outputs=so)))
            stays = asyncio.create_task(collect(eng.submit("stays", [5, 6], SamplingParams(
                structured_outputs=so, temperature=0))))
            while eng.engine.scheduler.num_waiting < 2:
                await asyncio.sleep(0.01)
            left.cancel()
            while eng.engine.scheduler.get("left") is not None:
                await asyncio.sleep(0.01)
            assert eng.engine.scheduler.num_waiting == 1
            gate.set()
            outs = await stays
            assert re.fullmatch(r"[a-c]{3}", "".join(o.new_text for o in outs))
            await wait_idle(eng)
        finally:
            gate.set()
            await eng.shutdown()

    run_async(main())
