"""SamplingParams: how one request wants its tokens chosen and when it wants to stop.

Validated on construction so that a bad value never reaches the engine thread; every
error is an InvalidParamError (a ValueError) that names the offending field, which the
API turns into a 400 naming the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from scheduler.errors import InvalidParamError

# OpenAI allows at most 20 top logprobs per token; vLLM keeps the same cap by default.
MAX_LOGPROBS = 20
# The sampler works in float32: a temperature past its largest finite value becomes inf
# (and -inf / inf is NaN). A repetition penalty divides or multiplies logits: within
# [1e-4, 1e4] a logit stays finite up to |3.4e34|, far past any model's, while 5e-324
# (which the JSON schema's "> 0" allowed) is 0 in float32 and turned logits into inf.
FLOAT32_MAX = 3.4028234663852886e38
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on a request's output, compiled by the engine into a token grammar.

    `spec` by kind: "json" a JSON Schema as JSON text; "json_object" "" (any JSON object);
    "regex" a regular expression; "choice" a JSON list of the allowed strings; "grammar" an
    EBNF/GBNF grammar. `param` names the request field it came from, so a spec that fails to
    compile is a 400 naming that field. The scheduler only knows that a request carrying one
    waits until its grammar is compiled."""

    kind: StructuredKind
    spec: str
    param: str = "structured_outputs"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling and stopping options (temperature 0 means greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # top-N logprobs of each sampled token
    prompt_logprobs: int | None = None  # top-N logprobs of each prompt token (echo scoring)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 0, "max_tokens", "must be >= 0")
        _check(_in(self.temperature, 0, FLOAT32_MAX), "temperature",
               f"must be >= 0 and <= {FLOAT32_MAX:.7g} (a finite float32)")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive integer")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        _check(_in(self.presence_penalty, -2, 2), "presence_penalty", "must be in [-2, 2]")
        _check(_in(self.frequency_penalty, -2, 2), "frequency_penalty", "must be in [-2, 2]")
        lo, hi = REPETITION_PENALTY_RANGE
        _check(_in(self.repetition_penalty, lo, hi), "repetition_penalty",
               f"must be in [{lo:g}, {hi:g}]")
        _check(all(_in(b, -100, 100) for b in self.logit_bias.values()), "logit_bias",
               "values must be in [-100, 100]")
        _check(all(t >= 0 for t in self.logit_bias), "logit_bias", "token ids must be >= 0")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        _check(all(s != "" for s in self.stop), "stop", "must not contain empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            _check(n is None or 0 <= n <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _in(x: float, lo: float, hi: float) -> bool:
    return _finite(x) and lo <= x <= hi


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise InvalidParamError(name, f"{name} {why}")
