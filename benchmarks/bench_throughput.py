"""Offline throughput: pagedserve's engine vs Hugging Face generate(), same model, same run.

The nano-vllm recipe: N random-token prompts (lengths uniform in --input-len), per-request
output lengths uniform in --output-len, EOS ignored so every request produces exactly its
length, fixed seed. Baselines, in the same process on the same weights and dtype:
  hf-single   model.generate() one request at a time (on the first --single-requests
              requests only: its rate is steady, and all 64 would take many minutes)
  hf-static   left-padded static batches of --batch-size; a batch runs until its longest
              request is done, only each request's own tokens count as output
Output tokens/s = generated tokens / wall time. Results (with the machine's description)
go to benchmarks/results/throughput-*.json and a PNG bar chart.

    .venv/bin/python benchmarks/bench_throughput.py --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import machine_info, median, random_workload, save_result
from benchmarks.hf_baseline import run_one_at_a_time, run_static_batches
from engine.llm import LLM
from engine.worker.loader import load_model
from scheduler.sampling_params import SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], help="dtypes to run")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--batch-size", type=int, default=16, help="static batch size for hf-static")
    p.add_argument("--single-requests", type=int, default=12,
                   help="how many requests hf-single runs (0 = skip)")
    p.add_argument("--repeats", type=int, default=2, help="runs of our engine (median kept)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args()


def run_ours(args: argparse.Namespace, dtype: str, prompts: list[list[int]],
             out_lens: list[int]) -> dict[str, Any]:
    llm = LLM(model=args.model, dtype=dtype, device="cpu", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024,
              kv_cache_memory="2GiB")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    walls = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        walls.append(time.perf_counter() - t0)
        assert [len(o.token_ids) for o in outs] == out_lens, "ignore_eos lengths not honoured"
    wall = median(walls)
    stats = llm.engine.stats()
    return {"output_tokens": sum(out_lens), "wall_s": wall, "wall_s_all": walls,
            "tok_per_s": sum(out_lens) / wall, "num_preemptions": stats.num_preemptions,
            "num_steps": stats.num_steps}


def run_hf(args: argparse.Namespace, dtype: str, prompts: list[list[int]],
           out_lens: list[int]) -> dict[str, Any]:
    loaded = load_model(args.model, device="cpu", dtype=dtype)
    res: dict[str, Any] = {}
    k = args.single_requests
    if k > 0:
        res["hf-single"] = run_one_at_a_time(loaded.model, None, prompts[:k], out_lens[:k])
    res["hf-static"] = run_static_batches(loaded.model, prompts, out_lens, args.batch_size)
    for r in res.values():
        r.pop("outputs", None)  # the token ids themselves: large and not a measurement
    return res


def bench_dtype(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    from engine.worker.loader import load_model as _lm  # vocab and special ids for the workload

    probe = _lm(args.model, device="cpu", dtype="float32")
    vocab = probe.facts.vocab_size
    special = set(probe.tokenizer.all_special_ids)
    del probe
    prompts, out_lens = random_workload(args.num_prompts, tuple(args.input_len),
                                        tuple(args.output_len), vocab, args.seed, special)
    print(f"[{dtype}] ours ...", flush=True)
    ours = run_ours(args, dtype, prompts, out_lens)
    gc.collect()
    print(f"[{dtype}] hugging face baselines ...", flush=True)
    result = {"pagedserve": ours, **run_hf(args, dtype, prompts, out_lens)}
    for name in ("hf-single", "hf-static"):
        if name in result:
            result[f"ratio_vs_{name}"] = ours["tok_per_s"] / result[name]["tok_per_s"]
    return result


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["pagedserve", "hf-static", "hf-single"]
    width = 0.8 / max(1, len(results))
    for j, (dtype, r) in enumerate(results.items()):
        vals = [r[n]["tok_per_s"] if n in r else 0 for n in names]
        xs = [i + j * width for i in range(len(names))]
        bars = ax.bar(xs, vals, width, label=dtype)
        ax.bar_label(bars, fmt="%.0f")
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Offline throughput, SmolLM2-135M, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    machine = machine_info()  # before the runs: load_avg_at_start tells if the box was busy
    results = {dtype: bench_dtype(args, dtype) for dtype in args.dtype}
    machine["load_avg_at_end"] = os.getloadavg()
    data = {"benchmark": "throughput", "args": vars(args), "machine": machine,
            "results": results}
    path = save_result("throughput", data)
    for dtype, r in results.items():
        line = f"{dtype}: pagedserve {r['pagedserve']['tok_per_s']:.1f} tok/s"
        for name in ("hf-single", "hf-static"):
            if name in r:
                line += f" | {name} {r[name]['tok_per_s']:.1f} tok/s (x{r[f'ratio_vs_{name}']:.2f})"
        print(line)
    if not args.no_plot:
        plot(results, path.with_suffix(".png"))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
