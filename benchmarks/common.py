"""Shared helpers for benchmark scripts: machine description, result files, workloads."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    """What ran the benchmark: CPU model, cores, memory, library versions, git commit."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_avg_at_start": os.getloadavg(),
        "git_commit": _git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, check=False,
                             text=True, cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def save_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def random_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int],
                    vocab_size: int, seed: int, avoid: set[int] | None = None
                    ) -> tuple[list[list[int]], list[int]]:
    """n random-token prompts with lengths uniform in in_range, and output lengths uniform
    in out_range (the nano-vllm recipe). Special token ids in `avoid` never appear."""
    rng = random.Random(seed)
    skip = avoid or set()
    prompts = []
    for _ in range(n):
        length = rng.randint(*in_range)
        ids: list[int] = []
        while len(ids) < length:
            t = rng.randrange(vocab_size)
            if t not in skip:
                ids.append(t)
        prompts.append(ids)
    return prompts, [rng.randint(*out_range) for _ in range(n)]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
