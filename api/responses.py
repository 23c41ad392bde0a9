"""Response and chunk bodies in OpenAI's exact shapes, and per-choice accumulation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import Logprob, RequestOutput, TokenLogprobs

MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM clamps the same way

# A completions-logprobs entry: the token's text and its logprobs (None: first prompt token).
LogprobEntry = tuple[str, TokenLogprobs | None]


@dataclass
class ChoiceState:
    """What one choice has produced so far (mutable: updated per delta)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    num_tokens: int = 0
    text_offset: int = 0  # completions logprobs: characters emitted before the next token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The engine sends the prompt (ids, logprobs) once, on the first delta that carries
    # tokens or on the final one; an earlier empty delta (a prefill chunk) does not count.
    prompt_seen: bool = False
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # when asked for
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    token_ids: list[int] = field(default_factory=list)  # generated, stop token included

    def add(self, out: RequestOutput) -> None:
        self.prompt_seen = self.prompt_seen or out.prompt_token_ids is not None
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
        self.text.append(out.new_text)
        self.num_tokens += len(out.new_token_ids)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(token_entries(out))
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


def token_entries(out: RequestOutput, as_ids: bool = False) -> list[LogprobEntry]:
    return [(token_name(lp.chosen, as_ids), lp) for lp in out.logprobs or ()]


def clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with `cached_tokens`, its prompt_tokens_details too (the prompt
    tokens served from the prefix cache)."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def token_name(lp: Logprob, as_ids: bool) -> str:
    """A token as logprobs show it: its text, or "token_id:N" (vLLM's
    return_tokens_as_token_ids, for tokens whose text is not valid UTF-8 on its own)."""
    return f"token_id:{lp.token_id}" if as_ids else lp.token


def completion_logprobs(entries: Sequence[LogprobEntry], offset: int,
                        as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; `offset` is the text length before the first entry.
    The top_logprobs dicts include the chosen token, as vLLM's do. Offsets count the shown
    tokens (their ids with `as_ids`), as vLLM's do."""
    result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    for token, lp in entries:
        result["tokens"].append(token)
        result["text_offset"].append(offset)
        offset += len(token)
        if lp is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(clamp(lp.chosen.logprob))
        top = {token_name(t, as_ids): clamp(t.logprob) for t in lp.top}
        top.setdefault(token_name(lp.chosen, as_ids), clamp(lp.chosen.logprob))
        result["top_logprobs"].append(top)
    return result


def chat_logprobs(entries: Sequence[LogprobEntry], top_n: int,
                  as_ids: bool = False) -> dict[str, Any]:
    return {"content": [_chat_token(lp, top_n, as_ids) for _, lp in entries if lp is not None]}


def _chat_token(lp: TokenLogprobs, top_n: int, as_ids: bool) -> dict[str, Any]:
    # The chosen token's bytes are its text's, even shown as an id (as vLLM).
    item = _chat_logprob(token_name(lp.chosen, as_ids), lp.chosen.logprob, lp.chosen.token)
    item["top_logprobs"] = [_chat_logprob(token_name(t, as_ids), t.logprob)
                            for t in lp.top[:top_n]]
    return item


def _chat_logprob(token: str, logprob: float, text: str | None = None) -> dict[str, Any]:
    raw = (token if text is None else text).encode("utf-8", "replace")
    return {"token": token, "logprob": clamp(logprob), "bytes": list(raw)}


def prompt_logprobs(plps: Sequence[TokenLogprobs | None]) -> list[Any]:
    """vLLM's prompt_logprobs: per prompt token None (the first: nothing predicts it) or
    {token id: {logprob, rank, decoded_token}} for the prompt token and the top-N."""
    return [None if lp is None else _position(lp) for lp in plps]


def _position(lp: TokenLogprobs) -> dict[int, dict[str, Any]]:
    entry = {lp.chosen.token_id: _lp_entry(lp.chosen, lp.rank)}
    for rank, t in enumerate(lp.top, start=1):
        entry.setdefault(t.token_id, _lp_entry(t, rank))
    return entry


def _lp_entry(lp: Logprob, rank: int) -> dict[str, Any]:
    return {"logprob": clamp(lp.logprob), "rank": rank, "decoded_token": lp.token}


def envelope(request_id: str, created: int, model: str, obj: str,
             choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None,
             ) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model,
                            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      state: ChoiceState) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": state.finish_reason, "stop_reason": state.stop_reason}


def chat_choice(index: int, state: ChoiceState, logprobs: dict[str, Any] | None,
                ) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": "".join(state.text)},
            "logprobs": logprobs, "finish_reason": state.finish_reason,
            "stop_reason": state.stop_reason}


def chat_chunk_choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
                      finish_reason: str | None, stop_reason: int | str | None = None,
                      ) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice
