"""ReplicaBoard: the Ray actor where every engine replica posts its state (ReplicaReport), so
the ingress can serve /metrics with a row per replica and answer /health.

Why a board and not a call per scrape: a DeploymentHandle routes each call to one replica
of its choosing; there is no "ask every replica". Each replica pushes instead, and an entry
that stops being refreshed (a dead replica) ages out. The driver (`pagedserve serve`)
creates the board and hands it to both deployments; it lives as long as the driver.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from engine.replicas.messages import ReplicaReport

REPORT_PERIOD_S = 0.25  # how often a replica posts its state
STALE_AFTER_S = 3.0  # a report older than this is a replica that is gone (or stuck)
WATCHED_FOR_S = 2.0  # after the live view's last look, replicas keep adding their snapshot


class ReplicaBoard:
    """Latest report per replica. Runs as a Ray actor (`ray.remote(ReplicaBoard)`); plain
    methods, so a test can use it in-process too."""

    def __init__(self) -> None:
        self._reports: dict[str, ReplicaReport] = {}
        self._watched_until = 0.0

    def post(self, report: ReplicaReport) -> bool:
        """Store the report; True while someone watches the live view (the replica's next
        report then carries its snapshot: nobody watching, nobody builds one)."""
        self._reports[report.replica] = report
        return time.time() < self._watched_until

    def watch(self) -> None:
        """The live view looked (the ingress calls this on each of its looks)."""
        self._watched_until = time.time() + WATCHED_FOR_S

    def remove(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def fresh(self, now: float | None = None) -> list[ReplicaReport]:
        """Reports refreshed within STALE_AFTER_S (older ones are dropped for good), by id."""
        t = time.time() if now is None else now
        for key in [k for k, r in self._reports.items() if t - r.sent_at > STALE_AFTER_S]:
            del self._reports[key]
        return sorted(self._reports.values(), key=lambda r: r.replica)


def create_board(detached_name: str | None = None) -> Any:
    """Start a board actor (no CPU reserved: it only stores a few records). Owned by the
    caller unless `detached_name` is given: then a named actor that outlives it (or the
    existing one of that name)."""
    actor = ray.remote(num_cpus=0)(ReplicaBoard)
    if detached_name is None:
        return actor.remote()
    return actor.options(name=detached_name, lifetime="detached",
                         get_if_exists=True).remote()
