"""SchedulerConfig: the batching limits. The KV pool size is not here: the engine learns it
only after loading the model and passes it to the Scheduler in EngineLimits, with the
max_model_len and block_size it resolved from these settings, the model and the pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from scheduler.speculative import SpeculativeConfig, parse_speculative_config


def option(default: Any, help: str, *, flag: str | None = None, kind: type | None = None,
           choices: tuple[str, ...] | None = None, default_text: str | None = None) -> Any:
    """A config field that is also a `pagedserve serve` flag (api/cli.py generates them, as
    vLLM's EngineArgs does): its default and its help live here and nowhere else. `flag`:
    the flag's name when it is not the field's (vLLM's where one exists); `kind`: the flag's
    type when it is not the default's; `default_text`: how to say a None default."""
    meta = {"help": help, "flag": flag, "kind": kind, "choices": choices,
            "default_text": default_text}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = option(64, "sequences per step")
    max_num_batched_tokens: int = option(
        2048, "token budget of one step (prefill chunks and decodes)")
    max_model_len: int = option(
        2048, "prompt + output tokens per sequence (an upper bound: the model's own limit and "
        "the KV pool may lower it)")
    block_size: int = option(16, "tokens per KV block")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes")
    # One sequence may take at most this many tokens of a step's budget, so a long prompt
    # cannot starve the others (vLLM's long_prefill_token_threshold). 0 = max_num_batched_tokens.
    long_prefill_token_threshold: int = option(
        0, "max tokens one prefill may take per step, 0 = no cap")
    # While any sequence is decoding, a step takes at most this many prompt tokens in all
    # (0 = no cap beyond the budget). A prefill token costs about as much as a whole decode
    # row's share of the step, so an uncapped 512-token chunk makes every running stream wait
    # several decode steps for its next token; spread over steps, prefill keeps inter-token
    # latency even (Sarathi-Serve's stall-free batching). With nothing decoding, prefill
    # uses the whole budget: there is no stream to stall.
    decode_step_prefill_tokens: int = option(
        0, "prompt tokens one step may take while other sequences decode, so long prompts "
        "cannot stall their streams; 0 = only the step budget")
    # With that cap on, it grows to this many prompt tokens per decoding sequence (0 = a
    # fixed cap). A step's cost grows with its rows, so the same prompt tokens stall a wide
    # decode batch relatively less, while the prompts waiting behind a fixed cap leave its
    # slots empty: at 64 streams a 64-token cap admitted the first wave of ~100-token
    # prompts over ~100 steps and cost a fifth of the throughput (docs/performance.md).
    decode_step_prefill_tokens_per_seq: int = option(
        0, "grow that cap to this many prompt tokens per decoding sequence, so a wide decode "
        "batch still admits new prompts quickly; 0 = a fixed cap")
    # The step-time budget (scheduler/step_budget.py): while sequences decode, a step takes the
    # prompt tokens that the cost model, fitted to the server's own steps, says fit within
    # this many milliseconds, or within prefill_stretch times the decode step of the batch it
    # is forming (running plus waiting sequences), whichever is longer; the first chunk always
    # gets a KV block's worth. The two token caps above apply only until the model is fitted.
    # 0 = off: the token caps alone, as before.
    target_itl_ms: float = option(
        0.0, "step-time budget in ms: while sequences decode, a step takes only the prompt "
        "tokens that a cost model fitted to the server's own steps says fit in it, so new "
        "prompts do not stall running streams; 0 = off (the token caps alone)")
    prefill_stretch: float = option(
        2.0, "with --target-itl-ms, a step may also take prompt tokens up to this many times "
        "the decode step of the batch it is forming (its running and waiting sequences), so "
        "a wide batch keeps admitting prompts")
    # Speculative decoding without a draft model (scheduler/speculative.py), vLLM's flag and
    # JSON: '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
    # "prompt_lookup_max": 5, "disable_by_batch_size": 8}'.
    speculative_config: str | None = option(
        None, "speculative decoding as a JSON object, as vLLM's: method ngram (prompt lookup: "
        "drafts are the tokens that followed the newest n-gram's last occurrence in the "
        "request's own prompt and output) or suffix (the most frequent continuation of the "
        "longest matched suffix, in the request's tokens and recent requests' outputs), "
        "num_speculative_tokens (4), prompt_lookup_min (2), prompt_lookup_max (5), "
        "suffix_decoding_max_tree_depth (24), suffix_decoding_max_cached_requests (1000), "
        "suffix_decoding_max_spec_factor (1.0), suffix_decoding_min_token_prob (0.1), "
        "disable_by_batch_size (8: no drafts while more sequences run; "
        "0 = never); a request whose "
        "drafts do not pay pauses its drafting; see docs/speculative.md",
        kind=str, default_text="off")
    # Bounded waiting queue (0 = unbounded); beyond it add() raises QueueFullError.
    max_num_queued_reqs: int = option(0, "waiting requests before 429, 0 = unbounded")
    max_num_queued_tokens: int = option(0, "waiting prompt tokens before 429, 0 = unbounded")
    policy: Literal["fcfs", "priority"] = option(
        "fcfs", "the waiting queue's order; priority takes requests' `priority` field (lower "
        "first, as vLLM)", flag="--scheduling-policy", choices=("fcfs", "priority"))

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.decode_step_prefill_tokens < 0:
            raise ValueError("decode_step_prefill_tokens must be >= 0")
        if self.decode_step_prefill_tokens_per_seq < 0:
            raise ValueError("decode_step_prefill_tokens_per_seq must be >= 0")
        if not 0 <= self.target_itl_ms < float("inf"):
            raise ValueError("target_itl_ms must be >= 0 and finite")
        if not 1 <= self.prefill_stretch < float("inf"):
            raise ValueError("prefill_stretch must be >= 1 and finite")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError("policy must be 'fcfs' or 'priority'")
        parse_speculative_config(self.speculative_config)  # a ValueError naming the field

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed --speculative-config; None when speculation is off."""
        return parse_speculative_config(self.speculative_config)

    def decode_step_prefill_cap(self, num_decoding: int) -> int:
        """Prompt tokens a step may take while num_decoding sequences decode; 0 = no cap
        beyond the step budget (the cap is off, or nothing decodes)."""
        if not self.decode_step_prefill_tokens or num_decoding == 0:
            return 0
        return max(self.decode_step_prefill_tokens,
                   self.decode_step_prefill_tokens_per_seq * num_decoding)

    @property
    def prefill_chunk_cap(self) -> int:
        t = self.long_prefill_token_threshold
        return min(t, self.max_num_batched_tokens) if t > 0 else self.max_num_batched_tokens
