"""Load generator for any OpenAI-compatible `/v1/completions` endpoint, after `vllm bench serve`.

    .venv/bin/python -m benchmarks.loadgen --base-url http://127.0.0.1:8000 \\
        --dataset random --num-prompts 64 --random-input-len 272 --random-output-len 136 \\
        --random-range-ratio 0.88 --max-concurrency 16 --ignore-eos \\
        --goodput ttft:2000 tpot:200 --save-result /tmp/run.json

Datasets (no download; prompts are text decoded from random token ids, re-encoded and cut
back to length as vLLM's random dataset does, since decode/encode does not round-trip):
  random        input and output lengths uniform in [len*(1-r), len*(1+r)], r = --random-range-ratio.
  conversation  a seeded chat-like mix (CONVERSATION_MIX): 70% short turns, input lognormal
                with median 96 tokens (sigma 0.8), output median 160 (sigma 0.6); 30%
                context-heavy turns (long history or retrieved documents), input median 1024
                (sigma 0.5), output median 96 (sigma 0.7); every length clipped to
                [4, --max-input-len] / [4, --max-output-len] and input + output to --max-model-len.
Arrivals: all at once (default), at most --max-concurrency in flight, and/or gamma-distributed
gaps at --request-rate (--burstiness 1 = Poisson). --num-warmups requests go first and are not
counted. Every request streams; each body carries stream_options.include_usage (and
ignore_eos with --ignore-eos), then --extra-body on top. Metrics: see serving_load.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import httpx
import numpy as np

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import CpuSample, machine_info, random_token_ids, random_workload
from benchmarks.serving_load import RequestSpec, compute_metrics, parse_goodput, run_load


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the datasets use."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


# --- datasets ---


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: [len*(1-r), len*(1+r)], never below 1 token."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {ratio}")
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def prompt_spec(tok: Tokenizer, ids: Sequence[int], output_len: int) -> RequestSpec:
    """A text prompt from token ids: decoded, re-encoded and cut back to len(ids) tokens."""
    text = tok.decode(tok.encode(tok.decode(ids), add_special_tokens=False)[:len(ids)])
    return RequestSpec(text, len(tok.encode(text, add_special_tokens=False)), output_len)


def random_dataset(tok: Tokenizer, n: int, in_range: tuple[int, int], out_range: tuple[int, int],
                   seed: int) -> list[RequestSpec]:
    ids, out_lens = random_workload(n, in_range, out_range, len(tok), seed, set(tok.all_special_ids))
    return [prompt_spec(tok, p, o) for p, o in zip(ids, out_lens)]


@dataclass(frozen=True)
class TurnKind:
    share: float
    input_median: float
    input_sigma: float
    output_median: float
    output_sigma: float


CONVERSATION_MIX = (TurnKind(0.7, 96, 0.8, 160, 0.6),    # short chat turns
                    TurnKind(0.3, 1024, 0.5, 96, 0.7))   # context-heavy turns


def conversation_lengths(n: int, seed: int, max_input: int, max_output: int,
                         max_model_len: int) -> list[tuple[int, int]]:
    """(input, output) lengths of the conversation-like mix, seeded."""
    rng = np.random.default_rng(seed)
    shares = np.array([k.share for k in CONVERSATION_MIX])
    kinds = rng.choice(len(CONVERSATION_MIX), size=n, p=shares / shares.sum())
    out = []
    for i in kinds:
        k = CONVERSATION_MIX[i]
        inp = int(np.clip(rng.lognormal(math.log(k.input_median), k.input_sigma), 4, max_input))
        outp = int(np.clip(rng.lognormal(math.log(k.output_median), k.output_sigma), 4, max_output))
        out.append((max(1, min(inp, max_model_len - outp)), outp))
    return out


def conversation_dataset(tok: Tokenizer, n: int, seed: int, max_input: int = 2048,
                         max_output: int = 512, max_model_len: int = 2048) -> list[RequestSpec]:
    rng = random.Random(seed)
    avoid = set(tok.all_special_ids)
    return [prompt_spec(tok, random_token_ids(rng, i, len(tok), avoid), o)
            for i, o in conversation_lengths(n, seed, max_input, max_output, max_model_len)]


# --- one measured load ---


@dataclass(frozen=True)
class Load:
    """How requests arrive: all at once (the defaults), capped in flight, and/or at a rate."""

    name: str
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0


async def warm_up(base_url: str, specs: Sequence[RequestSpec], num: int,
                  extra_body: dict[str, Any]) -> None:
    """`num` requests (the first prompts, cycled), up to 4 at a time, not measured."""
    if num <= 0 or not specs:
        return
    warm = [specs[i % len(specs)] for i in range(num)]
    results, _ = await run_load(base_url, warm, max_concurrency=min(num, 4), extra_body=extra_body)
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {num} warm-up requests failed: {failed[0]}")


async def measure(base_url: str, specs: Sequence[RequestSpec], load: Load, *,
                  extra_body: dict[str, Any], slos: dict[str, float] | None = None,
                  seed: int = 0, server_pid: int | None = None,
                  progress: str | None = None) -> dict[str, Any]:
    """Run one load and return its metrics, plus the machine load around it. With the
    server's pid, `foreign_cores` = cores busy with anything but us and the server."""
    load0, cpu0 = os.getloadavg(), CpuSample(server_pid)
    results, duration = await run_load(
        base_url, specs, request_rate=load.request_rate, burstiness=load.burstiness,
        max_concurrency=load.max_concurrency, extra_body=extra_body, seed=seed, desc=progress)
    m = compute_metrics(results, duration, slos)
    m |= {"load": asdict(load), "num_prompts": len(specs),
          "load_avg_before": load0, "load_avg_after": os.getloadavg()}
    if server_pid is not None:
        m["foreign_cores"] = CpuSample(server_pid).foreign_cores(cpu0, duration)
    return m


def get_models(base_url: str) -> Any:
    """The server's /v1/models answer, or the error (it is recorded, never required)."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10)
        return r.json() if r.status_code == 200 else {"error": f"HTTP {r.status_code}"}
    except (httpx.HTTPError, ValueError) as e:
        return {"error": f"{e.__class__.__name__}: {e}"}


def summary(m: dict[str, Any]) -> str:
    """vLLM-style result block."""
    rows = [("Successful requests", m["completed"], "d"), ("Failed requests", m["failed"], "d"),
            ("Benchmark duration (s)", m["duration_s"], ".2f"),
            ("Total input tokens", m["total_input_tokens"], "d"),
            ("Total generated tokens", m["total_output_tokens"], "d"),
            ("Request throughput (req/s)", m["request_throughput"], ".2f"),
            ("Output token throughput (tok/s)", m["output_throughput"], ".2f"),
            ("Total token throughput (tok/s)", m["total_token_throughput"], ".2f")]
    if "request_goodput" in m:
        rows.append(("Request goodput (req/s)", m["request_goodput"], ".2f"))
    for name in ("ttft", "tpot", "itl", "e2el"):
        rows += [(f"{stat.capitalize()} {name.upper()} (ms)", m[f"{stat}_{name}_ms"], ".2f")
                 for stat in ("mean", "p50", "p90", "p99")]
    return "\n".join(f"{label:<40}{value:>12{fmt}}" for label, value, fmt in rows)


# --- CLI ---


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the request's `model` field (omitted when not given)")
    p.add_argument("--tokenizer", help="tokenizer folder for building prompts "
                   "(default: the embedded SmolLM2-135M)")
    p.add_argument("--dataset", choices=["random", "conversation"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--max-input-len", type=int, default=2048, help="conversation: input cap")
    p.add_argument("--max-output-len", type=int, default=512, help="conversation: output cap")
    p.add_argument("--max-model-len", type=int, default=2048, help="conversation: input + output cap")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no cap)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, inf = constant")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: pins output lengths")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs (ttft, tpot, e2el in ms); goodput = requests/s meeting all of them")
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--server-flags", default="", help="how the server was started (recorded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", type=Path, help="write the results JSON here")
    return p.parse_args(argv)


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.model:
        body["model"] = args.model
    extra = json.loads(args.extra_body)
    if not isinstance(extra, dict):
        raise TypeError("--extra-body must be a JSON object")
    return body | extra


def dataset(args: argparse.Namespace, tok: Tokenizer) -> list[RequestSpec]:
    if args.dataset == "conversation":
        return conversation_dataset(tok, args.num_prompts, args.seed, args.max_input_len,
                                    args.max_output_len, args.max_model_len)
    return random_dataset(tok, args.num_prompts,
                          length_range(args.random_input_len, args.random_range_ratio),
                          length_range(args.random_output_len, args.random_range_ratio), args.seed)


def load_tokenizer(folder: str | Path | None) -> Tokenizer:
    from transformers import AutoTokenizer

    from benchmarks.common import model_folder

    return cast(Tokenizer, AutoTokenizer.from_pretrained(folder or model_folder()))


def main(argv: list[str] | None = None, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    slos = parse_goodput(args.goodput)
    body = request_body(args)
    specs = dataset(args, tokenizer or load_tokenizer(args.tokenizer))
    load = Load("cli", args.max_concurrency, args.request_rate, args.burstiness)
    models = get_models(args.base_url)

    async def run() -> dict[str, Any]:
        await warm_up(args.base_url, specs, args.num_warmups, body)
        return await measure(args.base_url, specs, load, extra_body=body, slos=slos,
                             seed=args.seed, progress="requests")

    metrics = asyncio.run(run())
    print(summary(metrics))
    result = {"benchmark": "loadgen", "args": vars(args), "machine": machine_info(),
              "server": {"base_url": args.base_url, "flags": args.server_flags, "models": models},
              "request_body": body, "prompt_lens": [s.prompt_len for s in specs],
              "requested_output_lens": [s.output_len for s in specs], "metrics": metrics}
    if args.save_result:
        args.save_result.parent.mkdir(parents=True, exist_ok=True)
        args.save_result.write_text(json.dumps(result, indent=2, default=str))
        print(f"saved {args.save_result}")
    return result


if __name__ == "__main__":
    main()
