"""engine/worker/file_pages.py, on the mappings transformers really reads (safetensors'
private, writable ones): a weight's pages leave the resident set when released and read back
the same; a page written in place, anonymous memory and partial pages are never released."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.worker.file_pages import mapped_checkpoints, release_pages

MB = 2**20


def resident_mapped_bytes() -> int:
    """File pages a process has mapped count as RssFile, or as RssShmem on a tmpfs."""
    status = Path("/proc/self/status").read_text()
    fields = dict(re.findall(r"^(RssFile|RssShmem):\s+(\d+) kB", status, re.MULTILINE))
    return sum(int(v) for v in fields.values()) * 1024


def mapped_tensor(tmp_path: Path, name: str, values: torch.Tensor) -> torch.Tensor:
    path = tmp_path / f"{name}.safetensors"
    save_file({name: values}, str(path))
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def test_released_file_pages_leave_the_resident_set_and_read_back(tmp_path: Path) -> None:
    tensor = mapped_tensor(tmp_path, "w", torch.randn(4 * MB))  # 16 MB
    assert any(lo <= tensor.data_ptr() < hi for lo, hi in mapped_checkpoints())  # a mapping
    expected = float(tensor.double().sum())  # reads every page
    before = resident_mapped_bytes()
    released = release_pages(tensor, mapped_checkpoints())
    assert released >= 16 * MB - 8192  # the whole pages inside the tensor
    assert before - resident_mapped_bytes() >= released // 2  # gone from the resident set
    assert float(tensor.double().sum()) == expected  # read back from the file, unchanged


def test_a_page_written_in_place_is_never_released(tmp_path: Path) -> None:
    tensor = mapped_tensor(tmp_path, "w", torch.ones(MB))
    middle = slice(MB // 2, MB // 2 + 10)  # inside a whole page (the first one is partial)
    tensor[middle].mul_(3)  # that page becomes a private copy
    assert release_pages(tensor, mapped_checkpoints()) == 0
    assert tensor[middle].tolist() == [3.0] * 10 and float(tensor.sum()) == MB + 20


def test_anonymous_memory_and_partial_pages_are_left_alone(tmp_path: Path) -> None:
    anonymous = torch.randn(4 * MB)
    copy = anonymous.clone()
    start = anonymous.data_ptr()
    claimed = [(start, start + 16 * MB)]  # a wrong range: pagemap still sees anonymous pages
    assert release_pages(anonymous, claimed) == 0
    assert torch.equal(anonymous, copy)
    small = mapped_tensor(tmp_path, "s", torch.arange(100, dtype=torch.float32))
    assert release_pages(small[1:50], mapped_checkpoints()) == 0  # inside one page: kept
    assert small[1:50].tolist() == list(range(1, 50))
