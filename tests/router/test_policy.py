"""Where one request goes: the cached prefix wins unless loads are out of balance."""

from __future__ import annotations

from pagoda.router.policy import Thresholds, cache_aware, least_loaded, out_of_balance, round_robin

NAMES = ["r0", "r1", "r2"]
T = Thresholds(cache_threshold=0.5, balance_abs_requests=4, balance_rel=1.5)


def test_the_replica_holding_most_of_the_prompt_wins():
    route = cache_aware(NAMES, {"r0": 0, "r1": 3, "r2": 0}, {"r1": 6, "r2": 2}, 10, {}, T)
    assert (route.backend, route.reason) == ("r1", "cache")


def test_a_match_under_the_threshold_goes_to_the_least_loaded():
    route = cache_aware(NAMES, {"r0": 2, "r1": 3, "r2": 1}, {"r1": 4}, 10, {}, T)
    assert (route.backend, route.reason) == ("r2", "least-loaded")


def test_out_of_balance_the_least_loaded_wins_over_the_cache():
    loads = {"r0": 10, "r1": 2, "r2": 3}
    assert out_of_balance(NAMES, loads, T)
    route = cache_aware(NAMES, loads, {"r0": 10}, 10, {}, T)
    assert (route.backend, route.reason) == ("r1", "balance")


def test_balance_needs_both_the_absolute_and_the_relative_gap():
    assert not out_of_balance(NAMES, {"r0": 4, "r1": 0, "r2": 0}, T)  # a gap of 4, not > 4
    assert not out_of_balance(NAMES, {"r0": 20, "r1": 15, "r2": 15}, T)  # 20 < 1.5 * 15


def test_equal_matches_go_to_the_less_loaded_holder():
    route = cache_aware(NAMES, {"r0": 3, "r1": 2, "r2": 0}, {"r0": 8, "r1": 8}, 10, {}, T)
    assert route.backend == "r1"


def test_a_key_shorter_than_a_chunk_is_balanced_by_load():
    route = cache_aware(NAMES, {"r0": 1, "r1": 0, "r2": 1}, {}, 0, {}, T)
    assert (route.backend, route.reason) == ("r1", "least-loaded")


def test_load_ties_go_to_the_replica_with_the_fewest_cached_chunks():
    assert least_loaded(NAMES, dict.fromkeys(NAMES, 0), {"r0": 9, "r1": 2, "r2": 5}) == "r1"


def test_round_robin_takes_the_replicas_in_turn():
    assert [round_robin(NAMES, turn).backend for turn in range(4)] == ["r0", "r1", "r2", "r0"]
