"""DrainRate: the Retry-After estimate of a 429 (queued requests / recent finish rate)."""

from __future__ import annotations

from engine.drain import MAX_RETRY_S, MIN_RETRY_S, UNKNOWN_RETRY_S, DrainRate


def test_no_history_gives_the_fallback() -> None:
    d = DrainRate()
    assert d.rate(100.0) is None
    assert d.retry_after_s(100.0, queued=10) == UNKNOWN_RETRY_S
    d.record(100.0, 1)  # one finish is not a rate
    assert d.retry_after_s(100.5, queued=10) == UNKNOWN_RETRY_S


def test_queue_over_rate_rounded_up_and_clamped() -> None:
    d = DrainRate(window_s=30)
    for t in range(11):  # 2 requests per second for 10 s (the first batch opens the window)
        d.record(100.0 + t, 2)
    assert d.rate(110.0) == 22 / 10
    assert d.retry_after_s(110.0, queued=5) == 3  # 5 / 2.2 = 2.27 -> 3
    assert d.retry_after_s(110.0, queued=0) == MIN_RETRY_S
    assert d.retry_after_s(110.0, queued=10_000) == MAX_RETRY_S


def test_old_finishes_leave_the_window() -> None:
    d = DrainRate(window_s=5)
    d.record(0.0, 50)
    d.record(1.0, 50)
    assert d.rate(2.0) == 100 / 2
    d.record(20.0, 0)  # both are now older than the window
    assert d.rate(20.0) is None
