"""The grammar backend behind one small interface: compile a StructuredOutputsParams into a
token grammar, and walk it one token at a time with a per-sequence Matcher.

xgrammar does the work (chosen over llguidance by measurement: docs/structured_outputs.md).
Nothing outside this module imports xgrammar, so another backend replaces this file only.

Bitmask layout (the sampler relies on it): int32 words, token t allowed iff bit t % 32 of
word t // 32 is set; one row per constrained sequence, ceil(vocab / 32) words per row.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection
from typing import Any

import torch
import xgrammar as xgr

from engine.structured_output.worker import (
    CompileLimitError,
    CompileWorker,
    GrammarError,
    choice_grammar,
)
from scheduler.sampling_params import StructuredOutputsParams

# xgrammar prefixes its messages with "[time] /path/file.cc:line: "; clients need the rest.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar",
               "regex": "regular expression", "choice": "choice list", "grammar": "grammar"}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class CompiledGrammar:
    """An immutable compiled grammar: shared by every sequence with the same (kind, spec).
    `is_json`: its output is JSON, which never holds a raw control character."""

    __slots__ = ("_compiled", "is_json")

    def __init__(self, compiled: xgr.CompiledGrammar, is_json: bool) -> None:
        self._compiled = compiled
        self.is_json = is_json


class Matcher:
    """One sequence's position in its grammar. Not thread-safe: the engine thread owns it."""

    __slots__ = ("_m", "is_json")

    def __init__(self, grammar: CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(grammar._compiled)
        self.is_json = grammar.is_json

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        return bool(self._m.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 [rows, words], CPU).
        Stop tokens (EOS) are set only where the grammar may end."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """The grammar ended and a stop token was accepted: nothing more may follow."""
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding, tests)."""
        self._m.rollback(num_tokens)


class GrammarBackend:
    """Compiles specs against one tokenizer. `compile` is thread-safe (the pool calls it)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int,
                 stop_token_ids: Collection[int]) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's: padding ids
        are never allowed). Builds the token table (~0.6 s at a 49k vocabulary): call it on
        the thread that owns hf_tokenizer (HF fast tokenizers are not thread-safe)."""
        self.vocab_size = vocab_size
        stops = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stops or None)
        # Compiles run in worker processes, one per compile thread, bounded in time and
        # memory (engine/structured_output/worker.py); what they return is rebuilt against `info`.
        self._info = info
        self._info_json = info.serialize_json()
        self._workers = threading.local()
        # Special tokens (<|im_start|>, ...) read as plain text to xgrammar but vanish from the
        # detokenized output, so they could make the text disagree with the grammar: never
        # allowed in a constrained row (stop tokens keep the grammar's say).
        special = getattr(hf_tokenizer, "all_special_ids", []) or []
        self.forbidden = tuple(sorted({t for t in special if 0 <= t < vocab_size} - set(stops)))
        # xgrammar 0.2.9 lets a string with minLength/maxLength hold raw control characters
        # ([^"\\\r\n]), which JSON forbids (and json.loads refuses): JSON rows never get a
        # token with a byte below 0x20. Valid JSON never needs one (whitespace is optional).
        self.forbidden_in_json = tuple(sorted(set(self.forbidden).union(
            t for t, text in enumerate(info.decoded_vocab)
            if t not in stops and any(b < 0x20 for b in text))))

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """Raises GrammarError when the spec cannot be compiled, or costs more time or
        memory than a compile may take (a 400 naming the field, either way)."""
        what = _KIND_NAMES[so.kind]
        if so.kind == "choice":
            choice_grammar(so.spec)  # its own message, before a worker is involved
        try:
            payload = self._worker().compile(so.kind, so.spec)
        except CompileLimitError as e:
            raise GrammarError(f"the {what} is too costly: {e}") from None
        except ValueError as e:
            raise GrammarError(f"invalid {what}: {_clean(e)}") from None
        compiled = xgr.CompiledGrammar.deserialize_json(payload, self._info)
        return CompiledGrammar(compiled, so.kind in ("json", "json_object"))

    def _worker(self) -> CompileWorker:
        """This compile thread's worker process (started on its first compile)."""
        worker = getattr(self._workers, "worker", None)
        if worker is None:
            worker = self._workers.worker = CompileWorker(self._info_json)
        return worker

    def matcher(self, grammar: CompiledGrammar) -> Matcher:
        return Matcher(grammar)


def _clean(error: Exception) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else type(error).__name__
    return _LOCATION.sub("", first)
