"""Preempt to admit (issue 27): a tenant below its share takes the room of a more-served
tenant above its share, so a flood that holds every slot no longer makes another tenant's
request wait for one of the flood's to end. The pure policy, then the core simulated."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from pagoda.scheduler_svc.core import Scheduler, SchedulerConfig
from pagoda.scheduler_svc.core.tenants import (
    MAX_ADMISSION_VICTIMS,
    MIN_VICTIM_AGE_STEPS,
    Ledger,
    Shortage,
    admission_shortage,
    admission_victims,
    holdings,
    neediest_tenant,
)
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import make_geometry, make_request
from tests.unit.test_tenants_core import Drive

STEP = 100  # the step being planned in the pure tests


def running(*specs: tuple[str, int, int]) -> list[SimpleNamespace]:
    """Running requests (tenant, admit_step, blocks held), given oldest first."""
    return [
        SimpleNamespace(tenant=tenant, admit_step=admitted, block_ids=[0] * num_blocks, name=i)
        for i, (tenant, admitted, num_blocks) in enumerate(specs)
    ]


def shortage(requests, *, slots_short=1, blocks_short=0, slots=4, blocks=100, **weights):
    num_running, num_held = {}, {}
    for request in requests:
        num_running[request.tenant] = num_running.get(request.tenant, 0) + 1
        num_held[request.tenant] = num_held.get(request.tenant, 0) + len(request.block_ids)
    return Shortage(
        needy="b",
        num_slots_short=slots_short,
        num_blocks_short=blocks_short,
        num_slots=slots,
        num_blocks=blocks,
        weights={"a": 1.0, "b": 1.0} | weights,
        num_running=num_running,
        num_held_blocks=num_held,
    )


def victims(requests, counters=None, **knobs) -> list[int]:
    counters = {"a": 10.0, "b": 1.0, "c": 5.0} | (counters or {})
    chosen = admission_victims(shortage(requests, **knobs), reversed(requests), counters, STEP)
    return [request.name for request in chosen]


def test_the_newest_of_the_most_served_tenant_gives_its_slot():
    requests = running(("a", 1, 2), ("a", 2, 2), ("a", 3, 2), ("a", 4, 2))
    assert victims(requests) == [3]


def test_nothing_is_preempted_without_a_shortage_or_for_a_tenant_at_its_share():
    requests = running(("a", 1, 2), ("a", 2, 2), ("b", 3, 2), ("b", 4, 2))
    assert victims(requests, slots_short=0) == []
    assert victims(requests) == []  # b holds 2 of 4 slots: its share


def test_never_from_a_less_served_tenant_but_from_one_served_as_much():
    requests = running(("a", 1, 2), ("a", 2, 2), ("a", 3, 2), ("a", 4, 2))
    assert victims(requests, {"a": 0.5}) == []
    # A tie: the needy tenant was just lifted to the flood's counter.
    assert victims(requests, {"a": 1.0}) == [3]


def test_at_a_tie_the_tenant_with_fewer_unfinished_requests_is_the_neediest():
    counters = {"flood": 7.0, "probe": 7.0, "other": 9.0}
    assert neediest_tenant(["flood", "probe"], counters) == "flood"
    num_requests = {"flood": 600, "probe": 1, "other": 0}
    assert neediest_tenant(["flood", "probe", "other"], counters, num_requests) == "probe"


def test_never_one_admitted_in_the_last_steps_nor_below_its_tenants_share():
    recent = STEP - MIN_VICTIM_AGE_STEPS + 1
    requests = running(("a", 1, 2), ("a", 2, 2), ("a", recent, 2), ("a", recent, 2))
    assert victims(requests) == [1]  # the newest old enough
    # Three tenants, 6 slots: a holds 3 (its share 2), c holds 3 (its share 2) and is less
    # served than a: a gives first, then c; never below a share of 2.
    requests = running(*[("c", 1, 2)] * 3, *[("a", 1, 2)] * 3)
    shares = dict(slots=6, slots_short=3, c=1.0)
    assert victims(requests, **shares) == [5, 2]


def test_bounded_per_step_and_blocks_counted_as_freed():
    requests = running(*[("a", 1, 10)] * 10)
    many = victims(requests, slots_short=0, blocks_short=1000, slots=100)
    assert many == [9, 8, 7, 6][:MAX_ADMISSION_VICTIMS]
    assert victims(requests, slots_short=0, blocks_short=15, slots=100) == [9, 8]
    # a above its share of slots but not of blocks (pool 400: share 200 of its 100 held)
    assert victims(requests, slots_short=0, blocks_short=15, slots=100, blocks=400) == []


def test_holdings_count_each_tenants_slots_blocks_and_next_steps_blocks():
    def r(tenant, num_tokens, num_computed, num_blocks):
        return SimpleNamespace(
            tenant=tenant,
            token_ids=[0] * num_tokens,
            num_computed_tokens=num_computed,
            block_ids=[0] * num_blocks,
        )

    at_boundary, mid_block, prefilling = r("a", 8, 8, 2), r("a", 7, 6, 2), r("b", 20, 4, 1)
    num_running, num_held, num_demand = holdings([at_boundary, mid_block, prefilling], 4)
    assert (num_running, num_held) == ({"a": 2, "b": 1}, {"a": 4, "b": 1})
    assert num_demand == 1 + 0 + 4


def test_admission_shortage_is_none_while_a_slot_and_blocks_are_there_even_if_all_grow():
    def r(tenant, num_tokens, num_blocks):
        return SimpleNamespace(
            tenant=tenant,
            token_ids=[0] * num_tokens,
            num_computed_tokens=num_tokens,
            block_ids=[0] * num_blocks,
        )

    flood = [r("a", 8, 2), r("a", 6, 2)]  # the first at a block boundary: 1 block next step
    accounts = {"a": SimpleNamespace(weight=2.0, num_requests=2)}
    accounts["b"] = SimpleNamespace(weight=1.0, num_requests=1)
    accounts["idle"] = SimpleNamespace(weight=5.0, num_requests=0)

    def of(num_head_tokens, num_available_blocks, num_slots=3):
        return admission_shortage(
            "b", num_head_tokens, 1, flood, num_available_blocks, 4, num_slots, 50, accounts
        )

    assert of(num_head_tokens=7, num_available_blocks=5) is None  # 3 blocks + 2 if both grow
    short = of(num_head_tokens=7, num_available_blocks=4)
    assert (short.num_slots_short, short.num_blocks_short) == (0, -1 + 1)
    short = of(num_head_tokens=1, num_available_blocks=50, num_slots=2)
    assert (short.needy, short.num_slots_short, short.num_slots, short.num_blocks) == (
        "b",
        1,
        2,
        50,
    )
    assert short.weights == {"a": 2.0, "b": 1.0}
    assert (short.num_running, short.num_held_blocks) == ({"a": 2}, {"a": 4})


def test_the_ledger_names_a_neediest_tenant_only_when_sharing_and_two_wait():
    ledger = Ledger()
    ledger.join("a", 1.0)
    assert ledger.neediest(["a"]) is None  # one tenant active: not sharing
    ledger.join("b", 1.0)
    ledger.charge_prompt("a", 10)
    assert ledger.neediest(["a"]) is None  # the one tenant waiting
    assert ledger.neediest(["a", "b"]) == "b"
    assert Ledger(enabled=False).neediest(["a", "b"]) is None


# -- the core, simulated --------------------------------------------------------------------

NUM_FLOOD = 600
MAX_ACTIVE = 256


def flood_and_probes(seed: int, *, fair_share: bool = True, num_probes: int = 12) -> list[int]:
    """A scheduler and a FakeWorker: tenant `flood` keeps NUM_FLOOD long requests (128 to 256
    new tokens) unfinished, tenant `probe` sends one short request at a time with random
    gaps. Returns the steps each probe waited to be admitted."""
    rng = random.Random(seed)
    geometry = make_geometry(
        num_kv_blocks=rng.choice([2048, 4096, 100_000]), block_size=16, max_context_tokens=2048
    )
    config = SchedulerConfig(
        max_active_requests=MAX_ACTIVE,
        target_step_ms=None,
        fair_share=fair_share,
        admission_policy=rng.choice(["fifo", "pack", "priority"]),
    )
    scheduler = Scheduler(config)
    scheduler.attach_worker(geometry)
    worker = FakeWorker(geometry)
    step = 0
    ids = iter(range(1 << 30))

    def add(tenant: str, num_prompt_tokens: int, max_new_tokens: int) -> str:
        request = make_request(
            f"{tenant}{next(ids)}",
            num_prompt_tokens,
            max_new_tokens=max_new_tokens,
            ignore_eos=True,
        )
        scheduler.add(dataclasses.replace(request, tenant=tenant), float(step))
        return request.request_id

    def run() -> None:
        nonlocal step
        step += 1
        plan = scheduler.schedule(float(step))
        if plan is not None:
            scheduler.apply(worker.step(plan), step + 0.5)
        while sum(rid.startswith("flood") for rid in scheduler._requests) < NUM_FLOOD:
            add("flood", rng.randint(8, 64), rng.randint(128, 256))

    run()
    for _ in range(30):
        run()
    waits = []
    for _ in range(num_probes):
        probe = add("probe", 3, 4)
        start = step
        while scheduler._requests[probe].first_scheduled_s is None and step < start + 1000:
            run()
        waits.append(step - start)
        while probe in scheduler._requests:
            run()
        for _ in range(rng.randint(0, 20)):
            run()
    return waits


@pytest.mark.parametrize("seed", range(3))
def test_under_a_flood_of_long_requests_every_probe_is_admitted_within_two_steps(seed):
    """The probe's tenant joins at the flood's counter (a tie, which the tenant with fewer
    requests wins) and takes a flood request's slot (and blocks) in the next plan; where
    the pool is short, sometimes the one after (a victim's shared blocks free nothing).
    Without preemption the first waited for a flood request to end (99 steps here)."""
    assert max(flood_and_probes(seed)) <= 2


def test_without_fair_share_the_probe_waits_for_the_flood():
    """The measure above can fail."""
    assert flood_and_probes(0, fair_share=False, num_probes=1)[0] > 50


def test_two_backlogged_tenants_do_not_take_turns_preempting():
    """Preemption only moves a slot from a tenant above its share to one below it: two
    tenants kept backlogged preempt rarely (measured: 17 to 31 in 700 steps)."""
    drive = Drive()
    drive.keep_backlog({"a": 1.0, "b": 1.0}, depth=12, num_steps=700)
    assert drive.scheduler._planner.num_preemptions <= 700 // 10
