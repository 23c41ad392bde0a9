"""What Ray Serve costs per request: TTFT and end-to-end latency of the same sequential
requests against `pagedserve serve` and against `pagedserve serve --num-replicas 1` (same
engine, same cores; the only difference is Serve's proxy, the ingress and the handle hop).

    .venv/bin/python -m benchmarks.replica_overhead            # from the repository root
    .venv/bin/python -m benchmarks.replica_overhead --requests 50 --extra-args --dtype float32

Prints and writes (--out) p50/p90 TTFT and latency per server and the difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from benchmarks.common import ServerProcess, machine_info

VARIANTS = {"single": [], "ray-1-replica": ["--num-replicas", "1"]}


def command(extra: list[str], variant: list[str]) -> Any:
    # `python -m api` from the repository root: the code of this checkout, whatever the
    # venv's `pagedserve` entry point was installed from.
    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "api", "serve", "--host", "127.0.0.1", "--port",
                str(port), "--log-level", "warning", *extra, *variant]
    return argv


def one(client: httpx.Client, url: str, i: int, max_tokens: int) -> tuple[float, float]:
    """(TTFT, end-to-end) seconds of one streamed completion."""
    body = {"prompt": f"Request {i}: tell me about the sea.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    assert first is not None
    return first, time.perf_counter() - start


def measure(name: str, argv: Any, requests: int, max_tokens: int) -> dict[str, float]:
    with ServerProcess(name, argv, grace_s=60) as proc:
        proc.wait_healthy(900)
        with httpx.Client(timeout=120) as client:
            for i in range(3):  # warm-up
                one(client, proc.base_url, -i, max_tokens)
            runs = [one(client, proc.base_url, i, max_tokens) for i in range(requests)]
    ttft = sorted(r[0] * 1000 for r in runs)
    e2e = sorted(r[1] * 1000 for r in runs)
    q = statistics.quantiles
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_p90_ms": q(ttft, n=10)[-1],
            "e2e_p50_ms": statistics.median(e2e), "e2e_p90_ms": q(e2e, n=10)[-1]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replica_overhead",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--extra-args", nargs=argparse.REMAINDER, default=[],
                   help="flags for both servers (must come last)")
    p.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    args = p.parse_args(argv)
    results = {name: measure(name, command(args.extra_args, variant), args.requests,
                             args.max_tokens) for name, variant in VARIANTS.items()}
    single, ray_ = results["single"], results["ray-1-replica"]
    added = {k: round(ray_[k] - single[k], 2) for k in single}
    report = {"machine": machine_info(), "requests": args.requests,
              "max_tokens": args.max_tokens, "extra_args": args.extra_args,
              "results": results, "ray_added_ms": added}
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
