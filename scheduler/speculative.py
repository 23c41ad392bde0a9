"""Speculative decoding's scheduler side: the `--speculative-config` JSON, which requests may
speculate, the proposers' common part (their switch-off), the n-gram proposer (prompt lookup),
and the counters. The suffix method is scheduler/suffix_decoding.py.

A draft model costs a forward; an n-gram proposer costs a dictionary lookup. It proposes
the tokens that followed the last occurrence of the sequence's newest n tokens in its own
prompt and output: for rewriting, summarising or answering over a given text, editing code,
most output tokens continue some run of the prompt. The engine then scores the sequence's
pending token and the k drafts in one forward (a k + 1 token query over the paged KV cache),
samples every position as decoding would (the same uniform for the same output position),
and keeps the drafts that equal the token drawn at their position, plus the token drawn
after the last one kept (engine/worker/model_runner.py `verify`). Greedy or seeded, the
output is token for token what decoding one token a step gives; unseeded, it follows the
model's distribution exactly (a draft is kept with probability p(draft), and a rejected
position draws from the rest: rejection sampling's rule for a deterministic proposer).

Before min_tokens a sequence speculates only in runs that end short of it (its stop tokens
are banned at every position of such a run, and no stop string is looked for in it); the
token that opens the gate is decoded alone, as it is without drafts, so stop tokens and
strings count from exactly where they would. Every request may speculate: a position's logprobs come from its own logits; penalties
count the drafts before the position as output (engine/sample/penalty_state.py), as
decoding would have counted them had they been drawn; grammars cut the drafts at the first
the grammar refuses (Scheduler.draft_filter) and mask each position with the grammar's state
after the drafts before it (engine/structured_output/manager.py `fill`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from scheduler import stop_policy
from scheduler.sequence import Sequence

METHODS = ("ngram", "suffix")
_FLOAT_FIELDS = {"suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}
_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
           "disable_by_batch_size", "suffix_decoding_max_tree_depth",
           "suffix_decoding_max_cached_requests"} | _FLOAT_FIELDS
MAX_SPECULATIVE_TOKENS = 32
# At most this many earlier occurrences of the newest prompt_lookup_min tokens are compared
# backwards for a longer match: the cost per step stays bounded on repetitive text.
MAX_CANDIDATES = 8
DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX = 2, 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` fields for model-free methods. `disable_by_batch_size`:
    no drafts while more sequences than this run (a wide step is compute-bound, and extra
    query tokens per row cost more than they save); 0 = never disabled. The suffix_decoding_
    fields are the suffix method's (scheduler/suffix_decoding.py): how long a context it
    matches, how many finished requests' outputs it keeps, drafts of at most factor x the
    match length, and the lowest estimated probability a draft may reach."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    disable_by_batch_size: int = 8
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported "
                             f"(supported: {', '.join(METHODS)})")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_config: num_speculative_tokens must be in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max")
        if self.disable_by_batch_size < 0:
            raise ValueError("speculative_config: disable_by_batch_size must be >= 0")
        if self.suffix_decoding_max_tree_depth < 2:
            raise ValueError("speculative_config: suffix_decoding_max_tree_depth must be >= 2")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config: suffix_decoding_max_cached_requests must be "
                             ">= 0")
        if not 0 < self.suffix_decoding_max_spec_factor < float("inf"):
            raise ValueError("speculative_config: suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config: suffix_decoding_min_token_prob must be in "
                             "[0, 1]")


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The `--speculative-config` JSON object -> its config; None or "" -> None (off). A
    ValueError names what is wrong."""
    if not text:
        return None
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("speculative_config must be a JSON object")  # noqa: TRY004 - a bad flag value
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(_FIELDS))})")
    for key, value in raw.items():
        number = (int, float) if key in _FLOAT_FIELDS else int
        if key != "method" and (not isinstance(value, number) or isinstance(value, bool)):
            kind = "a number" if key in _FLOAT_FIELDS else "an integer"
            raise ValueError(f"speculative_config: {key} must be {kind}")
    if "prompt_lookup_min" in raw and "prompt_lookup_max" not in raw:
        raw["prompt_lookup_max"] = max(raw["prompt_lookup_min"], DEFAULT_LOOKUP_MAX)
    if "prompt_lookup_max" in raw and "prompt_lookup_min" not in raw:
        raw["prompt_lookup_min"] = min(raw["prompt_lookup_max"], DEFAULT_LOOKUP_MIN)
    return SpeculativeConfig(**raw)


def draft_room(seq: Sequence) -> int:
    """How many drafts seq's next step may carry as far as its own tokens go (see the
    module's docstring): before min_tokens, a run must end a token short of the gate."""
    p = seq.params
    room = p.max_tokens - seq.num_output_tokens - 1
    if not stop_policy.may_stop(seq):
        room = min(room, p.min_tokens - seq.num_output_tokens - 2)
    return room


class NgramIndex:
    """Where each n-gram of one sequence's tokens ends, kept up to date as tokens arrive.

    Keyed by the sequence's first-n tokens for n = prompt_lookup_min; a lookup extends each
    recent candidate backwards up to prompt_lookup_max and takes the longest match (the most
    recent among equals)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # token_ids[:_indexed] are in _ends

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the best earlier match of token_ids' newest n-gram."""
        n = len(token_ids)
        # Index every n-gram ending before the newest token: the newest n-gram itself must not
        # match itself (it has no continuation yet).
        for end in range(max(self._indexed, self.min_n), n):
            self._ends.setdefault(tuple(token_ids[end - self.min_n:end]), []).append(end)
        self._indexed = max(self._indexed, n)
        if n <= self.min_n:
            return []
        ends = self._ends.get(tuple(token_ids[n - self.min_n:]))
        if not ends:
            return []
        best_end, best_len = -1, 0
        for end in reversed(ends[-MAX_CANDIDATES:]):
            length = self.min_n
            while (length < self.max_n and end - length - 1 >= 0
                   and token_ids[end - length - 1] == token_ids[n - length - 1]):
                length += 1
            if length > best_len:
                best_end, best_len = end, length
        return token_ids[best_end:best_end + k]


# What verifying k drafts costs, in decode steps of one sequence: measured with the embedded
# SmolLM2-135M (its GGUF's int4 weights, bf16) on the 2-core box (docs/speculative.md), a
# row of 1 + k tokens took about 1.3 + 0.2 k decode steps (13.7 ms for k = 2, 20 ms for
# k = 4, against 9.5 ms): the int4 kernels' cost grows with the rows. A draft pays when its
# kept tokens exceed that cost's excess over one step.
VERIFY_FIXED, VERIFY_PER_DRAFT = 0.3, 0.2
# The acceptance a sequence is judged by: an exponential average of its kept drafts per draft.
ACCEPT_EMA = 0.3
PAUSE_STEPS, MAX_PAUSE_STEPS = 8, 256


def break_even(num_drafts: int) -> float:
    """Kept drafts per draft below which drafting costs more than it saves."""
    return VERIFY_FIXED + VERIFY_PER_DRAFT * num_drafts


class _Track:
    """How one sequence's drafts do: the average kept, and its pause."""

    __slots__ = ("accepted", "pause", "wait")

    def __init__(self, k: int) -> None:
        self.accepted = break_even(k) + 1  # a little optimistic until its drafts say otherwise
        self.pause = PAUSE_STEPS  # steps without drafts the next time acceptance is low
        self.wait = 0  # steps left without drafts


class Proposer(ABC):
    """Drafts for the running sequences that may speculate; a method fills in `_draft`.

    It switches itself off for a sequence whose drafts do not pay: when the average of its
    kept drafts falls below break_even(), it proposes nothing for a pause, then tries again;
    the pause doubles each time (up to MAX_PAUSE_STEPS) and halves after a draft that paid.
    Free generation thus costs a probe now and then, and a request that turns to copying
    (a quoted passage, a repeated list) gets its drafts back within a pause."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._tracks: dict[str, _Track] = {}

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) drafts following seq's tokens ([] when none match, or
        while seq's drafting is paused)."""
        k = min(self.config.num_speculative_tokens, max_tokens)
        track = self._track(seq.seq_id)
        if track.wait > 0:
            track.wait -= 1
            return []
        return self._draft(seq, k) if k > 0 else []

    @abstractmethod
    def _draft(self, seq: Sequence, k: int) -> list[int]:
        """Up to k drafts following seq's tokens (k >= 1)."""

    def observe(self, seq_id: str, num_drafts: int, num_accepted: int) -> None:
        """How seq_id's last draft did: it may pause seq_id's drafting (see the class)."""
        track = self._track(seq_id)
        if num_accepted >= break_even(num_drafts):
            track.pause = max(PAUSE_STEPS, track.pause // 2)
        track.accepted += ACCEPT_EMA * (num_accepted - track.accepted)
        if track.accepted < break_even(num_drafts):
            track.wait = track.pause
            track.pause = min(2 * track.pause, MAX_PAUSE_STEPS)
            track.accepted = break_even(num_drafts)  # one draft after the pause decides

    def finish(self, seq: Sequence) -> None:
        """seq has finished (or was aborted): forget it."""
        self._tracks.pop(seq.seq_id, None)

    def _track(self, seq_id: str) -> _Track:
        track = self._tracks.get(seq_id)
        if track is None:
            track = self._tracks[seq_id] = _Track(self.config.num_speculative_tokens)
        return track


class NgramProposer(Proposer):
    """Prompt lookup: each sequence's n-gram index over its own tokens (NgramIndex)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self._indexes: dict[str, NgramIndex] = {}

    def _draft(self, seq: Sequence, k: int) -> list[int]:
        index = self._indexes.get(seq.seq_id)
        if index is None:
            cfg = self.config
            index = self._indexes[seq.seq_id] = NgramIndex(cfg.prompt_lookup_min,
                                                           cfg.prompt_lookup_max)
        return index.propose(seq.token_ids, k)

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        self._indexes.pop(seq.seq_id, None)


class SpecDecodeStats:
    """Counters under vLLM's metric names (spec_decode_num_drafts_total, ..._draft_tokens_,
    ..._accepted_tokens_, ..._accepted_tokens_per_pos): a draft is one sequence's drafts in
    one step; position i counts the drafts whose token i was kept."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating step yields per sequence on average (kept drafts + 1), as
        vLLM's log line reports it; 0.0 before the first draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
