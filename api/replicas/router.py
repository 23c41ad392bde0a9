"""Request routers for the engine deployment, on Ray Serve's request-router API.

prefix-aware (ours, PrefixAwareRouter): a request goes to the replica that was last given
the longest prefix of its prompt (PrefixIndex), unless that replica is overloaded (its queue
longer than the shortest by more than `imbalance`) or full; then, as when no replica holds
any of it, to the less loaded of two random replicas (power of two choices). A cold prefix's
choice is recorded at once, so its duplicates arriving before it is routed follow it. Ray's own
PrefixCacheAffinityRouter was not used: it matches prompt *text* in a separate actor with
blocking calls on the routing path, and needs `prompt`/`messages` attributes on the request,
while our engine requests carry token ids, which hash exactly as the engine's cache does.

power-of-two is Ray Serve's default router; round-robin is Ray's RoundRobinRouter.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve._private.constants import DEFAULT_REQUEST_ROUTER_PATH
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from api.replicas.prefix_index import DEFAULT_CAPACITY, PrefixIndex

DEFAULT_IMBALANCE = 8  # requests: a preferred replica this far above the least loaded is skipped
POWER_OF_TWO = DEFAULT_REQUEST_ROUTER_PATH  # Ray Serve's default: PowerOfTwoChoicesRequestRouter
ROUND_ROBIN = "ray.serve.experimental.round_robin_router:RoundRobinRouter"


class PrefixAwareRouter(RequestRouter):
    """No FIFOMixin on purpose: with it, a replica chosen for one request's prefix may be
    handed to whichever request waits first; without it each choice serves its own request."""

    def initialize_state(self, block_size: int = 16, imbalance: int = DEFAULT_IMBALANCE,
                         capacity: int = DEFAULT_CAPACITY, **_: Any) -> None:
        self._index = PrefixIndex(block_size, capacity)
        self._imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        prompt = prompt_of(pending_request)
        if prompt is None:
            return [two]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        owner, _ = self._index.lookup(prompt, by_id)
        if owner is None:
            # A cold prefix: the less loaded of the two, recorded now rather than once routed,
            # so its duplicates arriving meanwhile follow it instead of drawing their own pair.
            pick = min(two, key=self._queue_len)
            self._index.record(prompt, pick.replica_id.unique_id)
            return [[pick], two]
        if self._overloaded(by_id[owner], candidate_replicas):
            return [two]
        # Serve tries the ranks in order: the owner first (skipped if its queue is full).
        return [[by_id[owner]], two]

    def _queue_len(self, replica: RunningReplica) -> int:
        """Serve's cached count of requests in flight there (0 when unknown)."""
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    def _overloaded(self, replica: RunningReplica, candidates: list[RunningReplica]) -> bool:
        """From Serve's cached queue lengths; an unknown length is not counted as load."""
        cache = self._replica_queue_len_cache
        mine = cache.get(replica.replica_id)
        if mine is None:
            return False
        lengths = [q for r in candidates if (q := cache.get(r.replica_id)) is not None]
        return mine - min(lengths, default=mine) > self._imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        prompt = prompt_of(pending_request)
        if prompt is not None:
            self._index.record(prompt, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:  # scaled down: its cache went with it
            self._index.forget(replica_id.unique_id)


def prompt_of(pending_request: PendingRequest | None) -> list[int] | None:
    """The token ids of an engine request (GenerateRequest); None for other calls
    (tokenize, chat templates), which any replica serves alike."""
    if pending_request is None or not pending_request.args:
        return None
    prompt = getattr(pending_request.args[0], "prompt", None)
    return prompt if isinstance(prompt, list) else None


def router_class(routing: str) -> str | type[RequestRouter]:
    """The request_router_class for a --routing choice."""
    if routing == "prefix-aware":
        return PrefixAwareRouter
    return POWER_OF_TWO if routing == "power-of-two" else ROUND_ROBIN
