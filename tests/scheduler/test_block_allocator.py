from __future__ import annotations

import pytest

from infer_scheduler.block_allocator import BlockAllocator, BlockError


def test_allocate_and_free_round_trip():
    a = BlockAllocator(8)
    assert a.num_free == 8
    x = a.allocate(3)
    assert x == [0, 1, 2] and a.num_free == 5
    assert all(a.refcount(b) == 1 for b in x)
    assert a.decref(x) == 3
    assert a.num_free == 8
    a.check()


def test_recently_freed_blocks_are_reused_first():
    a = BlockAllocator(8)
    x = a.allocate(4)
    a.decref([x[2]])
    assert a.allocate(1) == [x[2]]
    a.check()


def test_shared_blocks_free_on_last_reference():
    a = BlockAllocator(4)
    x = a.allocate(2)
    a.incref(x)
    assert a.decref(x) == 0 and a.num_free == 2
    assert a.decref(x) == 2 and a.num_free == 4
    a.check()


def test_double_free_and_incref_of_free_block_raise():
    a = BlockAllocator(4)
    x = a.allocate(2)
    a.decref(x)
    with pytest.raises(BlockError, match="double free"):
        a.decref(x)
    with pytest.raises(BlockError, match="double free"):
        a.decref([x[0]])
    with pytest.raises(BlockError, match="incref of free"):
        a.incref([x[1]])
    a.check()  # a refused operation leaves the counts as they were


def test_allocating_beyond_the_free_blocks_raises():
    a = BlockAllocator(3)
    a.allocate(2)
    with pytest.raises(BlockError):
        a.allocate(2)
    assert a.allocate(0) == []
    assert a.num_free == 1
