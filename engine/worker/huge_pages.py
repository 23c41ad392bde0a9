"""The CPU KV pool on transparent huge pages.

A long-running server frees and reuses KV blocks in any order, so the decode kernel
(engine/attention/csrc/paged_decode.cpp) reads one 2 KB block per (sequence, kv head) at scattered
addresses. On 4 KB pages nearly every block costs a TLB miss and a page walk. A bare loop that
sums 2 KB chunks of a 1 GiB buffer in a shuffled order read 4.4-6.4 GB/s on one thread of the
AVX512-BF16 EPYC box, and 7.8-8.7 GB/s with the buffer on 2 MB pages (docs/performance.md).
On the kernel itself, over 30 layers with shuffled block tables, the pool on huge pages was
1.04-1.10x faster in four runs (benchmarks/bench_kv_huge_pages.py).

Only the pool gets them: a private anonymous mapping, aligned to 2 MB and advised
MADV_HUGEPAGE. torch's own switch (THP_MEM_ALLOC_ENABLE) would apply to every large allocation
of the process, and is read once, at the first one. The pool is zeroed at allocation, which
faults every page in at start-up rather than during the first steps. Where the advice does not
exist (not Linux) or transparent huge pages are off, the pool is a plain `torch.zeros`.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(text: str | None = None) -> str:
    """The kernel's transparent huge page mode, `always`, `madvise` or `never` (the bracketed
    word of THP_ENABLED, or of `text`); `unavailable` where there is no such file."""
    try:
        text = THP_ENABLED.read_text() if text is None else text
    except OSError:
        return "unavailable"
    chosen = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else "unavailable"


def huge_pages_apply(nbytes: int) -> bool:
    return (nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
            and thp_mode() in ("always", "madvise"))


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor, on huge pages where huge_pages_apply."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not huge_pages_apply(nbytes):
        return torch.zeros(shape, dtype=dtype)
    # One huge page more than needed, so the tensor can start on a 2 MB boundary.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # refused (a sandbox's seccomp): plain pages, still right
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf until freed
    start = -raw.data_ptr() % HUGE_PAGE
    pool = raw[start:start + nbytes].view(dtype).view(shape)
    pool.zero_()
    return pool
