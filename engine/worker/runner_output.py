"""What ModelRunner.execute() returns for one step: token ids and logprobs, no text.

Torch-free plain data; the engine turns ids into text (engine/outputs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprobIds:
    """Logprob of one chosen token plus the top-N alternatives, ids only.

    Logprobs are of the model's raw distribution (log_softmax of the logits before
    temperature, penalties or truncation), as vLLM and OpenAI report them."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: tuple[int, ...] = ()  # best first
    top_logprobs: tuple[float, ...] = ()


@dataclass(slots=True)
class RunnerOutput:
    # seq_id -> the token sampled this step (only sequences that reached their end this step)
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # seq_id -> logprobs of the sampled token (only when params.logprobs is not None)
    logprobs: dict[str, TokenLogprobIds] = field(default_factory=dict)
    # seq_id -> logprobs of the prompt tokens predicted by this step's positions, in order:
    # position p (< num_prompt_tokens - 1) yields the logprob of prompt token p + 1
    # (only when params.prompt_logprobs is not None)
    prompt_logprobs: dict[str, list[TokenLogprobIds]] = field(default_factory=dict)
    # seq_id -> a speculating sequence's drafts the model kept, then its own next token
    # (scheduler/speculative.py); such a sequence is not in sampled_token_ids
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # seq_id -> logprobs of each of verified_token_ids[seq_id], in order (only when
    # params.logprobs is not None): each from its own position's logits, as decoding gives
    verified_logprobs: dict[str, list[TokenLogprobIds]] = field(default_factory=dict)


class RequestFault(Exception):
    """A step failed because of some requests' own inputs, and the runner knows whose: the
    engine fails those requests alone, the others in the step run again in the next one, and
    the failure does not count toward declaring the engine dead (which only failures that no
    request's input explains do). `seq_ids`: the requests to blame."""

    def __init__(self, seq_ids: list[str], reason: str) -> None:
        super().__init__(f"{reason} (requests {', '.join(seq_ids)})")
        self.seq_ids = seq_ids
        self.reason = reason
