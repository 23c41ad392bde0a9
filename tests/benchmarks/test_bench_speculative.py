"""benchmarks/bench_speculative.py's pure parts: its workloads, one timed run's figures and
the summary (no model is loaded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_speculative import VARIANTS, plot, run_once, summarize, workloads
from scheduler.speculative import SpecDecodeStats


def test_workloads_come_from_this_repository_in_a_fixed_order() -> None:
    loads = workloads(4)
    assert set(loads) == {"rewrite", "passage", "agent", "story"}
    assert all(len(prompts) == 4 for prompts in loads.values())
    assert loads == workloads(4)
    assert all(p.endswith("<|im_start|>assistant\n") for ps in loads.values() for p in ps)
    assert "def " in loads["rewrite"][0] and "Passage:" in loads["passage"][0]
    assert loads["agent"][0].count("get_weather") == 2  # two earlier calls to copy from
    assert len(set(workloads(64)["agent"])) == 8


@dataclass
class FakeCompletion:
    token_ids: list[int] = field(default_factory=list)


class FakeLLM:
    """generate() yields 10 tokens a prompt and records a draft of 4 with 3 kept per prompt."""

    def __init__(self) -> None:
        stats = SpecDecodeStats(4)
        self.engine: Any = type("E", (), {"scheduler": type("S", (), {"spec_stats": stats})})
        self.calls: list[int] = []

    def generate(self, prompts: list[str], params: Any, use_tqdm: bool) -> list[FakeCompletion]:
        self.calls.append(len(prompts))
        for _ in prompts:
            self.engine.scheduler.spec_stats.observe(4, 3)
        return [FakeCompletion(list(range(10))) for _ in prompts]


def test_a_run_counts_its_own_drafts_at_its_concurrency() -> None:
    llm = FakeLLM()
    llm.engine.scheduler.spec_stats.observe(4, 0)  # an earlier run's draft is not counted
    got = run_once(llm, ["a"] * 5, 10, 2)
    assert llm.calls == [2, 2, 1] and got["tokens"] == 50 and got["drafts"] == 5
    assert got["acceptance_rate"] == pytest.approx(0.75)
    assert got["mean_acceptance_length"] == pytest.approx(4.0) and got["tok_s"] > 0


def test_summary_takes_medians_and_ratios_to_no_speculation(tmp_path: Path) -> None:
    def cell(tok_s: float) -> dict[str, float]:
        return {"tok_s": tok_s, "tokens": 10, "drafts": 0, "acceptance_rate": 0.0,
                "mean_acceptance_length": 0.0}

    runs = {"story-c1": {name: [cell(100 * (i + 1) + r) for r in (0, 30, 10)]
                         for i, name in enumerate(VARIANTS)}}
    table = summarize(runs)
    assert table["story-c1"]["none"]["tok_s"] == 110
    assert table["story-c1"]["ngram-4"]["ratio"] == pytest.approx(210 / 110)
    plot(table, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
