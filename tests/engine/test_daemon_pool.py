"""DaemonPool (the grammar compile pool): results and errors reach the futures, shutdown
cancels what has not started, and its threads are daemons (a compile that never ends does
not hold up the process's exit: tests/engine/test_reliability.py shows it end to end)."""

from __future__ import annotations

import threading

import pytest

from engine.structured_output.daemon_pool import DaemonPool


def test_results_errors_and_daemon_threads() -> None:
    pool = DaemonPool(2, "t-pool")
    assert pool.submit(lambda a, b: a + b, 2, 3).result(5) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    workers = [t for t in threading.enumerate() if t.name.startswith("t-pool-")]
    assert len(workers) == 2 and all(t.daemon for t in workers)
    pool.shutdown()


def test_shutdown_cancels_queued_jobs_and_refuses_new_ones() -> None:
    pool = DaemonPool(1, "t-busy")
    gate, entered = threading.Event(), threading.Event()

    def hold() -> bool:
        entered.set()
        return gate.wait(5)

    running = pool.submit(hold)
    assert entered.wait(5)
    queued = pool.submit(lambda: "never")
    pool.shutdown()
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: 1).result(5)
    gate.set()
    assert running.result(5) is True
