"""The KV block pool as the scheduler sees it: who owns which block, and which full
blocks are kept for their content (the prefix cache).

The worker holds the memory; the scheduler owns which block belongs to whom. A block
is in exactly one of three states:
  free      on the free list, content meaningless
  used      reference count >= 1 (sequences share a block through the prefix cache)
  retained  reference count 0 but kept for its cached content
so `num_used_blocks + num_free_blocks + num_retained_blocks == num_total_blocks` always.

Prefix caching: a full block's key is hash((parent block's key, its tokens' bytes)), so
two sequences share a key only if they share every token up to the end of that block. A
block's key is registered once its tokens are all computed or fed by the step being
planned (the worker writes a step's K/V before any attention reads it). Blocks nobody
owns keep their key while they wait on an LRU list; they are evicted only when the free
list alone cannot serve an allocation. Keys are Python's 64-bit hashes (salted per
process, and never leaving it): a false hit needs a collision among the cached blocks,
about 2^-64 per pair, accepted as vLLM does.

PrefixCache is the planner's one door to the pool: allocate, acquire hits, release,
register, and counts. Owned by the planner; BlockAllocator only through it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

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


ROOT_HASH = 0x5061676F6461  # parent of an unsalted sequence's first block


def cache_root_hash(cache_salt: str) -> int:
    """The parent of the first block of a request with this cache salt: requests with
    different salts share no key, so no prefix-cache block (issue 14 item 12). The empty
    salt is ROOT_HASH, which every unsalted request shares."""
    return hash((ROOT_HASH, cache_salt.encode())) if cache_salt else ROOT_HASH


def extend_block_hashes(
    token_ids: array[int],
    block_hashes: list[int],
    num_blocks: int,
    block_size: int,
    root_hash: int = ROOT_HASH,
) -> None:
    """Append to `block_hashes` the chained keys of `token_ids`' full blocks up to `num_blocks`,
    the first block's parent being `root_hash` (cache_root_hash of the request's salt)."""
    parent = block_hashes[-1] if block_hashes else root_hash
    for index in range(len(block_hashes), num_blocks):
        start = index * block_size
        parent = hash((parent, token_ids[start : start + block_size].tobytes()))
        block_hashes.append(parent)


class PrefixCache:
    __slots__ = (
        "allocator",
        "block_size",
        "enabled",
        "_block_of_hash",
        "_hash_of_block",
        "_evictable",
    )

    def __init__(self, allocator: BlockAllocator, block_size: int, *, enabled: bool = True) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self._block_of_hash: dict[int, int] = {}
        # Indexed by block id (None: unkeyed); a list, as every block has a slot.
        self._hash_of_block: list[int | None] = [None] * allocator.num_total_blocks
        # Retained (ownerless, keyed) blocks, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # -- counts ------------------------------------------------------------------------

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can get now: free ones plus evictable cached ones."""
        return self.allocator.num_free_blocks + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of_block[block_id]

    # -- lookups -----------------------------------------------------------------------

    def match(self, block_hashes: list[int], max_blocks: int, *, always: bool = False) -> list[int]:
        """Blocks of the longest cached prefix of the chain `block_hashes[:max_blocks]`;
        with `always`, even when prefix caching is off (the samples of one request)."""
        if not (self.enabled or always):
            return []
        block_of_hash = self._block_of_hash
        hit_block_ids: list[int] = []
        for block_hash in block_hashes[:max_blocks]:
            block_id = block_of_hash.get(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def num_evictable(self, block_ids: list[int]) -> int:
        """How many of `block_ids` acquiring would take off the evictable list."""
        evictable = self._evictable
        return sum(1 for block_id in block_ids if block_id in evictable)

    # -- ownership ---------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks, evicting least recently used cached ones if the free
        list is short; None (and nothing evicted) when even that is not enough."""
        allocator = self.allocator
        shortfall = num_blocks - allocator.num_free_blocks
        if shortfall > 0:
            if shortfall > len(self._evictable):
                return None
            hash_of_block = self._hash_of_block
            for _ in range(shortfall):
                block_id, _ = self._evictable.popitem(last=False)
                del self._block_of_hash[hash_of_block[block_id]]
                hash_of_block[block_id] = None
                allocator.reclaim(block_id)
        return allocator.allocate(num_blocks)

    def acquire(self, block_ids: list[int]) -> None:
        """Take one more reference on each cache-hit block (reviving evictable ones)."""
        evictable = self._evictable
        for block_id in block_ids:
            evictable.pop(block_id, None)
            self.allocator.acquire(block_id)

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block of a sequence's table.

        Released tail first, so among blocks of one sequence the tail is evicted first
        and the shared head of a prompt stays longest.
        """
        allocator, hash_of_block, evictable = self.allocator, self._hash_of_block, self._evictable
        release = allocator.release
        for block_id in reversed(block_ids):
            keyed = hash_of_block[block_id] is not None
            if release(block_id, retain=keyed) == 0 and keyed:
                evictable[block_id] = None

    def register(self, block_id: int, block_hash: int, *, always: bool = False) -> bool:
        """Key a full, computed (or being computed) block. False when the key already
        names another block (this one then stays unkeyed and is freed when released).
        With `always`, even when prefix caching is off (the samples of one request)."""
        if not (self.enabled or always) or self._hash_of_block[block_id] is not None:
            return False
        block_of_hash = self._block_of_hash
        if block_hash in block_of_hash:
            return False
        block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        return True

    def unregister(self, block_id: int) -> None:
        """Forget a block's key (its K/V was never written); an ownerless one is freed."""
        block_hash = self._hash_of_block[block_id]
        if block_hash is None:
            return
        self._hash_of_block[block_id] = None
        del self._block_of_hash[block_hash]
        if block_id in self._evictable:
            del self._evictable[block_id]
            self.allocator.reclaim(block_id)


def match_prefix(
    blocks: PrefixCache,
    token_ids: array[int],
    block_hashes: list[int],
    root_hash: int,
    *,
    always: bool = False,
) -> list[int]:
    """Cached blocks of the prefix of `token_ids` (its chain `block_hashes` under
    `root_hash`, extended as needed); the last token is always left to compute so there
    are logits to sample. `always`: match even with prefix caching off (the samples of one
    call share their prompt under a root private to the call)."""
    if not (blocks.enabled or always):
        return []
    max_blocks = (len(token_ids) - 1) // blocks.block_size
    extend_block_hashes(token_ids, block_hashes, max_blocks, blocks.block_size, root_hash)
    return blocks.match(block_hashes, max_blocks, always=always)


def match_request(blocks: PrefixCache, request) -> list[int]:
    """Cached blocks of a request's prompt prefix (match_prefix over its `token_ids`,
    `block_hashes` and `cache_root_hash`; `always` when its samples share the prompt)."""
    return match_prefix(
        blocks,
        request.token_ids,
        request.block_hashes,
        request.cache_root_hash,
        always=request.shares_prompt,
    )
