"""SchedulerOutput: the plain-data plan of one engine step.

The runner reads, for scheduled sequence i with n = num_scheduled_tokens[i] and
c = seqs[i].num_computed_tokens (not yet advanced: postprocess() does that):
    input tokens   seqs[i].token_ids[c : c + n]
    positions      c .. c + n - 1
    KV slots       block_table[p // block_size] * block_size + p % block_size for each position p
    context length c + n (the query attends to every cached token before it)
and samples one token for the sequence iff c + n == seqs[i].num_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # parallel to seqs
    preempted_ids: list[str] = field(default_factory=list)  # preempted during this schedule()

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def samples(self, i: int) -> bool:
        """Whether scheduled sequence i reaches the end of its tokens this step (and so samples)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_scheduled_tokens[i] == seq.num_tokens
