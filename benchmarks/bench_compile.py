"""The compiled step against --enforce-eager: model step time and start-up time.

The real SmolLM2-135M (--dtype, float32 by default). One runner per mode (eager, compiled
with the token count marked dynamic, compiled with bucketed token counts) in this process;
each prints its load time, warm-up compile included (run twice, or with a fresh
TORCHINDUCTOR_CACHE_DIR, to see a cold and a warm inductor cache). Then, per N: every
mode's N sequences get random 128-token prompts (prefilled 8 per step, untimed), and
--steps decode steps over all N are timed, the modes taking turns step by step so that a
shared machine's load hits them alike. Prints the median and the minimum per mode, and
the ratio of medians to eager. On a shared CPU pass --threads 1.

    .venv/bin/python -m benchmarks.bench_compile --streams 1 16 64 --steps 8 --modes eager dynamic
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.bench_batch_invariant import step
from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

MODES = {"eager": {"enforce_eager": True}, "dynamic": {"compile_dynamic": True},
         "buckets": {"compile_dynamic": False}}
PROMPT_TOKENS = 128


def load(mode: str, dtype: str, threads: int | None, budget: int) -> ModelRunner:
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget, max_model_len=1024,
                            block_size=16)
    runner = ModelRunner(EngineConfig(dtype=dtype, device="cpu", num_kv_blocks=1100,
                                      num_threads=threads, scheduler=sched,
                                      **MODES[mode]))  # type: ignore[arg-type]
    start = time.perf_counter()
    runner.load()
    print(f"{mode}: load {time.perf_counter() - start:.1f} s", flush=True)
    return runner


def prefilled(runner: ModelRunner, streams: int, steps: int) -> list[Sequence]:
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    seqs = [Sequence(f"s{i}", [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)],
                     params) for i in range(streams)]
    blocks_each = (PROMPT_TOKENS + steps + 2) // runner.block_size + 1
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * blocks_each, (i + 1) * blocks_each))
    for i in range(0, streams, 8):
        group = seqs[i:i + 8]
        step(runner, group, [PROMPT_TOKENS] * len(group))
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=["eager", "dynamic"])
    ap.add_argument("--budget", type=int, default=1024,
                    help="max_num_batched_tokens: the largest bucket (prefills go 8 x 128)")
    args = ap.parse_args()
    runners = {mode: load(mode, args.dtype, args.threads, args.budget) for mode in args.modes}
    for n in args.streams:
        seqs = {mode: prefilled(r, n, args.steps) for mode, r in runners.items()}
        times: dict[str, list[float]] = {mode: [] for mode in runners}
        for _ in range(args.steps):
            for mode, runner in runners.items():
                times[mode].append(step(runner, seqs[mode], [1] * n))
        base = statistics.median(times[args.modes[0]])
        for mode, t in times.items():
            med = statistics.median(t)
            print(f"{args.dtype} streams {n:3d} {mode:8s}: decode step median {med * 1e3:7.1f} ms"
                  f" min {min(t) * 1e3:7.1f} ms ({med * 1e3 / n:6.2f} ms/token; "
                  f"{args.modes[0]}/{mode} {base / med:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
