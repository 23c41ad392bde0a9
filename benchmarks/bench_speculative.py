"""Speculative decoding (--speculative-config, n-gram prompt lookup) against plain decoding,
offline: one process holds an LLM per variant (the embedded model, the server's defaults
otherwise), and every round runs each workload on every variant in turn, so a noisy box
slows all alike; we report medians over rounds and the ratio to `none`.

Workloads, written here from this repository's own files (no hub data):
- rewrite: "add a docstring to this function" over functions of scheduler/*.py, whose
  answer mostly copies the function;
- passage: a question answered from a paragraph of docs/*.md, quoting it;
- agent: a chat whose earlier turns are near-identical tool calls, asking for the next one
  (the suffix method also drafts from the calls it answered before, in this run);
- story: free generation, where drafts rarely match and speculation must not hurt.

At c=1 the prompts run one at a time; at c=64 all at once, where `disable_by_batch_size`
turns drafting off. Each round starts with another variant, so none is always first.
Greedy, and with --sampled also each workload at temperature 0.8, top_p 0.95, seeded (a
draft is kept when it is the token drawn at its position). Greedy (temperature 0): the only requests that speculate for now.

    python -m benchmarks.bench_speculative [--rounds 3] [--c64] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug

ROOT = Path(__file__).resolve().parent.parent
VARIANTS: dict[str, str | None] = {
    "none": None,
    "ngram-4": '{"method": "ngram", "num_speculative_tokens": 4}',
    "ngram-8": '{"method": "ngram", "num_speculative_tokens": 8}',
    "suffix-16": '{"method": "suffix", "num_speculative_tokens": 16}',
}


def chat(user: str, history: list[tuple[str, str]] = ()) -> str:  # type: ignore[assignment]
    """SmolLM2's ChatML, written out (the benchmark needs no chat-template machinery)."""
    turns = "".join(f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
                    for u, a in history)
    return f"{turns}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def functions(limit: int) -> list[str]:
    """Source of functions from scheduler/*.py of 8-40 lines, in a fixed order."""
    out = []
    for path in sorted((ROOT / "scheduler").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                body = lines[node.lineno - 1:node.end_lineno]
                if 8 <= len(body) <= 40:
                    out.append("\n".join(body))
    return out[:limit]


def paragraphs(limit: int) -> list[str]:
    """Paragraphs of 400-900 characters from docs/*.md, in a fixed order."""
    out = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for para in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            if 400 <= len(para) <= 900 and not para.lstrip().startswith(("|", "```", "#")):
                out.append(para.strip())
    return out[:limit]


def workloads(n: int) -> dict[str, list[str]]:
    rewrite = [chat("Add a docstring to this function. Reply with the whole function.\n\n"
                    f"```python\n{src}\n```") for src in functions(n)]
    passage = [chat(f"Passage:\n{p}\n\nQuote the sentence of the passage that matters most, "
                    "then explain it.") for p in paragraphs(n)]
    call = '{"name": "get_weather", "arguments": {"city": "%s", "unit": "celsius", "days": 3}}'
    calls = [(f"Weather in {city}?", call % city) for city in ("Paris", "Lyon")]
    cities = ["Berlin", "Madrid", "Rome", "Vienna", "Oslo", "Prague", "Lisbon", "Dublin"]
    agent = [chat(f"Weather in {city}? Answer with the tool call only.", calls)
             for city in (cities * (n // len(cities) + 1))[:n]]
    topics = ["a dragon who learns to bake bread", "a lighthouse keeper's last night",
              "two robots who find a garden", "a cat who runs a small library"]
    story = [chat(f"Write a long story about {t}.") for t in (topics * n)[:n]]
    return {"rewrite": rewrite, "passage": passage, "agent": agent, "story": story}


def run_once(llm: Any, prompts: list[str], max_tokens: int, concurrency: int,
             temperature: float = 0.0) -> dict[str, float]:
    from scheduler.sampling_params import SamplingParams

    params = (SamplingParams(temperature=0.0, max_tokens=max_tokens) if temperature == 0 else
              SamplingParams(temperature=temperature, top_p=0.95, seed=0, max_tokens=max_tokens))
    stats = llm.engine.scheduler.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        for c in llm.generate(prompts[i:i + concurrency], params, use_tqdm=False):
            tokens += len(c.token_ids)
    wall = time.perf_counter() - start
    drafts = stats.num_drafts - before[0]
    draft_tokens = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    return {"tok_s": tokens / wall, "tokens": tokens, "drafts": drafts,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}


def summarize(runs: dict[str, dict[str, list[dict[str, float]]]]
              ) -> dict[str, dict[str, dict[str, float]]]:
    """Per load and variant, the median of each figure over rounds, and tok/s as a ratio to
    `none`'s median."""
    table = {load: {name: {key: statistics.median(x[key] for x in rs) for key in rs[0]}
                    for name, rs in by_name.items()} for load, by_name in runs.items()}
    for row in table.values():
        for cell in row.values():
            cell["ratio"] = cell["tok_s"] / row["none"]["tok_s"]
    return table


def plot(table: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(table)
    names = [v for v in next(iter(table.values())) if v != "none"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ax.bar([i + j * width for i in range(len(loads))],
               [table[load][name]["ratio"] for load in loads], width, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(loads))], loads)
    ax.set_ylabel("output tok/s / without speculation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; medians over them")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload at c=1")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--c64", action="store_true", help="also run every workload at c=64")
    ap.add_argument("--sampled", action="store_true",
                    help="also run every workload at c=1 with temperature 0.8, top_p 0.95")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)} (none is always run)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    chosen = ["none", *(v for v in args.variants.split(",") if v in VARIANTS and v != "none")]

    from engine.llm import LLM

    llms = {name: LLM(speculative_config=VARIANTS[name]) if VARIANTS[name] else LLM()
            for name in chosen}
    loads: dict[str, tuple[list[str], int, float]] = {
        f"{k}-c1": (v, 1, 0.0) for k, v in workloads(args.prompts).items()}
    if args.sampled:
        loads |= {f"{k}-c1-t0.8": (v, 1, 0.8) for k, v in workloads(args.prompts).items()}
    if args.c64:
        loads |= {f"{k}-c64": (v, 64, 0.0) for k, v in workloads(64).items()}
    for llm in llms.values():  # warm-up: the compiled step's graphs, the caches
        run_once(llm, workloads(1)["story"], 16, 1)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        load: {name: [] for name in llms} for load in loads}
    names = list(llms)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # no variant always first
        for load, (prompts, c, temperature) in loads.items():
            for name in order:
                runs[load][name].append(run_once(llms[name], prompts, args.max_tokens, c,
                                                 temperature))
            line = ", ".join(f"{n} {runs[load][n][-1]['tok_s']:.1f}" for n in llms)
            print(f"round {r + 1}/{args.rounds} {load}: {line} tok/s", file=sys.stderr)
    table = summarize(runs)
    info = machine_info()
    stamp = time.strftime("%Y-%m-%d-%H%M")
    path = args.out / f"{stamp}-{machine_slug(info)}-speculative.json"
    path.write_text(json.dumps({"benchmark": "speculative", "args": {k: str(v) for k, v in
                                                                   vars(args).items()},
                                "machine": info,
                                "variants": {name: VARIANTS[name] for name in chosen},
                                "table": table,
                                "runs": runs}, indent=1))
    plot(table, path.with_suffix(".png"))
    for load, row in table.items():
        print(load, " | ".join(f"{n}: {c['tok_s']:.1f} tok/s ({c['ratio']:.2f}x, accept "
                               f"{c['acceptance_rate']:.2f}, len {c['mean_acceptance_length']:.2f})"
                               for n, c in row.items()))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
