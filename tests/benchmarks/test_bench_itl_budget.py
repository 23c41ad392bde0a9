"""benchmarks/bench_itl_budget.py's pure parts: its flags, its loads, the targets and the report
(no server is started)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_itl_budget import (
    CAPS,
    VLLM,
    Case,
    budget,
    cases,
    parse_args,
    plot,
    print_report,
    table,
    targets,
    turns,
    variants,
)


class FakeServer:
    def __init__(self, name: str) -> None:
        self.name = name

    def command(self, folder: Path, dtype: str, port: int, extra: list[str]) -> list[str]:
        return [self.name, *extra]

    def extra_body(self, ignore_eos: bool) -> dict[str, Any]:
        return {"ignore_eos": ignore_eos}


def test_budget_flags() -> None:
    assert budget("40") == (40.0, 2.0) and budget("25:1.5") == (25.0, 1.5)
    for bad in ("0", "40:0.5", "-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            budget(bad)
    args = parse_args(["--budgets", "30:1.5", "50", "--no-vllm", "--sampling-concurrencies"])
    assert args.budgets == [(30.0, 1.5), (50.0, 2.0)] and not args.vllm
    assert [c.name for c in cases(args)] == ["greedy-c1", "greedy-c4", "greedy-c16", "greedy-c64"]
    quick = parse_args(["--quick"])
    assert [c.name for c in cases(quick)] == ["greedy-c16"] and quick.output_len == 32


def test_the_variants_are_the_caps_the_budgets_and_vllm() -> None:
    args = parse_args(["--budgets", "40:1.5", "60"])
    registry = {"pagedserve": FakeServer("ours"), VLLM: FakeServer("vllm")}
    got = variants(args, registry)
    assert [v.name for v in got] == [CAPS, "pagedserve-itl-40-s1.5", "pagedserve-itl-60-s2", VLLM]
    assert got[0].command(Path("."), "bfloat16", 1, []) == ["ours", "--target-itl-ms", "0"]
    assert got[2].args == ("--target-itl-ms", "60", "--prefill-stretch", "2")
    assert got[3].target_itl_ms is None and got[3].extra_body(True) == {"ignore_eos": True}
    assert [c.name for c in cases(args)][-2:] == ["penalties-c16", "penalties-c64"]
    last = turns(cases(args))[-1]
    assert (last.specs, last.load.name, last.load.max_concurrency) == ("penalties-c64",
                                                                       "penalties-c64", 64)
    assert last.body["repetition_penalty"] == 1.1 and turns(cases(args))[0].body == {}


def run(tok_s: float, ttft: float, p50: float, p99: float) -> dict[str, Any]:
    return {"runs": {"greedy-c16": {"output_throughput": tok_s, "p50_ttft_ms": ttft,
                                    "p50_itl_ms": p50, "p99_itl_ms": p99}}}


def test_targets_compare_each_budget_with_the_caps_and_vllm(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    servers = {CAPS: run(400, 200, 25, 100), "b-good": run(390, 210, 30, 55),
               "b-bad": run(300, 400, 25, 80), VLLM: run(320, 300, 50, 67), "down": {}}
    tab = table(servers, [Case("greedy", 16)])
    assert tab["greedy-c16"]["b-good"]["spread"] == pytest.approx(55 / 30)
    assert tab["greedy-c16"]["down"]["tok_s"] is None
    got = {c["server"]: c for c in targets(tab, ["b-good", "b-bad", "down"])}
    assert got["b-good"] == {"load": "greedy-c16", "server": "b-good", "itl_p99_le_2x_p50": True,
                             "itl_p99_le_vllm": True, "tok_s_ge_0.95x_caps": True,
                             "ttft_p50_le_1.1x_caps": True}
    assert not any(got["b-bad"][k] for k in got["b-bad"] if k not in ("load", "server"))
    assert all(got["down"][k] is None for k in got["down"] if k not in ("load", "server"))
    print_report(tab, list(got.values()))
    assert "b-bad" in capsys.readouterr().out
    plot(tab, {CAPS: "caps", "b-good": "40/1.5"}, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_spread_is_not_judged_at_one_stream() -> None:
    tab = table({"b": {"runs": {"greedy-c1": {"p50_itl_ms": 10, "p99_itl_ms": 40}}}},
                [Case("greedy", 1)])
    assert targets(tab, ["b"])[0]["itl_p99_le_2x_p50"] is None
