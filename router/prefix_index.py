"""Which backend has probably cached how much of a prompt: the router's picture of each
replica's prefix cache, learnt from where it sent earlier requests.

A routing key (a prompt's text, or its token ids) is cut into fixed chunks, and each chunk
is named by a hash chained with its parent's, as the scheduler names its KV blocks: two
keys share a chunk hash only when they share everything up to the end of that chunk. Each
backend keeps the chunk hashes of the keys sent to it in LRU order, bounded in number; the
longest run of a new key's chunks, from its start, that a backend holds is its likely cache
hit. The trailing part of a key shorter than a chunk is never indexed.

The picture is a guess: a replica evicts on its own, and a restart empties it. A guess that
is wrong costs one prefill, never a wrong answer; `forget` drops a backend's whole picture
when the router knows it was emptied (its scheduler restarted or lost its worker).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

# Characters per chunk of a text key (about 16 tokens of English, one KV block), and token
# ids per chunk of a key given as ids.
TEXT_CHUNK_CHARS = 64
IDS_CHUNK_TOKENS = 16


def chunk_hashes(key: Sequence[Hashable], chunk_size: int, seed: Hashable) -> list[int]:
    """The chained hash of each whole chunk of `key`; `seed` opens the chain (a tenant's
    salt: keys with different seeds share no chunk)."""
    hashes = []
    parent = hash(seed)
    for start in range(0, len(key) - chunk_size + 1, chunk_size):
        part = key[start : start + chunk_size]
        parent = hash((parent, part if isinstance(part, str) else tuple(part)))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Chunk hashes per backend, each backend's bounded by `max_chunks_per_backend` (the
    least recently routed dropped first). Single-threaded: the router's event loop owns it."""

    def __init__(self, backends: Sequence[str], max_chunks_per_backend: int) -> None:
        if max_chunks_per_backend < 1:
            raise ValueError("max_chunks_per_backend must be >= 1")
        self._max_chunks = max_chunks_per_backend
        self._chunks: dict[str, OrderedDict[int, None]] = {name: OrderedDict() for name in backends}

    def num_chunks(self, backend: str) -> int:
        return len(self._chunks[backend])

    def matched_chunks(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each backend, how many of `hashes` it holds from the first on, without a gap."""
        matched = {}
        for name, chunks in self._chunks.items():
            count = 0
            for chunk_hash in hashes:
                if chunk_hash not in chunks:
                    break
                count += 1
            matched[name] = count
        return matched

    def record(self, backend: str, hashes: Sequence[int]) -> None:
        """`backend` was sent a key with these chunks: they become its most recent."""
        chunks = self._chunks[backend]
        # Tail first, so that a key's first chunk is its most recent: a backend over its
        # bound loses the tails of old keys before their heads, and a head lost first would
        # make the rest of its run unreachable (matching stops at the first miss).
        for chunk_hash in reversed(hashes):
            chunks[chunk_hash] = None
            chunks.move_to_end(chunk_hash)
        while len(chunks) > self._max_chunks:
            chunks.popitem(last=False)

    def forget(self, backend: str) -> None:
        """Everything `backend` held is gone (its cache was emptied)."""
        self._chunks[backend].clear()

    def add(self, backend: str) -> None:
        self._chunks.setdefault(backend, OrderedDict())

    def remove(self, backend: str) -> None:
        del self._chunks[backend]
