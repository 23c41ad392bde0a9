"""vLLM's request options that shape the prompt and the response rather than sampling, shared
by /v1/completions and /v1/chat/completions: prompt_logprobs, truncate_prompt_tokens,
return_tokens_as_token_ids, return_token_ids, add_special_tokens, request_id and
stream_options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.errors import bad_request
from api.requests.params import check_unicode, get_bool, get_int, get_str
from api.requests.sampling import MAX_LOGPROBS


@dataclass(frozen=True, slots=True)
class Options:
    prompt_logprobs: int | None  # top-N per prompt token, returned in the response
    truncate_prompt_tokens: int | None  # keep the last k prompt tokens; -1: as many as fit
    tokens_as_ids: bool  # logprobs tokens as "token_id:N"
    token_ids: bool  # return_token_ids: the prompt's and each choice's token ids
    add_special_tokens: bool  # BOS etc. on top of the text (or of the chat template)
    request_id: str | None  # the response id's suffix (vLLM's request_id)
    include_usage: bool  # stream: a usage chunk before [DONE]
    continuous_usage: bool  # stream: usage on every chunk too (needs include_usage, as vLLM)


def parse_options(body: dict[str, Any], stream: bool, add_special_tokens: bool) -> Options:
    """`add_special_tokens`: the route's default (completions true, chat false, as vLLM)."""
    include, continuous = parse_stream_options(body, stream)
    return Options(
        prompt_logprobs=parse_prompt_logprobs(body, stream),
        truncate_prompt_tokens=parse_truncate(body),
        tokens_as_ids=get_bool(body, "return_tokens_as_token_ids", False),
        token_ids=get_bool(body, "return_token_ids", False),
        add_special_tokens=get_bool(body, "add_special_tokens", add_special_tokens),
        request_id=parse_request_id(body),
        include_usage=include, continuous_usage=include and continuous)


MAX_REQUEST_ID = 256  # characters: it is echoed in every chunk of the response
# A prompt to be truncated may be longer than the context, but not more than this many
# contexts' worth of text (then it is a 400 before any tokenizer time is spent on it).
TRUNCATED_TEXT_FACTOR = 4


def parse_request_id(body: dict[str, Any]) -> str | None:
    rid = get_str(body, "request_id")
    if rid is None:
        return None
    if not 0 < len(rid) <= MAX_REQUEST_ID:
        raise bad_request(f"request_id must have 1 to {MAX_REQUEST_ID} characters",
                          param="request_id")
    check_unicode(rid, "request_id")  # it goes back out in the response's id
    return rid


def parse_prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    n = get_int(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if stream and n:  # vLLM: only the count-0 form streams (and then returns nothing)
        raise bad_request("prompt_logprobs are not available when stream is true",
                          param="prompt_logprobs")
    return n


def parse_truncate(body: dict[str, Any]) -> int | None:
    k = get_int(body, "truncate_prompt_tokens", None, lo=-1)
    if k == 0:
        raise bad_request("truncate_prompt_tokens must be >= 1, or -1 for as many as fit",
                          param="truncate_prompt_tokens")
    return k


def parse_stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); stream_options without stream is a 400, as
    in vLLM."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise bad_request("stream_options can only be set when stream is true",
                          param="stream_options")
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"stream_options.{key} must be a boolean",
                              param="stream_options")
        flags.append(bool(value))
    return flags[0], flags[1]


def fit_factor(options: Options) -> int:
    """How many contexts' worth of text a prompt may be before it is refused untokenized: 1,
    or TRUNCATED_TEXT_FACTOR for a prompt that will be truncated (it may be longer than the
    context, but a text many contexts long would only hold the tokenizer)."""
    return 1 if options.truncate_prompt_tokens is None else TRUNCATED_TEXT_FACTOR


def truncate(ids: list[int], options: Options, max_model_len: int,
             max_tokens: int | None) -> list[int]:
    """The last k prompt tokens (vLLM keeps the end of the prompt). k must leave room for
    max_tokens (400 naming truncate_prompt_tokens otherwise, as vLLM); -1 keeps as many as
    leave room for max_tokens, or for one token when max_tokens is unset."""
    k = options.truncate_prompt_tokens
    if k is None:
        return ids
    room = max_model_len - (max_tokens if max_tokens else (1 if k == -1 else 0))
    if k == -1:
        k = max(room, 1)
    elif k > room:
        raise bad_request(f"truncate_prompt_tokens ({k}) cannot be greater than the context "
                          f"left after max_tokens ({room}); select a smaller truncation size",
                          param="truncate_prompt_tokens")
    return ids[-k:]
