"""Routing policies of the simulation: round-robin, power-of-two, prefix-aware.

Load is a replica's in-flight requests (running + waiting), what Ray Serve's routers compare.

Prefix-aware keeps, like Ray's PrefixCacheAffinityRouter, its own record of what it sent
where (it cannot see the replicas' caches): per replica the chained block hashes of the
prompts routed there, least recently routed dropped beyond the replica's KV pool size (what
the replica can hold at most). A request goes to the replica whose record matches the longest
run of its leading blocks (ties: the less loaded), if that run covers at least
`min_match` of the prompt and the replica is not overloaded, i.e. its in-flight requests do
not exceed the least loaded replica's by more than `imbalance_threshold`. Otherwise: the less
loaded of two random replicas, whose record then takes the prompt.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import Protocol

from benchmarks.sim_replica import SimReplica
from scheduler.block_manager import block_hash

POLICIES = ("prefix-aware", "power-of-two", "round-robin")


class Router(Protocol):
    def choose(self, prompt: Seq[int], replicas: Seq[SimReplica]) -> int: ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, prompt: Seq[int], replicas: Seq[SimReplica]) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


class PowerOfTwo:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, prompt: Seq[int], replicas: Seq[SimReplica]) -> int:
        return less_loaded_of_two(self.rng, replicas)


def less_loaded_of_two(rng: random.Random, replicas: Seq[SimReplica]) -> int:
    if len(replicas) == 1:
        return 0
    a, b = rng.sample(range(len(replicas)), 2)
    return b if replicas[b].in_flight < replicas[a].in_flight else a


class PrefixAware:
    def __init__(self, rng: random.Random, block_size: int, capacity_blocks: int,
                 imbalance_threshold: int = 8, min_match: float = 0.1) -> None:
        self.rng = rng
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.imbalance_threshold = imbalance_threshold
        self.min_match = min_match
        self._held: list[OrderedDict[int, None]] = []  # per replica: hashes, oldest first
        self._where: dict[int, set[int]] = {}  # hash -> replicas whose record holds it
        self.num_affinity = 0  # requests sent to their prefix's replica
        self.num_overloaded = 0  # requests whose prefix replica was overloaded

    def choose(self, prompt: Seq[int], replicas: Seq[SimReplica]) -> int:
        while len(self._held) < len(replicas):
            self._held.append(OrderedDict())
        hashes = self._hashes(prompt)
        chosen = self._preferred(hashes, len(prompt), replicas)
        if chosen is None:
            chosen = less_loaded_of_two(self.rng, replicas)
        else:
            self.num_affinity += 1
        self._record(chosen, hashes)
        return chosen

    def _preferred(self, hashes: list[int], prompt_len: int, replicas: Seq[SimReplica]
                   ) -> int | None:
        matched, depth = self._longest_match(hashes)
        if not matched or depth * self.block_size < self.min_match * prompt_len:
            return None
        best = min(matched, key=lambda i: (replicas[i].in_flight, i))
        least = min(r.in_flight for r in replicas)
        if replicas[best].in_flight - least > self.imbalance_threshold:
            self.num_overloaded += 1
            return None
        return best

    def _longest_match(self, hashes: list[int]) -> tuple[set[int], int]:
        """Replicas whose record holds the longest leading run of `hashes`, and its length."""
        matched: set[int] = set()
        depth = 0
        for h in hashes:
            holders = self._where.get(h, set())
            narrowed = holders if depth == 0 else matched & holders
            if not narrowed:
                break
            matched, depth = narrowed, depth + 1
        return matched, depth

    def _hashes(self, prompt: Seq[int]) -> list[int]:
        out: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range(len(prompt) // bs):
            parent = block_hash(parent, tuple(prompt[i * bs:(i + 1) * bs]))
            out.append(parent)
        return out

    def _record(self, replica: int, hashes: list[int]) -> None:
        held = self._held[replica]
        for h in hashes:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                self._where.setdefault(h, set()).add(replica)
        while len(held) > self.capacity:
            old, _ = held.popitem(last=False)
            holders = self._where[old]
            holders.discard(replica)
            if not holders:
                del self._where[old]


def make_router(policy: str, seed: int, block_size: int, capacity_blocks: int,
                imbalance_threshold: int) -> Router:
    rng = random.Random(seed)
    if policy == "round-robin":
        return RoundRobin()
    if policy == "power-of-two":
        return PowerOfTwo(rng)
    if policy == "prefix-aware":
        return PrefixAware(rng, block_size, capacity_blocks, imbalance_threshold)
    raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}")
