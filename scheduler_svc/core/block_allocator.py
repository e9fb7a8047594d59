"""The KV block pool as the scheduler sees it: a free list plus reference counts.

The worker holds the memory; the scheduler owns which block belongs to whom. A block
is in exactly one of three states:
  free      on the free list, content meaningless
  used      reference count >= 1 (sequences share a block through the prefix cache)
  retained  reference count 0 but kept for its cached content (see prefix_cache.py)
so `num_used_blocks + num_free_blocks + num_retained_blocks == num_total_blocks` always.
"""

from __future__ import annotations

_FREE = 0
_USED = 1
_RETAINED = 2


class DoubleFreeError(RuntimeError):
    """A block released more often than it was acquired: a scheduler bug, never ignored."""


class BlockAllocator:
    __slots__ = ("num_total_blocks", "_free_block_ids", "_ref_counts", "_states", "_num_retained")

    def __init__(self, num_total_blocks: int) -> None:
        if num_total_blocks < 0:
            raise ValueError(f"num_total_blocks must be >= 0, got {num_total_blocks}")
        self.num_total_blocks = num_total_blocks
        # A stack: the most recently freed block is reused first (its pages are warm).
        self._free_block_ids: list[int] = list(range(num_total_blocks - 1, -1, -1))
        self._ref_counts = [0] * num_total_blocks
        self._states = bytearray(num_total_blocks)  # _FREE / _USED / _RETAINED
        self._num_retained = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_retained_blocks(self) -> int:
        return self._num_retained

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free_block_ids) - self._num_retained

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._states[block_id] == _FREE

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` free blocks with reference count 1, or None (and nothing taken)."""
        free = self._free_block_ids
        if num_blocks > len(free):
            return None
        if num_blocks == 0:
            return []
        block_ids = free[-num_blocks:]
        del free[-num_blocks:]
        ref_counts, states = self._ref_counts, self._states
        for block_id in block_ids:
            ref_counts[block_id] = 1
            states[block_id] = _USED
        return block_ids

    def acquire(self, block_id: int) -> None:
        """One more owner of a used block, or the first owner of a retained one."""
        state = self._states[block_id]
        if state == _FREE:
            raise DoubleFreeError(
                f"block {block_id} is free; only used or retained blocks are shared"
            )
        if state == _RETAINED:
            self._states[block_id] = _USED
            self._num_retained -= 1
        self._ref_counts[block_id] += 1

    def release(self, block_id: int, *, retain: bool) -> int:
        """Drop one owner; the last one frees the block, or retains it when `retain`.
        Returns the owners left."""
        if self._states[block_id] != _USED:
            raise DoubleFreeError(f"block {block_id} released but it has no owner")
        remaining = self._ref_counts[block_id] - 1
        self._ref_counts[block_id] = remaining
        if remaining:
            return remaining
        if retain:
            self._states[block_id] = _RETAINED
            self._num_retained += 1
        else:
            self._states[block_id] = _FREE
            self._free_block_ids.append(block_id)
        return 0

    def reclaim(self, block_id: int) -> None:
        """A retained block goes back to the free list (its cached content is dropped)."""
        if self._states[block_id] != _RETAINED:
            raise DoubleFreeError(f"block {block_id} reclaimed but it is not retained")
        self._states[block_id] = _FREE
        self._num_retained -= 1
        self._free_block_ids.append(block_id)
