r"""BlockManager: the KV block pool, per-sequence block tables and automatic prefix caching.

Blocks, slots and computed tokens (block_size = 4, one sequence of 10 tokens, 7 computed):

    token index   0  1  2  3 | 4  5  6  7 | 8  9
    block_table   [   7      |    2       |  5    ]     <- block ids, any order in the pool
    slot          28 29 30 31| 8  9 10 11 | 20 21       <- block_table[i // 4] * 4 + i % 4
    computed      x  x  x  x | x  x  x  . | .  .        <- num_computed_tokens = 7
                  \_ full, computed: published  \_ not full or not computed: private
                     under hash(None, ids[0:4])

A block becomes shareable only once it is full and all its tokens are computed. Its key is a
chained hash (parent block's hash + its own token ids); each published block also remembers
its token ids and the cache id of its parent, and a lookup checks both, so neither a hash
collision nor a stale parent can produce a false hit. Freed blocks keep their key and stay
reusable until a fresh block is needed; then the least recently freed block is evicted.

Sliding windows: when every layer of the model sees only its last `window` tokens (Mistral
v0.1), blocks that fall wholly before any future query's window are released while the
sequence runs (`release_out_of_window`); their table entries become NULL_BLOCK, always a
prefix of the table, so positions still map to `block_table[i // block_size]`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from scheduler.sequence import Sequence

NULL_BLOCK = -1  # a released out-of-window entry of a block table (a prefix of it)


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained key of a full block (module level so tests can make it collide)."""
    return hash((parent, token_ids))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while published in the prefix cache
    token_ids: tuple[int, ...] = ()  # the block's tokens, compared on every hit
    cache_id: int = 0  # unique per publication; 0 = not published
    parent_cache_id: int = 0  # cache_id of the previous block when this one was published


class BlockManager:
    """Owns the block pool. Every mutation keeps `check_invariants()` true."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first (never-used blocks come first).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> published block id
        self._owners: dict[str, Sequence] = {}  # sequences holding a non-empty block table
        self._cache_ids = itertools.count(1)
        self.prefix_cache_queries = 0  # tokens looked up at admission (vLLM's metric)
        self.prefix_cache_hits = 0  # of those, tokens served from the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def caches(self, seq: Sequence) -> bool:
        """Whether seq may take prefix hits (prompt logprobs need logits at every position)."""
        return self.enable_prefix_caching and seq.params.prompt_logprobs is None

    # -- lookup ------------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Published blocks matching seq's leading full blocks. Pure lookup, no mutation.

        At most (num_tokens - 1) // block_size blocks: the last token is always computed so
        the model produces logits to sample from."""
        if not self.caches(seq) or seq.block_table:
            return []
        hits: list[int] = []
        parent: int | None = None
        parent_cache_id = 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            ids = self._block_tokens(seq, i)
            parent = block_hash(parent, ids)
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != ids or block.parent_cache_id != parent_cache_id:
                break  # hash collision or a parent that was evicted and replaced
            hits.append(block_id)
            parent_cache_id = block.cache_id
        return hits

    # -- allocation --------------------------------------------------------------------------

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, computed: Seq[int] = ()) -> int:
        """Fresh blocks required so positions up to computed + num_new_tokens have slots."""
        end = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        have = len(seq.block_table) + len(computed)
        return max(0, -(-end // self.block_size) - have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: Seq[int] = ()) -> bool:
        # Hit blocks nobody holds sit in the free queue: taking them uses up free blocks too.
        idle_hits = sum(1 for b in computed if self.blocks[b].ref_count == 0)
        return self.num_blocks_needed(seq, num_new_tokens, computed) + idle_hits <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, computed: Seq[int] = ()) -> None:
        """Reserve slots for seq's next num_new_tokens tokens, first taking `computed` hit
        blocks (from get_computed_blocks) when seq is being admitted. The caller advances
        seq.num_computed_tokens by the hit tokens. Call can_allocate first."""
        if not self.can_allocate(seq, num_new_tokens, computed):
            raise RuntimeError(f"allocate without room: {seq!r} needs {num_new_tokens} tokens")
        needed = self.num_blocks_needed(seq, num_new_tokens, computed)
        if not seq.block_table:
            self._record_lookup(seq, len(computed))
        for block_id in computed:  # before fresh blocks, so eviction cannot take a hit
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(self.blocks[block_id].hash)  # type: ignore[arg-type]
        seq.block_table.extend(self._fresh_block() for _ in range(needed))
        if seq.block_table:
            self._owners[seq.seq_id] = seq

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Published ones stay cached until evicted; tail blocks are
        released first so they are evicted before the shared prefix."""
        for block_id in reversed(seq.block_table):
            if block_id == NULL_BLOCK:
                break  # released already: the rest of the table before it is NULL too
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
        self._owners.pop(seq.seq_id, None)

    def release_out_of_window(self, seq: Sequence, window: int) -> int:
        """Release seq's blocks that no future query can see when every layer attends only
        to its last `window` tokens (call after advancing computed and publishing). The next
        query sits at num_computed_tokens and sees positions >= num_computed_tokens - window
        + 1, so a block ending before that is dead. The block at len(block_hashes) - 1 is
        kept: cache_full_blocks reads it as the parent of the next block it publishes.
        Released published blocks stay in the prefix cache, but, freed before the sequence's
        tail, they are the first evicted under pressure. Returns how many it released."""
        dead = max(0, seq.num_computed_tokens - window + 1) // self.block_size
        if self.enable_prefix_caching:
            dead = min(dead, len(seq.block_hashes) - 1)
        start = dead  # the NULL entries are a prefix: only the run just before `dead` is new
        while start > 0 and seq.block_table[start - 1] != NULL_BLOCK:
            start -= 1
        released = 0
        for i in range(start, dead):
            block_id = seq.block_table[i]
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
            seq.block_table[i] = NULL_BLOCK
            released += 1
        if released and all(b == NULL_BLOCK for b in seq.block_table):
            self._owners.pop(seq.seq_id, None)  # holds nothing (window 1, no prefix caching)
        return released

    # -- publishing --------------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish seq's blocks that are full and computed (call after advancing computed)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[i - 1] if i > 0 else None
            ids = self._block_tokens(seq, i)
            h = block_hash(parent, ids)
            seq.block_hashes.append(h)
            # Never NULL: release_out_of_window keeps the block at len(block_hashes) - 1.
            parent_block = self.blocks[seq.block_table[i - 1]] if i > 0 else None
            # A duplicate (same content computed twice) or a collision stays private, and so
            # do its descendants: a lookup walk can never reach them.
            if h in self._cached or (parent_block is not None and parent_block.cache_id == 0):
                continue
            self._publish(self.blocks[seq.block_table[i]], h, ids, parent_block)

    # -- internals ---------------------------------------------------------------------------

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _publish(self, block: Block, h: int, ids: tuple[int, ...], parent: Block | None) -> None:
        block.hash, block.token_ids = h, ids
        block.cache_id = next(self._cache_ids)
        block.parent_cache_id = parent.cache_id if parent is not None else 0
        self._cached[h] = block.block_id

    def _record_lookup(self, seq: Sequence, num_hit_blocks: int) -> None:
        if self.caches(seq):
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _fresh_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: least recently freed published block
            del self._cached[block.hash]
            block.hash, block.token_ids, block.cache_id, block.parent_cache_id = None, (), 0, 0
        block.ref_count = 1
        return block_id

    def block_states(self) -> str:
        """Each block's state, by id, one character each: "2" in a block table, "1" free but
        holding a published prefix (reusable), "0" free and empty (the live view's grid)."""
        return "".join("2" if b.ref_count else "1" if b.hash is not None else "0"
                       for b in self.blocks)

    def check_invariants(self) -> None:
        """Raise AssertionError with details if the pool's bookkeeping is inconsistent."""
        refs = self._count_refs()
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {refs[block.block_id]} block tables")
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: ref_count {block.ref_count}, in free queue: "
                f"{block.block_id in self._free}")
            if block.hash is not None:
                assert self._cached.get(block.hash) == block.block_id, f"unmapped {block}"
                assert block.cache_id > 0 and len(block.token_ids) == self.block_size, block
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].hash == h, f"hash map entry {h} -> {block_id} is stale"
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used + len(self._free) == self.num_blocks, (
            f"free {len(self._free)} + used {used} != total {self.num_blocks}")

    def _count_refs(self) -> list[int]:
        """How many block tables hold each block, checking each table on the way."""
        refs = [0] * self.num_blocks
        for seq in self._owners.values():
            held = [b for b in seq.block_table if b != NULL_BLOCK]
            assert held, f"owner {seq!r} holds no blocks"
            assert seq.block_table[-len(held):] == held, f"NULL past a held block: {seq!r}"
            assert len(set(held)) == len(held), f"repeated block: {seq!r}"
            assert len(seq.block_hashes) <= len(seq.block_table), f"hashes > blocks: {seq!r}"
            for block_id in held:
                refs[block_id] += 1
        return refs
