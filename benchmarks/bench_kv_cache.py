"""The int8 KV cache (`--kv-cache-dtype int8`) against the model's dtype, in one process, at
the same `--kv-cache-memory`: how many sequences the pool holds, what that does to
throughput at high concurrency, and (on the embedded model) what it costs in perplexity.

    .venv/bin/python -m benchmarks.bench_kv_cache                      # embedded SmolLM2
    .venv/bin/python -m benchmarks.bench_kv_cache --shape llama-1b --quantization int4

Throughput: both engines (bf16, eager) load side by side; each round gives every engine
`--concurrency` greedy requests at once (random `--prompt-len`-token prompts, `--max-tokens`
each, EOS ignored) and runs them to the end; rounds alternate the engines' order; the median
output tokens/s is kept, with the most requests running at once and the preemptions. A pool
too small for the whole batch runs part of it and queues (or preempts) the rest, which is
where twice the tokens per byte pays.

Perplexity (`--perplexity`, the embedded model only: a random checkpoint's is meaningless):
tests/data's text in pieces of 384 tokens, scored through the engine's prompt logprobs with
prompts cut into 32-token steps, so each step reads the tokens before it from the pool.

Saves results/kv-cache-<model>-<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug, random_token_ids

KV_DTYPES = ("auto", "int8")
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "opticks_queries.txt"


def load(model: str | None, dtype: str, quantization: str, kv_dtype: str, kv_memory: str,
         **sched: Any) -> Any:
    from engine.config import make_config
    from engine.core.llm_engine import LLMEngine

    config = make_config({"model": model, "dtype": dtype, "quantization": quantization,
                          "kv_cache_dtype": kv_dtype, "kv_cache_memory": kv_memory,
                          "enforce_eager": True, **sched})
    engine = LLMEngine(config)
    engine.load()
    return engine


def run_batch(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """Every prompt at once, to the end: output tokens/s, the most running at once and the
    preemptions it took."""
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    preempted = engine.stats().num_preemptions
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    tokens, running = 0, 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        running = max(running, len(engine.scheduler.running))
    seconds = time.perf_counter() - start
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "most_running": running,
            "preemptions": engine.stats().num_preemptions - preempted}


def engine_perplexity(engine: Any, ids: list[int], piece: int = 384, chunk: int = 32) -> float:
    """exp(mean NLL) of ids in pieces of `piece` tokens (each piece's first token unscored),
    through the engine's prompt logprobs; the engine's token budget (`chunk`, set by the
    caller) cuts each piece into steps, so every step after a piece's first attends to the
    tokens before it as the pool holds them."""
    from scheduler.sampling_params import SamplingParams

    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    pieces = [ids[s:s + piece] for s in range(0, len(ids) - 1, piece) if len(ids) - s > 1]
    for i, p in enumerate(pieces):
        engine.add_request(f"piece{i}", p, scoring)
    nll, count = 0.0, 0
    while engine.has_unfinished():
        for out in engine.step():
            for lp in out.prompt_logprobs or []:
                if lp is not None:
                    nll -= lp.chosen.logprob
                    count += 1
    if count != sum(len(p) - 1 for p in pieces):
        raise RuntimeError(f"scored {count} tokens of {sum(len(p) - 1 for p in pieces)}")
    return math.exp(nll / count)


def perplexities(args: argparse.Namespace) -> dict[str, float]:
    """Per dtype and KV dtype, the embedded model's perplexity on tests/data's text."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        for kv in KV_DTYPES:
            engine = load(None, dtype, "none", kv, "256MiB", max_num_seqs=4,
                          max_num_batched_tokens=32, max_model_len=512)
            ids = engine.runner.tokenizer(TEXT.read_text()).input_ids[:args.perplexity_tokens]
            out[f"{dtype}/{kv}"] = engine_perplexity(engine, ids)
            print(f"perplexity {dtype:>8} kv {kv:>4}: {out[f'{dtype}/{kv}']:.4f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint folder or .gguf (default: the embedded model)")
    p.add_argument("--shape", help="a random checkpoint of these shapes (benchmarks/shapes.py)")
    p.add_argument("--quantization", default="auto", help="the weights (--quantization)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="the pool, the same for both")
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--perplexity", action="store_true",
                   help="also the embedded model's perplexity, float32 and bfloat16")
    p.add_argument("--perplexity-tokens", type=int, default=2048)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    from tqdm import tqdm

    model = args.model
    if args.shape:
        from benchmarks.shapes import random_model

        model = str(random_model(args.shape))
    most = max(args.concurrency)
    engines = {kv: load(model, "bfloat16", args.quantization, kv, args.kv_cache_memory,
                        max_num_seqs=most, max_model_len=args.prompt_len + args.max_tokens + 16)
               for kv in KV_DTYPES}
    span = args.prompt_len + args.max_tokens
    capacity = {}
    for kv, e in engines.items():
        bs, blocks = e.runner.block_size, e.runner.num_kv_blocks
        capacity[kv] = {"blocks": blocks, "tokens": blocks * bs,
                        "pool_mib": e.runner.kv_cache.untyped_storage().nbytes() / 2**20,
                        "sequences": blocks // -(-span // bs)}
    rng = random.Random(0)
    vocab = engines["auto"].runner.facts.vocab_size
    runs: dict[str, list[dict[str, Any]]] = {}
    jobs = [(r, c) for r in range(args.rounds) for c in args.concurrency]
    for r, c in tqdm(jobs, desc="rounds", unit="batch"):
        prompts = [random_token_ids(rng, args.prompt_len, vocab) for _ in range(c)]
        for kv in (KV_DTYPES if r % 2 == 0 else tuple(reversed(KV_DTYPES))):
            runs.setdefault(f"{kv}@{c}", []).append(
                run_batch(engines[kv], prompts, args.max_tokens, f"r{r}c{c}"))
    summary = {key: {"tok_s": statistics.median(x["tok_s"] for x in v),
                     "most_running": max(x["most_running"] for x in v),
                     "preemptions": max(x["preemptions"] for x in v)}
               for key, v in runs.items()}
    print(f"KV pool of {args.kv_cache_memory}; sequences of {span} tokens it holds:")
    for kv, cap in capacity.items():
        print(f"  {kv:>4}: {cap['tokens']} tokens, {cap['sequences']} sequences")
    print(f"  int8 / auto: {capacity['int8']['sequences'] / capacity['auto']['sequences']:.2f}x")
    print(f"{'c':>4} {'auto tok/s':>11} {'int8 tok/s':>11} {'ratio':>7} {'running a/i':>12}")
    for c in args.concurrency:
        a, i = summary[f"auto@{c}"], summary[f"int8@{c}"]
        print(f"{c:>4} {a['tok_s']:>11.1f} {i['tok_s']:>11.1f} {i['tok_s'] / a['tok_s']:>6.2f}x "
              f"{a['most_running']:>5}/{i['most_running']}")
    ppl = perplexities(args) if args.perplexity else {}
    info = machine_info()
    label = args.shape or (Path(args.model).name if args.model else "smollm2-135m")
    out = args.out / f"kv-cache-{label}-{args.quantization}-{machine_slug(info)}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "kv_cache", "machine": info,
                               "args": vars(args) | {"out": str(args.out)},
                               "capacity": capacity, "throughput": summary, "runs": runs,
                               "perplexity": ppl}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
