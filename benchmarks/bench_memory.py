"""Resident memory of a served model at each --quantization (issue 37): peak at load and
steady once ready, with the engine's own account of where it goes (engine/worker/memory.py:
weights by form, dense copies kept beside quantized weights, KV pool, warm-up, the rest).

Each mode loads in a fresh process (peak RSS is per process), the way `pagedserve serve`
does (a ModelRunner, then its warm-up steps), eager unless --compile.

    python -m benchmarks.bench_memory                       # the embedded SmolLM2-135M
    python -m benchmarks.bench_memory --shape llama-1b      # a random Llama-3.2-1B-shaped one
    python -m benchmarks.bench_memory --shape llama-8b --quantization int4 --generate 32

--generate N also serves one greedy request of N tokens (c=1, a 100-token prompt) once
ready and reports its inter-token latency (median step time of its decode steps) and the
resident set after it.

Saves JSON (and a PNG of the account) under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug

MiB = 2**20


def measure(model: str, quantization: str, dtype: str, kv_bytes: int, compile: bool,
            generate: int = 0) -> dict:
    """One mode in a child process: its memory account and load time (and, with `generate`,
    one request's ITL)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_memory", "--child", "--model", model,
           "--quantization", quantization, "--dtype", dtype, "--kv-cache-memory", str(kv_bytes),
           "--generate", str(generate)]
    if compile:
        cmd.append("--compile")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"quantization": quantization, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(model: str, quantization: str, dtype: str, kv_bytes: int, compile: bool,
          generate: int = 0) -> None:
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.worker.memory import resident_bytes

    config = EngineConfig(model=model, dtype=dtype, quantization=quantization,
                          kv_cache_memory=kv_bytes, enforce_eager=not compile)
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    engine.load()
    account = dict(engine.runner.memory.items())
    row: dict[str, Any] = {"quantization": quantization, "load_s": time.perf_counter() - t0,
                           **account}
    if generate:
        row |= serve_one(engine, generate) | {"resident_after_request": resident_bytes()}
    print(json.dumps(row))


def serve_one(engine: Any, tokens: int) -> dict[str, float]:
    """One greedy request of `tokens` tokens alone (c=1): its decode steps' median time."""
    import statistics

    from scheduler.sampling_params import SamplingParams

    prompt = list(range(1000, 1100))  # 100 tokens of the model's vocabulary
    engine.add_request("one", prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                     ignore_eos=True))
    times, t0 = [], time.perf_counter()
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    decode = times[1:]  # the first step is the prompt's
    return {"ttft_s": times[0], "itl_ms_p50": statistics.median(decode) * 1e3,
            "generated": tokens, "request_s": time.perf_counter() - t0}


def table(rows: list[dict]) -> str:
    kinds = ["dense_weights", "packed_weights", "quantized_weights", "dense_copies", "kv_pool",
             "warm_up", "other", "resident", "peak"]
    head = "| quantization | " + " | ".join(k.replace("_", " ") for k in kinds) + " | load s |"
    lines = [head, "|---" * (len(kinds) + 2) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['quantization']} | error: {r['error']} |")
            continue
        cells = [f"{r[k] / MiB:.0f}" for k in kinds]
        lines.append(f"| {r['quantization']} | " + " | ".join(cells) + f" | {r['load_s']:.1f} |")
    return "\n".join(lines) + "\n(MiB)"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ["dense_weights", "packed_weights", "quantized_weights", "dense_copies", "kv_pool",
             "warm_up", "other"]
    ok = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(ok)
    for part in parts:
        values = [r[part] / MiB for r in ok]
        ax.bar([r["quantization"] for r in ok], values, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.scatter([r["quantization"] for r in ok], [r["peak"] / MiB for r in ok], color="black",
               marker="_", s=400, label="peak at load", zorder=3)
    ax.set_ylabel("MiB resident")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint folder or .gguf (default: the embedded model)")
    p.add_argument("--shape", help="a random checkpoint of these shapes (benchmarks/shapes.py)")
    p.add_argument("--quantization", nargs="+", default=["none", "int8", "int4"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", type=int, default=256 * MiB, help="KV pool bytes")
    p.add_argument("--compile", action="store_true", help="compile the step (minutes)")
    p.add_argument("--generate", type=int, default=0,
                   help="also serve one greedy request of this many tokens and time it")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.model, args.quantization[0], args.dtype, args.kv_cache_memory, args.compile,
              args.generate)
        return
    model = args.model
    if args.shape:
        from benchmarks.shapes import random_model

        model = str(random_model(args.shape))
    if model is None:
        from benchmarks.common import model_folder

        model = str(model_folder())
    rows = []
    for mode in args.quantization:
        print(f"loading {model} with --quantization {mode} ...", flush=True)
        rows.append(measure(model, mode, args.dtype, args.kv_cache_memory, args.compile,
                            args.generate))
    print(table(rows))
    for r in rows:
        if "itl_ms_p50" in r:
            print(f"{r['quantization']}: one request of {r['generated']} tokens: TTFT "
                  f"{r['ttft_s'] * 1e3:.0f} ms, ITL p50 {r['itl_ms_p50']:.1f} ms, resident "
                  f"after it {r['resident_after_request'] / MiB:.0f} MiB")
    info = machine_info()
    label = args.shape or (Path(args.model).name if args.model else "smollm2-135m")
    name = f"memory-{label}-{machine_slug(info)}"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"machine": info, "model": model, "shape": args.shape,
                            "dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
                            "compile": args.compile, "rows": rows}
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(data, indent=2, default=str))
    plot(rows, RESULTS_DIR / f"{name}.png", f"{name} ({args.dtype}, KV pool "
         f"{args.kv_cache_memory // MiB} MiB)")
    print(f"saved {RESULTS_DIR / name}.json and .png")


if __name__ == "__main__":
    main()
