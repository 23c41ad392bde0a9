"""benchmarks.compare end to end with fake servers (subprocesses speaking the SSE protocol,
no model), plus the ratio orientation and the targets on hand-made numbers."""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare
from benchmarks.common import machine_slug
from benchmarks.compare import OURS, Plan, checks, parse_args, ratios_by_load
from tests.support.fake_sse_server import CharTokenizer

FAKE_SERVER = Path(__file__).resolve().parents[1] / "support" / "fake_sse_server.py"  # run as a subprocess
TINY = Plan(concurrencies=(2, 16), rate_fractions=(0.8,), input_range=(4, 8), output_range=(4, 6),
            prompts_per_slot=1, min_prompts=4, max_prompts=16, poisson_prompts=8, num_warmups=1)


@dataclass(frozen=True)
class FakeSpec:
    """The registry's ServerSpec interface, serving fake_sse_server.py."""

    name: str
    flags: tuple[str, ...] = ()
    description: str = "fake"

    def command(self, folder: Path, dtype: str, port: int, extra_args: list[str]) -> list[str]:
        return [sys.executable, str(FAKE_SERVER), "--port", str(port), *self.flags, *extra_args]

    def extra_body(self, ignore_eos: bool) -> dict[str, Any]:
        return {"stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}


@dataclass(frozen=True)
class BrokenSpec(FakeSpec):
    def command(self, folder: Path, dtype: str, port: int, extra_args: list[str]) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit('no model here')"]


# Token delays large against a loaded 2-core box's stalls: with 4 ms tokens a 0.3 s hiccup in
# our fake's c16 run once made it no faster than the serial one (ratio 1.02, in a fresh-clone CI run).
SERVERS = {OURS: FakeSpec(OURS, ("--delay", "0.02")),
           "naive": FakeSpec("naive", ("--serial", "--delay", "0.02")),
           "request-batching": FakeSpec("request-batching", ("--delay", "0.1")),
           "transformers-cb": BrokenSpec("transformers-cb")}


@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("results")
    # pagedserve listed last: it must still run first (the Poisson rates come from it)
    args = parse_args(["--servers", "naive", "request-batching", "transformers-cb", OURS,
                       "--out", str(out), "--server-args", "request-batching=--delay 0.15"],
                      tuple(SERVERS))
    mp = pytest.MonkeyPatch()
    mp.setattr(compare, "wait_for_idle", lambda *a: {"idle": True, "stub": True})
    try:
        return compare.run(args, SERVERS, CharTokenizer(), out, plan=TINY)
    finally:
        mp.undo()


def test_servers_run_one_at_a_time_ours_first(comparison: tuple[dict[str, Any], Path]) -> None:
    data, _ = comparison
    servers = data["by_dtype"]["bfloat16"]["servers"]
    assert list(servers) == [OURS, "naive", "request-batching", "transformers-cb"]
    spans = [(s["started_at"], s["stopped_at"]) for s in servers.values()]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # never two at once
    assert servers["request-batching"]["command"][-2:] == ["--delay", "0.15"]  # --server-args
    for name in (OURS, "naive", "request-batching"):
        runs = servers[name]["runs"]
        assert list(runs) == ["c2", "c16", "poisson-80"]
        assert all(m["failed"] == 0 and m["completed"] == m["num_prompts"] for m in runs.values())
        assert runs["c16"]["num_prompts"] == 16 and runs["c2"]["num_prompts"] == 4
        assert servers[name]["models"]["data"][0]["id"] == "fake"
        assert all("foreign_cores" in m for m in runs.values())
    broken = servers["transformers-cb"]
    assert broken["runs"] == {} and "no model here" in broken["log_tail"] and "exited" in broken["error"]


def test_poisson_rate_derives_from_pagedserve_capacity(comparison: tuple[dict[str, Any], Path]) -> None:
    data, _ = comparison
    cap = data["capacity"]
    ours = data["by_dtype"]["bfloat16"]["servers"][OURS]["runs"]
    assert cap["source"] == f"{OURS} c16"
    assert cap["request_throughput"] == ours["c16"]["request_throughput"]
    assert cap["request_rates"]["poisson-80"] == pytest.approx(0.8 * cap["request_throughput"])
    for s in data["by_dtype"]["bfloat16"]["servers"].values():
        if s["runs"]:
            load = s["runs"]["poisson-80"]["load"]
            assert load["request_rate"] == cap["request_rates"]["poisson-80"]
            assert load["max_concurrency"] is None


def test_ratios_layout_and_direction(comparison: tuple[dict[str, Any], Path]) -> None:
    data, path = comparison
    saved = json.loads(path.read_text())
    assert path.parent == Path(saved["args"]["out"]) and path.name.endswith(".json")
    assert machine_slug(saved["machine"]) in path.name  # <date>-<machine>.json
    r = saved["ratios"]
    # the serial fake serves 16 requests one by one: ours (concurrent, same speed) is far ahead
    assert r["naive"]["output_throughput"] > 3 and r["naive"]["ttft_p50"] < 0.5
    # same concurrency, but request-batching's tokens come 7.5x slower (--server-args)
    assert r["request-batching"]["output_throughput"] > 1.5 and r["request-batching"]["itl_p50"] < 0.5
    assert "transformers-cb" not in r  # failed: no numbers, no ratio
    naive = data["by_dtype"]["bfloat16"]["servers"]["naive"]["runs"]["c16"]
    ours = data["by_dtype"]["bfloat16"]["servers"][OURS]["runs"]["c16"]
    assert r["naive"]["output_throughput"] == pytest.approx(
        ours["output_throughput"] / naive["output_throughput"])
    assert saved["ratios_by_load"]["naive"]["c16"] == r["naive"]
    assert set(saved["ratios_by_load"]["naive"]) == {"c2", "c16", "poisson-80"}
    by_check = {(c["check"], c["load"]): c for c in saved["checks"]}
    naive_check = by_check[("output_throughput pagedserve/naive >= 5.0", "c16")]
    assert naive_check["value"] == r["naive"]["output_throughput"]
    assert naive_check["pass"] == (naive_check["value"] >= 5.0)


def test_plot_written(comparison: tuple[dict[str, Any], Path]) -> None:
    _, path = comparison
    png = path.with_name(f"{path.stem}-bfloat16.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def run(tput: float, ttft: float, itl50: float = 10.0, itl99: float = 15.0) -> dict[str, float]:
    return {"output_throughput": tput, "request_throughput": tput / 100, "p50_ttft_ms": ttft,
            "p99_ttft_ms": ttft * 2, "p50_itl_ms": itl50, "p99_itl_ms": itl99,
            "p50_tpot_ms": itl50, "p50_e2el_ms": ttft * 10}


def test_ratio_orientation_and_checks_on_hand_made_numbers() -> None:
    results = {OURS: {"runs": {"c16": run(300, 100), "poisson-80": run(100, 50, 10, 25)}},
               "request-batching": {"runs": {"c16": run(150, 400)}},
               "naive": {"runs": {"c16": run(50, 150), "poisson-80": run(20, 9000)}}}
    by = ratios_by_load(results)
    assert by["request-batching"]["c16"]["output_throughput"] == pytest.approx(2.0)
    assert by["request-batching"]["c16"]["ttft_p50"] == pytest.approx(0.25)  # ours / theirs
    assert "poisson-80" not in by["request-batching"]  # not run by the baseline
    got = {(c["check"], c["load"]): c["pass"] for c in checks(results, by)}
    assert got[("output_throughput pagedserve/request-batching >= 1.5", "c16")] is True
    assert got[("ttft_p50 pagedserve/request-batching <= 0.5", "c16")] is True
    assert got[("output_throughput pagedserve/naive >= 5.0", "c16")] is True   # 6x
    assert got[("output_throughput pagedserve/naive >= 5.0", "poisson-80")] is True  # 5x
    assert got[("output_throughput pagedserve/request-batching >= 1.5", "poisson-80")] is None
    assert got[("pagedserve p99 ITL / own p50 ITL <= 2.0", "c16")] is True    # 1.5
    assert got[("pagedserve p99 ITL / own p50 ITL <= 2.0", "poisson-80")] is False  # 2.5
    assert ratios_by_load({"naive": results["naive"]}) == {}


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out
    a = parse_args([])
    assert a.servers[0] == OURS and a.dtype == ["bfloat16"] and not a.quick
    assert parse_args(["--dtype", "bfloat16", "float32"]).dtype == ["bfloat16", "float32"]
    with pytest.raises(SystemExit):
        parse_args(["--server-args", "no-equals-sign"])


def test_plans() -> None:
    full, quick = compare.FULL, compare.QUICK
    assert full.concurrencies == (1, 4, 16, 64) and full.rate_fractions == (0.8, 0.4)
    assert (full.input_range, full.output_range) == ((32, 512), (16, 256))
    assert [full.num_prompts(c) for c in full.concurrencies] == [8, 8, 32, 64]
    assert 16 in quick.concurrencies and 0.8 in quick.rate_fractions


def test_workloads_never_repeat_a_prompt() -> None:
    specs = compare.workloads(TINY, CharTokenizer(), seed=0)
    assert {k: len(v) for k, v in specs.items()} == {"warmup": 1, "c2": 4, "c16": 16, "poisson-80": 8}
    prompts = [s.prompt for v in specs.values() for s in v]
    assert len(set(prompts)) == len(prompts)
    assert all(4 <= s.prompt_len <= 8 and 4 <= s.output_len <= 6 for v in specs.values() for s in v)
    assert specs == compare.workloads(TINY, CharTokenizer(), seed=0)


@pytest.mark.parametrize(("cpu_model", "slug"), [
    ("Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", "intel-xeon-platinum-8375c-2c"),
    ("Intel(R) Xeon(R) Processor", "intel-xeon-processor-2c"),
    ("AMD EPYC 9R45 96-Core Processor", "amd-epyc-9r45-96-core-2c"),
])
def test_machine_slug_is_file_name_safe(cpu_model: str, slug: str) -> None:
    assert machine_slug({"cpu_model": cpu_model, "cpu_count": 2}) == slug
