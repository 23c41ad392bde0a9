"""Project replica scale-out beyond this machine: a discrete-event simulation of N replicas.

Each replica runs our real Scheduler/BlockManager (prefix caching, chunked prefill,
preemption) on a simulated clock; a step takes what the measured cost model
(benchmarks/profile_step_cost.py) says; a router (round-robin, power-of-two, prefix-aware)
places every request of a shared-prefix multi-turn conversation trace (sim_workload.py).
See docs/scaling-simulation.md for the method and the findings.

Sweeps (every policy in each):
  replicas   N = 1..16 at a fixed offered rate per replica (--load x one replica's capacity);
             the request count grows with N (--requests-per-replica)
  rate       N fixed (--fixed-replicas), offered rate from 0.25x to 1.25x N replicas' capacity
  prefixes   N fixed, the number of distinct system prompts grows past one replica's KV pool
  skew       N fixed, Zipf-skewed system prompts; prefix-aware also without its overload check

One replica's capacity is measured first: one replica, every conversation arriving at once.

    .venv/bin/python -m benchmarks.simulate_replicas [--quick] [--profile FILE] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR
from benchmarks.sim_core import SimConfig, Simulation, simulate
from benchmarks.sim_router import POLICIES
from benchmarks.sim_workload import WorkloadConfig
from benchmarks.step_cost import Profile
from scheduler.config import SchedulerConfig

PRESET = Path(__file__).resolve().parent.parent / "configs" / "default.toml"
NO_OVERLOAD_CHECK = 1 << 30  # an imbalance threshold no load reaches
Point = tuple[str, SimConfig]  # (sweep name, config)


def default_profile() -> Path:
    """The newest full (non-quick) step-cost profile in benchmarks/results/."""
    found = sorted((p for p in RESULTS_DIR.glob("step-cost-*.json") if "quick" not in p.name),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit("no step-cost profile in benchmarks/results/: run "
                         "`python -m benchmarks.profile_step_cost` or pass --profile FILE")
    return found[-1]


def preset_scheduler(path: Path = PRESET) -> SchedulerConfig:
    """The default preset's [scheduler] table: what `pagedserve serve` runs with."""
    return SchedulerConfig(**tomllib.loads(path.read_text()).get("scheduler", {}))


def base_config(args: argparse.Namespace, profile: Profile) -> SimConfig:
    sched = preset_scheduler(args.preset)
    if sched.block_size != profile.block_size:
        sched = replace(sched, block_size=profile.block_size)
    wl = WorkloadConfig(num_requests=args.requests_per_replica, rate=1.0,
                        num_system_prompts=args.system_prompts, think_time_s=args.think_time,
                        turns=(args.turns[0], args.turns[1]),
                        max_model_len=sched.max_model_len, seed=args.seed)
    return SimConfig(1, "round-robin", wl, sched, args.num_kv_blocks or profile.num_kv_blocks,
                     profile.model, args.imbalance_threshold, args.seed)


def with_load(base: SimConfig, n: int, policy: str, rate: float, **wl: Any) -> SimConfig:
    """base at n replicas and `rate` req/s; the request count grows with n."""
    work = replace(base.workload, rate=rate,
                   num_requests=base.workload.num_requests * n, **wl)
    return replace(base, num_replicas=n, policy=policy, workload=work)


def capacity(base: SimConfig) -> tuple[float, dict[str, Any]]:
    """One replica's request throughput when far more is offered than it can serve: twice
    max_num_seqs conversations arrive at once, so the batch is full (not capped by how many
    conversations there are). Measured up to the 80th percentile finish, before the tail
    where only the longest conversations' last turns are left."""
    turns = base.workload.mean_turns
    n = max(base.workload.num_requests, int(2 * base.scheduler.max_num_seqs * turns))
    sim = Simulation(with_load(replace(base, workload=replace(base.workload, num_requests=n)),
                               1, "round-robin", 1e6))
    summary = sim.run()
    finishes = sorted(r.finish_s for r in sim.records.values() if r.finish_s is not None)
    k = int(0.8 * len(finishes))
    return k / finishes[k - 1], summary


def sweep_points(base: SimConfig, cap: float, args: argparse.Namespace) -> Iterator[Point]:
    n_fixed = args.fixed_replicas
    for n in args.replicas:
        for pol in POLICIES:
            yield "replicas", with_load(base, n, pol, args.load * cap * n)
    for frac in args.rate_fractions:
        for pol in POLICIES:
            yield "rate", with_load(base, n_fixed, pol, frac * cap * n_fixed)
    for k in args.prefix_counts:
        for pol in POLICIES:
            yield "prefixes", with_load(base, n_fixed, pol, args.load * cap * n_fixed,
                                        num_system_prompts=k)
    for s in args.skews:
        for pol in (*POLICIES, "prefix-aware-no-overload-check"):
            cfg = with_load(base, n_fixed, pol.removesuffix("-no-overload-check"),
                            args.load * cap * n_fixed, prefix_skew=s)
            if pol.endswith("no-overload-check"):
                cfg = replace(cfg, imbalance_threshold=NO_OVERLOAD_CHECK)
            yield "skew", cfg


def run_sweeps(points: list[Point], progress: Callable[[int], None]) -> list[dict[str, Any]]:
    rows = []
    for sweep, cfg in points:
        r = simulate(cfg)
        r["sweep"] = sweep
        r["system_prompts"] = cfg.workload.num_system_prompts
        r["prefix_skew"] = cfg.workload.prefix_skew
        r["imbalance_threshold"] = cfg.imbalance_threshold
        if cfg.imbalance_threshold == NO_OVERLOAD_CHECK:
            r["policy"] = "prefix-aware-no-overload-check"
        rows.append(r)
        progress(1)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer points and requests (~1 min)")
    p.add_argument("--profile", type=Path, default=None,
                   help="step-cost JSON (default: newest results/step-cost-*.json)")
    p.add_argument("--preset", type=Path, default=PRESET,
                   help="TOML whose [scheduler] table each replica runs (default: the default "
                        "preset, what `pagedserve serve` runs)")
    p.add_argument("--replicas", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    p.add_argument("--fixed-replicas", type=int, default=4, help="N of the other sweeps")
    p.add_argument("--load", type=float, default=0.7,
                   help="offered rate per replica, as a fraction of one replica's capacity")
    # --replicas, --rate-fractions, --prefix-counts, --skews with no value skip that sweep
    p.add_argument("--rate-fractions", type=float, nargs="*",
                   default=[0.25, 0.5, 0.75, 1.0, 1.25])
    p.add_argument("--prefix-counts", type=int, nargs="*", default=[2, 8, 32, 128])
    p.add_argument("--skews", type=float, nargs="*", default=[0.0, 1.0, 2.0])
    p.add_argument("--requests-per-replica", type=int, default=100)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--turns", type=int, nargs=2, default=[1, 6], metavar=("MIN", "MAX"),
                   help="turns per conversation, uniform")
    p.add_argument("--think-time", type=float, default=2.0, help="mean seconds between turns")
    p.add_argument("--imbalance-threshold", type=int, default=8,
                   help="prefix-aware: a replica is overloaded when its in-flight requests "
                        "exceed the least loaded replica's by more than this")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per replica (default: the profile's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.rate_fractions = [1, 4, 16], [0.5, 1.0]
        args.prefix_counts, args.skews = [2, 64], [0.0, 2.0]
        args.requests_per_replica = min(args.requests_per_replica, 20)
    return args


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm

    from benchmarks.sim_plots import plot_all

    args = parse_args(argv)
    profile = Profile.load(args.profile or default_profile())
    base = base_config(args, profile)
    t0 = time.monotonic()
    cap, cap_run = capacity(base)
    points = list(sweep_points(base, cap, args))
    with tqdm(total=len(points), desc="simulations", unit="run") as bar:
        rows = run_sweeps(points, bar.update)
    data = {"kind": "simulate-replicas", "profile": profile.source, "device": profile.device,
            "cost_model": profile.model.to_dict(), "num_kv_blocks": base.num_kv_blocks,
            "scheduler": {k: getattr(base.scheduler, k) for k in base.scheduler.__slots__},
            "workload": {k: getattr(base.workload, k) for k in base.workload.__slots__},
            "args": {k: str(v) for k, v in vars(args).items()},
            "replica_capacity_rps": cap, "capacity_run": cap_run, "results": rows,
            "wall_s": round(time.monotonic() - t0, 1)}
    stem = f"simulate-replicas{'-quick' if args.quick else ''}-{time.strftime('%Y%m%d-%H%M%S')}"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    png = plot_all(data, args.out / f"{stem}.png")
    print(f"one replica: {cap:.3f} req/s; {len(rows)} runs in {data['wall_s']} s")
    print(f"wrote {path}\nwrote {png}")


if __name__ == "__main__":
    main()
