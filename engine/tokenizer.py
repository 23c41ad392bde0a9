"""Tokenizer facade and the incremental detokenizer that turns new token ids into text deltas.

`Tokenizer` wraps any Hugging Face tokenizer so the rest of the engine sees one small API.
`IncrementalDetokenizer` streams text the way vLLM and HF's TextStreamer do: each step
decodes only a short window of ids (a few already-emitted tokens as context, then the
unread ones) and emits what the unread ids added. The context keeps SentencePiece's
leading spaces right; holding back a text that ends in U+FFFD keeps a UTF-8 character
split across byte tokens from being emitted half-done. Stop strings are matched on the
emitted text, with any tail that could still grow into a stop string held back. For a fast
(Rust) tokenizer the engine uses engine/stream_detokenizer.py's StreamDetokenizer, which gives
the same deltas through `tokenizers`' DecodeStream; this class is its fallback.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from functools import lru_cache
from typing import Any

from engine.protocol import ChatTemplateArgs
from scheduler.sampling_params import SamplingParams

# How many prompt tokens are decoded as context before the first output token (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character needs at most 4 bytes, so a real unfinished character leaves at most 3
# ids unread after a step. Past this many the tail is garbage bytes (each one renders as
# U+FFFD): emit it rather than let the decode window, and the cost of a step, grow unbounded.
MAX_PENDING_TOKENS = 16
_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


class Tokenizer:
    """Wraps a Hugging Face tokenizer (a PreTrainedTokenizerBase instance, passed in)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Collection[int] = ()) -> None:
        self.hf = hf_tokenizer
        own_eos = hf_tokenizer.eos_token_id
        self.eos_token_ids = frozenset(eos_token_ids) | (
            frozenset() if own_eos is None else frozenset([own_eos]))
        self.vocab_size: int = len(hf_tokenizer)
        self.has_chat_template: bool = bool(getattr(hf_tokenizer, "chat_template", None))
        self._special_ids = frozenset(hf_tokenizer.all_special_ids)
        self._decoder_kind = _decoder_kind(hf_tokenizer)
        self._token_texts: dict[int, str] = {}  # at most one entry per vocabulary token
        # The Rust tokenizer whose decode() hf.decode() is (None for a slow tokenizer), and the
        # ids its skip_special_tokens drops: its added tokens marked special, which can be
        # more than transformers' all_special_ids (SmolLM2: 17 against 3).
        self.backend: Any = _rust_backend(hf_tokenizer)
        self.backend_special_ids = frozenset() if self.backend is None else frozenset(
            i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers: the longest token's
        spelling (a byte-level BPE spells each byte as one 1-2 byte character, SentencePiece
        a space as the 3-byte "▁", so the spelling is never shorter than its text)."""
        tokens = self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))
        return max((len(t.encode("utf-8", "surrogatepass")) for t in tokens if t), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces ("a ." -> "a."): it is not local to a token, so streamed
        # deltas could not add up to it, and the model's own text is what users expect.
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        """One token's own text for logprobs (OpenAI style).

        A token that is only part of a UTF-8 character is spelled as its bytes,
        "bytes:\\xe4\\xb8", as OpenAI does; other tokens as their decoded text, with the
        leading space that SentencePiece's decode would drop at the start of a text.
        """
        text = self._token_texts.get(token_id)
        if text is None:  # logprobs ask for up to 21 tokens per sequence per step: cache
            text = self._token_texts[token_id] = self._spell(token_id)
        return text

    def _spell(self, token_id: int) -> str:
        raw = self._token_bytes(token_id)
        if raw is None:
            return self.decode([token_id], skip_special_tokens=False)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes a token stands for, or None where the piece does not say."""
        if token_id in self._special_ids or not 0 <= token_id < self.vocab_size:
            return None
        piece = self.hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if self._decoder_kind == "byte_level":
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return None
        if self._decoder_kind == "sentencepiece":
            byte = _BYTE_TOKEN.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode()
        return None

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        return self.render_chat(messages, ChatTemplateArgs(add_generation_prompt))

    def render_chat(self, messages: list[dict[str, Any]], args: ChatTemplateArgs) -> str:
        """Render chat messages to the prompt text the model was trained on. The messages
        are already validated (the API's parse_messages): content is a string. A request's
        chat_template replaces the model's; transformers runs it in a sandboxed Jinja."""
        if args.chat_template is None and not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; "
                             "use the completions endpoint with a plain prompt")
        try:
            text = self.hf.apply_chat_template(
                messages, tools=args.tools, chat_template=args.chat_template,
                add_generation_prompt=args.add_generation_prompt,
                continue_final_message=args.continue_final_message, tokenize=False,
                **args.kwargs)
        except Exception as exc:  # jinja2 errors, including the template's raise_exception()
            raise ValueError(f"the chat template cannot render the messages: {exc}") from exc
        assert isinstance(text, str), type(text)
        return text


def _rust_backend(hf_tokenizer: Any) -> Any:
    """hf_tokenizer's `tokenizers.Tokenizer` when hf_tokenizer.decode is exactly its decode
    (transformers 5's TokenizersBackend with decode and _decode not overridden; our calls
    turn clean-up off), else None."""
    # Here, not at the top: importing this module stays light (transformers is loaded by
    # whoever made hf_tokenizer).
    from transformers import TokenizersBackend
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(hf_tokenizer)
    if not isinstance(hf_tokenizer, TokenizersBackend):
        return None
    if (cls._decode is not TokenizersBackend._decode
            or cls.decode is not PreTrainedTokenizerBase.decode):
        return None
    return hf_tokenizer.backend_tokenizer


def _decoder_kind(hf_tokenizer: Any) -> str:
    """'byte_level' (GPT-2 style), 'sentencepiece' (Metaspace / byte fallback) or 'other'."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    spec = decoder.__getstate__().decode() if decoder is not None else ""
    if '"ByteLevel"' in spec:
        return "byte_level"
    if '"Metaspace"' in spec or '"ByteFallback"' in spec or "▁" in spec:
        return "sentencepiece"
    return "other"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-ins back to raw bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class IncrementalDetokenizer:
    """Per-request streaming state: token ids in, text deltas out.

    Without stop strings the deltas plus flush() add up to `decode(output ids)` for any
    split into steps (exactly for byte-level BPE; for SentencePiece the first token keeps
    the leading space that the prompt context gives it, which a bare decode would drop).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self._decode: Callable[[list[int], bool], str] = tokenizer.decode  # (ids, skip) -> text
        self._skip = params.skip_special_tokens
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        # Only a window of ids is kept: _ids[_prefix:_read] is context already turned into
        # text, _ids[_read:] the ids whose text is not known yet (an unfinished character).
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._context: str | None = None  # decode(_ids[_prefix:_read]), cached
        self._held = ""  # decoded text not yet emitted: it may be the start of a stop string
        self._stopped = False

    def step(self, new_token_ids: Sequence[int],
             check_stops: bool = True) -> tuple[str, str | None]:
        """Feed this step's tokens; return (text to emit now, the stop string hit or None).

        check_stops=False (before min_tokens is reached, as vLLM): stop strings are neither
        searched nor held back in this step's text."""
        assert not self._stopped, "step() after a stop string ended the request"
        stops = self._stops if check_stops else ()
        stale = self._pending  # ids that earlier steps could not turn into whole characters
        self._ids.extend(new_token_ids)
        end = len(self._ids)
        text = self._unread_text(end)
        unfinished = text.endswith(_REPLACEMENT) and stale <= MAX_PENDING_TOKENS
        if stops:
            # Look for stops even in a text whose last character is unfinished: all of it
            # but the trailing U+FFFDs is settled already.
            settled = self._held + (text.rstrip(_REPLACEMENT) if unfinished else text)
            hit = find_stop(settled, stops)
            if hit is not None:
                return self._stop_at(settled, *hit)
        if unfinished:
            text, end = self._finished_part()
        self._advance(end, bool(text))
        return self._emit(self._held + text, stops), None

    def flush(self) -> str:
        """The held-back text, once the request finished for a reason other than a stop."""
        if self._stopped:
            return ""
        text, self._held = self._held + self._unread_text(len(self._ids)), ""
        self._stopped = True
        hit = find_stop(text, self._stops) if self._stops else None
        return text if hit is None else self._stop_at(text, *hit)[0]

    @property
    def _pending(self) -> int:
        return len(self._ids) - self._read

    def _unread_text(self, end: int) -> str:
        """The text _ids[_read:end] add after their context (cost: the window, not the output)."""
        if end == self._read:
            return ""
        if self._context is None:
            self._context = self._decode(self._ids[self._prefix:self._read], self._skip)
        full = self._decode(self._ids[self._prefix:end], self._skip)
        return full[len(self._context):]

    def _finished_part(self) -> tuple[str, int]:
        """The unread text up to the last token boundary that ends a whole character.

        An unfinished character has at most 3 bytes, so it began in one of the last 3 ids.
        """
        for end in range(len(self._ids) - 1, max(self._read, len(self._ids) - 4), -1):
            text = self._unread_text(end)
            if not text.endswith(_REPLACEMENT):
                return text, end
        return "", self._read

    def _advance(self, end: int, produced_text: bool) -> None:
        """Mark _ids[:end] as read; the ids just read become the next step's context."""
        if end == self._read:
            return
        if produced_text:
            self._prefix = self._read
        # Ids that add no text (skipped special tokens) make poor context for SentencePiece,
        # so the old context is kept; the window is still bounded by dropping its oldest ids.
        self._read = end
        self._prefix = max(self._prefix, self._read - 4 * PROMPT_CONTEXT_TOKENS)
        del self._ids[:self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        self._context = None

    def _emit(self, text: str, stops: Sequence[str]) -> str:
        """Emit all of `text` but a tail that could still become a stop string."""
        keep = _stop_prefix_len(text, stops, self._max_stop_len) if stops else 0
        cut = len(text) - keep
        self._held = text[cut:]
        return text[:cut]

    def _stop_at(self, text: str, start: int, end: int, stop: str) -> tuple[str, str]:
        """End the stream at a stop string: emit up to it (or through it), nothing after."""
        self._stopped = True
        self._held = ""
        return (text[:end] if self._include_stop else text[:start]), stop


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """The stop string that completes first in `text` (ties: the longest): (start, end, stop).

    "Completes first" is what a character-by-character stream would see, so the answer
    does not depend on how the text was split into steps.
    """
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or (end, start) < (best[1], best[0]):
            best = (start, end, stop)
    return best


def _stop_prefix_len(text: str, stops: Sequence[str], max_len: int) -> int:
    """Length of the longest tail of `text` (at most max_len - 1 characters) that some stop
    string starts with. Such a tail starts with that stop's first character, so one find()
    per stop usually settles it (this runs every step of a request with stop strings)."""
    best = 0
    for stop in stops:
        start = max(len(text) - min(len(stop), max_len - 1), 0)
        at = text.find(stop[0], start)
        while at >= 0:  # the first match is the longest tail for this stop
            if stop.startswith(text[at:]):
                best = max(best, len(text) - at)
                break
            at = text.find(stop[0], at + 1)
    return best
