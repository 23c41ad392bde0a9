"""Decode attention alone: the CPU kernel (engine/attention/csrc/paged_decode.cpp) against the torch path
(gather + two bmm, engine/attention/paged.py), on one layer of a paged pool, model shapes.

For each dtype, number of decodes D and context length, both paths attend the same D queries
over the same pool through `engine.attention.paged.attend` (metadata built as the runner builds it,
block tables shuffled over the pool as a long-running server's are), alternating in a shuffled
order; the median of `--repeats` calls is kept, and the ratio torch / kernel is reported.
A 30-layer model pays this 30 times a step. `--kv-dtypes auto int8` adds the int8 KV cache
(engine/attention/kv_int8.py): each path over an int8 pool holding the same values, and the
kernel's time over the int8 pool against its time over the dtype's own.

    .venv/bin/python -m benchmarks.bench_decode_attention                 # SmolLM2-135M shapes
    .venv/bin/python -m benchmarks.bench_decode_attention --threads 1 --dtypes float32
    .venv/bin/python -m benchmarks.bench_decode_attention --heads 32 --kv-heads 8 \
        --dtypes bfloat16 --kv-dtypes auto int8                          # Llama-3.2-1B shapes

Writes benchmarks/results/decode-attention-<machine>.json with the machine description.
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

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_case(decodes: int, context: int, heads: int, kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, paged_kernel: bool,
              seed: int, int8: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """q [H, D, hd], the new k/v [kvH, D, hd] and the metadata of D decodes at `context`
    (int8: the pool's values held as the int8 KV cache holds them)."""
    from engine.attention import kv_int8
    from engine.attention.paged import build_metadata

    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    blocks = list(range(decodes * per_seq + 1))
    random.Random(seed).shuffle(blocks)
    pool = torch.randn(1, 2, len(blocks), kv_heads, block_size, head_dim, generator=gen).to(dtype)
    if int8:
        pool = kv_int8.quantize(pool)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(decodes)]
    slots = [t[(context - 1) // block_size] * block_size + (context - 1) % block_size
             for t in tables]
    meta = build_metadata(pool, block_size, slots, [(t, context) for t in tables], [],
                          torch.device("cpu"), paged_decode_kernel=paged_kernel)
    q = torch.randn(heads, decodes, head_dim, generator=gen).to(dtype)
    kv = torch.randn(2, kv_heads, decodes, head_dim, generator=gen).to(dtype)
    return q, kv[0], kv[1], meta


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from engine.attention.paged import attend

    rng = random.Random(args.seed)
    rows = []
    cases = [(dt, d, c) for dt in args.dtypes for d in args.decodes for c in args.contexts]
    with torch.inference_mode():
        for dt, d, c in tqdm(cases, desc="cases", unit="case"):
            calls = {}  # (path, kv dtype) -> one call, all timed interleaved
            for kv in args.kv_dtypes:
                for path, kernel in (("kernel", True), ("torch", False)):
                    q, k, v, meta = make_case(d, c, args.heads, args.kv_heads, args.head_dim,
                                              args.block_size, DTYPES[dt], kernel, args.seed,
                                              int8=kv == "int8")
                    calls[path, kv] = (lambda q=q, k=k, v=v, meta=meta:
                                       attend(q, k, v, 0, args.head_dim ** -0.5, meta))
            times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
            outs = {key: fn() for key, fn in calls.items()}  # warm, and compare
            order = list(calls)
            for _ in range(args.repeats):
                rng.shuffle(order)
                for key in order:
                    t0 = time.perf_counter()
                    calls[key]()
                    times[key].append(time.perf_counter() - t0)
            ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
            for kv in args.kv_dtypes:
                err = (outs["kernel", kv].float() - outs["torch", kv].float()).abs().max().item()
                row = {"dtype": dt, "kv_dtype": kv, "decodes": d, "context": c,
                       "kernel_ms": ms["kernel", kv], "torch_ms": ms["torch", kv],
                       "speedup": ms["torch", kv] / ms["kernel", kv], "max_abs_diff": err}
                if kv != "auto" and "auto" in args.kv_dtypes:  # the same kernel, its own pool
                    row["kernel_vs_auto"] = ms["kernel", "auto"] / ms["kernel", kv]
                rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--kv-dtypes", nargs="+", default=["auto"], choices=["auto", "int8"],
                   help="what the pool holds (as --kv-cache-dtype): auto, the dtype's own")
    p.add_argument("--decodes", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="decodes in the step (D)")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048],
                   help="context length of every decode, tokens")
    p.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads (SmolLM2-135M: 3)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the server's, every usable core)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from api.cli import serving_threads
    from engine.attention import cpu_kernels

    args = parse_args(argv)
    torch.set_num_threads(args.threads or serving_threads())
    if not cpu_kernels.paged_decode_available():
        raise SystemExit("the CPU paged-decode kernel did not build (see the warning above)")
    rows = measure(args)
    print(f"{'dtype':>9} {'kv':>5} {'D':>4} {'ctx':>5} {'kernel ms':>10} {'torch ms':>9} "
          f"{'torch/kernel':>13} {'auto/int8 kernel':>17}")
    for r in rows:
        vs = f"{r['kernel_vs_auto']:>16.2f}x" if "kernel_vs_auto" in r else ""
        print(f"{r['dtype']:>9} {r['kv_dtype']:>5} {r['decodes']:>4} {r['context']:>5} "
              f"{r['kernel_ms']:>10.3f} {r['torch_ms']:>9.3f} {r['speedup']:>12.2f}x {vs}")
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    shape = ("" if (args.heads, args.kv_heads, args.head_dim) == (9, 3, 64)  # SmolLM2's
             else f"{args.heads}x{args.kv_heads}x{args.head_dim}-")
    path = args.out / f"decode-attention-{shape}{machine_slug(info)}.json"
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path.write_text(json.dumps({"benchmark": "decode_attention", "args": config,
                                "threads": torch.get_num_threads(), "machine": info,
                                "rows": rows}, indent=2))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
