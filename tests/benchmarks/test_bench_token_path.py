"""bench_token_path: its API worker streams through the real app on this tree, and its driver
interleaves the two trees and takes medians."""

from __future__ import annotations

from pathlib import Path

import pytest

# benchmarks/ is not an installed package (pyproject installs engine, api, scheduler only).
import benchmarks.bench_token_path as bench


def test_api_worker_times_every_case() -> None:
    result = bench.worker(bench.ROOT, "api", tokens=30, requests=1)
    assert set(result) == {c + s for c in bench.API_CASES for s in ("", "_cpu")}
    assert all(0 < us < 1e6 for us in result.values())


def test_driver_interleaves_and_takes_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    base = Path("/base")

    def fake(root: Path, part: str, tokens: int, requests: int) -> dict[str, float]:
        side = "before" if root == base else "after"
        calls.append((side, part))
        k = sum(1 for c in calls if c == (side, part))
        return {"case": (20.0 if side == "before" else 10.0) + k}

    monkeypatch.setattr(bench, "run_worker", fake)
    result = bench.compare(base, rounds=3, tokens=10, requests=1, parts=["api"])
    assert [side for side, _ in calls] == ["before", "after", "after", "before",
                                           "before", "after"]
    case = result["cases"]["case"]
    assert (case["before_us"], case["after_us"]) == (22.0, 12.0)
    assert case["speedup"] == pytest.approx(22 / 12)
