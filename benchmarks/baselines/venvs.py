"""The baselines' own venvs (vLLM's CPU build, OpenVINO GenAI): where each lives, its python,
and whether its package is installed. Each pins a torch or a transformers of its own, so it
never shares ours; each is made only on request, never in CI."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def venv_dir(env_var: str, name: str) -> Path:
    """$env_var if set, else <cache root>/<name> (engine.worker.cache_paths.cache_root())."""
    if env := os.environ.get(env_var):
        return Path(env)
    from engine.worker.cache_paths import cache_root

    return cache_root() / name


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def has_module(venv: Path, module: str) -> bool:
    """True when the venv's python finds `module` (cheap: nothing is imported)."""
    py = python_of(venv)
    if not py.is_file():
        return False
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(py), "-c", probe], check=False, timeout=60).returncode == 0
