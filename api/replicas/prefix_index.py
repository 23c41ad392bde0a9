"""PrefixIndex: which replica most recently took each prompt prefix, so the prefix-aware
router can send a request where its prefix is likely still in the KV cache.

Keys are chained hashes of full blocks of prompt tokens, as the engine's prefix cache keys
its blocks (a block's hash covers every token before it), so "the deepest block of this
prompt found in the index" is the longest prefix some replica was given. Bounded (LRU):
what a replica has evicted since is a guess the index cannot see, and a stale entry only
costs one cache miss. Pure Python, no Ray: tested on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_CAPACITY = 200_000  # blocks remembered (a few MB)


class PrefixIndex:
    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError("block_size and capacity must be >= 1")
        self.block_size = block_size
        self._capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash -> replica, LRU order

    def __len__(self) -> int:
        return len(self._owner)

    def hashes(self, prompt: Sequence[int]) -> list[int]:
        """Chained hashes of the prompt's full blocks (a partial last block is not cached)."""
        out: list[int] = []
        parent = 0
        bs = self.block_size
        for start in range(0, len(prompt) - bs + 1, bs):
            parent = hash((parent, tuple(prompt[start:start + bs])))
            out.append(parent)
        return out

    def lookup(self, prompt: Sequence[int], candidates: Iterable[str]) -> tuple[str | None, int]:
        """(the candidate holding the longest prefix of `prompt`, its length in blocks);
        (None, 0) when no candidate holds any full block of it."""
        allowed = set(candidates)
        best: tuple[str | None, int] = (None, 0)
        for depth, h in enumerate(self.hashes(prompt), start=1):
            owner = self._owner.get(h)
            if owner is None:
                break  # a deeper block cannot be cached without this one
            if owner in allowed:
                best = (owner, depth)
        return best

    def record(self, prompt: Sequence[int], replica: str) -> None:
        """`replica` was given `prompt`: its blocks are (about to be) in that replica's cache."""
        for h in self.hashes(prompt):
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self._capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica died or left: its cache is gone."""
        for h in [h for h, owner in self._owner.items() if owner == replica]:
            del self._owner[h]
