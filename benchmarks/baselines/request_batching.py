"""Baseline `request-batching`: the classic dynamically batched inference API.

The TorchServe / Triton dynamic batcher that pagedserve replaces:

- request queue: every request waits in one FIFO;
- batcher: a batch leaves when --max-batch-size requests are waiting, or --max-wait-ms after
  the first of them arrived, whichever comes first (while a batch runs the next one forms, so
  after a long batch a full or overdue queue leaves at once);
- model inference: one left-padded greedy generate() over the batch (attention mask, pad
  token), run until its longest member is done: rows that finish early (their own
  max_tokens or EOS) keep their slot as padding, and requests arriving meanwhile wait for
  the whole batch;
- response handler: each decode step's [batch] tokens are dispatched column by column to the
  requests' streams; a request's stream ends at its own max_tokens or EOS (`ignore_eos` per
  request). A client that leaves only has its tokens dropped (its row still computes).

    python -m benchmarks.baselines.request_batching --model FOLDER --dtype bfloat16 --port 8002
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections import deque
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

logger = logging.getLogger("baselines.request_batching")

DEFAULT_MAX_BATCH_SIZE = 16
DEFAULT_MAX_WAIT_MS = 50.0


class Batcher:
    """The request queue and the batching loop (one batch in generate() at a time)."""

    def __init__(self, lm: LoadedModel, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
                 executor: Executor | None = None) -> None:
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_size must be >= 1 and max_wait_ms >= 0")
        self.lm = lm
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.executor = executor or make_executor()
        self.waiting: deque[tuple[float, Row]] = deque()  # (arrival, row), FIFO
        self.wakeup = asyncio.Event()
        self.batch_sizes: list[int] = []  # one entry per generate() call, for tests and logs

    def submit(self, req: CompletionRequest) -> Row:
        row = Row(req.prompt_ids, req.max_tokens, req.ignore_eos)
        self.waiting.append((time.monotonic(), row))
        self.wakeup.set()
        return row

    async def run(self) -> None:
        """Forever: form a batch, generate it, repeat."""
        while True:
            batch = await self.next_batch()
            self.batch_sizes.append(len(batch))
            logger.debug("batch of %d (max prompt %d, max_tokens %d), %d waiting", len(batch),
                         max(len(r.prompt_ids) for r in batch),
                         max(r.max_tokens for r in batch), len(self.waiting))
            await run_rows(self.lm, batch, self.executor)

    async def next_batch(self) -> list[Row]:
        """Wait until the queue holds a full batch or its oldest request is max_wait old."""
        while True:
            self._drop_cancelled()
            if len(self.waiting) >= self.max_batch_size:
                break
            if self.waiting:
                left = self.waiting[0][0] + self.max_wait_s - time.monotonic()
                if left <= 0:
                    break
            else:
                left = None
            self.wakeup.clear()  # no await since the checks: no submit can slip in between
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), left)
        n = min(self.max_batch_size, len(self.waiting))
        return [self.waiting.popleft()[1] for _ in range(n)]

    def _drop_cancelled(self) -> None:
        """Requests whose client left while queued never enter a batch."""
        if any(row.cancelled for _, row in self.waiting):
            for _, row in self.waiting:
                row.finished = row.finished or row.cancelled
            self.waiting = deque(item for item in self.waiting if not item[1].cancelled)


def build_app(lm: LoadedModel, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
              max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
              executor: Executor | None = None) -> Starlette:
    batcher = Batcher(lm, max_batch_size, max_wait_ms, executor)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(batcher.run())
        print(f"request-batching baseline ready: {lm.name} (max batch {max_batch_size}, "
              f"max wait {max_wait_ms:g} ms)", flush=True)
        try:
            yield
        finally:
            task.cancel()
            batcher.executor.shutdown(wait=False, cancel_futures=True)

    app = create_app(lm, batcher.submit, lifespan)
    app.state.batcher = batcher
    return app


def build_parser() -> argparse.ArgumentParser:
    p = base_parser(__doc__ or "")
    p.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                   help="a batch leaves as soon as this many requests wait (default %(default)s: "
                   "on a few CPU cores decode throughput of a small model stops growing around "
                   "here, while padding waste and the wait for a batch's longest row keep "
                   "growing with the batch)")
    p.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                   help="or when the oldest waiting request has waited this long (default "
                   "%(default)s: a few decode steps, small next to a batch's run time, so a "
                   "lone request is barely delayed while bursts still fill a batch)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    serve(args, lambda lm, executor: build_app(lm, args.max_batch_size, args.max_wait_ms,
                                               executor))


if __name__ == "__main__":
    main()
