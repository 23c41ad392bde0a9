"""The sampler step alone (engine/sample/: SamplingBatchBuilder.build + sample, what turns a
step's [rows, vocab] logits into tokens), before and after a change, at 16 and 64 rows.

Variants (issue 34 parts 2, 3 and 6): `greedy`; `top_p` (temperature 1, top_p 0.9);
`penalties` (temperature 1, presence 0.5, frequency 0.5, repetition 1.2). Each row is a
sequence of ~1.1k tokens (1000 prompt tokens, 100 output tokens, then one more per timed step)
cut from real text, so its tokens repeat as text does. The logits are SmolLM2-135M's own (bf16,
one forward over the same text): how flat they are decides top-p's cost (the file records the
nuclei's sizes).

Before and after run in two worker processes at once (`--before`: a folder holding the old
code, or a git revision checked out into a temporary worktree; after: this tree). Each round
runs every (code, variant, rows) case for a few decode steps, in a shuffled order, and the
decode step of the real model (ModelRunner.execute, greedy) at the same rows: drift on a shared
machine falls on all alike. Medians per case; ratios against greedy of the same code, for the
sampler alone and for a whole step (the measured greedy step, its greedy sampling swapped for
the variant's).

    .venv/bin/python -m benchmarks.bench_sampling --before 89075d0      # 1 thread, 12 rounds
    .venv/bin/python -m benchmarks.bench_sampling --before /tmp/base --threads 2 --rounds 20

Writes benchmarks/results/sampling-<machine>-<N>threads.json (and .png).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug

ROOT = Path(__file__).resolve().parent.parent
VARIANTS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "penalties": {"temperature": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                  "repetition_penalty": 1.2},
}
PROMPT, OUTPUT = 1000, 100  # each row's tokens before the first timed step
TEXT_FILES = ("docs/architecture.md", "README.md", "docs/models.md")


# ---------------------------------------------------------------------------------------
# The worker: one code tree's sampler, driven over stdin/stdout, one JSON line each way.


class Case:
    """`rows` sequences of one variant, decoding: each step builds, samples, appends."""

    def __init__(self, variant: str, rows: int, data: dict[str, Any], seed: int) -> None:
        import torch

        from engine.sample.sampling_batch import SamplingBatchBuilder
        from scheduler.sampling_params import SamplingParams
        from scheduler.sequence import Sequence

        text, vocab = data["text"], data["vocab"]
        params = SamplingParams(max_tokens=1 << 20, **VARIANTS[variant])
        self.seqs = []
        for i in range(rows):
            start = (i * 37) % (len(text) - PROMPT - OUTPUT)
            seq = Sequence(f"{variant}-{rows}-{i}", text[start:start + PROMPT], params)
            for t in text[start + PROMPT:start + PROMPT + OUTPUT]:
                seq.append_token(t)
            self.seqs.append(seq)
        self.builder = SamplingBatchBuilder(vocab, seed=seed)
        self.logits: torch.Tensor = data["logits"]
        self.step_index = rows * 7

    def step(self) -> tuple[float, float]:
        """One decode step -> (build ms, sample ms)."""
        import torch

        from engine.sample.sampler import sample

        n, total = len(self.seqs), self.logits.shape[0]
        first = (self.step_index * 13) % (total - n)
        self.step_index += 1
        logits = self.logits[first:first + n].contiguous()  # a new [n, V] each step
        t0 = time.perf_counter()
        batch = self.builder.build(self.seqs, torch.device("cpu"))
        t1 = time.perf_counter()
        tokens, _ = sample(logits, batch)
        t2 = time.perf_counter()
        for seq, t in zip(self.seqs, tokens):
            seq.append_token(t)
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def worker(code: Path, data_path: Path, threads: int) -> None:
    sys.path.insert(0, str(code))
    import torch

    import engine

    torch.set_num_threads(threads)
    data = torch.load(data_path)
    cases: dict[str, Case] = {}
    print(json.dumps({"engine": engine.__file__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        key = f"{cmd['variant']}/{cmd['rows']}"
        if key not in cases:
            cases[key] = Case(cmd["variant"], cmd["rows"], data, seed=0)
            cases[key].step()  # warm-up
        print(json.dumps([cases[key].step() for _ in range(cmd["steps"])]), flush=True)


class Worker:
    def __init__(self, code: Path, data_path: Path, threads: int) -> None:
        cmd = [sys.executable, "-m", "benchmarks.bench_sampling", "--worker", str(code),
               "--data", str(data_path), "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.engine = json.loads(self._line())["engine"]

    def run(self, variant: str, rows: int, steps: int) -> list[list[float]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"variant": variant, "rows": rows, "steps": steps})
                              + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return line

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


# ---------------------------------------------------------------------------------------
# The parent: data, the real decode step, the rounds, the report.


@contextlib.contextmanager
def old_tree(before: str) -> Iterator[Path]:
    """`before` as a folder of code: itself if it is one, else a temporary git worktree."""
    if Path(before).is_dir():
        yield Path(before).resolve()
        return
    folder = Path(tempfile.mkdtemp(prefix="bench-sampling-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), before], cwd=ROOT,
                   check=True, capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT,
                       check=False, capture_output=True)


def load_runner(threads: int, max_rows: int, enforce_eager: bool) -> Any:
    import torch

    from benchmarks.profile_step_cost import load_runner as load

    runner = load(argparse.Namespace(model=None, dtype="auto", device="cpu", threads=threads),
                  enforce_eager)
    torch.set_num_threads(threads)
    assert runner.config.scheduler.max_num_seqs >= max_rows
    return runner


def make_data(vocab: int, path: Path, logit_rows: int = 2048) -> dict[str, Any]:
    """Token ids of real text and the model's bf16 logits over its first `logit_rows` of them
    (transformers' own forward, one sequence) -> saved for the workers; returns the logits'
    nucleus statistics."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.common import model_folder

    folder = model_folder()
    text = "\n\n".join((ROOT / f).read_text() for f in TEXT_FILES)
    ids = AutoTokenizer.from_pretrained(folder)(text).input_ids[:2048]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids[:logit_rows]])).logits[0, :, :vocab]
    logits = logits.contiguous()
    torch.save({"text": ids, "logits": logits, "vocab": vocab}, path)
    return nucleus_stats(logits)


def nucleus_stats(logits: Any, p: float = 0.9) -> dict[str, Any]:
    """How many tokens top_p 0.9 keeps at temperature 1 (quantiles), and the share of rows
    whose 256 best hold less than p (the old code's full-row sort)."""
    import torch

    probs = logits.float().softmax(-1)
    vals = probs.sort(dim=-1, descending=True).values
    cum = vals.cumsum(-1)
    sizes = ((cum - vals) < p).sum(-1).float()
    q = [0.1, 0.5, 0.9, 1.0]
    return {"rows": int(probs.shape[0]), "dtype": str(logits.dtype),
            "nucleus_size_quantiles": dict(zip(map(str, q),
                                               sizes.quantile(torch.tensor(q)).tolist())),
            "share_wider_than_256": float((cum[:, 255] < p).float().mean())}


def decode_step_ms(runner: Any, rows: int, steps: dict[int, Any]) -> float:
    from benchmarks.profile_step_cost import build_step

    if rows not in steps:
        steps[rows] = build_step((rows, PROMPT + OUTPUT, 0, 0), runner.block_size,
                                 random.Random(rows))
        runner.execute(steps[rows])  # warm-up
    t0 = time.perf_counter()
    runner.execute(steps[rows])
    return (time.perf_counter() - t0) * 1e3


def run_rounds(workers: dict[str, Worker], runner: Any,
               args: argparse.Namespace) -> tuple[dict[str, list[list[float]]], dict[int, list]]:
    cases = [(code, v, r) for code in workers for v in VARIANTS for r in args.rows]
    samples: dict[str, list[list[float]]] = {f"{c}/{v}/{r}": [] for c, v, r in cases}
    step_ms: dict[int, list[float]] = {r: [] for r in args.rows}
    cache: dict[int, Any] = {}
    for i in range(args.rounds):
        jobs: list[Any] = [*cases, *[("step", None, r) for r in args.rows]]
        random.shuffle(jobs)
        for code, variant, rows in jobs:
            if code == "step":
                step_ms[rows].append(decode_step_ms(runner, rows, cache))
            else:
                samples[f"{code}/{variant}/{rows}"] += workers[code].run(variant, rows,
                                                                          args.steps)
        print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    return samples, step_ms


def summarize(samples: dict[str, list[list[float]]],
              step_ms: dict[int, list[float]]) -> list[dict[str, Any]]:
    med = {k: {"build_ms": statistics.median(b for b, _ in v),
               "sample_ms": statistics.median(s for _, s in v),
               "total_ms": statistics.median(b + s for b, s in v)} for k, v in samples.items()}
    out = []
    for key, m in med.items():
        code, variant, rows = key.split("/")
        greedy, step = med[f"{code}/greedy/{rows}"]["total_ms"], statistics.median(
            step_ms[int(rows)])
        out.append({"code": code, "variant": variant, "rows": int(rows), **m,
                    "steps_timed": len(samples[key]),
                    "sampler_vs_greedy": m["total_ms"] / greedy,
                    "greedy_decode_step_ms": step,
                    "step_vs_greedy_step": (step - greedy + m["total_ms"]) / step,
                    "sampler_share_of_step": m["total_ms"] / (step - greedy + m["total_ms"])})
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [("| rows | variant | before: sampler ms (x greedy) | after: sampler ms (x greedy) "
              "| after: build / sample ms | step x greedy step: before -> after "
              "| after: share of step |"),
             "|---:|---|---:|---:|---:|---:|---:|"]
    by = {(r["code"], r["variant"], r["rows"]): r for r in results}
    for rows in sorted({r["rows"] for r in results}):
        for v in VARIANTS:
            b, a = by[("before", v, rows)], by[("after", v, rows)]
            lines.append(
                f"| {rows} | {v} | {b['total_ms']:.2f} ({b['sampler_vs_greedy']:.2f}x) | "
                f"{a['total_ms']:.2f} ({a['sampler_vs_greedy']:.2f}x) | "
                f"{a['build_ms']:.2f} / {a['sample_ms']:.2f} | "
                f"{b['step_vs_greedy_step']:.3f}x -> {a['step_vs_greedy_step']:.3f}x | "
                f"{a['sampler_share_of_step']:.1%} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, rows in zip(axes, sorted({r["rows"] for r in results})):
        for j, code in enumerate(("before", "after")):
            vals = [next(r["total_ms"] for r in results if (r["code"], r["variant"], r["rows"])
                         == (code, v, rows)) for v in VARIANTS]
            ax.bar([i + 0.4 * j for i in range(len(VARIANTS))], vals, 0.4, label=code)
        ax.set_xticks([i + 0.2 for i in range(len(VARIANTS))], list(VARIANTS))
        ax.set_yscale("log")
        ax.set_title(f"{rows} rows, vocab 49152")
    axes[0].set_ylabel("sampler step, median ms (log)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="HEAD", help="a folder of old code, or a git revision")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=3, help="decode steps per case and round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--logit-rows", type=int, default=2048,
                   help="positions of the text whose logits the rows sample from (one bf16 "
                        "forward over them: ~75 s for 2048 on a CPU without bf16 hardware)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="time the model's decode step eagerly (no torch.compile warm-up: a "
                        "quick run; the whole-step ratios are then against the eager step)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.data, args.threads)
    if args.logit_rows <= max(args.rows):  # each step takes `rows` of them at a moving offset
        p.error(f"--logit-rows ({args.logit_rows}) must exceed the most --rows "
                f"({max(args.rows)})")
    random.seed(0)
    info = machine_info()
    runner = load_runner(args.threads, max(args.rows), args.enforce_eager)
    with tempfile.TemporaryDirectory() as tmp, old_tree(args.before) as old:
        data_path = Path(tmp) / "data.pt"
        stats = make_data(runner.vocab_size, data_path, args.logit_rows)
        workers = {"before": Worker(old, data_path, args.threads),
                   "after": Worker(ROOT, data_path, args.threads)}
        try:
            samples, step_ms = run_rounds(workers, runner, args)
        finally:
            for w in workers.values():
                w.close()
    info["load_avg_at_end"] = os.getloadavg()
    results = summarize(samples, step_ms)
    out = args.out / f"sampling-{machine_slug(info)}-{args.threads}threads.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "sampling", "machine": info, "threads": args.threads,
        "before": args.before, "code": {k: w.engine for k, w in workers.items()},
        "model": runner.model_display_name, "dtype": str(runner.dtype),
        "logits": stats, "args": vars(args) | {"out": str(args.out)}, "results": results,
        "samples_ms": samples, "decode_step_ms": step_ms}, indent=2, default=str))
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
