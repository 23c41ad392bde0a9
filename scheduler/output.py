"""SchedulerOutput: the plain-data plan of one engine step.

The runner reads, for scheduled sequence i with n = num_scheduled_tokens[i] and
c = seqs[i].num_computed_tokens (not yet advanced: postprocess() does that):
    input tokens   seqs[i].token_ids[c : c + n]
    positions      c .. c + n - 1
    KV slots       block_table[p // block_size] * block_size + p % block_size for each position p
    context length c + n (the query attends to every cached token before it)
and samples one token for the sequence iff c + n == seqs[i].num_tokens.

A speculating sequence (scheduler/speculative.py) is a decode with drafts: its input tokens
are its pending token then draft_token_ids[seq_id] (n = 1 + drafts), and the runner returns
the model's greedy token at each of the n positions instead of one sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # parallel to seqs
    preempted_ids: list[str] = field(default_factory=list)  # preempted during this schedule()
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # speculating seqs

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def samples(self, i: int) -> bool:
        """Whether scheduled sequence i reaches the end of its tokens this step (and so samples)."""
        seq = self.seqs[i]
        drafts = self.draft_token_ids.get(seq.seq_id, ())
        return seq.num_computed_tokens + self.num_scheduled_tokens[i] == seq.num_tokens + len(drafts)

    def input_token_ids(self, i: int) -> list[int]:
        """Scheduled sequence i's input tokens this step (its drafts after its own tokens)."""
        seq, n = self.seqs[i], self.num_scheduled_tokens[i]
        c = seq.num_computed_tokens
        drafts = self.draft_token_ids.get(seq.seq_id)
        return seq.token_ids[c:c + n] if drafts is None else seq.token_ids[c:] + drafts
