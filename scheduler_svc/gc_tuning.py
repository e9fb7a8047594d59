"""Garbage-collector settings for the long-running scheduler process (and its benchmark).

Refcounting frees almost everything the scheduler makes; the cyclic collector only has to
find rare cycles. Left at Python's defaults it runs often and over everything alive.
"""

from __future__ import annotations

import asyncio
import gc

GEN0_THRESHOLD = 100_000
# A quiet server's young generations are collected this often. Each RPC grpc.aio ends
# leaves a few small cycles (interceptor closures, an aborted call's exception and
# frames): at ~5-30 objects each, a 100k threshold let thousands of calls' worth wait,
# and whatever such a cycle held with them (security review N1).
YOUNG_COLLECTION_INTERVAL_S = 1.0


def tune_gc() -> None:
    """Called once start-up is done (modules, tokenizer and templates loaded).

    freeze(): the objects alive now (tokenizer tables, jinja2, grpc and protobuf modules)
    leave the collector's view; with them in it every full collection cost ~25 ms here.
    A gen-0 threshold of 100k instead of 700: admissions, finishes and gRPC messages
    allocate container objects every step, and with the default they were promoted and
    triggered full collections every few steps at 1,000 running sequences. Collections
    stay rare rather than off, so a cycle is still freed eventually; collect_young_when_quiet
    makes "eventually" a second on a server that allocates too little to reach the threshold.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, 50, 100)


def num_collections() -> int:
    """Collections of any generation so far, automatic or not."""
    return sum(generation["collections"] for generation in gc.get_stats())


def collect_young_if_quiet(num_seen: int) -> int:
    """Collect generations 0 and 1 unless a collection ran since `num_seen` was read (a
    busy server collects on its own, and then this costs nothing); returns what to pass
    next time."""
    if num_collections() == num_seen and gc.get_count()[0] > 0:
        gc.collect(1)
    return num_collections()


async def collect_young_when_quiet(interval_s: float = YOUNG_COLLECTION_INTERVAL_S) -> None:
    """Runs for the life of the process, on its event loop."""
    num_seen = -1
    while True:
        await asyncio.sleep(interval_s)
        num_seen = collect_young_if_quiet(num_seen)
