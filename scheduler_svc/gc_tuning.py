"""Garbage-collector settings for the long-running scheduler process (and its benchmark).

Refcounting frees almost everything the scheduler makes; the cyclic collector only has to
find rare cycles. Left at Python's defaults it runs often and over everything alive.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable

GEN0_THRESHOLD = 100_000
# A quiet server's young generations are collected this often. Each RPC grpc.aio ends
# leaves a few small cycles (interceptor closures, an aborted call's exception and
# frames): at ~5-30 objects each, a 100k threshold let thousands of calls' worth wait,
# and whatever such a cycle held with them (security review N1).
YOUNG_COLLECTION_INTERVAL_S = 1.0
# A quiet server gives the memory it freed back to the system at most this often: glibc
# keeps freed heap for reuse, so a wave of stalled streams left RSS at its peak for good
# (security review N4).
TRIM_INTERVAL_S = 10.0


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


def malloc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0), which returns free heap pages to the system; None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    return None if trim is None else lambda: trim(0)


async def collect_young_when_quiet(interval_s: float = YOUNG_COLLECTION_INTERVAL_S) -> None:
    """Runs for the life of the process, on its event loop: collects a quiet server's
    young generations, and returns its free heap to the system every TRIM_INTERVAL_S."""
    trim = malloc_trim()
    num_seen, last_trim_s = -1, time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        quiet = num_collections() == num_seen
        num_seen = collect_young_if_quiet(num_seen)
        if quiet and trim is not None and time.monotonic() - last_trim_s >= TRIM_INTERVAL_S:
            trim()
            last_trim_s = time.monotonic()
