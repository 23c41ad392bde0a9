"""How far compiling can take a step over eager: the compiled/eager ratio, and its ceiling.

Compiling removes per-op overhead (the interpreter, module calls, small kernels it fuses). It
does not shorten a GEMM or the attention kernel, which both modes call alike. So where those
two fill a step, no compiled step can beat eager by much. This loads the model twice in one
process, eager and compiled, and for each step shape:
- times `ModelRunner.execute` in both (median of `--repeats`, the two modes alternating in a
  shuffled order so a shared machine's drift hits both alike);
- profiles the compiled step (torch.profiler, self time per op) and splits it into linears
  (oneDNN, int4/int8 kernels, mm), attention (the paged decode kernel, SDPA, bmm) and the rest;
- reports the ceiling: eager's step over the compiled step's linears plus attention, the
  ratio a compiled step would reach if everything else in it cost nothing.
A workload line weighs decode and prefill steps as a closed load of `--requests` requests of
`--prompt-tokens` in and `--output-tokens` out at `--decodes` in flight would (benchmarks/
fast_step's c=64 by default), assuming decode steps of `--decodes` rows and prefill steps of
`--prefill-prompts` whole prompts; real steps mix the two, so this estimates the ratio, it is
not a run.

    .venv/bin/python -m benchmarks.compile_ceiling            # SmolLM2-135M, c=64's shapes
    .venv/bin/python -m benchmarks.compile_ceiling --decodes 16 --repeats 9

CPU only: the split reads the profiler's CPU self times. Writes
benchmarks/results/compile-ceiling-<machine>.json with the machine description.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug
from engine.worker.calibration import step_of
from scheduler.output import SchedulerOutput

# Substrings of profiler op names, lower-cased; the first group that matches wins. Wrappers
# (pagedserve::packed_linear, pagedserve::paged_attention) have small self times of their own.
KINDS = (
    ("attention", ("paged_decode", "attention", "scaled_dot_product", "bmm")),
    ("linear", ("linear", "int4pack", "int8pack", "aten::mm", "aten::addmm", "_int_mm")),
)


@dataclass
class Split:
    """One step's milliseconds: the wall median, and the profiled linears and attention."""

    step_ms: float
    linear_ms: float
    attention_ms: float

    @property
    def rest_ms(self) -> float:
        return max(0.0, self.step_ms - self.linear_ms - self.attention_ms)


def kind_of(op_name: str) -> str:
    name = op_name.lower()
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "rest"


def split_self_times(self_us: dict[str, float], steps: int) -> dict[str, float]:
    """Per-step milliseconds by kind, from op name -> total self microseconds over `steps`."""
    out = {"linear": 0.0, "attention": 0.0, "rest": 0.0}
    for name, us in self_us.items():
        out[kind_of(name)] += us / 1e3 / steps
    return out


def ceiling(eager_ms: float, compiled: Split) -> float:
    """eager / (the compiled step's linears + attention): the most compiling could give."""
    return eager_ms / max(1e-9, compiled.linear_ms + compiled.attention_ms)


def workload_steps(requests: int, output_tokens: int, decodes: int,
                   prefill_prompts: int) -> tuple[float, float]:
    """(decode steps, prefill steps) of the closed load, as whole steps of the two shapes."""
    return requests * output_tokens / decodes, requests / prefill_prompts


def workload_ratios(eager: dict[str, float], compiled: dict[str, Split],
                    steps: tuple[float, float]) -> dict[str, float]:
    """The load's eager/compiled ratio and its ceiling, decode and prefill steps weighed."""
    weights = dict(zip(("decode", "prefill"), steps, strict=True))
    e = sum(w * eager[k] for k, w in weights.items())
    c = sum(w * compiled[k].step_ms for k, w in weights.items())
    floor = sum(w * (compiled[k].linear_ms + compiled[k].attention_ms) for k, w in weights.items())
    return {"measured": e / c, "ceiling": e / floor}


def load_runner(args: argparse.Namespace, eager: bool) -> Any:
    from engine.config import EngineConfig
    from engine.worker.model_runner import ModelRunner
    from scheduler.config import SchedulerConfig

    prefill_tokens = args.prefill_prompts * args.prompt_tokens
    sched = SchedulerConfig(max_num_seqs=max(64, args.decodes, args.prefill_prompts),
                            max_num_batched_tokens=max(2048, prefill_tokens), max_model_len=2048)
    # Every row gets blocks of its own (16-token blocks, the default), as in a live server.
    blocks = (args.decodes * -(-args.context // 16)
              + args.prefill_prompts * -(-args.prompt_tokens // 16))
    runner = ModelRunner(EngineConfig(model=args.model, dtype=args.dtype, device="cpu",
                                      num_kv_blocks=max(1024, blocks), enforce_eager=eager,
                                      scheduler=sched))
    runner.load()
    return runner


def time_steps(runners: dict[str, Any], steps: dict[str, Any], repeats: int,
               seed: int) -> dict[tuple[str, str], float]:
    """Median ms of each (mode, shape), modes and shapes interleaved in a shuffled order."""
    from tqdm import tqdm

    keys = [(m, s) for m in runners for s in steps]
    for m, s in keys:  # warm-up: first calls allocate and, compiled, pick the graph
        for _ in range(2):
            runners[m].execute(steps[s])
    order = keys * repeats
    random.Random(seed).shuffle(order)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    for m, s in tqdm(order, desc="steps", unit="step"):
        t0 = time.perf_counter()
        runners[m].execute(steps[s])
        times[(m, s)].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def profile_step(runner: Any, step: Any, n: int = 5) -> dict[str, float]:
    """Per-step ms by kind of op (self time), over n profiled runs."""
    import torch

    with torch.profiler.profile() as prof:
        for _ in range(n):
            runner.execute(step)
    return split_self_times({e.key: e.self_cpu_time_total for e in prof.key_averages()}, n)


def build_step(decodes: int, context: int, prompts: int, prompt_tokens: int, block_size: int,
               pool_blocks: int, rng: random.Random) -> SchedulerOutput:
    """`decodes` one-token rows at `context`, then `prompts` whole prompts of `prompt_tokens`,
    over sequences whose block tables cover their tokens (distinct blocks, in order)."""
    rows = [(context, context - 1, 1)] * decodes + [(prompt_tokens, 0, prompt_tokens)] * prompts
    blocks = itertools.count()
    step = step_of(rows, blocks, block_size, rng)
    if (used := next(blocks)) > pool_blocks:
        raise ValueError(f"the step needs {used} KV blocks, the pool has {pool_blocks}")
    return step


def shapes(args: argparse.Namespace) -> dict[str, tuple[int, int, int, int]]:
    """name -> (decode rows, their context, prompts, tokens per prompt)."""
    return {"decode": (args.decodes, args.context, 0, 0),
            "prefill": (0, 0, args.prefill_prompts, args.prompt_tokens)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    runners = {"eager": load_runner(args, eager=True), "compiled": load_runner(args, eager=False)}
    rng = random.Random(args.seed)
    first = runners["eager"]
    steps = {name: build_step(*pt, first.block_size, first.num_kv_blocks, rng)
             for name, pt in shapes(args).items()}
    medians = time_steps(runners, steps, args.repeats, args.seed)
    compiled: dict[str, Split] = {}
    for name, step in steps.items():
        prof = profile_step(runners["compiled"], step)
        compiled[name] = Split(medians[("compiled", name)], prof["linear"], prof["attention"])
    eager = {name: medians[("eager", name)] for name in steps}
    load = workload_steps(args.requests, args.output_tokens, args.decodes, args.prefill_prompts)
    runner = runners["compiled"]
    return {
        "kind": "compile-ceiling", "machine": machine_info(), "device": str(runner.device),
        "dtype": str(runner.dtype), "model": runner.model_display_name,
        "repeats": args.repeats,
        "shapes": {name: {"point": list(pt), "eager_ms": eager[name],
                          "compiled": {**asdict(compiled[name]), "rest_ms": compiled[name].rest_ms},
                          "measured": eager[name] / compiled[name].step_ms,
                          "ceiling": ceiling(eager[name], compiled[name])}
                   for name, pt in shapes(args).items()},
        "workload": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens, "steps": list(load),
                     **workload_ratios(eager, compiled, load)},
    }


def print_report(data: dict[str, Any]) -> None:
    print(f"{'shape':>8} {'eager ms':>9} {'compiled':>9} {'linears':>8} {'attn':>7} "
          f"{'rest':>7} {'eager/compiled':>15} {'ceiling':>8}")
    for name, s in data["shapes"].items():
        c = s["compiled"]
        print(f"{name:>8} {s['eager_ms']:9.1f} {c['step_ms']:9.1f} {c['linear_ms']:8.1f} "
              f"{c['attention_ms']:7.1f} {c['rest_ms']:7.1f} {s['measured']:14.2f}x "
              f"{s['ceiling']:7.2f}x")
    w = data["workload"]
    print(f"workload ({w['requests']} requests, {w['prompt_tokens']} in, "
          f"{w['output_tokens']} out): eager/compiled {w['measured']:.2f}x, "
          f"ceiling {w['ceiling']:.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--decodes", type=int, default=64, help="rows of the decode step (default 64)")
    p.add_argument("--context", type=int, default=164,
                   help="each decode's context (default 164: ~100 in + half of 128 out)")
    p.add_argument("--prefill-prompts", type=int, default=10,
                   help="whole prompts in the prefill step (default 10)")
    p.add_argument("--prompt-tokens", type=int, default=100, help="tokens per prompt")
    p.add_argument("--requests", type=int, default=128, help="the workload line's requests")
    p.add_argument("--output-tokens", type=int, default=128,
                   help="the workload line's tokens out per request")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/compile-ceiling-<machine>.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data = measure(args)
    out = args.out or RESULTS_DIR / f"compile-ceiling-{machine_slug(data['machine'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str))
    print_report(data)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
