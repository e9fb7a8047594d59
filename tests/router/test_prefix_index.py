"""The router's picture of each replica's prefix cache: chained chunk hashes, LRU-bounded."""

from __future__ import annotations

from pagoda.router.prefix_index import PrefixIndex, chunk_hashes


def test_keys_share_a_chunk_only_when_they_share_everything_before_its_end():
    a = chunk_hashes("x" * 64 + "y" * 64 + "z" * 10, 64, seed="t")
    b = chunk_hashes("x" * 64 + "y" * 64 + "w" * 64, 64, seed="t")
    c = chunk_hashes("q" * 64 + "y" * 64, 64, seed="t")
    assert len(a) == 2  # the 10 trailing characters are not a whole chunk
    assert a == b[:2]
    assert a[1] != c[1]  # the same second chunk after a different first one


def test_the_seed_separates_tenants():
    assert chunk_hashes("x" * 64, 64, seed="a") != chunk_hashes("x" * 64, 64, seed="b")


def test_token_id_keys_chunk_like_text_keys():
    ids = list(range(40))
    assert chunk_hashes(ids, 16, seed=0) == chunk_hashes(ids[:32], 16, seed=0)
    assert len(chunk_hashes(ids, 16, seed=0)) == 2


def test_matched_chunks_counts_from_the_start_without_a_gap():
    index = PrefixIndex(["r0", "r1"], max_chunks_per_backend=100)
    key = chunk_hashes("abcd" * 64, 64, seed="")  # four chunks
    index.record("r0", key[:3])
    index.record("r1", key[1:])  # holds the later chunks but not the first
    assert index.matched_chunks(key) == {"r0": 3, "r1": 0}


def test_over_its_bound_a_backend_forgets_the_tails_of_old_keys_first():
    index = PrefixIndex(["r0"], max_chunks_per_backend=4)
    old = chunk_hashes("o" * 64 * 3, 64, seed="")
    new = chunk_hashes("n" * 64 * 2, 64, seed="")
    index.record("r0", old)
    index.record("r0", new)  # five chunks: one of old's goes, its last
    assert index.num_chunks("r0") == 4
    assert index.matched_chunks(old) == {"r0": 2}
    assert index.matched_chunks(new) == {"r0": 2}


def test_forget_empties_one_backend():
    index = PrefixIndex(["r0", "r1"], max_chunks_per_backend=10)
    key = chunk_hashes("k" * 128, 64, seed="")
    index.record("r0", key)
    index.record("r1", key)
    index.forget("r0")
    assert index.matched_chunks(key) == {"r0": 0, "r1": 2}
