"""A quantized model's decode step with one copy of its weights (the many-row kernel serves
steps above 8 rows) against dense copies kept for those steps (the fallback where that
kernel is unavailable, and what every quantized model did before it), in one process.

    .venv/bin/python -m benchmarks.bench_quant_step                       # embedded SmolLM2, auto
    .venv/bin/python -m benchmarks.bench_quant_step --shape llama-1b --quantization int4

Both engines load the same model (bf16, eager) side by side; the fallback is made by
reporting the many-row kernel unavailable while it loads. At each concurrency every engine
is given that many greedy requests (100-token prompts), their prompts are run, and then a
number of pure decode steps are timed; rounds alternate the engines and the median step time
is kept. Also reports each engine's resident weights (its memory account). Saves JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug

MiB = 2**20


@contextmanager
def many_rows_kernel(available: bool) -> Any:
    from engine.layers.quantization import many_rows

    real = many_rows.available
    if not available:
        many_rows.available = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        many_rows.available = real


def load(model: str | None, quantization: str, one_copy: bool) -> Any:
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

    config = EngineConfig(model=model, dtype="bfloat16", quantization=quantization,
                          enforce_eager=True)
    with many_rows_kernel(one_copy):
        engine = LLMEngine(config)
        engine.load()
    return engine


def decode_steps(engine: Any, streams: int, steps: int, round_: int) -> list[float]:
    """Seconds of each of `steps` decode steps of `streams` greedy requests (prompts done)."""
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    ids = [f"r{round_}-{streams}-{i}" for i in range(streams)]
    vocab = engine.runner.facts.vocab_size
    for i, rid in enumerate(ids):
        engine.add_request(rid, [(1000 + i * 7 + j) % vocab for j in range(100)], params)
    sched = engine.scheduler
    while sched.waiting or any(not s.output_token_ids for s in sched.running):
        engine.step()  # the prompts, until every request decodes
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint folder or .gguf (default: the embedded model)")
    p.add_argument("--shape", help="a random checkpoint of these shapes (benchmarks/shapes.py)")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    model = args.model
    if args.shape:
        from benchmarks.shapes import random_model

        model = str(random_model(args.shape))
    engines = {"one copy": load(model, args.quantization, True),
               "dense copies": load(model, args.quantization, False)}
    samples: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for streams in args.streams:
            for name in order:
                times = decode_steps(engines[name], streams, args.steps, r)
                samples.setdefault((name, streams), []).extend(times)
    medians = {f"{n}@{c}": statistics.median(v) * 1e3 for (n, c), v in samples.items()}
    weights = {n: {k: v / MiB for k, v in e.runner.memory.items()
                   if k in ("quantized_weights", "dense_copies")}  # one process: no RSS each
               for n, e in engines.items()}
    print(f"decode step, ms (median of {args.rounds} x {args.steps} steps)")
    print(f"{'streams':>8} {'one copy':>10} {'dense copies':>13} {'ratio':>7}")
    for c in args.streams:
        one, dense = medians[f"one copy@{c}"], medians[f"dense copies@{c}"]
        print(f"{c:>8} {one:>10.1f} {dense:>13.1f} {one / dense:>6.2f}x")
    for n, w in weights.items():
        print(f"{n}: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in w.items()))
    info = machine_info()
    label = args.shape or (Path(args.model).name if args.model else "smollm2-135m")
    out = args.out / f"quant-step-{label}-{args.quantization}-{machine_slug(info)}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "quant_step", "args": vars(args) | {"out": str(args.out)},
                               "machine": info, "step_ms_median": medians,
                               "memory_mib": weights}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
