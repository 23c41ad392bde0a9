"""The CPU KV pool on huge pages against plain pages: the decode kernel over every layer.

Two pools of the engine's shape ([layers, K/V, blocks, kvH, block_size, hd], SmolLM2-135M's
by default) live in one process: one from `engine.worker.huge_pages.zeros` (what the runner uses),
one from `torch.zeros`. Block tables are shuffled over the pool, as a long-running server's
are once blocks have been freed and reused. A step is the C++ decode kernel over every layer
for `--decodes` sequences; the two pools alternate in a shuffled order (a shared machine's
drift hits both alike) and the median of `--repeats` steps is kept for each. Contexts: a mix
of 100-228 tokens (fast_step's c=64) and each `--contexts` length.

    .venv/bin/python -m benchmarks.bench_kv_huge_pages

Writes benchmarks/results/kv-huge-pages-<machine>.json with the machine description and the
process's AnonHugePages (0 kB: the OS gave no huge pages, and the two pools are alike).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug
from engine.attention import cpu_kernels
from engine.worker import huge_pages


def tables_for(contexts: list[int], block_size: int, num_blocks: int,
               rng: random.Random) -> torch.Tensor:
    """[D, width] block tables: every sequence its own blocks, drawn shuffled from the pool."""
    need = [-(-c // block_size) for c in contexts]
    blocks = rng.sample(range(num_blocks), sum(need))
    tables = torch.zeros(len(contexts), max(need), dtype=torch.long)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(blocks[at:at + n])
        at += n
    return tables


def anon_huge_kb() -> int | None:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def measure(args: argparse.Namespace, contexts: list[int]) -> dict[str, float]:
    rng = random.Random(args.seed)
    num_blocks = sum(-(-c // args.block_size) for c in contexts) + 64
    shape = (args.layers, 2, num_blocks, args.kv_heads, args.block_size, args.head_dim)
    pools = {"huge": huge_pages.zeros(shape, torch.bfloat16),
             "plain": torch.zeros(shape, dtype=torch.bfloat16)}
    for p in pools.values():
        p.normal_()
    tables = tables_for(contexts, args.block_size, num_blocks, rng)
    lens = torch.tensor(contexts, dtype=torch.long)
    q = torch.randn(len(contexts), args.heads, args.head_dim, dtype=torch.bfloat16)
    scale = args.head_dim ** -0.5

    def step(pool: torch.Tensor) -> float:
        t0 = time.perf_counter()
        for layer in range(args.layers):
            cpu_kernels.paged_decode(q, pool[layer, 0], pool[layer, 1], tables, lens, scale)
        return (time.perf_counter() - t0) * 1e3

    for p in pools.values():
        step(p)
    order = list(pools) * args.repeats
    rng.shuffle(order)
    times: dict[str, list[float]] = {k: [] for k in pools}
    for k in order:
        times[k].append(step(pools[k]))
    out = {f"{k}_ms": statistics.median(v) for k, v in times.items()}
    out["plain_over_huge"] = out["plain_ms"] / out["huge_ms"]
    out["anon_huge_kb"] = float(anon_huge_kb() or 0)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024],
                   help="uniform context lengths to run besides the 100-228 mix")
    p.add_argument("--layers", type=int, default=30, help="SmolLM2-135M: 30")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not cpu_kernels.paged_decode_available():
        raise SystemExit("the C++ decode kernel is not available here")
    rng = random.Random(args.seed)
    runs: dict[str, list[int]] = {"mix 100-228": [rng.randint(100, 228)
                                                  for _ in range(args.decodes)]}
    runs.update({f"ctx {c}": [c] * args.decodes for c in args.contexts})
    results: dict[str, Any] = {}
    for name, contexts in runs.items():
        results[name] = measure(args, contexts)
        r = results[name]
        print(f"{name:>12}: plain {r['plain_ms']:.2f} ms, huge {r['huge_ms']:.2f} ms, "
              f"plain/huge {r['plain_over_huge']:.3f} (AnonHugePages {r['anon_huge_kb']:.0f} kB)",
              flush=True)
    machine = machine_info()
    data = {"kind": "kv-huge-pages", "machine": machine, "thp": huge_pages.thp_mode(),
            "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"kv-huge-pages-{machine_slug(machine)}.json"
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
