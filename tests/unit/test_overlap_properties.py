"""Random overlapped runs with refusals, failed steps, lost workers and cancels at any
step (overlap_harness.py): no key ever names K/V nobody wrote, and every request streams
what it gives alone. A few seconds here; PAGODA_OVERLAP_SEEDS=1000 for a deep search."""

from __future__ import annotations

import os

import pytest

from tests.unit.overlap_harness import run

NUM_SEEDS = int(os.environ.get("PAGODA_OVERLAP_SEEDS", "24"))


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_overlapped_runs_with_frequent_refusals_keep_every_key_true(seed):
    # Refusals and cancels far more often than in service: on the code before the fix of
    # sched s3 R1, seed 11 keyed a block a cancelled reader computed from garbage.
    counts = run(seed, num_arrival_steps=100, p_refuse=0.15, p_cancel=0.08)
    assert counts["refusals"] > 0


@pytest.mark.parametrize("seed", range(max(NUM_SEEDS // 4, 1)))
def test_serial_runs_with_failures_stream_exactly(seed):
    run(seed, num_arrival_steps=100, overlap=False)


@pytest.mark.parametrize("seed", range(max(NUM_SEEDS // 2, 1)))
def test_overlapped_runs_with_samples_keep_every_key_true(seed):
    # n > 1: siblings held, then sharing the prompt blocks their sample 0 keys, while
    # refusals, failures, losses and cancels hit any of them.
    counts = run(seed, num_arrival_steps=100, p_refuse=0.1, p_cancel=0.05, max_n=4)
    assert counts["samples"] > 0
