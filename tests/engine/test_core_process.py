"""The engine core in a child process (EngineCoreClient, `--engine-core process`) on the tiny
Llama: aborts free KV blocks in the child, a failed grammar compile is refused by submit, a
killed core ends open streams with an error and turns new requests away with 503 (the server
stays up), and shutdown leaves no child behind. The engine contract tests
(test_engine_contract.py) and two live-server tests of test_server_e2e.py run against it too.

The first core of a session starts the forkserver, which imports torch and transformers
once (~25 s on a busy 2-core box); every later core forks from it in about a second."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from api.app import create_app
from api.cli import run_serving
from api.server import GracefulServer
from api.state import AppState
from engine.client.core_client import EngineCoreClient
from engine.config import EngineConfig
from engine.protocol import EngineDeadError, InvalidParamError, RequestStream
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams

# These two run here against the process core, with this module's `live` fixture (pytest
# collects imported tests and resolves their fixtures in the importing module).
from tests.engine.test_server_e2e import (  # noqa: F401
    test_concurrent_streams_more_than_max_num_seqs,
    test_health_and_bad_input_never_500,
)

LONG = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)  # ~seconds of steps


def core_config(model: Path, **scheduler: int) -> EngineConfig:
    opts: dict[str, Any] = {"block_size": 4, "max_model_len": 512, **scheduler}
    return EngineConfig(model=str(model), dtype="float32", device="cpu", num_kv_blocks=128,
                        num_threads=1, served_model_name="tiny", enforce_eager=True,
                        scheduler=SchedulerConfig(**opts))


def run_async(coro) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(asyncio.wait_for(coro, 120))


async def until(check, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def first_delta(stream: RequestStream) -> None:
    async for out in stream:
        if out.new_token_ids:
            return
    raise AssertionError("the stream ended before its first token")


def test_abort_frees_kv_blocks_in_the_core(tiny_llama: Path) -> None:
    async def main() -> None:
        eng = EngineCoreClient(core_config(tiny_llama))
        await eng.start()
        try:
            stream = await eng.submit("gone", [5, 6, 7, 8], LONG)
            await first_delta(stream)
            await stream.aclose()

            def freed() -> bool:
                s = eng.stats()
                return s.num_running == 0 and s.num_free_kv_blocks == s.num_kv_blocks
            await until(freed, "the aborted request's blocks were not freed")
            assert eng.stats().num_steps < LONG.max_tokens  # ended by the abort, not its length
        finally:
            await eng.shutdown()

    run_async(main())


def test_a_failed_grammar_compile_is_refused_by_submit(tiny_llama: Path) -> None:
    so = StructuredOutputsParams("regex", "(x", "structured_outputs.x")

    async def main() -> None:
        eng = EngineCoreClient(core_config(tiny_llama))
        await eng.start()
        try:
            with pytest.raises(InvalidParamError) as e:
                await eng.submit("bad", [5, 6], SamplingParams(structured_outputs=so))
            assert e.value.param == "structured_outputs.x"
            ok = StructuredOutputsParams("choice", '["yes", "no"]')
            stream = await eng.submit("ok", [5, 6], SamplingParams(structured_outputs=ok))
            async with contextlib.aclosing(stream):
                text = "".join([o.new_text async for o in stream])
            assert text in ("yes", "no")
        finally:
            await eng.shutdown()

    run_async(main())


def test_a_killed_core_fails_open_streams_and_refuses_new_ones(tiny_llama: Path) -> None:
    async def main() -> None:
        eng = EngineCoreClient(core_config(tiny_llama))
        await eng.start()
        pid = eng.core_pid
        assert pid is not None
        stream = await eng.submit("open", [5, 6, 7, 8], LONG)
        await first_delta(stream)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):
            async for _ in stream:
                pass
        assert not eng.is_ready()
        with pytest.raises(EngineDeadError):
            await eng.submit("new", [5, 6], LONG)
        await asyncio.wait_for(eng.shutdown(), 10)

    run_async(main())


@contextlib.contextmanager
def live_process_server(model: Path) -> Iterator[tuple[str, EngineCoreClient, threading.Thread]]:
    """The CLI's path (api.cli.run_serving) with the process core, on an ephemeral port."""
    engine = EngineCoreClient(core_config(model, max_num_seqs=4, max_num_batched_tokens=32))
    app = create_app(engine)
    http = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"),
                          AppState.of_app(app).lifecycle, 10.0)
    thread = threading.Thread(target=run_serving, args=(engine, http), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 90
        while not (http.started and engine.is_ready()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.is_ready(), "the live server did not start"
        port = http.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", engine, thread
    finally:
        http.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the live server did not stop"


@pytest.fixture
def live(tiny_llama: Path) -> Iterator[tuple[str, EngineCoreClient]]:
    with live_process_server(tiny_llama) as (url, engine, _):
        yield url, engine


def test_over_http_a_killed_core_ends_streams_with_an_error_then_503(tiny_llama: Path) -> None:
    with live_process_server(tiny_llama) as (url, engine, thread):
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            assert engine.core_pid is not None
            os.kill(engine.core_pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        events = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
        assert any("error" in e for e in events), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        assert httpx.get(url + "/health").status_code == 503  # the server is up, saying so
        r2 = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r2.status_code == 503, r2.text
    assert not thread.is_alive()


def test_shutdown_leaves_no_core_process(tiny_llama: Path, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    with live_process_server(tiny_llama) as (url, engine, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200, r.text
        proc = engine._proc
        assert proc is not None and proc.is_alive()
    assert not proc.is_alive()
    # It exited on Shutdown, not a terminate/kill: shutdown() logs before either. (Its exit
    # code is not the witness: through the forkserver it reads 255 when the status could
    # not be read back, which happened 1 CI run in 3 with a clean exit.)
    assert "terminating it" not in caplog.text
    assert proc.exitcode in (0, 255), proc.exitcode
