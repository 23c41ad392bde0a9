"""Hugging Face `generate()` over a batch of requests, each streamed back on its own queue.

Shared by both baselines (the naive server is this with a batch of one). Each request is a
`Row`; one `generate()` call runs a list of rows left-padded into one batch. Per decode step a
`BaseStreamer` gets the [batch] tensor of next tokens in the worker thread and hands the whole
step to the event loop with one `call_soon_threadsafe`; `deliver` then routes column i to row
i's queue and ends a row at its own max_tokens or EOS. A `StoppingCriteria` applies the same
rule inside generate() so that finished rows stop counting towards the batch (generate() ends
when every row is done, not at the longest max_tokens when the others hit EOS earlier).

EOS is handled here rather than by generate(): `load_model` clears the model's
generation_config EOS, so `ignore_eos` can differ between rows of one batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

logger = logging.getLogger("baselines")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# What a row's queue carries: (token id, finish reason or None) per generated token, a
# (None, "length") closer if generate() ended without reaching the row's own limit, or the
# exception generate() raised.
Event = tuple[int | None, str | None] | BaseException


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (untyped upstream)
    tokenizer: Any
    name: str
    eos_ids: frozenset[int]
    pad_id: int
    max_model_len: int


def load_model(folder: Path | str, dtype: str) -> LoadedModel:
    """The model and tokenizer from a safetensors folder, EOS handling taken over (see top)."""
    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).eval()
    return wrap_model(model, tokenizer, folder.name)


def wrap_model(model: Any, tokenizer: Any, name: str) -> LoadedModel:
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    pad = gen.pad_token_id if gen.pad_token_id is not None else tokenizer.pad_token_id
    pad = pad if pad is not None else min(eos_ids, default=0)
    # generate() would otherwise stop every row at EOS; deliver/RowStop decide per row.
    gen.eos_token_id = None
    gen.pad_token_id = pad
    max_len = getattr(model.config, "max_position_embeddings", None) or 2048
    return LoadedModel(model, tokenizer, name, eos_ids, int(pad), int(max_len))


class CallerThreadExecutor(Executor):
    """Runs submitted calls on the thread that calls run(): the CLI's main thread, while
    HTTP is served from another (protocol.serve). On this host torch ran the same work
    1.4-1.5x faster from the main thread than from a thread started later, and pagedserve
    runs its step loop there too, so the baselines get the same advantage."""

    def __init__(self) -> None:
        self._calls: queue.Queue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...],
                                       dict[str, Any]] | None] = queue.Queue()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def run(self) -> None:
        """Serve calls until shutdown()."""
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                    future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._calls.put(None)


def make_executor() -> ThreadPoolExecutor:
    """The one generate() thread, with the torch thread count set in the calling thread
    (OpenMP settings are per thread)."""
    n = torch.get_num_threads()
    return ThreadPoolExecutor(1, thread_name_prefix="generate",
                              initializer=torch.set_num_threads, initargs=(n,))


@dataclass(eq=False)
class Row:
    """One request inside a generate() batch. Touched only on the event loop, except
    `cancelled`, which RowStop reads (a plain bool: reading it from another thread is safe)."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    num_generated: int = 0
    finished: bool = False
    cancelled: bool = False  # the client left: its tokens are dropped


def deliver(rows: list[Row], eos_ids: frozenset[int], tokens: list[int]) -> None:
    """One decode step on the event loop: token i goes to row i unless that row is done."""
    for row, tok in zip(rows, tokens):
        if row.finished:
            continue
        row.num_generated += 1
        if tok in eos_ids and not row.ignore_eos:
            reason: str | None = "stop"
        elif row.num_generated >= row.max_tokens:
            reason = "length"
        else:
            reason = None
        row.finished = reason is not None or row.cancelled
        if not row.cancelled:
            row.queue.put_nowait((tok, reason))


def finish_rows(rows: list[Row], error: BaseException | None) -> None:
    """After generate() returned (or failed): close every stream still open."""
    for row in rows:
        if not row.finished:
            row.finished = True
            row.queue.put_nowait(error if error is not None else (None, "length"))


class RowStop(StoppingCriteria):
    """Per-row stop inside generate(): own max_tokens reached, EOS (unless ignore_eos), or
    client gone. generate() keeps finished rows in the batch (padding) until all are done."""

    def __init__(self, rows: list[Row], prompt_len: int, eos_ids: frozenset[int],
                 device: torch.device) -> None:
        self.rows = rows
        self.prompt_len = prompt_len
        self.limits = torch.tensor([r.max_tokens for r in rows], device=device)
        self.stop_on_eos = torch.tensor([not r.ignore_eos for r in rows], device=device)
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = (input_ids.shape[1] - self.prompt_len) >= self.limits
        done |= self.stop_on_eos & torch.isin(input_ids[:, -1], self.eos)
        if any(r.cancelled for r in self.rows):
            done |= torch.tensor([r.cancelled for r in self.rows], device=done.device)
        return done


class StepStreamer(BaseStreamer):
    """Hands each step's [batch] next tokens to `post` (generate() puts the prompt first)."""

    def __init__(self, post: Callable[[list[int]], object]) -> None:
        self.post = post
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.post(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask with every prompt right-aligned (decoder-only batching)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def generate_rows(lm: LoadedModel, rows: list[Row], post: Callable[[list[int]], object]) -> None:
    """One greedy generate() over `rows` (worker thread), run to the longest row's end."""
    ids, mask = left_padded([r.prompt_ids for r in rows], lm.pad_id)
    device = lm.model.device
    stop = RowStop(rows, ids.shape[1], lm.eos_ids, device)
    with torch.inference_mode():
        lm.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                          max_new_tokens=max(r.max_tokens for r in rows), do_sample=False,
                          pad_token_id=lm.pad_id, stopping_criteria=StoppingCriteriaList([stop]),
                          streamer=StepStreamer(post))


async def run_rows(lm: LoadedModel, rows: list[Row], executor: Executor) -> None:
    """generate_rows on the worker thread, its steps delivered on this loop. The steps are
    queued with call_soon_threadsafe before the executor's result, so all are delivered
    before this returns."""
    loop = asyncio.get_running_loop()

    def post(tokens: list[int]) -> None:  # on the worker thread: one hand-over per step
        loop.call_soon_threadsafe(deliver, rows, lm.eos_ids, tokens)

    try:
        await loop.run_in_executor(executor, generate_rows, lm, rows, post)
    except Exception as e:
        logger.exception("generate() failed for a batch of %d", len(rows))
        finish_rows(rows, e)
    else:
        finish_rows(rows, None)
