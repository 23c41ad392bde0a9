"""PrefixIndex: the prefix-aware router's memory of which replica took which prompt prefix."""

from __future__ import annotations

import pytest

from api.replicas.prefix_index import PrefixIndex


def test_longest_prefix_wins_among_candidates() -> None:
    idx = PrefixIndex(block_size=4)
    idx.record(list(range(8)), "a")  # blocks [0..3], [4..7]
    idx.record(list(range(12)), "b")  # the same two blocks, then [8..11]: b took them last
    assert idx.lookup(list(range(12)) + [99], ["a", "b"]) == ("b", 3)
    assert idx.lookup(list(range(12)), ["a"]) == (None, 0)  # b overwrote a's entries
    idx.record(list(range(4)), "a")
    assert idx.lookup(list(range(12)), ["a"]) == ("a", 1)
    assert idx.lookup(list(range(12)), ["a", "b"]) == ("b", 3)


def test_partial_blocks_and_different_prefixes_do_not_match() -> None:
    idx = PrefixIndex(block_size=4)
    idx.record([1, 2, 3], "a")  # no full block: nothing cached, nothing recorded
    assert len(idx) == 0
    idx.record([1, 2, 3, 4, 5, 6, 7, 8], "a")
    assert idx.lookup([9, 2, 3, 4, 5, 6, 7, 8], ["a"]) == (None, 0)  # chained: first differs
    assert idx.lookup([1, 2, 3, 4, 0, 0, 0, 0], ["a"]) == ("a", 1)


def test_forget_and_capacity() -> None:
    idx = PrefixIndex(block_size=2, capacity=3)
    idx.record([1, 2, 3, 4], "a")
    idx.record([5, 6, 7, 8], "b")  # 4 blocks > 3: a's oldest block goes
    assert len(idx) == 3
    assert idx.lookup([1, 2, 3, 4], ["a", "b"]) == (None, 0)
    idx.forget("b")
    assert len(idx) == 1 and idx.lookup([5, 6], ["b"]) == (None, 0)
    with pytest.raises(ValueError):
        PrefixIndex(block_size=0)
