"""What the live view (/dashboard, /v1/engine/events) costs the engine, watched and not.

Not watched, the only work is StepLog.record, once per step (engine/core/live_view.py). It is
timed here against the scheduler's own schedule() + postprocess() of the same step, at a
steady state of N decoding sequences. Watched, each look builds a snapshot between two steps
(build_snapshot: the steps since the last look, the KV pool's states block by block, up to 50
request rows) and the API turns it into the event's JSON; at 10 looks a second (the most the
event stream allows) that is 10 x (build + encode) per second of the engine thread's time.

    .venv/bin/python -m benchmarks.bench_live_view --running 64 256 --blocks 8192 32768
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from api.live import _snapshot  # the event's JSON of one engine, as the API builds it
from benchmarks.common import machine_info, save_result
from engine.core.live_view import StepLog, build_snapshot
from scheduler.config import SchedulerConfig
from scheduler.limits import EngineLimits
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence

BLOCK_SIZE = 16
STEPS_PER_LOOK = 25  # a look every 100 ms at ~4 ms scheduler steps: the steps it carries


def steady(n: int, num_blocks: int) -> Scheduler:
    """n sequences, prompts of 32-512 tokens, all decoding."""
    cfg = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=1 << 20, max_model_len=4096,
                          block_size=BLOCK_SIZE)
    limits = EngineLimits(4096, num_blocks, BLOCK_SIZE, 50_000, frozenset({0}))
    s = Scheduler(cfg, limits)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(n):
        s.add(Sequence(f"r{i}", [rng.randrange(1000, 3000) for _ in range(rng.randint(32, 512))],
                       params))
    for _ in range(1000):  # prompts in (chunked), until every sequence decodes
        advance(s)
        if s.num_running == n and all(q.num_uncomputed_tokens == 1 for q in s.running):
            break
    assert s.num_running == n, "the pool is too small for the sequences"
    return s


def advance(s: Scheduler) -> None:
    """One step, every sampling sequence given token 7."""
    batch = s.schedule()
    s.postprocess(batch, {seq.seq_id: 7 for seq in batch.seqs})


def median_us(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def measure(n: int, num_blocks: int) -> dict[str, Any]:
    s = steady(n, num_blocks)
    batch = s.schedule()  # one decode step's batch, kept to replay record() on it
    step_us = median_us(lambda: advance(s), 200)
    log = StepLog()
    started = time.perf_counter()
    record_us = median_us(lambda: log.record(1, batch, started), 20_000)
    for i in range(2, 600):
        log.record(i, batch, started)
    since = 599 - STEPS_PER_LOOK
    build_us = median_us(lambda: build_snapshot(log, s, {}, since), 200)
    snap = build_snapshot(log, s, {}, since)
    encode_us = median_us(lambda: json.dumps(_snapshot(snap)), 200)
    look_us = build_us + encode_us
    return {"running": n, "num_blocks": num_blocks,
            "scheduler_step_us": round(step_us, 1), "record_us": round(record_us, 2),
            "record_share_of_scheduler_step": round(record_us / step_us, 4),
            "snapshot_build_us": round(build_us, 1), "event_encode_us": round(encode_us, 1),
            "watched_10hz_core_share": round(10 * look_us / 1e6, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, nargs="+", default=[64, 256])
    p.add_argument("--blocks", type=int, nargs="+", default=[8192, 32768])
    args = p.parse_args()
    rows = [measure(n, b) for n in args.running for b in args.blocks]
    for r in rows:
        print(f"N={r['running']:4d} blocks={r['num_blocks']:6d}: record {r['record_us']:.2f} us "
              f"({100 * r['record_share_of_scheduler_step']:.2f}% of schedule+postprocess "
              f"{r['scheduler_step_us']:.0f} us); a look {r['snapshot_build_us']:.0f} + "
              f"{r['event_encode_us']:.0f} us, at 10/s {100 * r['watched_10hz_core_share']:.2f}% "
              "of a core")
    path = save_result("live-view-cost", {"machine": machine_info(), "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
