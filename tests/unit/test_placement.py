"""The placement policy (several workers): prefix affinity among the lanes whose KV use
(counting queued demand) is within a gap of the least, then least KV use, then fewer
running; and the lane load a Scheduler reports."""

from __future__ import annotations

import math

import pytest

from pagoda.scheduler_svc.core import SchedulerConfig
from pagoda.scheduler_svc.core.config import ConfigError
from pagoda.scheduler_svc.core.kv import cache_root_hash
from pagoda.scheduler_svc.core.placement import LaneLoad, choose_lane
from pagoda.scheduler_svc.core.request import token_array
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import drive, make_geometry, make_request, make_scheduler


def load(hit=0, used=0, queued=0, total=100, running=0) -> LaneLoad:
    return LaneLoad(hit, used, queued, total, running)


def test_the_longest_cached_prefix_wins_over_a_lighter_lane_within_the_gap():
    loads = [load(used=0), load(hit=2, used=20), load(hit=3, used=25)]
    assert choose_lane(loads) == 2  # the default gap: a quarter of a pool


def test_a_hit_on_a_lane_past_the_gap_loses_to_the_least_loaded():
    # Review s3 R3: a cached shared prompt pinned every request to one lane.
    assert choose_lane([load(used=0), load(hit=3, used=26)]) == 0
    assert choose_lane([load(used=0), load(hit=3, queued=26)]) == 0  # queued demand counts
    # A shorter hit within the gap beats a longer one past it.
    assert choose_lane([load(used=0), load(hit=1, used=10), load(hit=3, used=30)]) == 1


def test_the_gap_is_a_knob_from_load_only_to_affinity_only():
    loads = [load(used=0), load(hit=3, used=1)]
    assert choose_lane(loads, max_affinity_gap=0.0) == 0  # a hit only breaks ties
    assert choose_lane([load(used=1), load(hit=3, used=1)], max_affinity_gap=0.0) == 1
    assert choose_lane([load(used=0), load(hit=3, used=95)], max_affinity_gap=math.inf) == 1
    assert SchedulerConfig().affinity_max_kv_use_gap == 0.25
    for bad in (-0.1, math.nan, True, "0.5"):
        with pytest.raises(ConfigError, match="affinity_max_kv_use_gap"):
            SchedulerConfig(affinity_max_kv_use_gap=bad).validate()


def test_equal_prefix_hits_go_to_the_lighter_of_them():
    loads = [load(used=5), load(hit=2, used=25), load(hit=2, used=20)]
    assert choose_lane(loads) == 2


def test_without_a_hit_the_least_kv_use_counting_the_queue_wins():
    # Lane 0 uses fewer blocks, but its queue will need more than lane 1 holds.
    loads = [load(used=10, queued=50), load(used=40)]
    assert choose_lane(loads) == 1


def test_kv_use_is_a_share_of_each_pool():
    assert choose_lane([load(used=30, total=100), load(used=40, total=200)]) == 1


def test_ties_go_to_fewer_running_then_the_first_lane():
    assert choose_lane([load(used=10, running=3), load(used=10, running=1)]) == 1
    assert choose_lane([load(used=10, running=2), load(used=10, running=2)]) == 0


def test_a_lane_without_a_pool_is_the_last_choice():
    assert choose_lane([load(total=0), load(used=99, total=100)]) == 1
    assert choose_lane([load(total=0, running=2), load(total=0, running=1)]) == 1


def test_no_lane_is_an_error():
    with pytest.raises(ValueError):
        choose_lane([])


def test_lane_load_sees_cached_prefix_blocks_and_queued_demand():
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    scheduler.add(make_request("first", prompt), 0.0)
    drive(scheduler, worker)
    same_prefix = token_array(prompt[:12] + [99, 98])
    assert scheduler.lane_load(same_prefix).num_cached_prefix_blocks == 3
    assert scheduler.lane_load(token_array([1, 2, 3, 4, 5])).num_cached_prefix_blocks == 0
    # Another tenant's salt shares no block.
    salted = scheduler.lane_load(same_prefix, cache_root_hash("tenant"))
    assert salted.num_cached_prefix_blocks == 0
    scheduler.add(make_request("queued", 9), 1.0)  # 9 tokens: 3 blocks once admitted
    view = scheduler.lane_load(same_prefix)
    assert (view.num_kv_blocks_queued, view.num_running) == (3, 0)
    assert view.num_kv_blocks_total == geometry.num_kv_blocks
