"""Sibling projections apart against fused (engine/layers/fused_linears.py), per layer, per row count.

For the shapes of one decoder layer (SmolLM2-135M's by default), the q/k/v projections and the
gate/up projections are timed as the separate modules the model had and as the one
concatenated module the loader now builds, in the kinds a step runs: int4 (the kernel steps of
up to DENSE_ABOVE_ROWS rows use) and oneDNN-packed bf16 (the dense path above that). The two
variants alternate, in a shuffled order, so a shared machine's drift hits both alike; the
median of the repeats is kept.

    .venv/bin/python -m benchmarks.bench_fused_linears
    .venv/bin/python -m benchmarks.bench_fused_linears --hidden 896 --intermediate 4864 \\
        --heads 14 --kv-heads 2 --head-dim 64                      # Qwen2-0.5B's shapes

Writes benchmarks/results/fused-linears-<machine>.json with the machine description.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug

INT4_ROWS = (1, 2, 4, 8)
BF16_ROWS = (16, 64, 256)


def groups(args: argparse.Namespace) -> dict[str, list[int]]:
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    return {"qkv": [q, kv, kv], "gate_up": [args.intermediate, args.intermediate]}


def build(kind: str, k: int, sizes: list[int]) -> tuple[list[nn.Module], nn.Module]:
    """The parts and their fusion, as the loader makes them (random weights: timing only)."""
    from engine.layers.fused_linears import concat_linears
    from engine.layers.packed_linear import PackedLinear
    from engine.layers.quantization.linear import Int4Linear
    from engine.layers.quantization.pack import quantize_int4

    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for n in sizes]
    if kind == "int4":
        parts: list[nn.Module] = [Int4Linear(quantize_int4(w, 32)) for w in weights]
        fused = concat_linears(parts)
        assert fused is not None, "these shapes do not fuse"
        return parts, fused
    bf16 = [w.to(torch.bfloat16) for w in weights]
    return ([PackedLinear(w, None) for w in bf16],
            PackedLinear(torch.cat(bf16), None))


def timed(fn: Callable[[], Any], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


@torch.inference_mode()
def measure(kind: str, k: int, sizes: list[int], rows: int, repeats: int,
            iters: int) -> dict[str, float]:
    parts, fused = build(kind, k, sizes)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    runs: dict[str, Callable[[], Any]] = {"apart": lambda: [p(x) for p in parts],
                                          "fused": lambda: fused(x)}
    for fn in runs.values():
        timed(fn, iters // 4 + 1)  # warm: caches, oneDNN primitives, thread pool
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        order = list(runs)
        random.shuffle(order)
        for name in order:
            samples[name].append(timed(runs[name], iters))
    apart, fused_us = statistics.median(samples["apart"]), statistics.median(samples["fused"])
    return {"apart_us": apart, "fused_us": fused_us, "speedup": apart / fused_us}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=576, help="hidden size (input of q/k/v, gate/up)")
    p.add_argument("--intermediate", type=int, default=1536, help="MLP width")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=200, help="calls per timed sample")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    random.seed(0)
    results = []
    plan = [("int4", r) for r in INT4_ROWS] + [("bf16", r) for r in BF16_ROWS]
    for kind, rows in plan:
        for name, sizes in groups(args).items():
            res = measure(kind, args.hidden, sizes, rows, args.repeats, args.iters)
            results.append({"kind": kind, "group": name, "sizes": sizes, "rows": rows, **res})
            print(f"{kind:4} {name:7} rows={rows:4}: apart {res['apart_us']:8.1f} us, "
                  f"fused {res['fused_us']:8.1f} us ({res['speedup']:.2f}x)", flush=True)
    info = machine_info()
    out = args.out / f"fused-linears-{machine_slug(info)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "fused_linears", "machine": info,
                               "threads": torch.get_num_threads(), "args": vars(args) | {
                                   "out": str(args.out)}, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
