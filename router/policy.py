"""Where one request goes: pure functions over the backends' loads and cached prefixes.

`cache-aware` (the default) sends a request to the backend that holds the longest run of
its prompt's chunks, when that run is at least `cache_threshold` of the prompt; otherwise,
or when the loads are out of balance, to the least loaded backend. Out of balance means the
busiest backend carries more than `balance_abs_requests` requests beyond the idlest and
more than `balance_rel` times as many: then cache hits would pile onto one replica while
another idles, and queueing there costs more than the prefill a hit saves.
`least-loaded` and `round-robin` ignore the caches (for comparison, or prompts that share
nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("cache-aware", "least-loaded", "round-robin")


@dataclass(frozen=True, slots=True)
class Thresholds:
    cache_threshold: float = 0.5
    balance_abs_requests: int = 8
    balance_rel: float = 1.5


@dataclass(frozen=True, slots=True)
class Route:
    backend: str
    # Why (the router's metrics count routes by it): "cache" (the longest cached prefix),
    # "balance" (loads out of balance), "least-loaded", "round-robin".
    reason: str


def least_loaded(
    candidates: Sequence[str], loads: Mapping[str, int], num_cached: Mapping[str, int]
) -> str:
    """The backend with the fewest requests in flight; ties go to the one with the fewest
    cached chunks (room for a new prefix), then to the earlier in `candidates`."""
    return min(candidates, key=lambda name: (loads[name], num_cached.get(name, 0)))


def out_of_balance(candidates: Sequence[str], loads: Mapping[str, int], t: Thresholds) -> bool:
    busiest = max(loads[name] for name in candidates)
    idlest = min(loads[name] for name in candidates)
    return busiest - idlest > t.balance_abs_requests and busiest > t.balance_rel * idlest


def cache_aware(
    candidates: Sequence[str],
    loads: Mapping[str, int],
    matched: Mapping[str, int],
    num_key_chunks: int,
    num_cached: Mapping[str, int],
    t: Thresholds,
) -> Route:
    """`matched[name]`: chunks of the key `name` holds from the start; `num_key_chunks`:
    the key's whole chunks (0 for a key shorter than one chunk: no cache to look for)."""
    if out_of_balance(candidates, loads, t):
        return Route(least_loaded(candidates, loads, num_cached), "balance")
    best = max(matched.get(name, 0) for name in candidates)
    if num_key_chunks and best and best >= t.cache_threshold * num_key_chunks:
        holders = [name for name in candidates if matched.get(name, 0) == best]
        return Route(least_loaded(holders, loads, num_cached), "cache")
    return Route(least_loaded(candidates, loads, num_cached), "least-loaded")


def round_robin(candidates: Sequence[str], turn: int) -> Route:
    return Route(candidates[turn % len(candidates)], "round-robin")
