"""The engine core on a thread of the API process against the engine core in a process of its
own (`--engine-core thread|process`), same client, same prompts (issue 9 item 3).

    .venv/bin/python -m benchmarks.bench_engine_core --rounds 3
    .venv/bin/python -m benchmarks.bench_engine_core --variants thread= process=--engine-core=process \\
        process-t1="--engine-core=process --num-threads=1"

Every variant's server is started (all stay up; an idle one waits on its inbox) and warmed
up; then each round drives them in turn, alternating at each load (the order flips every
round, so a noisy neighbour does not always hit the same one), at max concurrency 1, 16 and
64 (2, 16 and 64 requests): ~100-token prompts, 128 output tokens pinned with ignore_eos, streaming,
greedy, the embedded SmolLM2 in bfloat16. Prints, per variant and concurrency, the median
over rounds of output tok/s, ITL p50/p99 and TTFT p50, and writes every run to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, ServerProcess, machine_info, model_folder
from benchmarks.loadgen import Load, load_tokenizer, measure, random_dataset, warm_up
from benchmarks.serving_load import RequestSpec

METRICS = ("output_throughput", "p50_itl_ms", "p99_itl_ms", "p50_ttft_ms")
EXTRA_BODY = {"ignore_eos": True, "temperature": 0.0}
# concurrency -> requests sent (enough for the load to reach steady state, kept short)
LOADS = {1: 2, 16: 16, 64: 64}


def parse_variants(items: list[str]) -> dict[str, list[str]]:
    """NAME=FLAGS -> {name: flags}."""
    out = {}
    for item in items:
        name, _, flags = item.partition("=")
        out[name] = shlex.split(flags)
    return out


def server_command(flags: list[str], dtype: str):  # type: ignore[no-untyped-def]
    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "api", "serve", "--port", str(port), "--dtype", dtype,
                "--log-level", "warning", *flags]
    return command


def run_round(servers: dict[str, Any], specs: dict[int, list[RequestSpec]],
              order: list[str]) -> dict[str, dict[int, dict[str, Any]]]:
    """Every concurrency, and at each one every variant in `order` (alternating)."""
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in order}
    for c, batch in specs.items():
        for name in order:
            server = servers[name]
            m = asyncio.run(measure(server.base_url, batch, Load(f"c{c}", max_concurrency=c),
                                    extra_body=EXTRA_BODY, server_pid=server.pid))
            m["load_avg_1m"] = os.getloadavg()[0]
            results[name][c] = m
            print(f"  {name} c={c}: " + "  ".join(f"{k} {m[k]:.1f}" for k in METRICS)
                  + f"  failed {m['failed']}", flush=True)
    return results


def start_servers(stack: contextlib.ExitStack, variants: dict[str, list[str]], dtype: str,
                  specs: dict[int, list[RequestSpec]]) -> dict[str, Any]:
    servers = {name: stack.enter_context(ServerProcess(name, server_command(flags, dtype)))
               for name, flags in variants.items()}
    for name, server in servers.items():  # one at a time: the loads start together
        t0 = time.monotonic()
        server.wait_healthy(900)
        print(f"{name}: healthy after {time.monotonic() - t0:.1f} s", flush=True)
        asyncio.run(warm_up(server.base_url, next(iter(specs.values())), 4, EXTRA_BODY))
    return servers


def medians(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for v in variants:
        table[v] = {}
        for c in LOADS:
            done = [r["results"][v][c] for r in runs if c in r["results"].get(v, {})]
            if done:
                table[v][c] = {k: statistics.median(m[k] for m in done) for k in METRICS}
                table[v][c]["runs"] = len(done)
    return table


class Running:
    """A server somebody else started (--servers NAME=URL:PID)."""

    def __init__(self, spec: str) -> None:
        url, _, pid = spec.rpartition(":")
        self.base_url, self.pid = url, int(pid)


def print_table(table: dict[str, Any], rounds: int) -> None:
    print(f"\nmedians over {rounds} round(s) (see `runs` per cell in the JSON):")
    print(f"{'variant':<14}{'c':>4}{'tok/s':>10}{'ITL p50':>10}{'ITL p99':>10}{'TTFT p50':>10}")
    for v, per_c in table.items():
        for c, m in per_c.items():
            print(f"{v:<14}{c:>4}{m['output_throughput']:>10.1f}{m['p50_itl_ms']:>10.1f}"
                  f"{m['p99_itl_ms']:>10.1f}{m['p50_ttft_ms']:>10.1f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_engine_core", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", metavar="NAME=FLAGS",
                   default=["thread=--engine-core=thread", "process=--engine-core=process"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "engine-core.json")
    p.add_argument("--loads", type=int, nargs="+", choices=sorted(LOADS), default=sorted(LOADS),
                   help="max concurrencies to run (default: all)")
    p.add_argument("--servers", nargs="+", metavar="NAME=URL:PID",
                   help="drive servers already running instead of starting --variants")
    args = p.parse_args(argv)
    for c in set(LOADS) - set(args.loads):
        del LOADS[c]
    variants = parse_variants(args.variants)
    if args.servers:
        variants = {name: [] for name in parse_variants(args.servers)}
    tok = load_tokenizer(model_folder())
    specs = {c: random_dataset(tok, n, (100, 100), (128, 128), seed=c) for c, n in LOADS.items()}
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if args.servers:
            servers: dict[str, Any] = {
                name: Running(item.partition("=")[2])
                for name, item in zip(variants, args.servers)}
        else:
            servers = start_servers(stack, variants, args.dtype, specs)
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            print(f"round {r + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            runs.append({"round": r, "order": order, "results": run_round(servers, specs, order)})
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"machine": machine_info(), "variants": variants,
                                            "loads": LOADS, "runs": runs,
                                            "medians": medians(runs, list(variants))},
                                           indent=1, default=str))
    print_table(medians(runs, list(variants)), len(runs))


if __name__ == "__main__":
    main()
