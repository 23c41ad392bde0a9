"""Structured outputs around the grammar backend: compiling off the step loop, the compile
cache, and one step's token bitmask.

Compiles run in a small thread pool, so the step loop never waits for one: a request whose
grammar is not ready waits in the scheduler (Sequence.waiting_for_grammar) while the others
run. Results (grammars and failures alike: both are pure functions of the spec) are cached
by a hash of (kind, spec), as futures, so concurrent requests with the same spec share one
compile. A failure is a GrammarError; `param_error` names the request's own field in it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from engine.sample.sampling_batch import GrammarMasks
from engine.structured_output.daemon_pool import DaemonPool
from engine.structured_output.grammar import CompiledGrammar, GrammarBackend, GrammarError, Matcher
from scheduler.errors import InvalidParamError
from scheduler.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (a large schema's token tables are ~MBs)
COMPILE_THREADS = 2

GrammarFuture = concurrent.futures.Future[CompiledGrammar]


def param_error(so: StructuredOutputsParams, error: BaseException) -> BaseException:
    """A compile failure as the 400 that names the request's field (so.param)."""
    if isinstance(error, GrammarError):
        return InvalidParamError(so.param, f"{so.param}: {error}")
    return error


def spec_key(so: StructuredOutputsParams) -> str:
    """The cache key: `param` only names the field, it does not change the grammar."""
    return hashlib.sha256(f"{so.kind}\0{so.spec}".encode()).hexdigest()


class StructuredOutputs:
    """Owns the backend, the compile pool and cache, and the bitmask buffer."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int,
                 stop_token_ids: Collection[int]) -> None:
        self.backend = GrammarBackend(hf_tokenizer, vocab_size, stop_token_ids)
        # Daemon threads: a compile still running never holds up the process's exit.
        self._pool = DaemonPool(COMPILE_THREADS, "pagedserve-grammar")
        self._cache: OrderedDict[str, GrammarFuture] = OrderedDict()
        self._lock = threading.Lock()  # the event loop and the engine thread both compile
        self._bitmask = torch.empty(0, self.backend.words, dtype=torch.int32)
        words = self.backend.words
        self._keep = self._keep_words(self.backend.forbidden, words)
        self._keep_json = self._keep_words(self.backend.forbidden_in_json, words)
        self.num_compiles = 0  # compiles started (cache misses)

    def compile(self, so: StructuredOutputsParams) -> GrammarFuture:
        """The (possibly already finished) compile of so; thread-safe, never blocks. A
        failure is a GrammarError (see param_error)."""
        key = spec_key(so)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self.backend.compile, so)
                self._cache[key] = future
                self.num_compiles += 1
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return future

    def matcher(self, grammar: CompiledGrammar) -> Matcher:
        return self.backend.matcher(grammar)

    def fill(self, rows: list[tuple[str, Matcher, list[int]]]) -> GrammarMasks:
        """The bitmask of the step's constrained rows (engine thread only): per (sequence id,
        matcher, drafts), a row for its next token and, when it drafts, one for each
        position after a draft, filled with the drafts accepted so far, then rolled back."""
        c = sum(1 + len(drafts) for _, _, drafts in rows)
        if self._bitmask.shape[0] < c:
            self._bitmask = torch.empty(max(c, 2 * self._bitmask.shape[0]), self.backend.words,
                                        dtype=torch.int32)
        words = self._bitmask.numpy()  # shares memory: numpy's per-call cost is torch's /10
        seq_ids: list[str] = []
        offsets: list[int] = []
        for seq_id, m, drafts in rows:
            self._fill_row(m, words, len(seq_ids))
            seq_ids.append(seq_id)
            offsets.append(0)
            accepted = 0
            for j, draft in enumerate(drafts, 1):
                if accepted == j - 1 and m.accept_token(draft):
                    accepted = j
                    self._fill_row(m, words, len(seq_ids))
                else:  # past a refused draft: nothing there is kept, any valid row will do
                    self._bitmask[len(seq_ids)] = self._bitmask[len(seq_ids) - 1]
                seq_ids.append(seq_id)
                offsets.append(j)
            if accepted:
                m.rollback(accepted)
        return GrammarMasks(tuple(seq_ids), self._bitmask[:c].clone(), tuple(offsets))

    def _fill_row(self, m: Matcher, words: np.ndarray, row: int) -> None:
        """Row `row` of the bitmask (`words`: its numpy view) for m's state."""
        m.fill_bitmask(self._bitmask, row)
        keep = self._keep_json if m.is_json else self._keep
        if keep is not None:
            words[row] &= keep
            if not words[row].any():  # only a forbidden token fits: allow it rather
                m.fill_bitmask(self._bitmask, row)  # than sample from an empty row

    @staticmethod
    def _keep_words(forbidden: tuple[int, ...], words: int) -> np.ndarray | None:
        """[words] int32 with the forbidden tokens' bits cleared (None: nothing forbidden)."""
        if not forbidden:
            return None
        keep = [-1] * words  # -1: all 32 bits set
        for t in forbidden:
            w = keep[t // 32] & 0xFFFFFFFF & ~(1 << (t % 32))
            keep[t // 32] = w - (1 << 32) if w >= 1 << 31 else w  # back to signed int32
        return np.array(keep, dtype=np.int32)

    def shutdown(self) -> None:
        self._pool.shutdown()


def settled_on(loop: asyncio.AbstractEventLoop, future: GrammarFuture) -> asyncio.Future[None]:
    """An event-loop future that settles (with None) when the compile does. Unlike
    asyncio.wrap_future, cancelling it never cancels the compile, which other requests with
    the same spec may share (a cancelled one would stay in the cache), and a compile that
    ends after the loop has closed (at shutdown) is no error."""
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def on_done(_: GrammarFuture) -> None:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    future.add_done_callback(on_done)
    return done
