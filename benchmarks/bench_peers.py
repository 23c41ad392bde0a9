"""Issue 32's side-by-side: pagedserve against vLLM's CPU build, llama.cpp's llama-server and
OpenVINO GenAI on one model, per weight class, the same client and prompts for all.

    .venv/bin/python -m benchmarks.bench_peers --prepare     # once: build and convert what is missing
    .venv/bin/python -m benchmarks.bench_peers               # the 1B run (~12 min on 2 cores)
    .venv/bin/python -m benchmarks.bench_peers --model smollm2 --concurrency 1 4 16 64

Classes, each a group of servers interleaved over the loads (benchmarks/interleave.py) and
run one group after another, so a group's servers are up together (memory: at 1B the nine
servers would not fit in 24 GiB at once) and the servers compared are measured minutes apart:

- bf16: pagedserve (`--quantization none`), vLLM's CPU build;
- int8: pagedserve `--quantization int8` (W8A16) and `w8a8`, llama.cpp Q8_0, OpenVINO int8 (per
  channel; its CPU plugin quantizes activations to int8 on the fly by default);
- int4: pagedserve `--quantization int4` from safetensors, pagedserve on the GGUF Q4_0 (its
  blocks kept as they are), llama.cpp Q4_0, OpenVINO int4 (groups of 128).

Workload: ~100-token prompts, `--output-tokens` (64) output tokens pinned with ignore_eos,
streaming, greedy; max concurrency from `--concurrency` (1 4 16), 2 prompts per slot at c=1
and 1 above. llama.cpp runs with -np = the highest concurrency of the run (one server serves
every load; an idle slot costs it nothing) and flash attention. Before the servers, the box's
memory bandwidth is measured in this process with the servers' thread count (a STREAM-like
copy, and a read-only pass), and each server's weight bytes per decode step are taken from
what it reads (pagedserve: its /metrics memory account; vLLM: the bf16 safetensors; llama.cpp:
the GGUF; OpenVINO: the IR's weight file): at c=1, weight bytes / ITL p50 is its weight-read
rate, stated as a share of the read bandwidth in the summary and of the copy bandwidth in the
issue's checks (bench_peers_report.py). A server that cannot be prepared here is
reported as unavailable with its error. Writes <out>/<date>-<machine>-peers-<model>.json and
a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, ServerProcess, machine_info, machine_slug, wait_for_idle
from benchmarks.compare import Comparison, Plan, workloads
from benchmarks.interleave import bench_interleaved

OURS = "pagedserve"
CLASSES = ("bf16", "int8", "int4")
METRIC_WEIGHTS = ("dense_weights", "packed_weights", "quantized_weights")  # not dense_copies


@dataclass(frozen=True)
class Entry:
    """One server of the comparison: what it serves (`artifact`: safetensors, gguf:<type> or
    ir:<format>) and how it is started on that file or folder."""

    name: str
    klass: str
    description: str
    artifact: str
    launch: Callable[[Path, int, int], list[str]]  # (artifact, port, parallel) -> argv
    fields: Callable[[bool], dict[str, Any]] = field(
        default=lambda ignore_eos: {"stream_options": {"include_usage": True},
                                    "ignore_eos": ignore_eos})


def _pagedserve(*flags: str) -> Callable[[Path, int, int], list[str]]:
    def argv(model: Path, port: int, parallel: int) -> list[str]:
        return [str(Path(sys.executable).parent / "pagedserve"), "serve", "--model", str(model),
                "--dtype", "bfloat16", "--device", "cpu", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning", *flags]
    return argv


def _vllm(model: Path, port: int, parallel: int) -> list[str]:
    from benchmarks.baselines import vllm_cpu

    return vllm_cpu.argv(model, "bfloat16", port)


def _vllm_fields(ignore_eos: bool) -> dict[str, Any]:
    from benchmarks.baselines import vllm_cpu

    return vllm_cpu.fields(ignore_eos)


def _llama_server(model: Path, port: int, parallel: int) -> list[str]:
    from benchmarks.baselines import llama_cpp

    # -c is the whole KV cache, shared by the -np slots: 512 tokens a slot fits ~100 + 128.
    return [str(llama_cpp.binary("llama-server")), "-m", str(model), "-t", str(os.cpu_count()),
            "-c", str(512 * parallel), "-np", str(parallel), "-fa", "on", "--host", "127.0.0.1",
            "--port", str(port)]


def _openvino(model: Path, port: int, parallel: int) -> list[str]:
    from benchmarks.baselines import openvino_genai

    return openvino_genai.argv(model, port)


ENTRIES = (
    Entry("pagedserve-bf16", "bf16", "pagedserve --quantization none", "safetensors",
          _pagedserve("--quantization", "none")),
    Entry("vllm-cpu-bf16", "bf16", "vLLM's CPU build 0.32 (own venv), bf16", "safetensors",
          _vllm, _vllm_fields),
    Entry("pagedserve-int8", "int8", "pagedserve --quantization int8 (W8A16, per row)",
          "safetensors", _pagedserve("--quantization", "int8")),
    Entry("pagedserve-w8a8", "int8", "pagedserve --quantization w8a8 (int8 activations per "
          "token in steps of more than 8 rows)", "safetensors", _pagedserve("--quantization", "w8a8")),
    Entry("llama.cpp-q8_0", "int8", "llama-server on the Q8_0 GGUF, flash attention",
          "gguf:Q8_0", _llama_server),
    Entry("openvino-int8", "int8", "OpenVINO GenAI continuous batching, int8 per channel",
          "ir:int8", _openvino),
    Entry("pagedserve-int4", "int4", "pagedserve --quantization int4 (groups of 32) from "
          "safetensors", "safetensors", _pagedserve("--quantization", "int4")),
    Entry("pagedserve-gguf-q4_0", "int4", "pagedserve on the Q4_0 GGUF (auto: its blocks kept)",
          "gguf:Q4_0", _pagedserve()),
    Entry("llama.cpp-q4_0", "int4", "llama-server on the Q4_0 GGUF, flash attention",
          "gguf:Q4_0", _llama_server),
    Entry("openvino-int4", "int4", "OpenVINO GenAI continuous batching, int4 groups of 128 "
          "(int8 embedding and head)", "ir:int4", _openvino),
)


@dataclass(frozen=True)
class PreparedSpec:
    """compare's ServerSpec interface over an entry and its prepared file."""

    entry: Entry
    path: Path
    parallel: int

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def description(self) -> str:
        return self.entry.description

    def command(self, folder: Path, dtype: str, port: int, extra_args: list[str]) -> list[str]:
        return [*self.entry.launch(self.path, port, self.parallel), *extra_args]

    def extra_body(self, ignore_eos: bool) -> dict[str, Any]:
        return self.entry.fields(ignore_eos)


# --- preparing what each server serves ---


def model_path(name: str) -> Path:
    """The safetensors folder of `--model`: a folder, a benchmarks/shapes.py shape or the
    embedded SmolLM2 ("smollm2", its converted folder)."""
    if Path(name).is_dir():
        return Path(name)
    if name == "smollm2":
        from benchmarks.common import model_folder

        return model_folder()
    from benchmarks.shapes import random_model

    return random_model(name)


def artifact(entry: Entry, folder: Path, make: bool) -> Path:
    """The file or folder `entry` serves; `make`: build or install what is missing first.
    Raises RuntimeError with the reason when it cannot be had."""
    kind, _, arg = entry.artifact.partition(":")
    if entry.name.startswith("vllm"):
        from benchmarks.baselines import vllm_cpu

        if make:
            vllm_cpu.make_venv()
        if reason := vllm_cpu.missing_reason():
            raise RuntimeError(reason)
    if kind == "safetensors":
        return folder
    if kind == "gguf":
        from benchmarks.baselines import llama_cpp

        if not llama_cpp.binary("llama-server").exists():
            if not make:
                raise RuntimeError(f"llama.cpp is not built ({llama_cpp.binary('llama-server')}"
                                   "): run with --prepare")
            llama_cpp.build()
        return llama_cpp.gguf(folder, arg)
    from benchmarks.baselines import openvino_genai

    if not openvino_genai.installed():
        if not make:
            raise RuntimeError(f"no OpenVINO venv at {openvino_genai.venv_dir()}: run with "
                               "--prepare")
        openvino_genai.make_venv()
    ir = openvino_genai.export(folder, arg)
    return ir


def weight_bytes(entry: Entry, path: Path, metrics: str | None, embedding: int) -> int | None:
    """What one decode step reads of this server's weights (see the module's text).
    `embedding`: the bf16 embedding table's bytes, of which a step reads a row only when the
    head is a quantized copy of its own (pagedserve's int8/int4 modes)."""
    kind = entry.artifact.partition(":")[0]
    if entry.name.startswith(OURS):
        if metrics is None:
            return None
        found = {k: float(v) for k, v in
                 re.findall(r'memory_bytes\{[^}]*kind="(\w+)"[^}]*\}\s+([0-9.e+]+)', metrics)}
        total = sum(found.get(k, 0.0) for k in METRIC_WEIGHTS)
        return int(total - (embedding if found.get("quantized_weights") else 0)) or None
    if kind == "gguf":
        return path.stat().st_size
    if kind == "ir":
        from benchmarks.baselines import openvino_genai

        return openvino_genai.weight_bytes(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def embedding_bytes(folder: Path) -> int:
    """The bf16 embedding table's size, from the checkpoint's config."""
    config = json.loads((folder / "config.json").read_text())
    return 2 * config["vocab_size"] * config["hidden_size"]


def server_state(name: str, proc: ServerProcess) -> dict[str, Any]:
    """After start and warm-up: pagedserve's /metrics text and the tree's resident memory."""
    import psutil

    out: dict[str, Any] = {}
    if name.startswith(OURS):
        with urllib.request.urlopen(f"{proc.base_url}/metrics", timeout=30) as r:
            out["metrics"] = r.read().decode()
    try:
        root = psutil.Process(proc.pid)
        out["rss_bytes"] = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        pass
    return out


# --- the box's bandwidth ---


def bandwidth(threads: int, mib: int = 512, repeats: int = 7) -> dict[str, Any]:
    """STREAM-like, in this process with `threads` torch threads: copy (bytes read + written
    per second, STREAM's convention) and read (a sum over the array: what a decode step does
    with its weights). Medians of `repeats`; the arrays are far above the caches."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
        b = torch.empty_like(a)

        def timed(fn: Callable[[], object]) -> float:
            fn()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        nbytes = a.numel() * a.element_size()
        copy = 2 * nbytes / timed(lambda: b.copy_(a))
        read = nbytes / timed(lambda: a.sum())
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "array_mib": mib, "copy_gb_s": copy / 1e9, "read_gb_s": read / 1e9}


# --- the run ---


def run(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from benchmarks.loadgen import load_tokenizer

    t0 = time.perf_counter()
    folder = model_path(args.model)
    tok = load_tokenizer(folder)
    plan = Plan(concurrencies=tuple(args.concurrency), rate_fractions=(), input_range=(96, 104),
                output_range=(args.output_tokens, args.output_tokens), prompts_per_slot=1,
                min_prompts=2, max_prompts=64, poisson_prompts=0, num_warmups=2)
    idle = wait_for_idle(0.5, 120.0)
    machine = machine_info() | {"idle_check": idle}
    bw = bandwidth(os.cpu_count() or 1)
    print(f"memory bandwidth ({bw['threads']} threads): copy {bw['copy_gb_s']:.1f} GB/s, "
          f"read {bw['read_gb_s']:.1f} GB/s", flush=True)
    specs = workloads(plan, tok, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    path = args.out / f"{stamp}-{machine_slug(machine)}-peers-{folder.name}.json"
    parallel = max(plan.concurrencies)
    servers: dict[str, Any] = {}
    chosen = [e for e in ENTRIES if e.name in args.servers and e.klass in args.classes]
    for klass in args.classes:
        prepared: dict[str, PreparedSpec] = {}
        for e in (e for e in chosen if e.klass == klass):
            try:
                prepared[e.name] = PreparedSpec(e, artifact(e, folder, args.prepare), parallel)
            except (RuntimeError, OSError, ValueError) as err:  # CalledProcessError is one
                print(f"[{e.name}] unavailable: {err}", flush=True)
                servers[e.name] = {"status": "unavailable", "reason": str(err), "class": klass,
                                   "runs": {}}
        comp = Comparison(args, plan, prepared, tok, folder)
        records = bench_interleaved(comp, list(prepared), "bfloat16", specs,
                                    after_start=server_state)
        for name, rec in records.items():
            spec = prepared[name]
            state = rec.get("after_start", {})
            rec |= {"status": "failed" if "error" in rec else "ok", "class": klass,
                    "artifact": str(spec.path),
                    "weight_bytes": weight_bytes(spec.entry, spec.path, state.pop("metrics", None),
                                                 embedding_bytes(folder)),
                    "rss_bytes": state.get("rss_bytes")}
            servers[name] = rec
        path.with_suffix(".partial.json").write_text(json.dumps({"servers": servers}, default=str))
    data = {"benchmark": "bench_peers", "model": folder.name, "model_folder": str(folder),
            "args": vars(args), "plan": asdict(plan), "bandwidth": bw,
            "machine": machine | {"load_avg_at_end": os.getloadavg()}, "servers": servers,
            "summary": summary(servers, plan.concurrencies, bw),
            "workload": {n: {"num_prompts": len(s), "prompt_lens": [x.prompt_len for x in s]}
                         for n, s in specs.items()},
            "wall_s": time.perf_counter() - t0}
    from benchmarks.bench_peers_report import checks, plot, print_report

    data["checks"] = checks(data)
    path.write_text(json.dumps(data, indent=2, default=str))
    path.with_suffix(".partial.json").unlink(missing_ok=True)
    print_report(data)
    if not args.no_plot:
        plot(data, path.with_suffix(".png"))
    print(f"\nsaved {path} (wall {data['wall_s']:.0f} s)")
    return data, path


def summary(servers: dict[str, Any], concurrencies: tuple[int, ...],
            bw: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per server: class, tok/s and ITL p50 per load, c=1 weight-read rate and its
    share of the read bandwidth."""
    rows = []
    for name, rec in servers.items():
        runs = rec.get("runs", {})
        row: dict[str, Any] = {"server": name, "class": rec.get("class"),
                               "status": rec.get("status"), "weight_bytes": rec.get("weight_bytes"),
                               "rss_bytes": rec.get("rss_bytes")}
        for c in concurrencies:
            m = runs.get(f"c{c}", {})
            row[f"c{c}_tok_s"] = m.get("output_throughput")
            row[f"c{c}_itl_p50_ms"] = m.get("p50_itl_ms")
            row[f"c{c}_itl_p99_ms"] = m.get("p99_itl_ms")
            row[f"c{c}_ttft_p50_ms"] = m.get("p50_ttft_ms")
        itl = row.get("c1_itl_p50_ms")
        wb = row["weight_bytes"]
        rate = wb / (itl / 1e3) / 1e9 if wb and itl else None
        row["c1_weight_read_gb_s"] = rate
        row["c1_weight_read_share"] = rate / bw["read_gb_s"] if rate else None
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [e.name for e in ENTRIES]
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b",
                   help="a shape of benchmarks/shapes.py (llama-1b, llama-8b), smollm2 (the "
                   "embedded model's converted folder) or a safetensors folder")
    p.add_argument("--classes", nargs="+", default=list(CLASSES), choices=CLASSES)
    p.add_argument("--servers", nargs="+", default=names, choices=names)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--prepare", action="store_true",
                   help="build llama.cpp, make the vLLM and OpenVINO venvs, convert the model "
                   "where missing (else such a server is reported unavailable)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.server_args = {}  # Comparison's per-server extra flags: none here
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on a kill too
    run(args)


if __name__ == "__main__":
    main()
