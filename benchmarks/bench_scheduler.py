"""The scheduler's own cost per engine step, against the model's decode step.

At a steady state of N running sequences (prompts uniform in 32-512 tokens), per step:
  scheduler  the pure-Python Scheduler alone with a fake runner (one token for every sequence
             that reached the end of its tokens, no model): schedule() and postprocess(), the
             two scheduler calls LLMEngine.step() makes around the forward. Two cases:
             decode  all N decoding, max_tokens past the end of the run; the pool holds every
                     sequence to the end, so nothing is preempted (checked);
             mixed   closed loop at N in flight, outputs uniform in 16-256 tokens: a finished
                     sequence is replaced by a new arrival whose prompt goes in as chunked
                     prefill (budget 1024, chunk cap 256, as the default preset) beside decodes.
  engine     LLMEngine.step() with a fake ModelRunner and the embedded model's tokenizer: the
             whole step minus the fake execute() (scheduler + detokenizer + output objects).
  model      the real SmolLM2-135M decode step (ModelRunner.execute: tensors, forward, sampling)
             at the same N. Prompts are not run through the model: all of them go in one step
             answered by the fake, so prompt KV slots keep the pool's zeros (which cost a
             decode step exactly what real values cost) and contexts are prompt + ~25 tokens.
The scheduler's share is (schedule + postprocess) / model decode step; the target is < 5%.
On a CPU that other processes share, pass --threads 1: torch threads that must wait for a
descheduled sibling made decode steps 4-20x slower there, and the share misleadingly small.

    .venv/bin/python -m benchmarks.bench_scheduler --running 64 256 [--threads 1]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_info, save_result
from scheduler.config import SchedulerConfig
from scheduler.limits import EngineLimits
from scheduler.output import SchedulerOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence

PROMPT_LEN = (32, 512)
OUTPUT_LEN = (16, 256)  # mixed case only
BLOCK_SIZE = 16
FAKE_TOKENS = range(1000, 3000)  # ordinary ids of SmolLM2's vocabulary (no special tokens)


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Workload:
    """N sequences of random ordinary tokens. In the decode case max_tokens outlasts the run:
    the steps that prefill all prompts, then `steps` steps (warm-up and measured)."""

    num_running: int
    mixed: bool
    steps: int
    tokens: Seq[int] = FAKE_TOKENS

    @property
    def budget(self) -> int:
        """Tokens per step: the default preset's 1024, leaving at least N for prefill."""
        return max(1024, 2 * self.num_running)

    @property
    def max_tokens(self) -> int:
        if self.mixed:
            return OUTPUT_LEN[1]
        # Each step before all are decoding prefills at least budget - N prompt tokens.
        fill = -(-self.num_running * PROMPT_LEN[1] // (self.budget - self.num_running))
        return fill + self.steps + 2

    @property
    def max_len(self) -> int:
        return PROMPT_LEN[1] + self.max_tokens + 1

    @property
    def num_blocks(self) -> int:
        """Every sequence at its longest fits at once, so nothing is ever preempted."""
        return self.num_running * (-(-self.max_len // BLOCK_SIZE) + 1)

    @property
    def config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.num_running, max_num_batched_tokens=self.budget,
                               max_model_len=self.max_len, block_size=BLOCK_SIZE,
                               long_prefill_token_threshold=256)

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(max_model_len=self.max_len, num_kv_blocks=self.num_blocks,
                            block_size=BLOCK_SIZE, vocab_size=FAKE_TOKENS.stop,
                            eos_token_ids=frozenset())

    def request(self, rng: random.Random) -> tuple[list[int], SamplingParams]:
        prompt = [rng.choice(self.tokens) for _ in range(rng.randint(*PROMPT_LEN))]
        max_tokens = rng.randint(*OUTPUT_LEN) if self.mixed else self.max_tokens
        return prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def fake_sample(batch: SchedulerOutput, step: int, tokens: Seq[int]) -> dict[str, int]:
    """What the runner returns: a token for each sequence whose tokens are all computed now."""
    return {seq.seq_id: tokens[(step + i) % len(tokens)]
            for i, seq in enumerate(batch.seqs) if batch.samples(i)}


def summarize(ns: Seq[int]) -> dict[str, float]:
    """Nanosecond samples -> median / p90 / mean / max in microseconds."""
    us = [x / 1e3 for x in ns]
    p90 = statistics.quantiles(us, n=10, method="inclusive")[-1] if len(us) > 1 else us[0]
    return {"median": statistics.median(us), "p90": p90, "mean": statistics.fmean(us),
            "max": max(us)}


class StepLog:
    """Per measured step: durations of the timed calls, sequences and tokens scheduled."""

    def __init__(self) -> None:
        self.ns: dict[str, list[int]] = {}
        self.seqs: list[int] = []
        self.tokens: list[int] = []

    def add(self, batch: SchedulerOutput, **durations: int) -> None:
        for name, ns in durations.items():
            self.ns.setdefault(name, []).append(ns)
        self.seqs.append(len(batch.seqs))
        self.tokens.append(batch.total_num_scheduled_tokens)

    def result(self) -> dict[str, Any]:
        res: dict[str, Any] = {f"{k}_us": summarize(v) for k, v in self.ns.items()}
        res["scheduled_seqs"] = {"min": min(self.seqs), "mean": statistics.fmean(self.seqs),
                                 "max": max(self.seqs)}
        res["tokens_per_step"] = statistics.fmean(self.tokens)
        res["decode_only_steps"] = sum(t == s for t, s in zip(self.tokens, self.seqs))
        return res


# ----------------------------------------------------------------------------- scheduler alone


def bench_scheduler(num_running: int, steps: int, warmup: int, mixed: bool = False,
                    seed: int = 0) -> dict[str, Any]:
    """schedule() and postprocess() of the bare Scheduler at N running sequences."""
    wl = Workload(num_running, mixed, warmup + steps)
    sched = Scheduler(wl.config, wl.limits)
    rng, ids = random.Random(seed), itertools.count()

    def refill() -> None:  # closed loop: keep N sequences in flight
        while sched.num_running + sched.num_waiting < num_running:
            sched.add(Sequence(f"r{next(ids)}", *wl.request(rng)))

    refill()
    step, log = 0, StepLog()
    while not mixed and not _all_decoding(sched, num_running):  # untimed: prefill all prompts
        batch = sched.schedule()
        sched.postprocess(batch, fake_sample(batch, step, wl.tokens))
        step += 1
    for k in range(warmup + steps):
        t0 = time.perf_counter_ns()
        batch = sched.schedule()
        t1 = time.perf_counter_ns()
        sampled = fake_sample(batch, step + k, wl.tokens)
        t2 = time.perf_counter_ns()
        sched.postprocess(batch, sampled)
        t3 = time.perf_counter_ns()
        if k >= warmup:
            log.add(batch, schedule=t1 - t0, postprocess=t3 - t2, total=t1 - t0 + t3 - t2)
        if mixed:
            refill()
    sched.check_invariants()
    return {"case": "mixed" if mixed else "decode", "num_running": num_running, "steps": steps,
            "warmup": warmup, "num_preemptions": sched.num_preemptions,
            "running_at_end": sched.num_running, "waiting_at_end": sched.num_waiting,
            "finished": next(ids) - sched.num_running - sched.num_waiting, **log.result()}


def _all_decoding(sched: Scheduler, n: int) -> bool:
    return sched.num_running == n and all(s.num_uncomputed_tokens == 1 for s in sched.running)


# ----------------------------------------------------------------------------- engine, fake runner


class FakeRunner:
    """Stands in for a loaded ModelRunner inside LLMEngine: execute() samples without a model."""

    def __init__(self, hf_tokenizer: Any, num_kv_blocks: int, max_model_len: int) -> None:
        self.tokenizer = hf_tokenizer
        self.eos_token_ids = frozenset([hf_tokenizer.eos_token_id])
        self.vocab_size = len(hf_tokenizer)
        self.block_size = BLOCK_SIZE
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.windows: tuple[int, ...] = ()  # no sliding window: every block is kept
        self.tokens = ordinary_ids(hf_tokenizer)
        self.num_steps = 0
        self.last_ns = 0

    def execute(self, batch: SchedulerOutput, masks: Any = None) -> Any:
        from engine.worker.runner_output import RunnerOutput

        t0 = time.perf_counter_ns()
        out = RunnerOutput(sampled_token_ids=fake_sample(batch, self.num_steps, self.tokens))
        self.num_steps += 1
        self.last_ns = time.perf_counter_ns() - t0
        return out


def ordinary_ids(hf_tokenizer: Any, count: int = len(FAKE_TOKENS)) -> list[int]:
    """Token ids that are not special, from the middle of the vocabulary when it is large."""
    special = set(hf_tokenizer.all_special_ids)
    start = min(FAKE_TOKENS.start, len(hf_tokenizer) // 4)
    return [t for t in range(start, len(hf_tokenizer)) if t not in special][:count]


def embedded_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from engine.worker.loader import converted_gguf, resolve_source

    source, _ = resolve_source(None)
    return AutoTokenizer.from_pretrained(converted_gguf(source) if source.is_file() else source)


def bench_engine(num_running: int, steps: int, warmup: int, hf_tokenizer: Any,
                 mixed: bool = False, seed: int = 0) -> dict[str, Any]:
    """LLMEngine.step() with FakeRunner: the step's cost apart from the model."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

    wl = Workload(num_running, mixed, warmup + steps)
    runner = FakeRunner(hf_tokenizer, wl.num_blocks, wl.max_len)
    wl = replace(wl, tokens=runner.tokens)
    engine = LLMEngine(EngineConfig(scheduler=wl.config), runner=cast(Any, runner))
    engine.load()
    timer = CallTimer(engine.scheduler, ("schedule", "postprocess"))
    rng, ids, log = random.Random(seed), itertools.count(), StepLog()
    while len(engine.requests) < num_running:
        engine.add_request(f"r{next(ids)}", *wl.request(rng))
    while not mixed and not _all_decoding(engine.scheduler, num_running):
        engine.step()
    for k in range(warmup + steps):
        t0 = time.perf_counter_ns()
        engine.step()
        step_ns = time.perf_counter_ns() - t0
        if k >= warmup:
            sched_ns = timer.ns["schedule"] + timer.ns["postprocess"]
            log.add(timer.results["schedule"], step=step_ns, overhead=step_ns - runner.last_ns,
                    schedule=timer.ns["schedule"], postprocess=timer.ns["postprocess"],
                    engine_only=step_ns - runner.last_ns - sched_ns)
        while mixed and len(engine.requests) < num_running:
            engine.add_request(f"r{next(ids)}", *wl.request(rng))
    return {"case": "mixed" if mixed else "decode", "num_running": num_running, "steps": steps,
            "num_preemptions": engine.scheduler.num_preemptions, **log.result()}


class CallTimer:
    """Wraps methods of one object: each call's duration and result are kept (the last one)."""

    def __init__(self, obj: object, names: Seq[str]) -> None:
        self.ns: dict[str, int] = {}
        self.results: dict[str, Any] = {}
        for name in names:
            setattr(obj, name, self._wrap(getattr(obj, name), name))

    def _wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter_ns()
            result = fn(*args)
            self.ns[name] = time.perf_counter_ns() - t0
            self.results[name] = result
            return result
        return timed


# ----------------------------------------------------------------------------- the real model


class PrefillSkippingRunner:
    """A loaded ModelRunner that runs only all-decode steps; prefill steps get fake tokens."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tokens = ordinary_ids(inner.tokenizer)
        self.decode_ns: list[int] = []
        self.decode_sizes: list[int] = []  # sequences in each step that ran the model
        self.num_steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, batch: SchedulerOutput, masks: Any = None) -> Any:
        from engine.worker.runner_output import RunnerOutput

        self.num_steps += 1
        if any(n != 1 for n in batch.num_scheduled_tokens):
            return RunnerOutput(sampled_token_ids=fake_sample(batch, self.num_steps, self.tokens))
        t0 = time.perf_counter_ns()
        out = self.inner.execute(batch)
        self.decode_ns.append(time.perf_counter_ns() - t0)
        self.decode_sizes.append(len(batch.seqs))
        return out


def bench_model(running: Seq[int], steps: int, warmup: int, dtype: str, device: str,
                model: str | None, seed: int = 0, prompt_len: tuple[int, int] = PROMPT_LEN,
                threads: int | None = None) -> dict[int, dict[str, Any]]:
    """Decode step of the real model at each N: the first N of one list of prompts, all
    prefilled (faked) in the first step, then warmup + steps decode steps."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.worker.model_runner import ModelRunner

    rng = random.Random(seed)
    lens = [rng.randint(*prompt_len) for _ in range(max(running))]
    max_tokens = warmup + steps + 2  # one token from the prefill step, then the decode steps
    num_blocks = sum(-(-(n + max_tokens + 1) // BLOCK_SIZE) for n in lens) + len(lens)
    config = EngineConfig(model=model, dtype=dtype, device=device, seed=seed,
                          num_kv_blocks=num_blocks, num_threads=threads,
                          scheduler=_model_config(lens))
    inner = ModelRunner(config)
    inner.load()
    runner = PrefillSkippingRunner(inner)
    prompts = [[rng.choice(runner.tokens) for _ in range(n)] for n in lens]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = {}
    for n in running:
        runner.decode_ns.clear()
        runner.decode_sizes.clear()
        engine = LLMEngine(replace(config, scheduler=_model_config(lens[:n])),
                           runner=cast(Any, runner))
        engine.load()
        for i in range(n):
            engine.add_request(f"m{i}", prompts[i], params)
        step_ns = []
        while len(runner.decode_ns) < warmup + steps:
            before = len(runner.decode_ns)
            t0 = time.perf_counter_ns()
            engine.step()
            if len(runner.decode_ns) > max(before, warmup):
                step_ns.append(time.perf_counter_ns() - t0)
        assert set(runner.decode_sizes) == {n} and engine.scheduler.num_preemptions == 0
        results[n] = {"device": str(inner.device), "dtype": str(inner.dtype), "steps": steps,
                      "decode_execute_us": summarize(runner.decode_ns[warmup:]),
                      "engine_step_us": summarize(step_ns)}
    return results


def _model_config(lens: Seq[int]) -> SchedulerConfig:
    """One step takes every prompt (the prefill is faked anyway), so contexts at the decode
    steps are the prompts plus a few tokens."""
    return SchedulerConfig(max_num_seqs=len(lens), max_num_batched_tokens=sum(lens),
                           max_model_len=max(lens) + 1024, block_size=BLOCK_SIZE)


# ----------------------------------------------------------------------------- report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=1000, help="measured steps (fake runner)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--no-model", action="store_true", help="skip the real model's decode step")
    p.add_argument("--no-engine", action="store_true", help="skip LLMEngine with a fake runner")
    p.add_argument("--decode-step-ms", type=float, nargs="+", default=None,
                   help="decode step per --running value (or one for all): skips the model")
    p.add_argument("--model-steps", type=int, default=20)
    p.add_argument("--model-warmup", type=int, default=3)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.decode_step_ms and len(args.decode_step_ms) not in (1, len(args.running)):
        p.error("--decode-step-ms takes one value or one per --running value")
    return args


def decode_step_us(args: argparse.Namespace,
                   model: dict[int, dict[str, Any]]) -> dict[int, float | None]:
    """The denominator at each N: given on the command line, measured, or unknown."""
    if args.decode_step_ms:
        given = args.decode_step_ms * (len(args.running) // len(args.decode_step_ms))
        return {n: ms * 1e3 for n, ms in zip(args.running, given)}
    return {n: model[n]["decode_execute_us"]["median"] if n in model else None
            for n in args.running}


def print_table(data: dict[str, Any]) -> None:
    print(f"{'N':>4} {'case':<7} {'schedule us':>14} {'postproc us':>14} {'sched total us':>15}"
          f" {'engine ovh us':>14} {'decode ms':>10} {'sched %':>8} {'engine %':>9}")
    for row in data["table"]:
        dec = row["decode_step_us"]
        cells = [_cell(row.get(k), w) for k, w in (("schedule_us", 14), ("postprocess_us", 14),
                                                   ("total_us", 15), ("overhead_us", 14))]
        print(f"{row['num_running']:>4} {row['case']:<7} {' '.join(cells)} "
              f"{_num(dec and dec / 1e3, 1):>10} {_num(row['sched_pct'], 2):>8} "
              f"{_num(row['engine_pct'], 2):>9}")
    print("(median/p90 microseconds per step; % = medians over the model's median decode step)")


def _cell(s: dict[str, float] | None, width: int) -> str:
    return (f"{s['median']:.0f}/{s['p90']:.0f}" if s else "-").rjust(width)


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def build_table(results: dict[str, Any], decode: dict[int, float | None]) -> list[dict[str, Any]]:
    rows = []
    for r in results["scheduler"]:
        n, dec = r["num_running"], decode[r["num_running"]]
        eng = next((e for e in results.get("engine", [])
                    if e["num_running"] == n and e["case"] == r["case"]), None)
        row = {"num_running": n, "case": r["case"], "schedule_us": r["schedule_us"],
               "postprocess_us": r["postprocess_us"], "total_us": r["total_us"],
               "overhead_us": eng["overhead_us"] if eng else None, "decode_step_us": dec}
        row["sched_pct"] = 100 * r["total_us"]["median"] / dec if dec else None
        row["engine_pct"] = 100 * eng["overhead_us"]["median"] / dec if dec and eng else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    machine = machine_info()
    results: dict[str, Any] = {"scheduler": [], "engine": [], "model": {}}
    for n, mixed in itertools.product(args.running, (False, True)):
        print(f"scheduler N={n} {'mixed' if mixed else 'decode'} ...", flush=True)
        results["scheduler"].append(bench_scheduler(n, args.steps, args.warmup, mixed, args.seed))
    if not args.no_engine:
        tok = embedded_tokenizer()
        for n, mixed in itertools.product(args.running, (False, True)):
            print(f"engine N={n} {'mixed' if mixed else 'decode'} ...", flush=True)
            results["engine"].append(bench_engine(n, args.steps, args.warmup, tok, mixed,
                                                  args.seed))
    if not args.no_model and not args.decode_step_ms:
        print("model decode steps ...", flush=True)
        results["model"] = bench_model(args.running, args.model_steps, args.model_warmup,
                                       args.dtype, args.device, args.model, args.seed,
                                       threads=args.threads)
    machine["load_avg_at_end"] = os.getloadavg()
    data: dict[str, Any] = {"benchmark": "scheduler", "args": vars(args), "machine": machine, "results": results}
    data["table"] = build_table(results, decode_step_us(args, results["model"]))
    print_table(data)
    print(f"saved {save_result('scheduler', data)}")
    return data


if __name__ == "__main__":
    main()
