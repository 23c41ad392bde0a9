"""What crosses Ray between ingress and replicas: refusals come back as the same typed errors
(which the API maps to 400/429/503), across a pickle round trip; replica stats add up."""

from __future__ import annotations

import pickle

import pytest

from api.replicas.client import sum_stats
from api.replicas.collector import ReplicaCollector
from engine.protocol import (
    EngineDeadError,
    EngineStats,
    InvalidParamError,
    PromptTooLongError,
    QueueFullError,
)
from engine.replicas.board import STALE_AFTER_S, ReplicaBoard
from engine.replicas.messages import Refusal, ReplicaReport, refusal_of


@pytest.mark.parametrize("error", [
    PromptTooLongError("too long"), QueueFullError("full", "max_num_queued_tokens"),
    InvalidParamError("logit_bias", "bad token"), EngineDeadError("dead")])
def test_refusals_rebuild_the_typed_error(error: Exception) -> None:
    refusal = refusal_of(error)
    assert refusal is not None
    back = pickle.loads(pickle.dumps(refusal)).error()
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "param", None) == getattr(error, "param", None)
    assert getattr(back, "limit", None) == getattr(error, "limit", None)


def test_a_bug_is_not_a_refusal() -> None:
    assert refusal_of(RuntimeError("boom")) is None
    assert isinstance(Refusal("engine_dead", "x").error(), EngineDeadError)


def report(replica: str, sent_at: float, **stats: object) -> ReplicaReport:
    return ReplicaReport(replica, "tiny", f"actor#{replica}", True,
                         EngineStats(**stats), None, sent_at)  # type: ignore[arg-type]


def test_stats_add_up_across_replicas() -> None:
    a = EngineStats(num_running=2, num_waiting=1, num_kv_blocks=10, num_free_kv_blocks=4,
                    finish_rate=1.5, iteration_tokens=(1, 2), iteration_tokens_sum=7,
                    cache_dtype="float32", enable_prefix_caching=True,
                    memory=(("kv_pool", 100), ("resident", 1000)), spec_num_drafts=3,
                    spec_accepted_per_pos=(3, 1))
    b = EngineStats(num_running=1, num_kv_blocks=10, num_free_kv_blocks=10,
                    iteration_tokens=(3, 4), cache_dtype="float32", enable_prefix_caching=True,
                    memory=(("kv_pool", 100), ("resident", 900)), spec_num_drafts=2,
                    spec_accepted_per_pos=(2, 2))
    total = sum_stats([a, b])
    assert (total.num_running, total.num_waiting, total.num_kv_blocks,
            total.num_free_kv_blocks) == (3, 1, 20, 14)
    assert total.finish_rate == 1.5 and total.iteration_tokens == (4, 6)
    assert total.cache_dtype == "float32" and total.enable_prefix_caching
    assert total.memory == (("kv_pool", 200), ("resident", 1900))  # bytes add up by kind
    assert total.spec_num_drafts == 5 and total.spec_accepted_per_pos == (5, 3)
    assert sum_stats([]) == EngineStats()


def test_board_drops_replicas_that_stopped_reporting() -> None:
    board = ReplicaBoard()
    board.post(report("b", 100.0))
    board.post(report("a", 100.0 + STALE_AFTER_S))
    assert [r.replica for r in board.fresh(now=100.0 + STALE_AFTER_S)] == ["a", "b"]
    assert [r.replica for r in board.fresh(now=100.1 + STALE_AFTER_S)] == ["a"]
    board.remove("a")
    assert board.fresh(now=0.0) == []


class FakeClient:
    limits = None

    def __init__(self, reports: list[ReplicaReport]) -> None:
        self._reports = reports

    def reports(self) -> list[ReplicaReport]:
        return self._reports

    def stats(self) -> EngineStats:
        return sum_stats([r.stats for r in self._reports])


def test_metrics_have_one_row_per_replica() -> None:
    client = FakeClient([report("r1", 0, num_running=2, prefix_cache_hits=5),
                         report("r2", 0, num_running=1)])
    families = {f.name: f for f in ReplicaCollector(client, "pagedserve", "tiny").collect()}  # type: ignore[arg-type]
    running = families["pagedserve:num_requests_running"].samples
    assert [(s.labels, s.value) for s in running] == [
        ({"model_name": "tiny", "replica": "r1"}, 2), ({"model_name": "tiny", "replica": "r2"}, 1)]
    hits = families["pagedserve:prefix_cache_hits"].samples
    assert {s.labels["replica"]: s.value for s in hits if s.name.endswith("_total")} == {
        "r1": 5, "r2": 0}
