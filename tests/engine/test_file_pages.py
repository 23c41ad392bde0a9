"""engine/worker/file_pages.py: a weight's pages in a mapped checkpoint leave the resident
set when released and read back the same; anonymous memory is never touched."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import torch

from engine.worker.file_pages import mapped_checkpoints, release_pages

MB = 2**20


def resident_file_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"RssFile:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def test_released_file_pages_leave_the_resident_set_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "weights.safetensors"  # mapped_checkpoints knows checkpoints by suffix
    values = np.random.default_rng(0).standard_normal(4 * MB).astype(np.float32)  # 16 MB
    values.tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only array: torch warns, we only read it
        tensor = torch.from_numpy(mapped)
    expected = float(tensor.double().sum())  # reads every page
    before = resident_file_bytes()
    released = release_pages(tensor, mapped_checkpoints())
    assert released >= 16 * MB - 8192  # whole pages inside the tensor
    assert before - resident_file_bytes() >= released // 2  # gone from the resident set
    assert float(tensor.double().sum()) == expected  # read back from the file, unchanged
    assert release_pages(tensor[: 1024], []) == 0  # no mapping given: nothing to release


def test_anonymous_memory_and_partial_pages_are_left_alone(tmp_path: Path) -> None:
    anonymous = torch.randn(4 * MB)
    copy = anonymous.clone()
    assert release_pages(anonymous, mapped_checkpoints()) == 0
    assert torch.equal(anonymous, copy)
    path = tmp_path / "small.safetensors"
    np.arange(100, dtype=np.float32).tofile(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r"))
    assert release_pages(small[1:50], mapped_checkpoints()) == 0  # inside one page: kept
    assert small[1:50].tolist() == list(range(1, 50))
