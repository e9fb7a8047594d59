"""When to plan step N+1 while step N runs: as late as still keeps the worker busy.

With overlapped steps the loop used to plan N+1 as soon as N was sent. N+1 was then fixed
for nearly all of N's time, so a request arriving during N waited for N+1 to run before
its own step: two steps and a half to its first token on average, three at worst (issue
27's probe under a flood of another tenant: TTFT p50 2.4 steps). Planned just before N
ends, N+1 takes what arrived meanwhile: a step and a half on average, two at worst, and
the worker still finds N+1 waiting when N is done.

When N's result will arrive is predicted: N starts on the worker when it is sent or when
the step before it ends, whichever is later, and lasts what a StepCostModel (the step
budget's, fed every result's worker time) predicts for its shape. N+1 is planned `lead`
before that moment. The lead is what the recent steps needed. Each step planned ahead,
timed or not, tells how early its successor's planning should have begun to be sent before
its result came with a margin to spare: the planning and encoding time (measured), plus
the margin, plus how late the loop came to plan (a stream writer held the event loop),
less how late the result came against its prediction. The lead is the LEAD_QUANTILE of the
last LEAD_WINDOW of these: the margin is eaten in about one step in fifty, and a steady
worker lets the lead settle near the planning time plus the margin (docs/benchmarks.md,
"Overlapped steps", for what the margin costs and buys).

Until MIN_OBSERVATIONS results have taught the model, and whenever the lead reaches back
past the moment the loop may plan, N+1 is planned at once, as before. Pure bookkeeping on
the times the loop gives it; the loop (step_loop.py) owns the clock and the waiting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagoda.scheduler_svc.core import StepPlan
from pagoda.scheduler_svc.core.step_budget import StepCostModel

# Results seen before the model's prediction is trusted.
MIN_OBSERVATIONS = 8
# The slack wanted beyond the planning time: this fraction of the predicted step, at least
# MIN_MARGIN_S (the event loop's own jitter: a stream writer may hold it that long).
MARGIN_FRACTION = 0.25
MIN_MARGIN_S = 0.001
# The lead is this quantile of what the last LEAD_WINDOW steps needed.
LEAD_QUANTILE = 0.98
LEAD_WINDOW = 64
# Planning time follows its recent values at this rate (an exponentially weighted mean).
PLAN_COST_RATE = 0.2


@dataclass(slots=True)
class _Prediction:
    step_id: int  # of the step in flight
    worker_s: float  # its predicted worker time
    end_s: float  # when its result is predicted to arrive
    plan_s: float  # when the next plan is due: end_s - lead, or when first asked if later
    late_s: float = 0.0  # how far past plan_s the next plan started


@dataclass(slots=True)
class PlanTiming:
    """Predicts when the step in flight ends and says when to plan the next one."""

    model: StepCostModel = field(default_factory=StepCostModel)
    lead_s: float | None = None  # plan this long before the predicted result; learned
    plan_cost_s: float = 0.0  # planning and encoding one step, recent mean
    _prediction: _Prediction | None = None
    _needed_s: deque[float] = field(default_factory=lambda: deque(maxlen=LEAD_WINDOW))

    def reset(self) -> None:
        """A new worker: its step times are learned afresh."""
        self.model.reset()
        self.lead_s, self.plan_cost_s, self._prediction = None, 0.0, None
        self._needed_s.clear()

    def plan_at(self, in_flight: StepPlan, started_s: float, now: float) -> float | None:
        """When to plan the step after `in_flight`, which began on the worker at
        `started_s`: None means now (no prediction yet, or the lead reaches back past
        `now`). Predicted once per step in flight; the loop asks again at each turn."""
        prediction = self._prediction
        if prediction is None or prediction.step_id != in_flight.step_id:
            prediction = self._prediction = self._predict(in_flight, started_s, now)
            if prediction is None:
                return None
        return prediction.plan_s if prediction.plan_s > now else None

    def _predict(self, in_flight: StepPlan, started_s: float, now: float) -> _Prediction | None:
        if self.model.num_observations < MIN_OBSERVATIONS:
            return None
        predicted_ms = self.model.predict_ms(
            in_flight.num_extra_tokens, in_flight.num_decode_tokens, in_flight.num_context_tokens
        )
        worker_s = max(0.0, predicted_ms) / 1000
        if self.lead_s is None:  # nothing learned yet: start from half a step
            self.lead_s = max(worker_s / 2, self._wanted_slack_s(worker_s))
        end_s = started_s + worker_s
        return _Prediction(in_flight.step_id, worker_s, end_s, max(end_s - self.lead_s, now))

    def planning(self, now: float) -> None:
        """The loop starts to plan the step after the one in flight."""
        prediction = self._prediction
        if prediction is not None:
            prediction.late_s = max(0.0, now - prediction.plan_s)

    def planned(self, planning_s: float) -> None:
        """How long one plan took to build and encode."""
        self.plan_cost_s += PLAN_COST_RATE * (planning_s - self.plan_cost_s)

    def result(self, plan: StepPlan, worker_s: float, received_s: float) -> None:
        """A step's result came: its worker time (total_ms) teaches the model, and if the
        step after it was due by a prediction, its arrival teaches the lead."""
        prediction, self._prediction = self._prediction, None
        if prediction is not None and prediction.step_id == plan.step_id:
            needed_s = self._wanted_slack_s(prediction.worker_s) + prediction.late_s
            self._needed_s.append(needed_s - (received_s - prediction.end_s))
            ordered = sorted(self._needed_s)
            lead_s = max(0.0, ordered[int(LEAD_QUANTILE * (len(ordered) - 1))])
            assert self.lead_s is not None
            # A few steps say little about the tail: until then the lead only grows.
            few = len(ordered) < MIN_OBSERVATIONS
            self.lead_s = max(self.lead_s, lead_s) if few else lead_s
        self.model.observe(
            plan.num_extra_tokens,
            plan.num_decode_tokens,
            worker_s * 1000,
            plan.num_context_tokens,
        )

    def _wanted_slack_s(self, worker_s: float) -> float:
        return self.plan_cost_s + max(MIN_MARGIN_S, MARGIN_FRACTION * worker_s)
