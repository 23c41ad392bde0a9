"""The fast_step run on the terminal and as a PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.fast_step_targets import HF

VERDICT = {True: "PASS", False: "FAIL", None: "n/a"}


def _fmt(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def print_report(data: dict[str, Any]) -> None:
    rows = data["summary"]
    loads = [k[:-6] for k in (rows[0] if rows else {}) if k.endswith("_tok_s")]
    print(f"\n=== issue 9 targets, {data['dtype']}{' (quick)' if data['quick'] else ''} ===")
    w = max([len(HF), *(len(r["server"]) for r in rows)]) + 2  # the server column fits every name
    head = f"{'server':<{w}}{'status':<15}{'start s':>9}{'c1 ITL p50':>12}{'c1 TTFT p50':>13}"
    print(head + "".join(f"{load + ' tok/s':>12}" for load in loads))
    for r in rows:
        print(f"{r['server']:<{w}}{r['status']:<15}{_fmt(r['ready_s'], '{:.1f}'):>9}"
              f"{_fmt(r['c1_itl_p50_ms'], '{:.1f}'):>12}{_fmt(r['c1_ttft_p50_ms'], '{:.0f}'):>13}"
              + "".join(f"{_fmt(r[f'{load}_tok_s'], '{:.1f}'):>12}" for load in loads))
    hf = data["hf_generate"]
    if hf.get("status") == "ok":
        print(f"{HF:<{w}}{'ok':<15}{'':>9}{hf['ms_per_token']:>12.1f}{hf['first_token_ms']:>13.0f}"
              "   (ms per token, one request at a time)")
    else:
        print(f"{HF:<{w}}{hf.get('status', '-'):<15} {hf.get('reason', '')}")
    for name, rec in data["servers"].items():
        if rec.get("status", "ok") != "ok":
            print(f"  {name}: {rec['status']}: {rec.get('reason', '')}")
    st = data["startup"]
    print(f"\ndefault start-up: first {_fmt(st.get('first_s'), '{:.1f}')} s (empty compile cache), "
          f"second {_fmt(st.get('second_s'), '{:.1f}')} s (warm)"
          + (f"; {st['error']}" if st.get("error") else ""))
    print("\n=== checks (ratio = ours / reference) ===")
    for c in data["checks"]:
        bound = "" if c["bound"] is None else f"{c['op']} {c['bound']:g}"
        print(f"{VERDICT[c['pass']]:<5} ({c['target']}) {c['check']:<44} ours {_fmt(c['ours'], '{:.1f}'):>8}"
              f"  ref {_fmt(c['ref'], '{:.1f}'):>8}  ratio {_fmt(c['ratio']):>6} {bound}"
              + (f"   [{c['missing']}]" if c["missing"] else ""))


def plot(data: dict[str, Any], path: Path) -> None:
    """Output tok/s against concurrency; c=1 ITL p50 per server next to HF's ms/token;
    TTFT p50 against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    bars: list[tuple[str, float]] = []
    for i, (name, rec) in enumerate(data["servers"].items()):
        runs = rec.get("runs", {})
        pts = sorted((m["load"]["max_concurrency"], m["output_throughput"], m["p50_ttft_ms"])
                     for m in runs.values() if m["load"]["max_concurrency"] and m["completed"])
        if pts:
            c, tput, ttft = zip(*pts)
            axes[0].plot(c, tput, "o-", color=f"C{i}", label=name)
            axes[2].plot(c, ttft, "o-", color=f"C{i}", label=name)
        itl = runs.get("c1", {}).get("p50_itl_ms")
        if itl is not None and not math.isnan(itl):
            bars.append((name, itl))
    hf = data["hf_generate"]
    if hf.get("status") == "ok":
        bars.append((HF, hf["ms_per_token"]))
    if bars:
        axes[1].bar([b[0] for b in bars], [b[1] for b in bars],
                    color=[f"C{i}" for i in range(len(bars))])
        axes[1].tick_params(axis="x", labelrotation=20, labelsize=7)
    axes[0].set(xlabel="max concurrency", ylabel="output tokens / s", title="throughput")
    axes[1].set(ylabel="ms", title="c=1 ITL p50 (HF: ms per token)")
    axes[2].set(xlabel="max concurrency", ylabel="TTFT p50 (ms)", yscale="log", title="TTFT p50")
    for ax in (axes[0], axes[2]):
        ax.set_xscale("log", base=2)
        if ax.get_legend_handles_labels()[0]:  # no server ran a load: no legend to draw
            ax.legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    m = data["machine"]
    plan = data["plan"]
    fig.suptitle(f"issue 9 targets: SmolLM2-135M {data['dtype']}, {m.get('cpu_model')} "
                 f"x{m.get('cpu_count')}, in {plan['input_range']} out {plan['output_range']} tokens"
                 f"{' (quick)' if data['quick'] else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
