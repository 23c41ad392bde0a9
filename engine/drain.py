"""DrainRate: how fast requests leave the engine, for the Retry-After of a 429.

A client refused because the queue is full should come back about when the requests ahead
of it have drained: queued / (finished per second over the last window). Clamped, so a
burst right after start (no history) or a stalled engine never asks for more than a minute.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW_S = 30.0  # finishes older than this are forgotten
MIN_RETRY_S = 1
MAX_RETRY_S = 60
UNKNOWN_RETRY_S = 5  # nothing finished within the window: no rate to estimate from


class DrainRate:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._finishes: deque[tuple[float, int]] = deque()  # (time, requests finished)
        self._total = 0

    def record(self, now: float, finished: int) -> None:
        if finished:
            self._finishes.append((now, finished))
            self._total += finished
        while self._finishes and self._finishes[0][0] < now - self.window_s:
            self._total -= self._finishes.popleft()[1]

    def rate(self, now: float) -> float | None:
        """Requests finished per second over the window; None without two finishes."""
        self.record(now, 0)
        if self._total < 2:
            return None
        span = now - self._finishes[0][0]
        return self._total / span if span > 0 else None

    def retry_after_s(self, now: float, queued: int) -> int:
        """Whole seconds until the `queued` requests ahead are expected to have drained."""
        rate = self.rate(now)
        if rate is None:
            return UNKNOWN_RETRY_S
        return max(MIN_RETRY_S, min(MAX_RETRY_S, math.ceil(max(queued, 1) / rate)))
