"""DrainRate: how fast requests leave the engine (EngineStats.finish_rate).

The API turns it into the Retry-After of a 429 (api/errors.py): a client refused because the
queue is full should come back about when the requests ahead of it have drained.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 30.0  # finishes older than this are forgotten


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
