"""One decode step's MoE work on a random ~1B-parameter Qwen3-MoE: transformers' experts loop
against ours (engine/layers/moe.py), dense and with int8/int4 experts.

The model is a real Qwen3MoeForCausalLM (default: hidden 1024, 16 experts of intermediate
1024, 2 active, 20 layers: 1.01B expert parameters), built with random weights and prepared
the way engine/worker/loader.py prepares a loaded one (experts split per expert, quantized,
oneDNN-packed in bf16, stacks dropped). A step at N rows runs every layer's sparse MoE block
(router + experts) on N random token rows. Timed per row count, each in a shuffled order per
round so a shared machine's drift hits all alike, medians kept:

- `hf_eager`: transformers' per-expert loop (`experts_implementation="eager"`);
- `hf_grouped_mm`: transformers' own grouped path (torch's `grouped_mm`; its default when a
  model names none);
- `ours` / `ours_int8` / `ours_int4`: the loader's model at `--quantization none/int8/int4`.

Each variant of ours is built, timed with the two transformers ones in the same rounds, and
freed before the next (three 1B models at once would not fit beside other work), so each
ratio is against the loop timed next to it.

    .venv/bin/python -m benchmarks.bench_moe                       # bf16, this CPU's default
    .venv/bin/python -m benchmarks.bench_moe --dtype float32 --variants none

Writes benchmarks/results/moe-<machine>-<dtype>-<N>threads.json with the machine description.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import RESULTS_DIR, machine_info, machine_slug

HF_KINDS = ("hf_eager", "hf_grouped_mm")


def build(args: argparse.Namespace, dtype: torch.dtype) -> Any:
    """A random Qwen3-MoE in `dtype`, its experts on transformers' loop (same seed, same
    weights every call). Built on the meta device and filled in place: no float32 copy."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape: dict[str, Any] = {
        "vocab_size": 1024, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
        "moe_intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
        "num_experts": args.experts, "num_experts_per_tok": args.top_k,
        "experts_implementation": "eager"}
    model: Any
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape))
    # Only the MoE blocks run: buffers left empty (the rotary table) are never read.
    model = model.to(dtype).to_empty(device="cpu").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norms
            else:  # std 0.02 as HF's init; generated in float32 a matrix at a time
                for part in p.view(-1, p.shape[-1]).split(4096):
                    part.copy_(torch.randn(part.shape, generator=gen) * 0.02)
    return model


def prepare(model: Any, mode: str) -> Any:
    """What engine/worker/loader.py does to a loaded model, in its order."""
    from engine.layers.moe import drop_stacked_weights, use_grouped_experts
    from engine.layers.packed_linear import pack_linears, packing_applies
    from engine.layers.quantization.quant import quantize_model

    use_grouped_experts(model)
    quantize_model(model, mode, None)
    if packing_applies(torch.device("cpu"), model.dtype, False):
        pack_linears(model)
    drop_stacked_weights(model)
    return model


def moe_step(model: Any, x: torch.Tensor) -> torch.Tensor:
    """One step's MoE work: every layer's sparse block on x [1, N, H] (the sum keeps them)."""
    out = x
    for layer in model.model.layers:
        out = out + layer.mlp(x)
    return out


def experts_hit(model: Any, x: torch.Tensor) -> float:
    """Mean number of distinct experts a step of x's rows reaches per layer."""
    hit = []
    for layer in model.model.layers:
        _, _, index = layer.mlp.gate(x.reshape(-1, x.shape[-1]))
        hit.append(index.unique().numel())
    return statistics.mean(hit)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def runs_for(hf: Any, ours: Any, x: torch.Tensor, name: str) -> dict[str, Callable[[], Any]]:
    def hf_run(impl: str) -> Callable[[], Any]:
        def run() -> Any:
            hf.config._experts_implementation = impl  # what set_experts_implementation sets
            return moe_step(hf, x)
        return run

    return {"hf_eager": hf_run("eager"), "hf_grouped_mm": hf_run("grouped_mm"),
            name: lambda: moe_step(ours, x)}


@torch.inference_mode()
def measure(hf: Any, ours: Any, name: str, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    x = torch.randn(1, rows, args.hidden, generator=torch.Generator().manual_seed(rows))
    x = x.to(hf.dtype)
    runs = runs_for(hf, ours, x, name)
    outs = {kind: run() for kind, run in runs.items()}  # also the warm-up
    for run in runs.values():
        run()
    samples: dict[str, list[float]] = {kind: [] for kind in runs}
    for _ in range(args.repeats):
        order = list(runs)
        random.shuffle(order)
        for kind in order:
            samples[kind].append(timed(runs[kind]))
    med = {kind: statistics.median(v) for kind, v in samples.items()}
    diff = (outs[name].float() - outs["hf_eager"].float()).abs().max().item()
    return {"variant": name, "rows": rows, "experts_hit_per_layer": experts_hit(hf, x),
            "median_ms": med, "samples_ms": samples, "speedup_vs_eager": {
                kind: med["hf_eager"] / v for kind, v in med.items()},
            "bitwise_equal_to_eager": torch.equal(outs[name], outs["hf_eager"]),
            "max_abs_diff_vs_eager": diff}


def report(res: dict[str, Any]) -> None:
    med, name = res["median_ms"], res["variant"]
    print(f"{name:10} rows={res['rows']:3} (experts hit/layer {res['experts_hit_per_layer']:5.2f}):"
          f" hf eager {med['hf_eager']:8.2f} ms, hf grouped_mm {med['hf_grouped_mm']:8.2f} ms"
          f" ({res['speedup_vs_eager']['hf_grouped_mm']:.2f}x), {name} {med[name]:8.2f} ms"
          f" ({res['speedup_vs_eager'][name]:.2f}x); bitwise = eager: "
          f"{res['bitwise_equal_to_eager']}, max |diff| {res['max_abs_diff_vs_eager']:.3g}",
          flush=True)


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: per row count, each kind's median ms and its ratio to the eager loop timed in
    the same rounds (the transformers columns: from the first variant's rounds)."""
    names = list(dict.fromkeys(r["variant"] for r in results))
    lines = ["| rows | experts hit/layer | " + " | ".join([*HF_KINDS, *names]) + " |",
             "|---:|---:|" + "---:|" * (len(HF_KINDS) + len(names))]
    for rows in dict.fromkeys(r["rows"] for r in results):
        mine = {r["variant"]: r for r in results if r["rows"] == rows}
        first = mine[names[0]]
        cells = [_cell(first, kind) for kind in HF_KINDS] + [_cell(mine[n], n) for n in names]
        lines.append(f"| {rows} | {first['experts_hit_per_layer']:.1f} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def _cell(res: dict[str, Any], kind: str) -> str:
    return f"{res['median_ms'][kind]:.1f} ms ({res['speedup_vs_eager'][kind]:.2f}x)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=1024, help="each expert's width")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--dtype", default="auto", help="auto: the engine's choice for this CPU")
    p.add_argument("--variants", default="none,int8,int4", help="--quantization modes of ours")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    from engine.worker.loader import resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    random.seed(0)
    info = machine_info()  # before the runs: load_avg_at_start says if the box was busy
    hf = build(args, dtype)
    experts_params = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj
                         .numel() for layer in hf.model.layers)
    print(f"{experts_params / 1e9:.2f}B expert parameters, {dtype}, "
          f"{torch.get_num_threads()} threads", flush=True)
    results = []
    for mode in args.variants.split(","):
        name = "ours" if mode == "none" else f"ours_{mode}"
        ours = prepare(build(args, dtype), mode)
        for rows in (int(r) for r in args.rows.split(",")):
            results.append(measure(hf, ours, name, rows, args))
            report(results[-1])
        del ours
        gc.collect()
    info["load_avg_at_end"] = os.getloadavg()
    dt = str(dtype).removeprefix("torch.")
    out = args.out / f"moe-{machine_slug(info)}-{dt}-{torch.get_num_threads()}threads.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "moe", "machine": info, "dtype": dt,
                               "threads": torch.get_num_threads(),
                               "expert_params": experts_params,
                               "args": vars(args) | {"out": str(args.out)},
                               "results": results}, indent=2))
    print(table(results))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
