"""Fair share between tenants in the core (issue 27 item 2): the Virtual Token Counter's
policies, exact plans with one tenant, shares near the weights, no starvation under a
flood, the lift of a returning tenant, and the per-tenant quotas (item 3)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest

from pagoda.scheduler_svc.core import Scheduler, SchedulerConfig
from pagoda.scheduler_svc.core.tenants import (
    Ledger,
    TenantQuotaError,
    by_least_served,
    lifted_counter,
    neediest_tenant,
    victims_order,
)
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit import overlap_harness
from tests.unit.conftest import make_geometry, make_request

NUM_SEEDS = 60


# -- the pure policies -----------------------------------------------------------------------


def test_the_lowest_counter_is_served_first_and_ties_keep_the_given_order():
    counters = {"a": 5.0, "b": 2.0, "c": 2.0}
    assert neediest_tenant(["a", "b", "c"], counters) == "b"
    assert neediest_tenant(["c", "b"], counters) == "c"
    assert neediest_tenant([], counters) is None


def test_victims_come_from_the_most_served_tenant_first_newest_first_within():
    r = [SimpleNamespace(tenant=t, name=n) for t, n in [("a", 4), ("b", 3), ("a", 2), ("b", 1)]]
    groups = victims_order(r, {"a": 1.0, "b": 9.0})
    assert [[x.name for x in group] for group in groups] == [[3, 1], [4, 2]]
    assert [x.name for x in by_least_served(r, {"a": 1.0, "b": 9.0})] == [4, 2, 3, 1]


def test_a_new_or_returning_tenant_is_lifted_to_the_least_served_active_one():
    assert lifted_counter(0.0, [40.0, 70.0]) == 40.0  # banked no credit while idle
    assert lifted_counter(90.0, [40.0, 70.0]) == 90.0  # keeps what it owes
    assert lifted_counter(5.0, []) == 5.0
    ledger = Ledger()
    ledger.join("a", 1.0)
    ledger.charge_prompt("a", 100)
    ledger.join("b", 1.0)
    assert ledger.accounts["b"].counter == 100.0
    ledger.charge_generated(["a", "a", "b"])  # generated tokens weigh 2
    assert ledger.counters() == {"a": 104.0, "b": 102.0}
    ledger.leave("b")  # b idle while a is served
    ledger.charge_prompt("a", 400)
    ledger.join("b", 1.0)
    assert ledger.accounts["b"].counter == 504.0
    ledger.join("c", 2.0)  # a weight divides what it is charged
    ledger.charge_prompt("c", 100)
    assert ledger.accounts["c"].counter == 504.0 + 50.0
    assert ledger.fair
    for name in ("a", "b", "c"):
        ledger.leave(name)
    assert not ledger.fair and set(ledger.counters().values()) == {0.0}


# -- one tenant: nothing changes --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_one_tenant_plans_exactly_as_without_tenants(seed):
    """The overlap harness's random workloads (policies, chunking, preemption, failures,
    cancels): with the tenancy paths on and one named tenant, every plan equals the plan
    of the scheduler with fair share off."""
    quiet = dict(p_refuse=0.0, p_fail=0.0, p_loss=0.0, num_arrival_steps=120)
    baseline: list = []
    overlap_harness.run(seed, knob_overrides={"fair_share": False}, plans=baseline, **quiet)
    shared: list = []
    overlap_harness.run(seed, tenants=("alice",), plans=shared, **quiet)
    assert baseline and shared == baseline


@pytest.mark.parametrize("seed", range(0, NUM_SEEDS, 3))
def test_several_tenants_keep_every_invariant_and_exact_outputs(seed):
    overlap_harness.run(seed, tenants=("a", "b", "c"), num_arrival_steps=150)


# -- two tenants under saturation -------------------------------------------------------------


class Drive:
    """A scheduler and a FakeWorker, one step at a time, counting each tenant's service as
    the counters weigh it (prompt tokens 1, generated tokens 2), from the plans."""

    def __init__(self, **knobs) -> None:
        knobs = dict(max_num_batched_tokens=64, max_active_requests=8, target_step_ms=None) | knobs
        self.geometry = make_geometry(num_kv_blocks=256, block_size=4, max_context_tokens=512)
        self.scheduler = Scheduler(SchedulerConfig(**knobs))
        self.scheduler.attach_worker(self.geometry)
        self.worker = FakeWorker(self.geometry)
        self.step = 0
        self.served: Counter = Counter()
        self.admitted_at: dict[str, int] = {}
        self.num_ids = 0

    def add(self, tenant: str, weight: float = 1.0, *, prompt: int = 16, new: int = 32) -> str:
        self.num_ids += 1
        request_id = f"{tenant}{self.num_ids}"
        request = make_request(request_id, prompt, max_new_tokens=new, ignore_eos=True)
        request = dataclasses.replace(request, tenant=tenant, tenant_weight=weight)
        self.scheduler.add(request, float(self.step))
        return request_id

    def run(self, num_steps: int) -> Counter:
        """Steps; returns each tenant's weighted tokens served in them."""
        served: Counter = Counter()
        running = self.scheduler._planner.running
        for _ in range(num_steps):
            self.step += 1
            plan = self.scheduler.schedule(float(self.step))
            if plan is None:
                continue
            for index, seq_id in enumerate(plan.seq_ids):
                request = running[seq_id]
                self.admitted_at.setdefault(request.request_id, self.step)
                num_tokens = plan.token_offsets[index + 1] - plan.token_offsets[index]
                decoding = request.num_computed_tokens > request.num_prompt_tokens
                served[request.tenant] += 2 * num_tokens if decoding else num_tokens
            self.scheduler.apply(self.worker.step(plan), float(self.step) + 0.5)
        self.served += served
        return served

    def keep_backlog(self, tenants: dict[str, float], depth: int, num_steps: int) -> Counter:
        """Run while every tenant keeps `depth` requests waiting (saturation)."""
        served: Counter = Counter()
        for _ in range(num_steps):
            for tenant, weight in tenants.items():
                while self.scheduler._planner.waiting.num_waiting_of(tenant) < depth:
                    self.add(tenant, weight)
            served += self.run(1)
        return served


@pytest.mark.parametrize("policy", ["fifo", "pack", "priority"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_backlogged_tenants_get_token_shares_near_their_weights(policy, weights):
    drive = Drive(admission_policy=policy)
    tenants = {"a": weights[0], "b": weights[1]}
    drive.keep_backlog(tenants, depth=12, num_steps=100)  # past the start
    served = drive.keep_backlog(tenants, depth=12, num_steps=600)
    ratio = served["a"] / served["b"]
    expected = weights[0] / weights[1]
    assert abs(ratio - expected) / expected < 0.15, (served, expected)


def test_without_fair_share_the_same_load_follows_arrival_order():
    """The measure above can fail: with fair share off, weights do nothing."""
    drive = Drive(fair_share=False)
    drive.keep_backlog({"a": 2.0, "b": 1.0}, depth=12, num_steps=100)
    served = drive.keep_backlog({"a": 2.0, "b": 1.0}, depth=12, num_steps=600)
    assert served["a"] / served["b"] < 1.5


@pytest.mark.parametrize("fair_share", [True, False])
def test_a_flood_from_one_tenant_no_longer_starves_another(fair_share):
    drive = Drive(fair_share=fair_share)
    for _ in range(300):
        drive.add("flood")
    drive.run(20)
    probes = []
    for _ in range(5):  # one short request after another
        request_id = drive.add("probe", new=4)
        start = drive.step
        while request_id in drive.scheduler._requests and drive.step < start + 2000:
            drive.run(1)
        probes.append(drive.admitted_at[request_id] - start)
    # A slot frees within one flood request's 32 tokens; the probe takes the next one.
    if fair_share:
        assert max(probes) <= 34, probes
    else:
        assert probes[0] > 1000, probes  # it waits behind the whole flood


def test_a_returning_tenant_cannot_bank_credit_while_idle():
    drive = Drive()
    three = {"a": 1.0, "b": 1.0, "c": 1.0}
    drive.keep_backlog(three, depth=12, num_steps=100)
    for request_id in [r for r in drive.scheduler._requests if r.startswith("b")]:
        drive.scheduler.cancel(request_id, float(drive.step))
    drive.keep_backlog({"a": 1.0, "c": 1.0}, depth=12, num_steps=300)  # b idle
    counters = drive.scheduler._planner.tenants.counters()
    assert min(counters["a"], counters["c"]) > 2 * counters["b"]  # b's is far behind
    drive.add("b")
    lifted = drive.scheduler._planner.tenants.counters()["b"]
    assert lifted == min(counters["a"], counters["c"])
    served = drive.keep_backlog(three, depth=12, num_steps=300)
    share_b = served["b"] / sum(served.values())
    assert abs(share_b - 1 / 3) < 0.05, served  # no catch-up burst


@pytest.mark.parametrize("fair_share", [True, False])
def test_preemption_takes_the_most_served_tenants_requests_first(fair_share):
    """Two running requests, a pool with no block for their next token: the victim is the
    most-served tenant's (a, though admitted first), not the newest (b's)."""
    geometry = make_geometry(num_kv_blocks=4, block_size=4)
    scheduler = Scheduler(SchedulerConfig(fair_share=fair_share, target_step_ms=None))
    scheduler.attach_worker(geometry)
    worker = FakeWorker(geometry)
    for tenant in ("a", "b"):
        request = make_request(tenant, 8, max_new_tokens=4, ignore_eos=True)
        scheduler.add(dataclasses.replace(request, tenant=tenant), 0.0)
    scheduler.apply(worker.step(scheduler.schedule(1.0)), 1.5)  # both prefill: 4 blocks
    scheduler._planner.tenants.accounts["a"].counter += 1000.0
    scheduler.schedule(2.0)
    accounts = scheduler._planner.tenants.accounts
    preempted = "a" if fair_share else "b"
    assert accounts[preempted].num_preemptions == 1
    assert sum(account.num_preemptions for account in accounts.values()) == 1


# -- quotas -----------------------------------------------------------------------------------


def test_per_tenant_caps_refuse_naming_the_limit_and_leave_others_room():
    drive = Drive(max_tenant_requests=5, max_tenant_waiting_requests=3, max_active_requests=2)
    for _ in range(3):
        drive.add("a")
    with pytest.raises(TenantQuotaError, match=r"tenant a has 3 requests queued.*max_tenant_wai"):
        drive.add("a")
    drive.run(1)  # two start: a has 5 in flight at most
    drive.add("a")
    drive.add("a")
    with pytest.raises(TenantQuotaError, match=r"tenant a has 5 requests in flight.*max_tenant_re"):
        drive.add("a")
    drive.add("b")  # another tenant still gets in
    stats = {s.tenant: s for s in drive.scheduler.tenant_stats()}
    assert (stats["a"].num_running, stats["a"].num_waiting) == (2, 3)
    assert (stats["b"].num_running, stats["b"].num_waiting) == (0, 1)


# -- the fairness bound under any arrival pattern ----------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_backlogged_tenants_service_stays_within_a_bound_of_their_weights(seed):
    """Random bursts of random sizes from two tenants (weights 1 and 1-3). Over any window
    in which both have requests waiting, the weighted tokens each was served, divided by
    its weight, differ by at most 2 x max_active_requests x the largest request's weighted
    cost (each running request may still be owed its whole cost when the window opens)."""
    import random

    rng = random.Random(seed)
    weights = {"a": 1.0, "b": float(rng.choice([1, 2, 3]))}
    max_active = 6
    drive = Drive(max_active_requests=max_active, admission_policy=rng.choice(["fifo", "pack"]))
    max_prompt, max_new = 24, 24
    bound = 2 * max_active * (max_prompt * 1 + max_new * 2) / min(weights.values())
    service = {"a": 0.0, "b": 0.0}
    difference: list[float] = []  # normalized service of a minus b, while both backlogged
    worst = 0.0
    waiting = drive.scheduler._planner.waiting
    for _ in range(1500):
        for tenant, weight in weights.items():
            if rng.random() < 0.08:
                for _ in range(rng.randint(1, 10)):
                    drive.add(
                        tenant,
                        weight,
                        prompt=rng.randint(1, max_prompt),
                        new=rng.randint(1, max_new),
                    )
        backlogged = all(waiting.num_waiting_of(tenant) for tenant in weights)
        served = drive.run(1)
        for tenant, weight in weights.items():
            service[tenant] += served[tenant] / weight
        if backlogged:
            difference.append(service["a"] - service["b"])
            worst = max(worst, max(difference) - min(difference))
        else:
            difference = [service["a"] - service["b"]]  # a new window starts here
    # Measured: at most 366 of the bound's 864 over these seeds; 1,800 to 6,400 with
    # fair_share off.
    assert worst <= bound, (worst, bound)


def test_the_neediest_tenants_new_prompt_goes_before_a_more_served_ones_chunks():
    """Issue 27 item 2, the chunk budget: a's long prompt is in progress, 16 tokens a step;
    b's short one arrives. b, lifted to a's counter and waiting, is the neediest: its head
    takes the budget before a's next chunk, whole, and samples in that step, where it used
    to wait until a's prompt was done (or take what a's chunk left)."""
    geometry = make_geometry(num_kv_blocks=64, block_size=4)
    config = SchedulerConfig(max_num_batched_tokens=16, target_step_ms=None)
    scheduler = Scheduler(config)
    scheduler.attach_worker(geometry)
    worker = FakeWorker(geometry)
    long = dataclasses.replace(make_request("a0", 64, max_new_tokens=4), tenant="a")
    scheduler.add(long, 0.0)
    scheduler.apply(worker.step(scheduler.schedule(1.0)), 1.5)  # a0's first chunk
    short = dataclasses.replace(make_request("b0", 8, max_new_tokens=4), tenant="b")
    scheduler.add(short, 2.0)
    plan = scheduler.schedule(3.0)
    assert plan_feeds(scheduler, plan) == {"b0": 8, "a0": 8}


def plan_feeds(scheduler, plan) -> dict[str, int]:
    """Tokens each request feeds in `plan`, by request id."""
    offsets, running = plan.token_offsets, scheduler._planner.running
    return {
        running[seq_id].request_id: offsets[i + 1] - offsets[i]
        for i, seq_id in enumerate(plan.seq_ids)
    }
