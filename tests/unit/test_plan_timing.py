"""PlanTiming: when the loop plans step N+1 while N runs (scheduler_svc/plan_timing.py).

Steps are driven on a made-up clock: each decode step of 64 sequences is sent, planned
ahead at the moment PlanTiming names, and answered when the test says."""

from __future__ import annotations

import pytest

from pagoda.scheduler_svc.core import StepPlan
from pagoda.scheduler_svc.plan_timing import (
    LEAD_WINDOW,
    MARGIN_FRACTION,
    MIN_OBSERVATIONS,
    PlanTiming,
)

STEP_S = 0.020
PLAN_S = 0.001  # what building and encoding a plan takes


def decode_step(step_id: int) -> StepPlan:
    return StepPlan(
        step_id=step_id, start_positions=[100] * 64, token_ids=[1] * 64, num_decode_tokens=64
    )


class Steps:
    """A worker whose steps take what the test says, each sent as soon as the one before
    it, or planned ahead where the timing says."""

    def __init__(self, timing: PlanTiming) -> None:
        self.timing = timing
        self.step_id = 0
        self.started_s = 0.0  # the step in flight began on the worker
        self.plans_at: list[float | None] = []  # what plan_at said for each step

    def run(self, worker_s: float = STEP_S, *, late_s: float = 0.0) -> None:
        """One step in flight, `worker_s` long; the next is planned `late_s` past its time."""
        timing, plan = self.timing, decode_step(self.step_id)
        plan_at = timing.plan_at(plan, self.started_s, self.started_s)
        self.plans_at.append(plan_at)
        planning_s = (plan_at if plan_at is not None else self.started_s) + late_s
        timing.planning(planning_s)
        timing.planned(PLAN_S)
        received_s = self.started_s + worker_s
        timing.result(plan, worker_s, received_s)
        self.started_s = max(received_s, planning_s + PLAN_S)  # the next one starts
        self.step_id += 1


def test_nothing_waits_until_the_model_has_seen_a_few_steps():
    steps = Steps(PlanTiming())
    for _ in range(MIN_OBSERVATIONS):
        steps.run()
    assert steps.plans_at == [None] * MIN_OBSERVATIONS  # planned at once, as before
    steps.run()
    assert steps.plans_at[-1] is not None


def test_a_steady_worker_gets_its_next_plan_just_before_each_step_ends():
    timing = PlanTiming()
    steps = Steps(timing)
    for _ in range(MIN_OBSERVATIONS + LEAD_WINDOW):
        steps.run()
    wanted_s = PLAN_S + MARGIN_FRACTION * STEP_S
    assert timing.lead_s == pytest.approx(wanted_s, rel=0.05)
    started_s = steps.started_s
    plan_at = timing.plan_at(decode_step(steps.step_id), started_s, started_s)
    assert plan_at == pytest.approx(started_s + STEP_S - wanted_s, rel=1e-3)
    # Planned in the last quarter of the step or so: not at its start.
    assert plan_at - started_s > STEP_S / 2


def test_results_that_come_early_now_and_then_push_the_plans_earlier():
    """One step in ten ends 5 ms before its prediction (a faster step, a loop that picked
    up the one before late): the lead covers it, so the worker does not wait for them."""
    timing = PlanTiming()
    steps = Steps(timing)
    for index in range(MIN_OBSERVATIONS + LEAD_WINDOW):
        steps.run(STEP_S - 0.005 if index % 10 == 9 else STEP_S)
    assert timing.lead_s >= PLAN_S + MARGIN_FRACTION * STEP_S + 0.004


def test_a_loop_that_comes_late_to_plan_is_given_an_earlier_moment():
    timing = PlanTiming()
    steps = Steps(timing)
    for _ in range(MIN_OBSERVATIONS + LEAD_WINDOW):
        steps.run(late_s=0.003)
    assert timing.lead_s >= PLAN_S + MARGIN_FRACTION * STEP_S + 0.003 - 1e-6


def test_a_lead_as_long_as_the_step_means_planning_at_once():
    timing = PlanTiming()
    steps = Steps(timing)
    for _ in range(MIN_OBSERVATIONS + LEAD_WINDOW):
        steps.run(late_s=STEP_S)  # the loop is always a whole step late
    assert steps.plans_at[-1] is None


def test_a_new_worker_is_learned_afresh():
    timing = PlanTiming()
    steps = Steps(timing)
    for _ in range(2 * MIN_OBSERVATIONS):
        steps.run()
    timing.reset()
    assert timing.plan_at(decode_step(99), 5.0, 5.0) is None
    assert timing.lead_s is None and timing.plan_cost_s == 0.0
