"""The sampling fields shared by /v1/completions and /v1/chat/completions.

Parsing happens in two steps: `parse_sampling` checks types (before the prompt is known),
`build_params` fixes max_tokens against the context left by the tokenized prompt and builds
one SamplingParams per choice (choice i gets seed + i so n samples differ yet reproduce).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from api.errors import APIError, bad_request
from api.requests.params import (
    INT64_MAX,
    check_int,
    check_unicode,
    get_bool,
    get_float,
    get_int,
    get_int_list,
)
from api.requests.structured import parse_structured
from engine.protocol import (
    MAX_LOGPROBS,  # noqa: F401 - one cap, shared with the engine (re-exported)
    InvalidParamError,
    SamplingParams,
)

MAX_N = 128  # choices per prompt; beyond that one request could monopolise the batch
MAX_STOP = 16  # OpenAI allows 4; vLLM has no cap
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's own cap

@dataclass(frozen=True, slots=True)
class SamplingArgs:
    """Type-checked sampling fields; `fields` are SamplingParams keyword arguments."""

    fields: dict[str, Any]
    max_tokens: int | None  # None = as many as the context allows
    seed: int | None
    n: int
    priority: int
    timeout: float | None  # seconds from arrival (pagedserve extension; see parse_timeout)


def parse_sampling(body: dict[str, Any], max_tokens: int | None) -> SamplingArgs:
    n = get_int(body, "n", 1, lo=1, hi=MAX_N)
    seed = get_int(body, "seed", None, hi=INT64_MAX - MAX_N)
    fields = {
        "temperature": get_float(body, "temperature", 1.0),
        "top_p": get_float(body, "top_p", 1.0),
        "top_k": get_int(body, "top_k", 0, lo=-1),
        "min_p": get_float(body, "min_p", 0.0),
        "presence_penalty": get_float(body, "presence_penalty", 0.0),
        "frequency_penalty": get_float(body, "frequency_penalty", 0.0),
        "repetition_penalty": get_float(body, "repetition_penalty", 1.0),
        "min_tokens": get_int(body, "min_tokens", 0, lo=0),
        "ignore_eos": get_bool(body, "ignore_eos", False),
        "include_stop_str_in_output": get_bool(body, "include_stop_str_in_output", False),
        "skip_special_tokens": get_bool(body, "skip_special_tokens", True),
        "stop": parse_stop(body.get("stop")),
        "stop_token_ids": parse_stop_token_ids(body),
        "logit_bias": parse_logit_bias(body.get("logit_bias")),
        "structured_outputs": parse_structured(body),
    }
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("user must be a string", param="user")
    priority = get_int(body, "priority", 0)
    return SamplingArgs(fields, max_tokens, seed, n, priority, parse_timeout(body))


def parse_timeout(body: dict[str, Any]) -> float | None:
    """`timeout`: seconds from arrival. Still queued then: an error (503); already
    generating: it finishes with what it has and finish_reason "timeout"."""
    timeout = get_float(body, "timeout", None)
    if timeout is not None and timeout <= 0:
        raise bad_request("timeout must be > 0 seconds", param="timeout")
    return timeout


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP:
        raise bad_request(f"stop accepts at most {MAX_STOP} strings", param="stop")
    for stop in stops:
        check_unicode(stop, "stop")  # it is matched against decoded text: never could match
    return tuple(stops)


def parse_stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    ids = tuple(get_int_list(body, "stop_token_ids") or ())
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} ids",
                          param="stop_token_ids")
    return ids


def parse_logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object of token id -> bias", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:  # every entry costs work in every step of the request
        raise bad_request(f"logit_bias accepts at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    bias: dict[int, float] = {}
    for key, b in value.items():
        # ASCII digits only: int() would also take " 5", "+5", "1_0" or non-ASCII digits.
        # (and a 5000-digit key would make int() raise).
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}",
                              param="logit_bias")
        bias[check_int(int(key), "logit_bias", 0)] = get_float({"logit_bias": b}, "logit_bias",
                                                               0.0)
    return bias


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  prompt_param: str) -> int:
    """max_tokens resolved against the room the prompt leaves (400 when it does not fit)."""
    if prompt_len == 0:
        raise bad_request(f"{prompt_param} must not be empty", param=prompt_param)
    room = max_model_len - prompt_len
    if room < (1 if max_tokens != 0 else 0):
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input.",
            param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(
            f"max_tokens is too large: {max_tokens}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_len}).",
            param="max_tokens", code="context_length_exceeded")
    return max_tokens


def build_params(args: SamplingArgs, max_tokens: int, **extra: Any) -> list[SamplingParams]:
    """One SamplingParams per choice; `extra` sets logprobs/prompt_logprobs."""
    try:
        base = SamplingParams(max_tokens=max_tokens, seed=args.seed, **args.fields, **extra)
    except InvalidParamError as e:
        raise bad_request(str(e), param=e.param) from None
    if args.seed is None:
        return [base] * args.n
    return [dataclasses.replace(base, seed=args.seed + i) for i in range(args.n)]


def check_max_tokens(value: int | None, allow_zero: bool, param: str = "max_tokens") -> None:
    if value == 0 and not allow_zero:
        raise APIError(400, f"{param} must be >= 1 (0 is allowed only with echo)", param=param)
