"""The router, admission and speculation benchmarks run end to end on the dummy worker (so
they cannot rot between the sittings that measure them with the real model), and what
they print holds: cache-aware routing finds every repeat of a prefix cached, every policy
of the admission benchmark serves the whole burst, and every speculation setting streams
the same tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def run(module: str, *args: str) -> list[list[str]]:
    result = subprocess.run(
        [sys.executable, "-m", module, "--model", "dummy", *args],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [line.split() for line in result.stdout.splitlines()]


def test_the_router_benchmark_routes_each_repeat_to_its_cached_prefix():
    rows = run(
        "benchmarks.router",
        "--policies", "cache-aware,round-robin",
        "--groups", "3", "--per-group", "3", "--prefix-words", "120", "--rate-per-s", "40",
    )  # fmt: skip
    by_policy = {row[0]: row for row in rows if row and row[0] in ("cache-aware", "round-robin")}
    cached = {policy: float(row[1].rstrip("%")) for policy, row in by_policy.items()}
    # Each prefix computed once: 6 of 9 prompts hit most of theirs.
    assert cached["cache-aware"] > 50
    assert set(by_policy) == {"cache-aware", "round-robin"}


def test_the_admission_benchmark_serves_the_burst_under_each_policy():
    rows = run(
        "benchmarks.admission_prefix",
        "--groups", "3", "--per-group", "2", "--prefix-words", "60", "--num-kv-blocks", "64",
    )  # fmt: skip
    policies = [row[0] for row in rows if row and row[0] in ("fifo", "prefix", "pack")]
    assert policies == ["fifo", "prefix", "pack"]


def test_the_speculation_benchmark_compares_settings_on_the_same_tokens():
    rows = run(
        "benchmarks.speculation",
        "--settings", "0,3", "--requests", "4", "--burst", "2", "--max-new-tokens", "12",
    )  # fmt: skip
    runs = [row for row in rows if row and row[0] in ("0", "3")]
    assert [(row[0], row[1], row[2]) for row in runs] == [
        (setting, kind, run_name)
        for setting in ("0", "3")
        for kind in ("echo", "open", "json")
        for run_name in ("sequential", "burst")
    ]
    assert all(row[-1] == "yes" for row in runs)  # the same tokens in every run
