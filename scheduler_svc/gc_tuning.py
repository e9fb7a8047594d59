"""Garbage-collector settings for the long-running scheduler process (and its benchmark).

Refcounting frees almost everything the scheduler makes; the cyclic collector only has to
find rare cycles. Left at Python's defaults it runs often and over everything alive.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 100_000


def tune_gc() -> None:
    """Called once start-up is done (modules, tokenizer and templates loaded).

    freeze(): the objects alive now (tokenizer tables, jinja2, grpc and protobuf modules)
    leave the collector's view; with them in it every full collection cost ~25 ms here.
    A gen-0 threshold of 100k instead of 700: admissions, finishes and gRPC messages
    allocate container objects every step, and with the default they were promoted and
    triggered full collections every few steps at 1,000 running sequences. Collections
    stay rare rather than off, so a cycle is still freed eventually.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, 50, 100)
