from __future__ import annotations

from pagoda.scheduler_svc.core.kv import (
    ROOT_HASH,
    BlockAllocator,
    PrefixCache,
    extend_block_hashes,
    match_prefix,
)
from pagoda.scheduler_svc.core.request import token_array


def hashes(token_ids: list[int], block_size: int = 2) -> list[int]:
    block_hashes: list[int] = []
    tokens = token_array(token_ids)
    extend_block_hashes(tokens, block_hashes, len(tokens) // block_size, block_size)
    return block_hashes


def cache_with(num_blocks: int = 8) -> PrefixCache:
    return PrefixCache(BlockAllocator(num_blocks), block_size=2)


def test_a_block_key_chains_its_parent():
    assert hashes([1, 2, 3, 4])[:1] == hashes([1, 2, 9, 9])[:1]
    # Same tokens in block 1, different past: different keys.
    assert hashes([1, 2, 3, 4])[1] != hashes([5, 6, 3, 4])[1]
    assert len(hashes([1, 2, 3, 4, 5])) == 2  # a partial block has no key


def test_extending_hashes_is_incremental():
    token_ids = token_array([1, 2, 3, 4, 5, 6])
    block_hashes: list[int] = []
    extend_block_hashes(token_ids, block_hashes, 1, 2)
    extend_block_hashes(token_ids, block_hashes, 3, 2)
    assert block_hashes == hashes(token_ids)


def register_sequence(cache: PrefixCache, token_ids: list[int]) -> list[int]:
    block_ids = cache.allocate(len(token_ids) // 2)
    for block_id, block_hash in zip(block_ids, hashes(token_ids), strict=True):
        assert cache.register(block_id, block_hash)
    return block_ids


def test_match_returns_the_longest_cached_prefix():
    cache = cache_with()
    block_ids = register_sequence(cache, [1, 2, 3, 4])
    assert cache.match(hashes([1, 2, 3, 4, 5, 6]), max_blocks=3) == block_ids
    assert cache.match(hashes([1, 2, 3, 4, 5, 6]), max_blocks=1) == block_ids[:1]
    assert cache.match(hashes([1, 2, 9, 9]), max_blocks=2) == block_ids[:1]
    assert cache.match(hashes([9, 9, 3, 4]), max_blocks=2) == []


def test_ownerless_keyed_blocks_stay_cached_until_the_free_list_is_empty():
    cache = cache_with(4)
    block_ids = register_sequence(cache, [1, 2, 3, 4])
    cache.release(block_ids)
    assert cache.num_cached_free_blocks == 2 and cache.allocator.num_free_blocks == 2
    assert cache.match(hashes([1, 2, 3, 4]), 2) == block_ids
    fresh = cache.allocate(2)  # served by the free list: nothing evicted
    assert set(fresh).isdisjoint(block_ids) and cache.num_cached_free_blocks == 2
    cache.release(fresh)  # unkeyed: straight back to the free list
    assert cache.allocator.num_free_blocks == 2


def test_eviction_is_least_recently_used_and_tail_first():
    cache = cache_with(4)
    old = register_sequence(cache, [1, 2, 3, 4])
    cache.release(old)
    new = register_sequence(cache, [5, 6, 7, 8])
    cache.release(new)
    assert cache.allocator.num_free_blocks == 0 and cache.num_cached_free_blocks == 4
    # The older sequence goes first, its tail block before its head block.
    assert cache.allocate(1) == [old[1]]
    assert cache.match(hashes([1, 2, 3, 4]), 2) == [old[0]]
    assert cache.allocate(1) == [old[0]]
    assert cache.match(hashes([5, 6, 7, 8]), 2) == new


def test_a_hit_revives_a_block_and_protects_it_from_eviction():
    cache = cache_with(2)
    block_ids = register_sequence(cache, [1, 2, 3, 4])
    cache.release(block_ids)
    cache.acquire(block_ids[:1])
    assert cache.num_cached_free_blocks == 1 and cache.num_available_blocks == 1
    assert cache.allocate(2) is None  # all-or-nothing: nothing was evicted
    assert cache.num_cached_free_blocks == 1
    assert cache.allocate(1) == [block_ids[1]]


def test_a_duplicate_key_is_not_registered_twice():
    cache = cache_with()
    (first,) = register_sequence(cache, [1, 2])
    (second,) = cache.allocate(1)
    assert not cache.register(second, hashes([1, 2])[0])
    cache.release([second])
    assert cache.allocator.is_free(second)
    assert cache.match(hashes([1, 2]), 1) == [first]


def test_unregister_frees_an_ownerless_block():
    cache = cache_with(2)
    block_ids = register_sequence(cache, [1, 2, 3, 4])
    cache.release(block_ids)
    cache.unregister(block_ids[0])
    assert cache.allocator.is_free(block_ids[0]) and cache.num_cached_free_blocks == 1
    assert cache.match(hashes([1, 2, 3, 4]), 2) == []


def test_a_disabled_cache_never_hits_or_retains():
    cache = PrefixCache(BlockAllocator(2), block_size=2, enabled=False)
    (block_id,) = cache.allocate(1)
    assert not cache.register(block_id, hashes([1, 2])[0])
    cache.release([block_id])
    assert cache.allocator.num_free_blocks == 2 and cache.match(hashes([1, 2]), 1) == []


def test_a_prompt_matches_its_cached_prefix_but_always_leaves_its_last_token():
    cache = cache_with()
    block_ids = register_sequence(cache, [1, 2, 3, 4])
    block_hashes: list[int] = []
    assert match_prefix(cache, token_array([1, 2, 3, 4, 5]), block_hashes, ROOT_HASH) == block_ids
    assert block_hashes == hashes([1, 2, 3, 4])  # the chain is extended on the request
    # The same prompt ends on a block boundary: its last block is computed again.
    assert match_prefix(cache, token_array([1, 2, 3, 4]), [], ROOT_HASH) == block_ids[:1]
    disabled = PrefixCache(BlockAllocator(8), block_size=2, enabled=False)
    assert match_prefix(disabled, token_array([1, 2, 3, 4, 5]), [], ROOT_HASH) == []
