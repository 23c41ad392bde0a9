"""Baseline `naive`: Hugging Face `generate()` one request at a time behind a lock.

What a user writes in an afternoon: each request waits for the lock, then runs its own
greedy generate() (batch of one) on the single worker thread, its tokens streamed back as
they are produced. No batching: with N clients, N-1 of them wait.

    python -m benchmarks.baselines.naive --model FOLDER --dtype bfloat16 --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor

from starlette.applications import Starlette

from benchmarks.baselines.generation import (
    LoadedModel,
    Row,
    make_executor,
    run_rows,
)
from benchmarks.baselines.protocol import CompletionRequest, base_parser, create_app, serve


class NaiveServer:
    """One request at a time: an asyncio.Lock (FIFO) in front of one generate() thread."""

    def __init__(self, lm: LoadedModel, executor: Executor | None = None) -> None:
        self.lm = lm
        self.executor = executor or make_executor()
        self.lock = asyncio.Lock()
        self.tasks: set[asyncio.Task[None]] = set()
        self.batch_sizes: list[int] = []  # always 1s; kept for parity with the batcher

    def submit(self, req: CompletionRequest) -> Row:
        row = Row(req.prompt_ids, req.max_tokens, req.ignore_eos)
        task = asyncio.create_task(self._run(row))
        self.tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self.tasks.discard)
        return row

    async def _run(self, row: Row) -> None:
        async with self.lock:
            if row.cancelled:
                return
            self.batch_sizes.append(1)
            await run_rows(self.lm, [row], self.executor)


def build_app(lm: LoadedModel, executor: Executor | None = None) -> Starlette:
    server = NaiveServer(lm, executor)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        print(f"naive baseline ready: {lm.name}", flush=True)
        yield
        server.executor.shutdown(wait=False, cancel_futures=True)

    app = create_app(lm, server.submit, lifespan)
    app.state.server = server
    return app


def build_parser() -> argparse.ArgumentParser:
    return base_parser(__doc__ or "")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    serve(parse_args(argv), build_app)


if __name__ == "__main__":
    main()
