"""Suffix decoding (`"method": "suffix"`): drafts from what followed the sequence's newest
tokens, in its own prompt and output and in the outputs of recent requests.

Suffix decoding (Snowflake's Arctic Inference, in vLLM as the `suffix` method) keeps suffix
trees: one over the request's own tokens, one over finished requests' outputs. It matches the
longest suffix of the request's newest tokens (up to `suffix_decoding_max_tree_depth`), then
walks the most frequent continuation while its estimated probability stays at or above
`suffix_decoding_min_token_prob`, for at most `suffix_decoding_max_spec_factor` x the match
length tokens: a long match earns a long draft. Agent loops that send near-identical calls,
and answers that repeat an earlier answer's shape, are where it pays.

We keep the same statistics without a tree. A `SuffixIndex` lists where each pair of tokens
ends in its sequences. A lookup extends the recent occurrences of the newest pair backwards
to find the longest match. The occurrences of that longest suffix then vote, token by token,
on the continuation. That is the count a suffix-tree node holds, found by scanning a bounded
number of occurrences (MAX_OCCURRENCES) instead of storing every suffix of every sequence.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from scheduler.sequence import Sequence
from scheduler.speculative import Proposer, SpeculativeConfig

ANCHOR = 2  # tokens a match starts from
MAX_OCCURRENCES = 128  # the newest occurrences of the anchor a lookup scans


class SuffixIndex:
    """Token sequences by id, and where each ANCHOR-gram ends in them (a sequence's newest
    position is indexed once a token follows it: until then it has no continuation)."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self._ends: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._indexed: dict[int, int] = {}

    def update(self, sid: int, tokens: list[int]) -> None:
        """Index sid's tokens (a list that may have grown since the last call)."""
        self.seqs[sid] = tokens
        start = max(self._indexed.get(sid, 0), ANCHOR)
        for end in range(start, len(tokens)):
            self._ends.setdefault(tuple(tokens[end - ANCHOR:end]), []).append((sid, end))
        self._indexed[sid] = max(start, len(tokens))

    def remove(self, sid: int) -> None:
        tokens = self.seqs.pop(sid)
        del self._indexed[sid]
        for end in range(ANCHOR, len(tokens)):
            key = tuple(tokens[end - ANCHOR:end])
            left = [o for o in self._ends.get(key, ()) if o[0] != sid]
            if left:
                self._ends[key] = left
            else:
                self._ends.pop(key, None)

    def continuation(self, context: list[int], max_depth: int, max_factor: float,
                     min_prob: float, k: int) -> tuple[list[int], float]:
        """The most frequent continuation of context's longest indexed suffix, and its score
        (the expected number of its tokens kept: the sum of their estimated probabilities)."""
        n = len(context)
        occurrences = self._ends.get(tuple(context[n - ANCHOR:]), []) if n >= ANCHOR else []
        best = 0
        matches: list[tuple[list[int], int]] = []  # (tokens, where the match ends) of the best
        for sid, end in occurrences[-MAX_OCCURRENCES:]:
            tokens = self.seqs[sid]
            length = ANCHOR
            while (length < max_depth and end - length - 1 >= 0 and length < n
                   and tokens[end - length - 1] == context[n - length - 1]):
                length += 1
            if length > best:
                best, matches = length, []
            if length == best:
                matches.append((tokens, end))
        limit = min(k, int(max_factor * best))
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while matches and len(draft) < limit:
            votes = Counter(tokens[end] for tokens, end in matches if end < len(tokens))
            if not votes:
                break
            token, count = votes.most_common(1)[0]
            prob *= count / sum(votes.values())
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            matches = [(tokens, end + 1) for tokens, end in matches
                       if end < len(tokens) and tokens[end] == token]
        return draft, score


class SuffixProposer(Proposer):
    """Suffix decoding over each sequence's own tokens and a bounded cache of finished
    requests' outputs (`suffix_decoding_max_cached_requests`, oldest dropped first): the
    draft with the higher score of the two."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self._own: dict[str, SuffixIndex] = {}
        self._cache = SuffixIndex()
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._next_id = 0

    def _draft(self, seq: Sequence, k: int) -> list[int]:
        own = self._own.get(seq.seq_id)
        if own is None:
            own = self._own[seq.seq_id] = SuffixIndex()
        own.update(0, seq.token_ids)
        cfg = self.config
        args = (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_spec_factor,
                cfg.suffix_decoding_min_token_prob, k)
        mine, mine_score = own.continuation(seq.token_ids, *args)
        theirs, their_score = self._cache.continuation(seq.token_ids, *args)
        return theirs if their_score > mine_score else mine

    def finish(self, seq: Sequence) -> None:
        """Forget seq's own index; keep its output for later requests (aborted ones too:
        what a client left is still text the model wrote)."""
        super().finish(seq)
        self._own.pop(seq.seq_id, None)
        limit = self.config.suffix_decoding_max_cached_requests
        if limit == 0 or seq.num_output_tokens == 0:
            return
        self._cache.update(self._next_id, list(seq.output_token_ids))
        self._cached[self._next_id] = None
        self._next_id += 1
        while len(self._cached) > limit:
            oldest, _ = self._cached.popitem(last=False)
            self._cache.remove(oldest)
