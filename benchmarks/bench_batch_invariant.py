"""The cost of --batch-invariant: model step time with the mode off and on.

The real SmolLM2-135M (bfloat16 unless --dtype), N sequences with random 128-token prompts:
the first three prompts are prefilled alone (one 128-token prefill each: the prefill time),
the rest 8 per step (untimed), then --steps decode steps over all N are timed (the decode
step time). Medians; the ratio is on / off. Prints one line per N and writes nothing. On a
shared CPU pass --threads 1 (waiting for a descheduled sibling thread swamps the numbers).

    .venv/bin/python -m benchmarks.bench_batch_invariant --streams 1 16 64 --steps 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.config import EngineConfig
from engine.worker.model_runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence

PROMPT_TOKENS = 128


def load(dtype: str, invariant: bool, threads: int | None) -> ModelRunner:
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024,
                            block_size=16)
    runner = ModelRunner(EngineConfig(dtype=dtype, device="cpu", num_kv_blocks=1100,
                                      num_threads=threads, batch_invariant=invariant,
                                      scheduler=sched))
    runner.load()
    return runner


def step(runner: ModelRunner, seqs: list[Sequence], counts: list[int]) -> float:
    batch = SchedulerOutput(seqs=seqs, num_scheduled_tokens=counts)
    start = time.perf_counter()
    out = runner.execute(batch)
    elapsed = time.perf_counter() - start
    for seq, n in zip(seqs, counts, strict=True):
        seq.num_computed_tokens += n
        seq.append_token(out.sampled_token_ids[seq.seq_id])
    return elapsed


def measure(runner: ModelRunner, streams: int, steps: int) -> tuple[float, float]:
    """(median prefill time of one prompt, median decode step time of all streams)."""
    rng = random.Random(0)
    params = SamplingParams(temperature=1.0, max_tokens=steps + 1, seed=1, ignore_eos=True)
    seqs = [Sequence(f"s{i}", [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)],
                     params) for i in range(streams)]
    blocks_each = (PROMPT_TOKENS + steps + 2) // runner.block_size + 1
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * blocks_each, (i + 1) * blocks_each))
    prefill = [step(runner, [seq], [PROMPT_TOKENS]) for seq in seqs[:3]]
    for i in range(3, streams, 8):
        group = seqs[i:i + 8]
        step(runner, group, [PROMPT_TOKENS] * len(group))
    decode = [step(runner, seqs, [1] * streams) for _ in range(steps)]
    return statistics.median(prefill), statistics.median(decode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    runners = {mode: load(args.dtype, mode, args.threads) for mode in (False, True)}
    for n in args.streams:
        (p_off, d_off), (p_on, d_on) = (measure(runners[m], n, args.steps) for m in (False, True))
        print(f"streams {n:3d}: decode step off {d_off * 1e3:7.1f} ms  on {d_on * 1e3:7.1f} ms  "
              f"ratio {d_on / d_off:.2f} | {PROMPT_TOKENS}-token prefill off {p_off * 1e3:6.1f} "
              f"ms  on {p_on * 1e3:6.1f} ms  ratio {p_on / p_off:.2f}", flush=True)


if __name__ == "__main__":
    main()
