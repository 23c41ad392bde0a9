"""engine/huge_pages: the CPU KV pool's allocation."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.worker import huge_pages
from engine.worker.huge_pages import HUGE_PAGE, huge_pages_apply, thp_mode, zeros

POOL = (4, 2, 64, 3, 16, 64)  # [layers, K/V, blocks, kvH, block_size, hd]: 3 MB in bf16


def test_thp_mode_reads_the_bracketed_word() -> None:
    assert thp_mode("always [madvise] never\n") == "madvise"
    assert thp_mode("[always] madvise never") == "always"
    assert thp_mode("always madvise [never]") == "never"
    assert thp_mode("") == "unavailable"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_pool_is_zeroed_contiguous_writable_and_outlives_its_mapping(
        dtype: torch.dtype) -> None:
    pool = zeros(POOL, dtype)
    assert pool.shape == POOL and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    gc.collect()  # the mapping object is only referenced by the tensor's storage now
    pool[1, 0, 5].fill_(2.5)
    pool[3, 1, 63].fill_(-1.0)
    assert pool[1, 0, 5].float().eq(2.5).all() and pool[3, 1, 63].float().eq(-1.0).all()
    assert float(pool.float().sum()) == 2.5 * 3 * 16 * 64 - 3 * 16 * 64


@pytest.mark.skipif(not huge_pages_apply(HUGE_PAGE), reason="no transparent huge pages here")
def test_with_huge_pages_the_pool_starts_on_a_huge_page_boundary() -> None:
    pool = zeros(POOL, torch.bfloat16)
    assert pool.data_ptr() % HUGE_PAGE == 0


def test_without_huge_pages_or_below_one_the_pool_is_plain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    small = zeros((2, 3), torch.float32)
    assert small.shape == (2, 3) and not small.any()
    monkeypatch.setattr(huge_pages, "thp_mode", lambda text=None: "never")
    assert not huge_pages_apply(HUGE_PAGE * 4)
    pool = zeros(POOL, torch.bfloat16)
    assert pool.shape == POOL and not pool.any()
