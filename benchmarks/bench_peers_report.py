"""bench_peers' run on the terminal, its targets (issue 32), and a PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

OURS = "pagedserve"
VERDICT = {True: "PASS", False: "FAIL", None: "n/a"}
WEIGHT_READ_SHARE = 0.70  # of the copy bandwidth, c=1, bf16 and int8
INT4_C16_OVER_LLAMA = 1.5


def _fmt(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _loads(rows: list[dict[str, Any]]) -> list[str]:
    return [k[:-6] for k in (rows[0] if rows else {}) if k.endswith("_tok_s")]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def checks(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 32's targets: in each class, the best pagedserve entry against every peer (tok/s
    at every load, c=1 ITL p50); int4 against llama.cpp Q4_0; the c=1 weight-read share."""
    rows = data["summary"]
    loads = _loads(rows)
    copy = data["bandwidth"]["copy_gb_s"]
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, op: str, bound: float) -> None:
        ok = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out.append({"check": name, "value": value, "op": op, "bound": bound, "pass": ok})

    for klass in dict.fromkeys(r["class"] for r in rows):
        ours = [r for r in rows if r["class"] == klass and r["server"].startswith(OURS)]
        peers = [r for r in rows if r["class"] == klass and not r["server"].startswith(OURS)]
        for peer in peers:
            for load in loads:
                best = max((r[f"{load}_tok_s"] or 0.0 for r in ours), default=0.0) or None
                add(f"{klass} {load} tok/s: best pagedserve / {peer['server']}",
                    _ratio(best, peer[f"{load}_tok_s"]), ">=", 1.0)
            best_itl = min((r["c1_itl_p50_ms"] for r in ours if r["c1_itl_p50_ms"]), default=None)
            add(f"{klass} c1 ITL p50: best pagedserve / {peer['server']}",
                _ratio(best_itl, peer.get("c1_itl_p50_ms")), "<=", 1.0)
        if klass == "int4":
            llama = next((r for r in peers if r["server"] == "llama.cpp-q4_0"), None)
            if llama is not None and "c16_tok_s" in llama:
                best = max((r["c16_tok_s"] or 0.0 for r in ours), default=0.0) or None
                add("int4 c16 tok/s: best pagedserve / llama.cpp-q4_0", _ratio(best, llama["c16_tok_s"]),
                    ">=", INT4_C16_OVER_LLAMA)
        if klass in ("bf16", "int8"):
            for r in ours:
                add(f"{r['server']} c1 weight-read rate / copy bandwidth",
                    _ratio(r["c1_weight_read_gb_s"], copy), ">=", WEIGHT_READ_SHARE)
    return out


def print_report(data: dict[str, Any]) -> None:
    rows = data["summary"]
    loads = _loads(rows)
    bw = data["bandwidth"]
    print(f"\n=== {data['model']}: servers by weight class ({bw['threads']} threads; copy "
          f"{bw['copy_gb_s']:.1f} GB/s, read {bw['read_gb_s']:.1f} GB/s) ===")
    w = max((len(r["server"]) for r in rows), default=6) + 2
    print(f"{'server':<{w}}{'class':<6}{'status':<12}{'weights MB':>11}{'RSS MB':>8}"
          + "".join(f"{load + ' tok/s':>12}" for load in loads)
          + f"{'c1 ITL p50':>11}{'c1 GB/s':>9}{'share':>7}")
    for r in rows:
        wb, rss = r["weight_bytes"], r["rss_bytes"]
        print(f"{r['server']:<{w}}{r['class'] or '-':<6}{r['status'] or '-':<12}"
              f"{_fmt(wb / 1e6 if wb else None, '{:.0f}'):>11}"
              f"{_fmt(rss / 1e6 if rss else None, '{:.0f}'):>8}"
              + "".join(f"{_fmt(r[f'{load}_tok_s'], '{:.1f}'):>12}" for load in loads)
              + f"{_fmt(r.get('c1_itl_p50_ms'), '{:.1f}'):>11}"
              f"{_fmt(r['c1_weight_read_gb_s'], '{:.1f}'):>9}{_fmt(r['c1_weight_read_share']):>7}")
    for name, rec in data["servers"].items():
        if rec.get("status") != "ok":
            print(f"  {name}: {rec.get('status')}: {rec.get('reason') or rec.get('error', '')}")
    print("\n=== ITL p50 / p99 (ms) ===")
    for r in rows:
        print(f"{r['server']:<{w}}" + "".join(
            f"  {load} {_fmt(r.get(f'{load}_itl_p50_ms'), '{:.0f}')}/"
            f"{_fmt(r.get(f'{load}_itl_p99_ms'), '{:.0f}')}" for load in loads))
    print("\n=== targets (issue 32) ===")
    for c in data.get("checks", []):
        print(f"{VERDICT[c['pass']]:<5} {c['check']:<62} {_fmt(c['value'])} {c['op']} {c['bound']:g}")


def plot(data: dict[str, Any], path: Path) -> None:
    """Output tok/s against concurrency, one panel per class; c=1 ITL p50 per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["summary"] if r["status"] == "ok"]
    loads = _loads(data["summary"])
    classes = list(dict.fromkeys(r["class"] for r in rows))
    fig, axes = plt.subplots(1, len(classes) + 1, figsize=(5 * (len(classes) + 1), 4.6))
    xs = [int(load[1:]) for load in loads]
    for ax, klass in zip(axes, classes):
        for r in (r for r in rows if r["class"] == klass):
            style = "-o" if r["server"].startswith(OURS) else "--s"
            ax.plot(xs, [r[f"{load}_tok_s"] for load in loads], style, label=r["server"])
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_title(f"{klass}: output tok/s")
        ax.set_xlabel("max concurrency")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    names = [r["server"] for r in rows]
    ax.barh(names, [r["c1_itl_p50_ms"] or 0 for r in rows],
            color=["tab:blue" if n.startswith(OURS) else "tab:gray" for n in names])
    ax.set_title("c=1 ITL p50 (ms)")
    ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"{data['model']}: pagedserve and its peers by weight class "
                 f"({data['machine'].get('cpu_model', '')}, {data['machine'].get('cpu_count')} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
