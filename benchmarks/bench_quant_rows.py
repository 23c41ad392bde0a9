"""Where the quantized kernels stop paying: the linear work of one step at N token rows,
torch's quantized kernel, our many-row kernel and the dense weight, on the loaded model.

A step of N token rows calls every linear of the model once with N rows (the lm_head only
with the rows that need logits; a decode step needs all of them). For each quantized module
of `--quantization` (engine/layers/quantization/quant.py) and each N, this times the module's torch int4/int8
kernel (`_kernel`, activations cast to the kernel dtype and back, as forward does), our
many-row kernel (`_many_rows_kernel`, engine/layers/quantization/many_rows.py, where it is available) and a
dense copy (kept for this benchmark: oneDNN-packed in bf16, engine/layers/packed_linear.py),
alternating them in a shuffled order so a shared machine's drift hits all alike, and keeps
the median. Summed over the modules, that is the part of a step that MANY_ROWS_ABOVE and
DENSE_ABOVE_ROWS decide; the crossover is the smallest N from which dense is faster than
torch's kernel.

    .venv/bin/python -m benchmarks.bench_quant_rows                    # auto (GGUF Q4_1), fp32
    .venv/bin/python -m benchmarks.bench_quant_rows --quantization int8 --threads 1
    .venv/bin/python -m benchmarks.bench_quant_rows --model <folder> --quantization w8a8 \
        --dtype bfloat16

With int8 codes (`int8`, `w8a8`) a fourth path is timed: the W8A8 product (activations
quantized per token, torch._int_mm; W8A8Linear's path above W8A8_ABOVE rows).

Writes benchmarks/results/quant-rows-<machine>-<mode>-<dtype>.json with the machine
description.
"""

from __future__ import annotations

import argparse
import json
import os
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

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug

ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def quant_modules(model: Any) -> list[tuple[str, Any]]:
    from engine.layers.quantization.linear import _QuantLinear

    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, _QuantLinear)]
    missing = [n for n, m in mods if m.dense is None]
    if missing:
        raise SystemExit(f"{len(missing)} quantized modules have no dense copy ({missing[0]}...)")
    return mods


def kernel_call(mod: Any, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        return mod._kernel(x.to(mod.kernel_dtype)).to(x.dtype)
    return call


def many_rows_call(mod: Any, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        return mod._many_rows_kernel(x.to(mod.kernel_dtype).contiguous()).to(x.dtype)
    return call


def w8a8_call(mod: Any, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    from engine.layers.quantization.linear import w8a8_mm

    def call() -> torch.Tensor:
        return w8a8_mm(x.to(mod.kernel_dtype), mod.codes, mod.scales).to(x.dtype)
    return call


def dense_call(mod: Any, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: mod.dense(x)


def time_once(fn: Callable[[], torch.Tensor]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def group(name: str) -> str:
    """The module's kind without its layer: model.layers.3.mlp.up_proj -> mlp.up_proj."""
    parts = name.split(".")
    return ".".join(parts[3:]) if parts[:2] == ["model", "layers"] else name


def measure(mods: list[tuple[str, Any]], rows: tuple[int, ...], repeats: int,
            seed: int, dtype: torch.dtype = torch.float32) -> dict[int, dict[str, dict[str, float]]]:
    """{N: {group: {"kernel": s, "many_rows": s, "dense": s}}}: per N and module kind, the
    sum over its modules of each path's median ("many_rows" only where every module has our
    kernel); group "all" sums every module."""
    from tqdm import tqdm

    paths = {"kernel": kernel_call, "dense": dense_call}
    if all(mod.use_many_rows for _, mod in mods):
        paths["many_rows"] = many_rows_call
    if all(hasattr(mod, "codes") for _, mod in mods):  # int8 codes: the W8A8 product too
        paths["w8a8"] = w8a8_call
    rng = random.Random(seed)
    samples: dict[tuple[int, str, str], list[float]] = {}
    jobs = [(n, name, mod) for n in rows for name, mod in mods]
    with torch.inference_mode():
        for _ in tqdm(range(repeats), desc="rounds", unit="round"):
            rng.shuffle(jobs)
            for n, name, mod in jobs:
                x = torch.randn(n, mod.in_features, dtype=dtype)
                calls = [(path, make(mod, x)) for path, make in paths.items()]
                rng.shuffle(calls)
                for path, fn in calls:
                    fn()  # warm: the first call of a shape may allocate
                    samples.setdefault((n, name, path), []).append(time_once(fn))
    out: dict[int, dict[str, dict[str, float]]] = {}
    for n in rows:
        out[n] = {}
        for name, _ in mods:
            for g in ("all", group(name)):
                acc = out[n].setdefault(g, dict.fromkeys(paths, 0.0))
                for path in acc:
                    acc[path] += statistics.median(samples[(n, name, path)])
    return out


def crossover(per_rows: dict[int, dict[str, float]]) -> int | None:
    """Smallest N from which dense is faster at every larger N measured."""
    ns = sorted(per_rows)
    for i, n in enumerate(ns):
        if all(per_rows[m]["dense"] < per_rows[m]["kernel"] for m in ns[i:]):
            return n
    return None


def with_dense_copies(model: Any, dtype: torch.dtype) -> Any:
    """Give every quantized module a dense bf16 copy of its dequantized weight to time
    against (what DENSE_ABOVE_ROWS keeps where our many-row kernel is unavailable), packed
    as the loader packs dense linears."""
    from engine.layers.packed_linear import PackedLinear, packing_applies
    from engine.layers.quantization.linear import _dense_linear

    with torch.inference_mode():
        for _, mod in model.named_modules():
            if getattr(mod, "kernel_dtype", None) is None or getattr(mod, "dense", 1) is not None:
                continue
            eye = torch.eye(mod.in_features, dtype=mod.kernel_dtype)
            call = mod._many_rows_kernel if mod.use_many_rows else mod._kernel
            weight = call(eye).t().to(dtype).contiguous()  # [N, K]: W e_k is row k of W^T
            packs = packing_applies(weight.device, weight.dtype, False)
            dense = PackedLinear(weight, None) if packs else _dense_linear(weight, None)
            mod.dense, mod.dense_above = dense, 10**9  # kept for timing only, never chosen
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M (Q4_1 GGUF)")
    p.add_argument("--quantization", default="auto", choices=("auto", "int8", "int4", "w8a8"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: what `pagedserve serve` uses, every usable core)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from api.cli import serving_threads
    from engine.worker.loader import load_model

    args = parse_args(argv)
    threads = args.threads or serving_threads()
    torch.set_num_threads(threads)
    loaded = load_model(args.model, device="cpu", dtype=args.dtype, quantization=args.quantization)
    mods = quant_modules(with_dense_copies(loaded.model, getattr(torch, args.dtype)))
    per_rows = measure(mods, tuple(args.rows), args.repeats, args.seed,
                       getattr(torch, args.dtype))
    crossovers = {g: crossover({n: v[g] for n, v in per_rows.items()})
                  for g in next(iter(per_rows.values()))}
    print(f"{len(mods)} quantized linears, {args.dtype}, {threads} thread(s); ms per step")
    for g, cross in crossovers.items():
        print(f"\n{g}: {'rows':>5} {'kernel':>9} {'many_rows':>10} {'w8a8':>9} {'dense':>9} "
              f"{'dense/kernel':>13}")
        for n, v in per_rows.items():
            k, d, m = v[g]["kernel"], v[g]["dense"], v[g].get("many_rows", float("nan"))
            w = v[g].get("w8a8", float("nan"))
            print(f"{'':{len(g) + 2}}{n:>5} {k * 1e3:>9.2f} {m * 1e3:>10.2f} {w * 1e3:>9.2f} "
                  f"{d * 1e3:>9.2f} {d / k:>12.2f}x")
        print(f"{'':{len(g) + 2}}crossover: {cross}")
    print(f"\ncrossover of the whole step (dense faster from here on): {crossovers['all']} rows")
    machine = machine_info() | {"load_avg_at_end": os.getloadavg()}
    data = {"benchmark": "quant_rows", "args": vars(args) | {"out": str(args.out)},
            "threads": threads, "modules": len(mods), "machine": machine,
            "ms": {n: {g: {k: s * 1e3 for k, s in t.items()} for g, t in v.items()}
                   for n, v in per_rows.items()},
            "crossover_rows": crossovers["all"], "crossover_rows_by_group": crossovers}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"quant-rows-{machine_slug(machine)}-{args.quantization}-{args.dtype}.json"
    path.write_text(json.dumps(data, indent=2))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
