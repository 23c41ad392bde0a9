"""Shared helpers for benchmark scripts: machine description, result files, workloads."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Self

from engine.cpu_flags import cpu_flags

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    """What ran the benchmark: CPU model, cores, memory, library versions, git commit."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "cpu_features": cpu_features(),
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


# The CPU flags that pick the kernels (bf16 dot products, AMX tiles, VNNI): "AMD EPYC" alone
# names both an AVX2-only and an AVX512-BF16 machine here, whose numbers differ by 3-5x.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile",
                "amx_bf16", "amx_int8")


def cpu_features(cpuinfo: str | None = None) -> list[str]:
    """Which of KERNEL_FLAGS the first CPU of /proc/cpuinfo (or `cpuinfo`) has."""
    flags = cpu_flags(cpuinfo) or frozenset()
    return [f for f in KERNEL_FLAGS if f in flags]


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
    prompts = [random_token_ids(rng, rng.randint(*in_range), vocab_size, avoid) for _ in range(n)]
    return prompts, [rng.randint(*out_range) for _ in range(n)]


def random_token_ids(rng: random.Random, length: int, vocab_size: int,
                     avoid: set[int] | None = None) -> list[int]:
    """`length` ids drawn uniformly from the vocabulary, never one in `avoid`."""
    skip = avoid or set()
    ids: list[int] = []
    while len(ids) < length:
        t = rng.randrange(vocab_size)
        if t not in skip:
            ids.append(t)
    return ids


def model_folder() -> Path:
    """The converted safetensors folder of the embedded model (made on first use): what
    the baselines load and where the benchmarks take the tokenizer from."""
    from engine.worker.loader import converted_gguf, resolve_source

    src, _ = resolve_source(None)
    return converted_gguf(src) if src.suffix == ".gguf" else src


def machine_slug(info: dict[str, Any]) -> str:
    """A file-name-safe machine name: CPU model and core count, e.g.
    'intel-xeon-platinum-8375c-2c' from 'Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz'."""
    import re

    model = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", " ", str(info.get("cpu_model") or "cpu").lower())
    words = re.findall(r"[a-z0-9]+", model)
    return "-".join([*words[:5], f"{info.get('cpu_count') or 0}c"])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --- helpers for benchmarks that run servers as subprocesses (compare.py) ---


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_idle(max_load: float, timeout_s: float, window_s: float = 5.0,
                  load_avg: bool = True) -> dict[str, Any]:
    """Wait until the 1-minute load average (unless not `load_avg`: it lags a minute behind)
    and the busy cores measured over `window_s` are both below max_load, or timeout_s passes.
    -> what was seen last, and the seconds waited."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        before = CpuSample(None)
        time.sleep(window_s)
        busy = round((CpuSample(None).busy_s - before.busy_s) / window_s, 3)
        load = os.getloadavg()
        idle = (load[0] < max_load or not load_avg) and busy < max_load
        if idle or time.monotonic() >= deadline:
            return {"idle": idle, "load_avg": load, "busy_cores": busy,
                    "waited_s": round(time.monotonic() - t0, 1)}


class CpuSample:
    """Machine-wide busy CPU seconds and the part of it that is ours (this process and the
    server's process tree), so a run can report how many cores *other* processes used."""

    def __init__(self, server_pid: int | None) -> None:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        self.busy_s = (sum(fields[:8]) - fields[3] - fields[4]) / hz  # minus idle and iowait
        me = os.times()  # this process only: the server is our child, counted just below
        self.ours_s = me.user + me.system + (_tree_cpu_s(server_pid) if server_pid else 0.0)

    def foreign_cores(self, before: CpuSample, wall_s: float) -> float:
        foreign = (self.busy_s - before.busy_s) - (self.ours_s - before.ours_s)
        return round(max(0.0, foreign) / wall_s, 3) if wall_s > 0 else float("nan")


def _tree_cpu_s(pid: int) -> float:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass  # exited between listing and reading
    return total


class ServerProcess:
    """A server started as a subprocess in its own session on a free 127.0.0.1 port; a
    context manager that always stops it (SIGTERM, then SIGKILL after `grace_s`)."""

    def __init__(self, name: str, command_for_port: Any, grace_s: float = 15.0) -> None:
        self.name = name
        self.port = free_port()
        self.command: list[str] = command_for_port(self.port)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.grace_s = grace_s
        self.log_path = Path(tempfile.gettempdir()) / f"bench-{name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    def __enter__(self) -> Self:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM, SIGKILL after grace_s; then the same for the server's child processes
        that outlived it (vLLM's EngineCore and Worker would otherwise stay, orphaned)."""
        import psutil

        if self.proc is None:
            return None
        try:  # listed first: once the leader is gone its children are re-parented
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        code = self.proc.poll()
        if code is None:
            self.proc.terminate()
            try:
                code = self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(10)
        for kid in kids:  # psutil checks the creation time: never a recycled pid
            with contextlib.suppress(psutil.Error):
                kid.terminate()
        _, alive = psutil.wait_procs(kids, timeout=5)
        for kid in alive:
            with contextlib.suppress(psutil.Error):
                kid.kill()
        return code

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""
