"""The linear-attention state pool (core/state_pool.py): committed blocks, checkpoints, promotion."""

from __future__ import annotations

import pytest

from dflash.core.state_pool import StatePool


def test_committed_blocks_are_zeroed_and_checkpoints_promoted():
    zeroed = []
    pool = StatePool(8, zero=zeroed.append)
    a, b = pool.allocate("a"), pool.allocate("b")
    assert (a, b) == (0, 1) and zeroed == [0, 1]
    assert pool.la_block_indices("a") == ([0, 0], 0)  # prefill / decode: read and write the committed block
    checkpoints = pool.reserve_checkpoints("a", 4)
    assert checkpoints == [2, 3, 4, 5] and zeroed == [0, 1]  # checkpoints are written whole, never zeroed
    assert pool.la_block_indices("a") == ([0, 2, 3, 4, 5], 1)
    assert pool.promote("a", 2) == 3  # seed + 1 accepted candidate
    assert pool.committed("a") == 3 and pool.la_block_indices("a") == ([3, 3], 0)
    assert pool.num_free == 6
    pool.reserve_checkpoints("b", 3)
    pool.release_checkpoints("b")  # nothing verified (abort mid-step, or the request finished)
    pool.free("a")
    pool.free("b")
    assert pool.num_free == 8


def test_exhaustion_and_misuse_are_errors():
    pool = StatePool(3)
    pool.allocate("a")
    with pytest.raises(MemoryError, match="exhausted"):
        pool.reserve_checkpoints("a", 3)
    assert pool.num_free == 2 and not pool.can_allocate(3)
    with pytest.raises(ValueError, match="already owns"):
        pool.allocate("a")
    pool.reserve_checkpoints("a", 2)
    with pytest.raises(ValueError, match="checkpoint 3 of 2"):
        pool.promote("a", 3)
    pool.free("a")
    assert pool.num_free == 3
