"""StreamDetokenizer: IncrementalDetokenizer's deltas, each step's text computed by the
`tokenizers` library's DecodeStream (one call into Rust per token instead of two transformers
decodes, each one a trip through Python); `new_detokenizer` picks it for fast tokenizers.

DecodeStream (tokenizers 0.23) keeps a window of ids: the context behind the last text it
returned, decoded once into a prefix, then the unread ids. A step decodes the window and
returns what follows the prefix, or None while that text ends in U+FFFD (an unfinished
character) or did not grow. For one token at a time that is IncrementalDetokenizer's rule,
with the same decode (transformers' decode of a fast tokenizer is the Rust one). It parts from
IncrementalDetokenizer:

- a context that ends inside a character: its prefix stays empty, and its first text would
  repeat the prompt's tail;
- past MAX_PENDING_TOKENS unread ids (bytes that never make a character) it holds them all;
- several tokens in one step: it emits up to the last whole character anywhere in them, the
  window only within their last 3 ids (the same for valid UTF-8, not for garbage bytes);
- a token that adds no text (a special token being skipped) stays unread in its window.

So the base class's window is kept as the base class would keep it (list bookkeeping, no
decoding), skipped special tokens never reach the stream, and every step that is not one
token with a stream in step runs the base class's own step on that window; a new stream is
made once nothing is unread. Stop strings are the base class's code; a step that ends inside a
character decodes its unread text through the window, as the base class does.

What is not mirrored: a token outside the special set that adds no text (SentencePiece's
lone leading "▁" when the context decodes to "") is unread for the stream and read for the
base class. Its text is "" either way, so the deltas are the same; only the MAX_PENDING_TOKENS
count sees it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from engine.tokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer, Tokenizer, find_stop
from scheduler.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


def new_detokenizer(tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> IncrementalDetokenizer:
    """A request's detokenizer: on DecodeStream when the tokenizer is a fast one."""
    if tokenizer.backend is None:
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
    return StreamDetokenizer(tokenizer, prompt_token_ids, params)


class StreamDetokenizer(IncrementalDetokenizer):
    """IncrementalDetokenizer whose one-token steps take their text from a DecodeStream."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        super().__init__(tokenizer, prompt_token_ids, params)
        assert tokenizer.backend is not None, "StreamDetokenizer needs a fast tokenizer"
        self._backend = tokenizer.backend
        self._decode = self._backend.decode  # what tokenizer.decode calls, minus transformers
        self._skipped = tokenizer.backend_special_ids if self._skip else frozenset()
        self._stream: DecodeStream | None = None
        self._stream_failed = False  # it raised once: the window goes on alone
        self._new_stream()

    def step(self, new_token_ids: Sequence[int],
             check_stops: bool = True) -> tuple[str, str | None]:
        stream = self._stream
        if stream is not None and len(new_token_ids) == 1 and self._pending <= MAX_PENDING_TOKENS:
            token = new_token_ids[0]
            try:
                text = self._next_text(stream, token)
            except Exception:  # noqa: BLE001 - InvalidPrefix: a decoder that rewrites earlier text
                self._stream, self._stream_failed = None, True
            else:
                return self._stream_step(token, text, check_stops)
        moves = bool(new_token_ids) or self._pending > 0  # else the window stays as it is
        result = super().step(new_token_ids, check_stops)
        if moves:
            self._stream = None
            self._new_stream()
        return result

    def _next_text(self, stream: DecodeStream, token: int) -> str | None:
        """The text one more token adds, None while it leaves a character unfinished. A skipped
        special token adds nothing: it is kept from the stream, whose window would hold it."""
        if token in self._skipped:
            return None if self._pending else ""
        text: str | None = stream.step(self._backend, token)
        return text

    def _stream_step(self, token: int, text: str | None,
                     check_stops: bool) -> tuple[str, str | None]:
        """The base class's step for one token whose text (None: unfinished) is known."""
        assert not self._stopped, "step() after a stop string ended the request"
        stops = self._stops if check_stops else ()
        self._ids.append(token)
        if text is None:  # what the base class finds: no whole character to emit yet
            if stops:  # but a stop may end in the settled part of the unfinished text
                settled = self._held + self._unread_text(len(self._ids)).rstrip(_REPLACEMENT)
                hit = find_stop(settled, stops)
                if hit is not None:
                    return self._stop_at(settled, *hit)
            return self._emit(self._held, stops), None
        if stops:
            settled = self._held + text
            hit = find_stop(settled, stops)
            if hit is not None:
                return self._stop_at(settled, *hit)
        kept = self._read - self._prefix + 1  # the context's ids if this one joins it
        self._advance(len(self._ids), bool(text))
        if not text and self._read < kept:
            # A long run of skipped special tokens: the window's bound dropped context the
            # stream still holds (a SentencePiece context can then decode to "" and lose the
            # next leading space); a stream on the window's context gives the same text.
            self._stream = None
            self._new_stream()
        return self._emit(settled if stops else self._held + text, stops), None

    def _new_stream(self) -> None:
        """A stream in step with the window, made when nothing is unread and the context's text
        ends on a whole character (DecodeStream would otherwise emit the context again)."""
        if self._stream_failed or self._stopped or self._pending:
            return
        context = self._ids[self._prefix:self._read]
        self._context = self._decode(context, self._skip)  # the base class's cache, filled
        if not self._context.endswith(_REPLACEMENT):
            self._stream = DecodeStream(context, skip_special_tokens=self._skip)
