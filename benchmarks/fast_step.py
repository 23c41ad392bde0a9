"""Issue 9's targets in one run: pagedserve (default, --enforce-eager, --quantization int4),
vLLM's CPU build and Hugging Face generate(), the same client and the same prompts.

    .venv/bin/python -m benchmarks.fast_step --make-vllm-venv   # once: vLLM's own venv
    .venv/bin/python -m benchmarks.fast_step                    # full run, bfloat16
    .venv/bin/python -m benchmarks.fast_step --quick            # smoke run

Steps: (1) the default server is started once with an empty compile cache and stopped: its
first start-up time; (2) every variant (fast_step_targets.VARIANTS) is started, one at a time
(the default's start, on the cache (1) left, is its second start-up time), warmed up and left
running; (3) at max concurrency 1, 4, 16 and 64 in turn, every running server is driven with
~100-token prompts and 128 output tokens (ignore_eos, streaming, greedy), a different server
first at each level (benchmarks/interleave.py: the servers compared at one load are measured
minutes apart at most, not a whole run apart); (4) with every server stopped, HF generate()
decodes the c=1 prompts one at a time in the same dtype: its ms per token is the reference of
targets (b) and (c). A variant whose flag the server does not know is reported as
`rejected-flag` with the server's own error line; the run goes on. Start-up time = process
start to the first /health 200.
Writes <out>/<date>-<machine>-fast-step[-quick].json and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: benchmarks/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, ServerProcess, machine_info, machine_slug, wait_for_idle
from benchmarks.compare import WARMUP, Comparison, Plan, ServerSpec, workloads
from benchmarks.fast_step_report import plot, print_report
from benchmarks.fast_step_targets import (
    DEFAULT,
    HF,
    VARIANTS,
    VLLM,
    Variant,
    all_checks,
    start_failure,
    summary_rows,
)
from benchmarks.interleave import bench_interleaved
from benchmarks.loadgen import Tokenizer
from benchmarks.serving_load import RequestSpec

# ~100-token prompts, exactly 128 output tokens; 2 prompts per slot so every stream of a
# concurrency level runs twice (4 at c=1: 508 ITL samples).
FULL = Plan(concurrencies=(1, 4, 16, 64), rate_fractions=(), input_range=(96, 104),
            output_range=(128, 128), prompts_per_slot=2, min_prompts=4, max_prompts=128,
            poisson_prompts=0, num_warmups=2, wait_idle_timeout_s=180.0)
QUICK = Plan(concurrencies=(1, 16), rate_fractions=(), input_range=(96, 104),
             output_range=(32, 32), prompts_per_slot=1, min_prompts=2, max_prompts=16,
             poisson_prompts=0, num_warmups=1, wait_idle_timeout_s=20.0)
COMPILE_CACHE = "torch_compile"  # <cache root>/torch_compile: the compile branch's cache


@dataclass(frozen=True)
class VariantSpec:
    """A registry server with the variant's flags and the run's environment (compare's
    ServerSpec interface, so Comparison.bench_server drives it)."""

    variant: Variant
    base: ServerSpec
    env: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def description(self) -> str:
        return self.variant.description

    def command(self, folder: Path, dtype: str, port: int, extra_args: list[str]) -> list[str]:
        argv = self.base.command(folder, dtype, port, [*self.variant.args, *extra_args])
        return ["env", *(f"{k}={v}" for k, v in self.env), *argv] if self.env else argv

    def extra_body(self, ignore_eos: bool) -> dict[str, Any]:
        return self.base.extra_body(ignore_eos)


@contextmanager
def fresh_compile_cache(keep: Path | None) -> Iterator[dict[str, str]]:
    """Environment for a pagedserve whose compile caches start empty: a new cache root that
    links every entry of the real one (the converted model above all, so nothing else is
    redone) except torch_compile, plus inductor's own cache dir inside it. `keep`: use
    (and keep) that folder instead of a temporary one."""
    from engine.worker.cache_paths import cache_root

    real = cache_root()
    root = keep or Path(tempfile.mkdtemp(prefix="pagedserve-cache-"))
    root.mkdir(parents=True, exist_ok=True)
    if real.is_dir():
        for entry in real.iterdir():
            link = root / entry.name
            if entry.name != COMPILE_CACHE and not link.exists():
                link.symlink_to(entry)
    try:
        yield {"PAGEDSERVE_CACHE": str(root), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)  # removes the links, never their targets


def first_startup(spec: VariantSpec, folder: Path, dtype: str, timeout_s: float) -> dict[str, Any]:
    """Start the default server on the empty cache, time it to /health 200, stop it."""
    proc = ServerProcess(f"{spec.name}-first", lambda port: spec.command(folder, dtype, port, []))
    print(f"\n[{spec.name}] first start (empty compile cache): {' '.join(proc.command)}", flush=True)
    t0 = time.perf_counter()
    with proc:
        try:
            proc.wait_healthy(timeout_s)
            out: dict[str, Any] = {"first_s": time.perf_counter() - t0}
        except (RuntimeError, TimeoutError, OSError) as e:
            out = {"error": f"first start failed: {str(e).splitlines()[0]}",
                   "log_tail": proc.log_tail()}
        out["first_command"] = proc.command
    print(f"[{spec.name}] first start: {out.get('first_s', out.get('error'))}", flush=True)
    return out


def classify(rec: dict[str, Any]) -> dict[str, Any]:
    """Add status (ok | rejected-flag | failed) and a one-line reason to a bench_server record."""
    if "error" not in rec:
        return rec | {"status": "ok"}
    if "ready_s" not in rec:  # never became healthy: maybe a flag it does not know
        return rec | start_failure(rec.get("exit_code"), rec.get("log_tail", ""))
    return rec | {"status": "failed", "reason": rec["error"].splitlines()[0]}


def hf_reference(folder: Path, dtype: str, tok: Tokenizer, specs: list[RequestSpec],
                 new_tokens: int) -> dict[str, Any]:
    """HF generate()'s ms per token on the c=1 prompts, in this process, no server running."""
    from benchmarks.baselines.generation import load_model
    from benchmarks.hf_baseline import decode_ms_per_token

    print(f"\n[{HF}] {len(specs)} prompts x {new_tokens} tokens, one at a time, {dtype}", flush=True)
    try:
        model = load_model(folder, dtype).model
        prompts = [tok.encode(s.prompt, add_special_tokens=False) for s in specs]
        out = decode_ms_per_token(model, prompts, new_tokens)
    except (OSError, ValueError, RuntimeError) as e:
        return {"status": "failed", "reason": f"{e.__class__.__name__}: {e}"}
    print(f"[{HF}] {out['ms_per_token']:.1f} ms/token (median), first token "
          f"{out['first_token_ms']:.0f} ms", flush=True)
    return {"status": "ok", **out}


def run(args: argparse.Namespace, registry: Mapping[str, ServerSpec], tok: Tokenizer,
        folder: Path, plan: Plan | None = None,
        variants: tuple[Variant, ...] = VARIANTS) -> tuple[dict[str, Any], Path]:
    """The whole run; -> (the JSON data, its path)."""
    t0 = time.perf_counter()
    plan = plan or (QUICK if args.quick else FULL)
    timeout = args.wait_idle_timeout if args.wait_idle_timeout is not None else plan.wait_idle_timeout_s
    idle = wait_for_idle(args.wait_idle, timeout)
    print(f"before the run: {idle}", flush=True)
    machine = machine_info() | {"idle_check": idle}
    specs = workloads(plan, tok, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    path = args.out / f"{stamp}-{machine_slug(machine)}-fast-step{'-quick' if args.quick else ''}.json"
    partial = path.with_suffix(".partial.json")  # after every server: a killed run keeps its numbers
    chosen = [v for v in variants if v.name in args.servers]
    servers: dict[str, Any] = {}
    startup: dict[str, Any] = {}
    with fresh_compile_cache(args.compile_cache) as env:
        run_specs = {v.name: VariantSpec(v, registry[v.server], tuple(env.items())) for v in chosen}
        comp = Comparison(args, plan, run_specs, tok, folder)  # its server_args, seed, startup_timeout
        for v in chosen:
            unavailable = unavailable_reason(v)
            if unavailable:
                print(f"\n[{v.name}] not run: {unavailable}", flush=True)
                servers[v.name] = {"status": "unavailable", "reason": unavailable, "runs": {}}

        def first(name: str) -> None:  # the cold start, alone, before the default's own start
            if name == DEFAULT:
                startup.update(first_startup(run_specs[name], folder, args.dtype,
                                             args.startup_timeout))

        def save(records: dict[str, Any]) -> None:
            partial.write_text(json.dumps({"servers": records, "startup": startup}, default=str))

        names = [v.name for v in chosen if v.name not in servers]
        records = bench_interleaved(comp, names, args.dtype, specs, save, first)
        for v in chosen:  # in the variants' order, the unavailable ones included
            if v.name in records:
                servers[v.name] = classify(records[v.name]) | {"variant": asdict(v)}
            servers[v.name].setdefault("variant", asdict(v))
        if "ready_s" in servers.get(DEFAULT, {}):
            startup["second_s"] = servers[DEFAULT]["ready_s"]
    hf: dict[str, Any] = (hf_reference(folder, args.dtype, tok, specs["c1"], plan.output_range[0])
          if HF in args.servers and "c1" in specs else {"status": "not run", "reason": "not asked"})
    loads = tuple(f"c{c}" for c in plan.concurrencies)
    data = {"benchmark": "fast_step", "quick": args.quick, "args": vars(args), "plan": asdict(plan),
            "machine": machine | {"load_avg_at_end": os.getloadavg()}, "model_folder": str(folder),
            "dtype": args.dtype, "servers": servers, "hf_generate": hf, "startup": startup,
            "summary": summary_rows(servers, loads),
            "checks": all_checks(servers, hf.get("ms_per_token"), startup),
            "workload": {n: {"num_prompts": len(s), "prompt_lens": [x.prompt_len for x in s],
                             "output_lens": [x.output_len for x in s]} for n, s in specs.items()
                         if n != WARMUP},
            "wall_s": time.perf_counter() - t0}
    print_report(data)
    path.write_text(json.dumps(data, indent=2, default=str))
    partial.unlink(missing_ok=True)
    if not args.no_plot:
        plot(data, path.with_suffix(".png"))
    print(f"\nsaved {path} (wall {data['wall_s']:.0f} s)")
    return data, path


def unavailable_reason(v: Variant) -> str | None:
    if v.server != VLLM:
        return None
    from benchmarks.baselines.vllm_cpu import missing_reason

    return missing_reason()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.compare import parse_server_args

    names = [v.name for v in VARIANTS] + [HF]
    p = argparse.ArgumentParser(prog="python -m benchmarks.fast_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", nargs="+", default=names, choices=names,
                   help="which variants (and hf-generate) to run; the targets that need a "
                   "missing one say n/a")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quick", action="store_true",
                   help="c=1 and c=16 only, 32 output tokens, 2 HF prompts: a smoke run")
    p.add_argument("--make-vllm-venv", action="store_true",
                   help="first make vLLM's venv if it is missing (pip, a few minutes)")
    p.add_argument("--compile-cache", type=Path,
                   help="cache root for the run's pagedserve servers (default: a temp folder, "
                   "empty but for links to the real one's converted models; removed at the end)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", nargs="*", default=[], metavar="NAME=FLAGS",
                   help='extra flags for one variant, e.g. "vllm-cpu=--max-num-seqs 64"')
    p.add_argument("--model-folder", type=Path,
                   help="safetensors folder vLLM and HF load (default: the embedded SmolLM2-135M)")
    p.add_argument("--wait-idle", type=float, default=0.5)
    p.add_argument("--wait-idle-timeout", type=float, help="s (default 180, --quick 20)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        args.server_args = parse_server_args(args.server_args)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    from benchmarks.baselines.registry import SERVERS
    from benchmarks.common import model_folder
    from benchmarks.loadgen import load_tokenizer

    args = parse_args(argv)
    # SIGTERM (timeout, CI) unwinds like Ctrl-C, so the running server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.make_vllm_venv:
        from benchmarks.baselines.vllm_cpu import make_venv

        make_venv()
    folder = args.model_folder or model_folder()
    run(args, SERVERS, load_tokenizer(folder), folder)


if __name__ == "__main__":
    main()
