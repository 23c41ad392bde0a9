"""The CPU's feature flags, from /proc/cpuinfo: what the engine's kernel choices (bf16 or fp32
by default, W8A8's int8 GEMM) and the benchmarks' machine descriptions are read from."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The first CPU's `flags` line of /proc/cpuinfo (or of `cpuinfo`, for tests) as a set;
    None where there is none: no /proc (not Linux), or not x86 (ARM lists "Features")."""
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return None
