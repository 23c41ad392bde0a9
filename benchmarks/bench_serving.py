"""Online serving: pagedserve vs `transformers serve --continuous-batching`, same run.

The `vllm bench serve` recipe. Each server is started here as a subprocess on 127.0.0.1 (a
free port, ready when /health answers 200), gets one warm-up request, then the sweep of
--concurrency values, then is stopped (SIGTERM, then SIGKILL) before the next one starts, so
the two never share the cores. Same model (the embedded SmolLM2-135M-Instruct; the baseline
serves the safetensors folder engine.loader converts it to), same dtype, same prompts: text
decoded from random token ids (`/v1/completions` of transformers serve takes only a string),
greedy, and output length pinned to max_tokens on both (ours: ignore_eos; transformers: a
per-request generation_config with eos_token_id -1); the completion tokens each server
reports in `usage` are kept per request. Metrics: TTFT, TPOT, ITL, E2EL mean/median/p90/p99,
request and output token throughput. Results go to benchmarks/results/serving-*.json + .png.

    .venv/bin/python benchmarks/bench_serving.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    CpuSample,
    ServerProcess,
    machine_info,
    random_workload,
    save_result,
    wait_for_idle,
)
from benchmarks.serving_load import RequestSpec, compute_metrics, run_load, send_request

VENV_BIN = Path(sys.executable).parent
OURS, BASELINE = "pagedserve", "transformers-serve-cb"
RATIO_HIGHER = ("request_throughput", "output_throughput")  # ours / baseline
RATIO_LOWER = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms",
               "p99_itl_ms", "median_e2el_ms")  # baseline / ours: > 1 means ours is faster


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16],
                   help="the sweep: one run per --max-concurrency value")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson-like arrivals (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--servers", nargs="+", default=[OURS, BASELINE], choices=[OURS, BASELINE])
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let EOS end requests early (lengths then differ between servers)")
    p.add_argument("--ours-args", default="", help="extra flags for `pagedserve serve`")
    p.add_argument("--baseline-args", default="--cb-num-blocks 64 --cb-max-batch-tokens 512",
                   help="extra flags for `transformers serve` (peers-cpu.md 3d)")
    p.add_argument("--wait-idle", type=float, default=0.5,
                   help="first wait (up to --wait-idle-timeout s) until the 1-min load average and "
                   "the busy cores are below this")
    p.add_argument("--wait-idle-timeout", type=float, default=180.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def model_folder() -> Path:
    """The converted safetensors folder of the embedded model (made on first use)."""
    from engine.loader import converted_gguf, resolve_source

    src, _ = resolve_source(None)
    return converted_gguf(src) if src.suffix == ".gguf" else src


def make_specs(args: argparse.Namespace, folder: Path) -> list[RequestSpec]:
    """Text prompts from random token ids, re-encoded and cut back to length as vLLM's
    random dataset does (decode/encode does not round-trip exactly)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    r = args.random_range_ratio
    in_range = (max(1, int(args.random_input_len * (1 - r))), int(args.random_input_len * (1 + r)))
    out_range = (max(1, int(args.random_output_len * (1 - r))), int(args.random_output_len * (1 + r)))
    ids, out_lens = random_workload(args.num_prompts, in_range, out_range, len(tok),
                                    args.seed, set(tok.all_special_ids))
    specs = []
    for prompt_ids, out_len in zip(ids, out_lens):
        text = tok.decode(tok.encode(tok.decode(prompt_ids), add_special_tokens=False)[:len(prompt_ids)])
        specs.append(RequestSpec(text, len(tok.encode(text, add_special_tokens=False)), out_len))
    return specs


def server_command(name: str, args: argparse.Namespace, folder: Path, port: int) -> list[str]:
    if name == OURS:
        return [str(VENV_BIN / "pagedserve"), "serve", "--host", "127.0.0.1", "--port", str(port),
                "--dtype", args.dtype, "--device", "cpu", "--log-level", "warning",
                *args.ours_args.split()]
    return [str(VENV_BIN / "transformers"), "serve", str(folder), "--continuous-batching",
            "--device", "cpu", "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *args.baseline_args.split()]


def extra_body(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Per-server request fields (the same for every request) that pin output length."""
    if name == OURS:
        return {"stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    # transformers serve ignores stream_options (its last chunk always carries usage) and
    # has no ignore_eos; its CB manager takes eos_token_id per request from a
    # generation_config JSON (max_tokens still sets max_new_tokens on top of it).
    return {"generation_config": json.dumps({"do_sample": False, "eos_token_id": -1})} \
        if args.ignore_eos else {}


async def sweep(name: str, args: argparse.Namespace, base_url: str,
                specs: list[RequestSpec], pid: int) -> dict[str, Any]:
    body = extra_body(name, args)
    warm = RequestSpec(specs[0].prompt, specs[0].prompt_len, 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        w = await send_request(client, base_url + "/v1/completions", warm, body)
    if not w.success:
        raise RuntimeError(f"{name}: warm-up request failed: {w.error}")
    runs = {}
    for c in args.concurrency:
        load0, cpu0 = os.getloadavg(), CpuSample(pid)
        results, duration = await run_load(
            base_url, specs, request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=c, extra_body=body, seed=args.seed, desc=f"{name} c={c}")
        m = compute_metrics(results, duration)
        m["load_avg_before"], m["load_avg_after"] = load0, os.getloadavg()
        m["foreign_cores"] = CpuSample(pid).foreign_cores(cpu0, duration)
        runs[str(c)] = m
        print(f"[{name}] c={c}: {m['completed']} ok, {m['failed']} failed, "
              f"{m['output_throughput']:.1f} out tok/s, median TTFT {m['median_ttft_ms']:.0f} ms, "
              f"foreign cores {m['foreign_cores']}", flush=True)
    return runs


def bench_server(name: str, args: argparse.Namespace, folder: Path,
                 specs: list[RequestSpec]) -> dict[str, Any]:
    proc = ServerProcess(name, lambda port: server_command(name, args, folder, port))
    print(f"[{name}] starting: {' '.join(proc.command)}", flush=True)
    with proc:
        t0 = time.perf_counter()
        proc.wait_healthy(args.startup_timeout)
        ready_s = time.perf_counter() - t0
        print(f"[{name}] healthy after {ready_s:.1f} s", flush=True)
        runs = asyncio.run(sweep(name, args, proc.base_url, specs, proc.pid))
        rc = proc.stop()
    return {"command": proc.command, "ready_s": ready_s, "runs": runs, "exit_code": rc}


def ratios(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per concurrency: ours/baseline for throughputs, baseline/ours for latencies
    (so > 1 always means pagedserve is better)."""
    if not {OURS, BASELINE} <= results.keys():
        return {}
    out = {}
    for c, ours in results[OURS]["runs"].items():
        base = results[BASELINE]["runs"][c]
        r = {k: _div(ours[k], base[k]) for k in RATIO_HIGHER}
        r |= {k: _div(base[k], ours[k]) for k in RATIO_LOWER}
        out[c] = r
    return out


def _div(a: float, b: float) -> float:
    return a / b if b else float("nan")


TABLE_ROWS = [("completed", "{:.0f}"), ("failed", "{:.0f}"), ("total_input_tokens", "{:.0f}"),
              ("total_output_tokens", "{:.0f}"), ("duration_s", "{:.1f}"),
              ("request_throughput", "{:.2f}"), ("output_throughput", "{:.1f}"),
              *[(f"{s}_{m}_ms", "{:.1f}") for m in ("ttft", "tpot", "itl", "e2el")
                for s in ("mean", "median", "p90", "p99")], ("foreign_cores", "{:.2f}")]


def print_tables(results: dict[str, Any], rat: dict[str, dict[str, float]]) -> None:
    names = list(results)
    for c in map(str, next(iter(results.values()))["runs"]):
        print(f"\n=== max concurrency {c} ===")
        print(f"{'metric':<22}" + "".join(f"{n:>24}" for n in names) + f"{'ratio (>1: ours better)':>26}")
        for key, fmt in TABLE_ROWS:
            cells = "".join(f"{fmt.format(results[n]['runs'][c][key]):>24}" for n in names)
            ratio = rat.get(c, {}).get(key)
            print(f"{key:<22}{cells}{'' if ratio is None else f'{ratio:>25.2f}x'}")
        lens = {n: sorted(set(results[n]["runs"][c]["output_lens"])) for n in names}
        print("completion tokens per request: " + "; ".join(f"{n} {v}" for n, v in lens.items()))


def plot(results: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in results.items():
        cs = [int(c) for c in r["runs"]]
        a1.plot(cs, [m["output_throughput"] for m in r["runs"].values()], "o-", label=name)
        a2.plot(cs, [m["median_ttft_ms"] for m in r["runs"].values()], "o-", label=name)
    for ax, ylabel in ((a1, "output tokens / s"), (a2, "median TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    a2.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    idle = wait_for_idle(args.wait_idle, args.wait_idle_timeout)
    print(f"before the run: {idle}", flush=True)
    machine = machine_info() | {"idle_check": idle}
    folder = model_folder()
    specs = make_specs(args, folder)
    results = {name: bench_server(name, args, folder, specs) for name in args.servers}
    machine["load_avg_at_end"] = os.getloadavg()
    rat = ratios(results)
    print_tables(results, rat)
    data = {"benchmark": "serving", "args": vars(args), "machine": machine,
            "model_folder": str(folder), "prompt_lens": [s.prompt_len for s in specs],
            "results": results, "ratios": rat}
    path = save_result("serving", data)
    if not args.no_plot:
        title = (f"Serving, SmolLM2-135M {args.dtype}, {args.num_prompts} prompts, "
                 f"in {args.random_input_len} / out {args.random_output_len}, CPU")
        plot(results, path.with_suffix(".png"), title)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
