"""Response and chunk bodies in OpenAI's exact shapes, and per-choice accumulation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import RequestOutput, TokenLogprobs

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

    def add(self, out: RequestOutput) -> None:
        self.prompt_seen = self.prompt_seen or out.prompt_token_ids is not None
        self.text.append(out.new_text)
        self.num_tokens += len(out.new_token_ids)
        self.logprobs.extend(token_entries(out))
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


def token_entries(out: RequestOutput) -> list[LogprobEntry]:
    return [(lp.chosen.token, lp) for lp in out.logprobs or ()]


def clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: Sequence[LogprobEntry], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; `offset` is the text length before the first entry.
    The top_logprobs dicts include the chosen token, as vLLM's do."""
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
        top = {t.token: clamp(t.logprob) for t in lp.top}
        top.setdefault(lp.chosen.token, clamp(lp.chosen.logprob))
        result["top_logprobs"].append(top)
    return result


def chat_logprobs(entries: Sequence[LogprobEntry], top_n: int) -> dict[str, Any]:
    return {"content": [_chat_token(lp, top_n) for _, lp in entries if lp is not None]}


def _chat_token(lp: TokenLogprobs, top_n: int) -> dict[str, Any]:
    item = _chat_logprob(lp.chosen.token, lp.chosen.logprob)
    item["top_logprobs"] = [_chat_logprob(t.token, t.logprob) for t in lp.top[:top_n]]
    return item


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": clamp(logprob), "bytes": list(token.encode("utf-8"))}


def envelope(request_id: str, created: int, model: str, obj: str,
             choices: list[dict[str, Any]], usage_: dict[str, int] | None = None,
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
