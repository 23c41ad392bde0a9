"""/metrics with a row per engine replica: the same `pagedserve:` engine series as a
single-process server, plus a `replica` label (Serve's replica id), read from the replica
reports the ingress keeps (ReplicaClient.reports())."""

from __future__ import annotations

from api.metrics import LABEL, EngineCollector
from api.replicas.client import ReplicaClient
from engine.protocol import EngineStats

REPLICA_LABEL = "replica"


class ReplicaCollector(EngineCollector):
    labels = (LABEL, REPLICA_LABEL)

    def __init__(self, client: ReplicaClient, prefix: str, model_name: str) -> None:
        super().__init__(client, prefix, model_name)
        self._client = client

    def rows(self) -> list[tuple[list[str], EngineStats]]:
        return [([self._model, r.replica], r.stats) for r in self._client.reports()]
