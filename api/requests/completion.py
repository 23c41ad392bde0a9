"""The /v1/completions request: JSON body -> CompletionRequest (types checked, nothing run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.errors import bad_request
from api.requests.fields import CMPL, MAX_PROMPTS, check_fields
from api.requests.options import Options, parse_options
from api.requests.params import INT64_MAX, check_int, get_bool, get_int, get_str
from api.requests.sampling import MAX_LOGPROBS, SamplingArgs, check_max_tokens, parse_sampling

MAX_CHOICES = MAX_PROMPTS  # prompts x n in one request

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str | None
    prompts: list[Prompt]  # each becomes a group of n choices
    sampling: SamplingArgs
    echo: bool
    logprobs: int | None
    stream: bool
    options: Options


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    check_fields(body, CMPL)
    if "prompt" not in body:
        raise bad_request("prompt is required", param="prompt")
    prompts = parse_prompt(body["prompt"])
    echo = get_bool(body, "echo", False)
    # Absent: 16 (OpenAI's default); null: as many as the context allows (vLLM).
    max_tokens = get_int(body, "max_tokens", None, lo=0) if "max_tokens" in body else 16
    check_max_tokens(max_tokens, allow_zero=echo)
    sampling = parse_sampling(body, max_tokens)
    _check_unsupported(body, sampling.n)
    if len(prompts) * sampling.n > MAX_CHOICES:
        raise bad_request(f"prompts x n must be at most {MAX_CHOICES}", param="n")
    stream = get_bool(body, "stream", False)
    return CompletionRequest(
        model=get_str(body, "model"), prompts=prompts, sampling=sampling, echo=echo,
        logprobs=get_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS), stream=stream,
        options=parse_options(body, stream, add_special_tokens=True),
    )


def parse_prompt(value: Any) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids "
                          "or a list of token-id lists, and not empty", param="prompt")
    batch = all(isinstance(p, str) for p in value) or all(isinstance(p, list) for p in value)
    if not batch:
        return [_token_ids(value)]  # one prompt given as token ids
    if len(value) > MAX_PROMPTS:  # checked before any of them is tokenized
        raise bad_request(f"prompt accepts at most {MAX_PROMPTS} prompts in one request, "
                          f"got {len(value)}", param="prompt")
    return [p if isinstance(p, str) else _token_ids(p) for p in value]


def _token_ids(value: list[Any]) -> list[int]:
    return [check_int(t, "prompt", 0, INT64_MAX) for t in value]


def _check_unsupported(body: dict[str, Any], n: int) -> None:
    best_of = get_int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != n:
        raise bad_request("best_of is not supported unless it equals n", param="best_of")
