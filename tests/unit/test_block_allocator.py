from __future__ import annotations

import pytest

from pagoda.scheduler_svc.core.kv import BlockAllocator, DoubleFreeError


def counts(allocator: BlockAllocator) -> tuple[int, int, int]:
    return allocator.num_used_blocks, allocator.num_free_blocks, allocator.num_retained_blocks


def test_allocation_is_all_or_nothing():
    allocator = BlockAllocator(4)
    first = allocator.allocate(3)
    assert first is not None and len(set(first)) == 3
    assert allocator.allocate(2) is None
    assert counts(allocator) == (3, 1, 0)  # the failed call took nothing
    assert allocator.allocate(1) is not None
    assert allocator.allocate(0) == []


def test_a_double_free_raises():
    allocator = BlockAllocator(2)
    (block_id,) = allocator.allocate(1)
    allocator.release(block_id, retain=False)
    with pytest.raises(DoubleFreeError):
        allocator.release(block_id, retain=False)
    assert counts(allocator) == (0, 2, 0)


def test_shared_blocks_free_on_the_last_release():
    allocator = BlockAllocator(2)
    (block_id,) = allocator.allocate(1)
    allocator.acquire(block_id)
    allocator.release(block_id, retain=False)
    assert allocator.ref_count(block_id) == 1 and counts(allocator) == (1, 1, 0)
    allocator.release(block_id, retain=False)
    assert counts(allocator) == (0, 2, 0)


def test_retained_blocks_can_be_revived_or_reclaimed_once():
    allocator = BlockAllocator(3)
    a, b = allocator.allocate(2)
    allocator.release(a, retain=True)
    allocator.release(b, retain=True)
    assert counts(allocator) == (0, 1, 2)
    allocator.acquire(a)
    assert counts(allocator) == (1, 1, 1)
    allocator.reclaim(b)
    assert counts(allocator) == (1, 2, 0)
    with pytest.raises(DoubleFreeError):
        allocator.reclaim(b)


def test_a_free_block_cannot_be_shared():
    allocator = BlockAllocator(1)
    with pytest.raises(DoubleFreeError):
        allocator.acquire(0)
