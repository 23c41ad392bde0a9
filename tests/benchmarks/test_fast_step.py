"""benchmarks.fast_step (issue 9's targets in one run): the check logic on hand-made numbers,
start-up failures told apart from rejected flags, the fresh compile cache, and one tiny run
end to end with fake servers (no model, no vLLM)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common, fast_step, interleave
from benchmarks.baselines import vllm_cpu
from benchmarks.compare import Plan
from benchmarks.fast_step_targets import (
    DEFAULT,
    EAGER,
    HF,
    INT4,
    TORCH_ATTENTION,
    VLLM,
    Variant,
    all_checks,
    start_failure,
    summary_rows,
)
from tests.support.fake_sse_server import CharTokenizer

FAKE_SERVER = Path(__file__).resolve().parents[1] / "support" / "fake_sse_server.py"


def run(tput: float, itl: float, ttft: float = 50.0) -> dict[str, Any]:
    return {"output_throughput": tput, "p50_itl_ms": itl, "p50_ttft_ms": ttft, "completed": 4}


def servers(**over: dict[str, Any]) -> dict[str, Any]:
    base = {
        DEFAULT: {"status": "ok", "ready_s": 3.0, "runs": {
            "c1": run(40, 20), "c4": run(120, 30), "c16": run(390, 40), "c64": run(500, 90)}},
        EAGER: {"status": "ok", "runs": {"c1": run(25, 40), "c16": run(300, 50), "c64": run(300, 200)}},
        INT4: {"status": "ok", "runs": {"c1": run(60, 14)}},
        VLLM: {"status": "ok", "runs": {
            "c1": run(39, 24), "c4": run(130, 28), "c16": run(250, 60), "c64": run(420, 150)}},
    }
    return base | over


def by_name(checks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["check"]: c for c in checks}


def test_checks_pass_fail_and_ratio_direction() -> None:
    got = by_name(all_checks(servers(), 45.0, {"first_s": 40.0, "second_s": 8.0}))
    c = got["c=1 ITL p50 <= vLLM's"]
    assert (c["ours"], c["ref"], c["pass"]) == (20, 24, True) and c["ratio"] == pytest.approx(20 / 24)
    assert got["c=4 output tok/s >= vLLM's"]["pass"] is False  # 120 < 130
    assert got["c=16 output tok/s >= 1.2x vLLM"]["pass"] is True  # 1.56
    assert got["c=64 output tok/s >= 1.2x vLLM"]["pass"] is False  # 1.19
    assert got["c=64 output tok/s >= 1.2x vLLM"]["ratio"] == pytest.approx(500 / 420)
    b = got["default c=1 ITL p50 <= 0.5x HF ms/token"]
    assert b["ref"] == 45.0 and b["ratio"] == pytest.approx(20 / 45) and b["pass"] is True
    c4 = got["int4 c=1 ITL p50 <= 0.3x HF ms/token"]
    assert c4["ratio"] == pytest.approx(14 / 45) and c4["pass"] is False  # 0.311 > 0.3
    assert got["default c=16 tok/s >= 1.3x enforce-eager"]["pass"] is True   # 1.3 exactly
    assert got["default c=64 tok/s >= 1.3x enforce-eager"]["pass"] is True   # 1.67
    e = got["start-up s: first (cold cache), second"]
    assert (e["ours"], e["ref"], e["ratio"], e["pass"]) == (40.0, 8.0, 0.2, True)
    assert all(c["missing"] is None for c in got.values())


def test_missing_numbers_are_na_with_the_reason() -> None:
    rejected = {"status": "rejected-flag", "reason": "unrecognized arguments: --quantization int4",
                "runs": {}}
    no_vllm = {"status": "unavailable", "reason": "vLLM venv not found", "runs": {}}
    got = by_name(all_checks(servers(**{INT4: rejected, VLLM: no_vllm}), None, {"error": "boom"}))
    int4 = got["int4 c=1 ITL p50 <= 0.3x HF ms/token"]
    assert int4["pass"] is None and "rejected-flag: unrecognized arguments" in int4["missing"]
    assert "HF generate() not measured" in int4["missing"]
    assert "vLLM venv not found" in got["c=1 ITL p50 <= vLLM's"]["missing"]
    assert got["default c=1 ITL p50 <= 0.5x HF ms/token"]["pass"] is None
    assert got["default c=16 tok/s >= 1.3x enforce-eager"]["pass"] is True  # unaffected
    e = got["start-up s: first (cold cache), second"]
    assert e["pass"] is None and e["missing"] == "boom"
    # a load that is absent, or where every request failed, is n/a, never a 0 ratio
    failed = {"status": "ok", "runs": {"c16": run(0.0, float("nan")) | {"completed": 0}}}
    got = by_name(all_checks(servers(**{EAGER: failed}), 45.0, {}))
    assert got["default c=16 tok/s >= 1.3x enforce-eager"]["pass"] is None
    assert "no c64 load" in got["default c=64 tok/s >= 1.3x enforce-eager"]["missing"]


def test_start_failure_tells_a_rejected_flag_from_a_crash() -> None:
    log = ("usage: pagedserve [-h] {serve} ...\n"
           "pagedserve: error: unrecognized arguments: --enforce-eager\n")
    assert start_failure(2, log) == {"status": "rejected-flag",
                                     "reason": "unrecognized arguments: --enforce-eager"}
    choice = "serve: error: argument --quantization: invalid choice: 'int4' (choose from 'none')"
    assert start_failure(2, choice)["status"] == "rejected-flag"
    assert "invalid choice: 'int4'" in start_failure(2, choice)["reason"]
    crash = "Traceback (most recent call last):\n  ...\nRuntimeError: out of memory\n"
    assert start_failure(1, crash) == {"status": "failed", "reason": "RuntimeError: out of memory"}
    assert start_failure(1, "") == {"status": "failed", "reason": "exit code 1"}


def test_summary_rows() -> None:
    rows = summary_rows(servers(), ("c1", "c64"))
    first = rows[0]
    assert first == {"server": DEFAULT, "status": "ok", "ready_s": 3.0, "c1_itl_p50_ms": 20,
                     "c1_ttft_p50_ms": 50.0, "c1_tok_s": 40, "c64_tok_s": 500}
    assert rows[2]["c64_tok_s"] is None  # int4 ran c1 only


def test_fresh_compile_cache_links_all_but_the_compile_cache(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "real"
    (real / "model-x").mkdir(parents=True)
    (real / "model-x" / "config.json").write_text("{}")
    (real / fast_step.COMPILE_CACHE).mkdir()
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(real))
    with fast_step.fresh_compile_cache(None) as env:
        root = Path(env["PAGEDSERVE_CACHE"])
        assert root != real and (root / "model-x" / "config.json").is_file()
        assert not (root / fast_step.COMPILE_CACHE).exists()
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert not root.exists() and (real / "model-x" / "config.json").is_file()  # targets kept
    kept = tmp_path / "kept"
    with fast_step.fresh_compile_cache(kept):
        pass
    assert (kept / "model-x").is_symlink()


def test_vllm_argv_and_missing_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_VLLM_VENV", str(tmp_path / "no-venv"))
    argv = vllm_cpu.argv(Path("/models/smol"), "bfloat16", 8123)
    assert argv[0] == "env" and "VLLM_CPU_OMP_THREADS_BIND=auto" in argv
    i = argv.index("-m")
    assert argv[i - 1] == str(tmp_path / "no-venv" / "bin" / "python")
    assert argv[i + 1] == "vllm.entrypoints.openai.api_server"
    assert argv[argv.index("--model") + 1] == "/models/smol" and argv[argv.index("--port") + 1] == "8123"
    assert vllm_cpu.fields(True)["model"] == argv[argv.index("--served-model-name") + 1]
    reason = vllm_cpu.missing_reason()
    assert reason is not None and "--make-vllm-venv" in reason and "no-venv" in reason


class Fake:
    """A registry ServerSpec serving fake_sse_server.py."""

    def __init__(self, name: str, *flags: str) -> None:
        self.name, self.flags, self.description = name, flags, "fake"

    def command(self, folder: Path, dtype: str, port: int, extra_args: list[str]) -> list[str]:
        return [sys.executable, str(FAKE_SERVER), "--port", str(port), *self.flags, *extra_args]

    def extra_body(self, ignore_eos: bool) -> dict[str, Any]:
        return {"stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}


TINY = Plan(concurrencies=(1, 16), rate_fractions=(), input_range=(4, 8), output_range=(8, 8),
            prompts_per_slot=1, min_prompts=2, max_prompts=16, poisson_prompts=0, num_warmups=1)
# Token delays large against a loaded box's stalls (a 0.3 s hiccup must not bring the 15x
# gap under the 1.3x the check asks for).
REGISTRY = {"fast": Fake("fast", "--delay", "0.01"), "slow": Fake("slow", "--delay", "0.15")}
# The fake server knows neither --enforce-eager nor --quantization: it must reject the int4
# variant's flag at start-up, as today's pagedserve would, and the run must go on.
VARIANTS = (Variant(DEFAULT, "fast"), Variant(EAGER, "slow"),
            Variant(INT4, "fast", ("--quantization", "int4")))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("results")
    args = fast_step.parse_args(["--servers", DEFAULT, EAGER, INT4, "--out", str(out),
                                 "--compile-cache", str(out / "cache")])
    mp = pytest.MonkeyPatch()
    mp.setattr(fast_step, "wait_for_idle", lambda *a: {"idle": True, "stub": True})
    mp.setattr(interleave, "settle", lambda: {"settled": True, "stub": True})
    try:
        return fast_step.run(args, REGISTRY, CharTokenizer(), out, plan=TINY, variants=VARIANTS)
    finally:
        mp.undo()


def test_tiny_run_end_to_end(tiny_run: tuple[dict[str, Any], Path]) -> None:
    data, path = tiny_run
    srv = data["servers"]
    assert list(srv) == [DEFAULT, EAGER, INT4]
    for name in (DEFAULT, EAGER):
        assert srv[name]["status"] == "ok" and list(srv[name]["runs"]) == ["c1", "c16"]
        assert all(m["failed"] == 0 for m in srv[name]["runs"].values())
        assert srv[name]["command"][:2] == ["env", f"PAGEDSERVE_CACHE={path.parent / 'cache'}"]
    assert srv[INT4]["status"] == "rejected-flag" and srv[INT4]["runs"] == {}
    assert "unrecognized arguments: --quantization int4" in srv[INT4]["reason"]
    st = data["startup"]
    assert st["first_s"] > 0 and st["second_s"] == srv[DEFAULT]["ready_s"]
    got = by_name(data["checks"])
    d = got["default c=16 tok/s >= 1.3x enforce-eager"]
    assert d["pass"] is True and d["ratio"] > 1.3  # same concurrency, tokens 15x faster
    assert got["c=1 ITL p50 <= vLLM's"]["pass"] is None  # vLLM not in this run
    assert "not in this run" in got["c=1 ITL p50 <= vLLM's"]["missing"]
    assert data["hf_generate"]["status"] == "not run"
    assert got["start-up s: first (cold cache), second"]["pass"] is True
    assert path.name.endswith("-fast-step.json") and data["machine"]["cpu_count"]
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert not path.with_suffix(".partial.json").exists()  # written per server, gone at the end


def test_loads_are_interleaved_each_led_by_another_server(
        tiny_run: tuple[dict[str, Any], Path]) -> None:
    srv = tiny_run[0]["servers"]
    began = {(name, load): srv[name]["runs"][load]["started_at"]
             for name in (DEFAULT, EAGER) for load in ("c1", "c16")}
    # every server's c=1 before any server's c=16 ...
    assert max(began[n, "c1"] for n in (DEFAULT, EAGER)) < min(began[n, "c16"] for n in (DEFAULT, EAGER))
    # ... the default first at c=1, the eager one first at c=16
    assert began[DEFAULT, "c1"] < began[EAGER, "c1"] and began[EAGER, "c16"] < began[DEFAULT, "c16"]
    assert all(srv[n]["exit_code"] is not None and srv[n]["wall_s"] > 0 for n in (DEFAULT, EAGER))
    assert all(srv[n]["runs"][load]["settle"]["stub"] for n in (DEFAULT, EAGER) for load in ("c1", "c16"))


def test_wait_for_idle_without_the_load_average_waits_for_a_quiet_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy seconds the machine reports: 1 core busy in the first window, then 0.05."""
    busy = iter([0.0, 0.01, 0.01, 0.0105])  # before/after of window 1, then of window 2
    monkeypatch.setattr(common.CpuSample, "__init__",
                        lambda self, pid: setattr(self, "busy_s", next(busy)))
    monkeypatch.setattr(common.os, "getloadavg", lambda: (9.0, 9.0, 9.0))  # never asked
    got = common.wait_for_idle(0.15, 5.0, window_s=0.01, load_avg=False)
    assert got["idle"] is True and got["busy_cores"] == 0.05 and got["waited_s"] < 5


def test_turn_order_rotates() -> None:
    names = ["a", "b", "c"]
    assert [interleave.turn_order(names, i) for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert interleave.turn_order([], 3) == []


def test_cli_defaults() -> None:
    args = fast_step.parse_args([])
    assert args.servers == [DEFAULT, EAGER, INT4, TORCH_ATTENTION, VLLM, HF] and args.dtype == "bfloat16"
    assert not args.make_vllm_venv and fast_step.FULL.concurrencies == (1, 4, 16, 64)
    assert fast_step.FULL.output_range == (128, 128)
    with pytest.raises(SystemExit):
        fast_step.parse_args(["--servers", "nope"])


def fake_venv(root: Path, has_vllm: bool) -> Path:
    """A venv whose python only answers the 'is vllm importable' probe."""
    py = root / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f"#!/bin/sh\nexit {0 if has_vllm else 1}\n")
    py.chmod(0o755)
    return root


def test_make_venv_keeps_a_venv_that_has_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = fake_venv(tmp_path / "v", has_vllm=True)
    monkeypatch.setenv("PAGEDSERVE_VLLM_VENV", str(venv))
    assert vllm_cpu.installed() and vllm_cpu.missing_reason() is None
    assert vllm_cpu.make_venv(python="/nonexistent/python") == venv  # no venv, no pip run
    assert not vllm_cpu.installed(fake_venv(tmp_path / "w", has_vllm=False))
