"""Where pagedserve caches what it derives (converted GGUF folders, native quantized weights,
compiled kernels and graphs): one root, and a GGUF's folder keyed by the file's content.
Torch-free, a leaf: the loader, the GGUF weight reader and the kernel builder all use it."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    if env := os.environ.get("PAGEDSERVE_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve"


def gguf_cache_dir(gguf: Path) -> Path:
    """Keyed by the file's content, not its path or mtime: every fresh install of the wheel
    writes the same GGUF with a new mtime, and an mtime key left a 671 MB copy behind each."""
    st = gguf.stat()
    return cache_root() / f"{gguf.stem}-{_content_key(gguf.resolve(), st.st_size, st.st_mtime_ns)}"


@functools.lru_cache(maxsize=16)
def _content_key(path: Path, size: int, mtime_ns: int) -> str:
    """sha256 of the file, first 16 hex digits (~0.1 s for the embedded 98 MB; size and
    mtime are in the arguments only so that a rewritten file is hashed again)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]
