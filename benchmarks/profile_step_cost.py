"""Measure the per-step cost model (benchmarks/step_cost.py) on the real engine.

Times ModelRunner.execute() of the loaded model (the embedded SmolLM2-135M by default) on
hand-built steps over a grid: decode batches of 1..64 rows at contexts of 128..1024 tokens,
prefill chunks of 64..1024 tokens (from scratch or after 512 cached tokens), and mixes of
both. Every point is run `--repeats` times in a shuffled order (drift on a shared machine
spreads over all points instead of biasing some) and its median kept. The fit and its error
go to benchmarks/results/step-cost-<machine>.json with the machine description; that file
is what `python -m benchmarks.simulate_replicas --profile` reads.

Block tables are real but rows share pool blocks (round-robin over a 1024-block pool): the
values read do not change the cost, only the number of slots read does.

    .venv/bin/python -m benchmarks.profile_step_cost [--quick] [--threads 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug
from benchmarks.step_cost import StepShape, fit, fit_error, shape_of
from engine.worker.calibration import step_of
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput

POOL_BLOCKS = 1024
Point = tuple[int, int, int, int]  # (decode rows, decode context, prefill tokens, cached before)


def grid(quick: bool) -> list[Point]:
    """Decode-only, prefill-only and mixed steps."""
    if quick:
        return ([(d, 512, 0, 0) for d in (1, 16, 64)] + [(0, 0, p, 0) for p in (128, 512)]
                + [(16, 512, 256, 0), (0, 0, 256, 512)])
    decode = [(d, c, 0, 0) for d in (1, 8, 16, 32, 64) for c in (128, 512, 1024)]
    prefill = [(0, 0, p, c) for p in (64, 256, 512, 1024) for c in (0, 512)]
    mixed = [(d, 512, p, 0) for d in (8, 32, 64) for p in (64, 256, 1024)]
    return decode + prefill + mixed


def build_step(point: Point, block_size: int, rng: random.Random) -> SchedulerOutput:
    """One step of `point`'s shape over sequences whose block tables cover their tokens."""
    d, ctx, p, cached = point
    rows = [(ctx, ctx - 1, 1)] * d + ([(cached + p, cached, p)] if p else [])
    return step_of(rows, itertools.cycle(range(POOL_BLOCKS)), block_size, rng)


def load_runner(args: argparse.Namespace, enforce_eager: bool = False) -> Any:
    from engine.config import EngineConfig
    from engine.worker.model_runner import ModelRunner

    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048)
    runner = ModelRunner(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                      num_kv_blocks=POOL_BLOCKS, num_threads=args.threads,
                                      enforce_eager=enforce_eager, scheduler=sched))
    runner.load()
    return runner


def default_pool_blocks(runner: Any) -> int:
    """The KV pool a replica gets by default here: the CPU default budget (1 GiB), or on CUDA
    the pool a real load would profile (measured by a second runner would cost minutes; the
    CUDA figure is left to the caller's --num-kv-blocks)."""
    from engine.worker.model_runner import CPU_DEFAULT_KV_BYTES

    return int(CPU_DEFAULT_KV_BYTES // runner._block_bytes())


def measure(runner: Any, points: list[Point], repeats: int, seed: int) -> dict[Point, float]:
    """Median seconds of runner.execute per point."""
    from tqdm import tqdm

    rng = random.Random(seed)
    steps = {pt: build_step(pt, runner.block_size, rng) for pt in points}
    runner.execute(steps[max(points, key=lambda q: q[0] * q[1] + q[2] * 4)])  # warm-up
    order = [pt for _ in range(repeats) for pt in points]
    rng.shuffle(order)
    times: dict[Point, list[float]] = {pt: [] for pt in points}
    for pt in tqdm(order, desc="steps", unit="step"):
        t0 = time.perf_counter()
        runner.execute(steps[pt])
        _sync(runner)
        times[pt].append(time.perf_counter() - t0)
    return {pt: statistics.median(ts) for pt, ts in times.items()}


def _sync(runner: Any) -> None:
    if runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize(runner.device)


def report(runner: Any, medians: dict[Point, float], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    shapes = [shape_of(build_step(pt, runner.block_size, rng)) for pt in medians]
    secs = list(medians.values())
    model = fit(shapes, secs)
    return {
        "kind": "step-cost", "machine": machine_info(), "device": str(runner.device),
        "dtype": str(runner.dtype), "model": runner.model_display_name,
        "threads": args.threads, "repeats": args.repeats, "quick": args.quick,
        "block_size": runner.block_size,
        "num_kv_blocks": args.num_kv_blocks or default_pool_blocks(runner),
        "fit": {"formula": "fixed + per_decode*D + per_prefill*P + per_decode_ctx*Cd/1e3 "
                           "+ per_prefill_attn*Ap/1e6 (seconds)",
                "coefficients": model.to_dict(), "error": fit_error(model, shapes, secs)},
        "points": [{"decode_rows": pt[0], "decode_context": pt[1], "prefill_tokens": pt[2],
                    "prefill_cached": pt[3], "median_s": s, "predicted_s": model.step_time(sh),
                    "shape": _shape_dict(sh)}
                   for (pt, s), sh in zip(medians.items(), shapes, strict=True)],
    }


def _shape_dict(s: StepShape) -> dict[str, float]:
    return {"D": s.decode_tokens, "P": s.prefill_tokens, "Cd": s.decode_context,
            "Ap": s.prefill_attention}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="7 points, 3 repeats (a smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="runs per point (default 5)")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="a replica's KV pool to record (default: the CPU default of 1 GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="default: results/step-cost-*.json")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 5)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runner = load_runner(args)
    t0 = time.monotonic()
    medians = measure(runner, grid(args.quick), args.repeats, args.seed)
    data = report(runner, medians, args)
    data["measure_s"] = round(time.monotonic() - t0, 1)
    suffix = "-quick" if args.quick else ""
    out = args.out or RESULTS_DIR / f"step-cost-{machine_slug(data['machine'])}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str))
    fitd = data["fit"]
    print(json.dumps({"coefficients": fitd["coefficients"], "error": fitd["error"]}, indent=2))
    print(f"wrote {out} ({data['measure_s']} s)")


if __name__ == "__main__":
    main()
