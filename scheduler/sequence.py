"""Sequence: one request's tokens and its progress through the engine.

There are no prefill/decode phases: `num_computed_tokens` (tokens whose K/V sit in the
cache) chases `num_tokens` (prompt + generated). A step schedules some of the missing
tokens; when a step brings computed up to total, the model samples one new token.
Chunked prefill, prefix-cache hits and recompute after preemption all reduce to moving
`num_computed_tokens`.
"""

from __future__ import annotations

import enum
import time

from scheduler.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 3  # max_tokens or max_model_len
    FINISHED_ABORTED = 4  # client gone, or aborted by the server

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """Mutable per-request state owned by the scheduler (the engine only reads it)."""

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.seq_id = seq_id
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # The most tokens ever computed: unlike num_computed_tokens it survives preemption, so
        # the runner reports each prompt position's logprob once across a recompute. Kept by
        # the num_computed_tokens setter, so every writer maintains it without knowing.
        self.max_num_computed_tokens = 0
        self._num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (first admission)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that hit
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # A structured-output request waits (in `waiting`) until the engine has compiled its
        # grammar: the scheduler does not admit it before Scheduler.grammar_ready().
        self.waiting_for_grammar = params.structured_outputs is not None

    @property
    def num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        self._num_computed_tokens = n
        self.max_num_computed_tokens = max(self.max_num_computed_tokens, n)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
