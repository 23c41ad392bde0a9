"""DrainRate (the engine's finish rate) and the Retry-After the API derives from it."""

from __future__ import annotations

from api.errors import MAX_RETRY_S, MIN_RETRY_S, UNKNOWN_RETRY_S, retry_after_s
from engine.core.drain import DrainRate
from engine.protocol import EngineStats


def retry(rate: float | None, waiting: int) -> int:
    return retry_after_s(EngineStats(num_waiting=waiting, finish_rate=rate))


def test_no_history_gives_the_fallback() -> None:
    d = DrainRate()
    assert d.rate(100.0) is None
    assert retry(d.rate(100.0), 10) == UNKNOWN_RETRY_S
    d.record(100.0, 1)  # one finish is not a rate
    assert d.rate(100.5) is None


def test_queue_over_rate_rounded_up_and_clamped() -> None:
    d = DrainRate(window_s=30)
    for t in range(11):  # 2 requests per second for 10 s (the first batch opens the window)
        d.record(100.0 + t, 2)
    rate = d.rate(110.0)
    assert rate == 22 / 10
    assert retry(rate, 5) == 3  # 5 / 2.2 = 2.27 -> 3
    assert retry(rate, 0) == MIN_RETRY_S
    assert retry(rate, 10_000) == MAX_RETRY_S


def test_old_finishes_leave_the_window() -> None:
    d = DrainRate(window_s=5)
    d.record(0.0, 50)
    d.record(1.0, 50)
    assert d.rate(2.0) == 100 / 2
    d.record(20.0, 0)  # both are now older than the window
    assert d.rate(20.0) is None
