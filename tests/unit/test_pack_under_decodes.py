"""Issue 24 item 9: pack's effect on a head-of-line burst, with decodes in every step.

Without chunked prefill a long prompt that fits a step alone but not beside the decodes
(decodes come first) lost its forced FIFO round; the head reservation then held every
admission back until the running set drained, so the short prompts behind it waited as
long as under FIFO and the head itself waited for the drain. And under a decode cap the
step budget sized each step to the whole target although a decoder waits several steps
(the round-robin) for its next token, so chunked prefill raised the gap between tokens.
Counted in steps on the fake worker; the step budget's case on its own cost model.
"""

from __future__ import annotations

import dataclasses

from pagoda.scheduler_svc.core.request import RequestState
from pagoda.scheduler_svc.core.step_budget import ERROR_MARGIN, MIN_PREFILL_TOKENS, prefill_cap
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import check_invariants, make_geometry, make_request, make_scheduler

# The shape, in tokens a step rather than the model's milliseconds: prompts of 250
# tokens under 256-token steps fit a step alone but not beside the 8 decodes.
KNOBS = dict(
    max_num_batched_tokens=256,
    chunked_prefill=False,
    max_decode_batch_size=8,
    target_step_ms=None,
)
PACK = dict(admission_policy="pack", admission_lookahead=64, force_fifo_every=8)
LONG_TOKENS, SHORT_TOKENS = 250, 16


def _geometry():
    return make_geometry(num_kv_blocks=8192, max_context_tokens=2048)


@dataclasses.dataclass
class Waits:
    """Steps from arrival to the first token (to admission for `admitted`), by request."""

    first_token: dict[str, int] = dataclasses.field(default_factory=dict)
    admitted: dict[str, int] = dataclasses.field(default_factory=dict)

    def p99(self, prefix: str) -> int:
        waits = sorted(w for r, w in self.first_token.items() if r.startswith(prefix))
        return waits[int(0.99 * len(waits))]

    def longest(self, prefix: str) -> int:
        return max(w for r, w in self.first_token.items() if r.startswith(prefix))


def _burst_waits(policy_knobs: dict, num_requests: int = 48, per_step: int = 2) -> Waits:
    """48 requests, every 4th long, arriving `per_step` a step; first-token waits in steps."""
    geometry = _geometry()
    scheduler = make_scheduler(geometry, **KNOBS, **policy_knobs)
    worker = FakeWorker(geometry)
    arrived: dict[str, int] = {}
    waits = Waits()
    step = 0
    while len(arrived) < num_requests or scheduler.has_work():
        for _ in range(per_step):
            index = len(arrived)
            if index < num_requests:
                long = index % 4 == 0
                request_id = f"{'long' if long else 'short'}{index}"
                prompt = LONG_TOKENS if long else SHORT_TOKENS
                scheduler.add(
                    make_request(request_id, prompt, max_new_tokens=16, ignore_eos=True),
                    float(step),
                )
                arrived[request_id] = step
        plan = scheduler.schedule(float(step))
        if plan is not None:
            for output in scheduler.apply(worker.step(plan), float(step)):
                request_id = output.request_id
                if output.token_ids and request_id not in waits.first_token:
                    waits.first_token[request_id] = step - arrived[request_id]
        check_invariants(scheduler)
        step += 1
        assert step < 2_000, "not done"
    return waits


def test_pack_lets_short_prompts_past_a_long_head_that_does_not_fit_beside_the_decodes():
    fifo = _burst_waits(dict(admission_policy="fifo"))
    pack = _burst_waits(PACK)
    # Before the fix: 47 steps for pack against FIFO's 66 (the reservation stopped them).
    assert pack.p99("short") * 4 <= fifo.p99("short"), (pack.p99("short"), fifo.p99("short"))
    # Starvation-freedom: the long heads lose at most one forced period against FIFO.
    assert pack.longest("long") <= fifo.longest("long") + PACK["force_fifo_every"]


def test_a_long_head_under_a_flood_of_short_ones_waits_at_most_one_forced_period():
    # A short prompt a step, 9 tokens each: about 8 decoders at any time, so the head
    # never fits beside them. Before the fix the reservation waited for the running set to
    # drain, longer for each head (9, 12, 15, 18, 21, 24 steps).
    geometry = _geometry()
    scheduler = make_scheduler(geometry, **KNOBS, **PACK)
    worker = FakeWorker(geometry)
    waits: list[int] = []
    waiting: dict[str, int] = {}
    for step in range(240):
        if step % 40 == 0:
            request_id = f"long{step}"
            scheduler.add(
                make_request(request_id, LONG_TOKENS, max_new_tokens=16, ignore_eos=True),
                float(step),
            )
            waiting[request_id] = step
        scheduler.add(
            make_request(f"short{step}", SHORT_TOKENS, max_new_tokens=9, ignore_eos=True),
            float(step),
        )
        plan = scheduler.schedule(float(step))
        if plan is not None:
            scheduler.apply(worker.step(plan), float(step))
        check_invariants(scheduler)
        for request_id, arrived in list(waiting.items()):
            if scheduler.core._requests[request_id].state is not RequestState.WAITING:
                waits.append(step - arrived)
                del waiting[request_id]
    assert not waiting and len(waits) == 6
    assert max(waits) <= PACK["force_fifo_every"], waits


def test_a_reserved_head_costs_the_decodes_one_step_of_room_only():
    geometry = _geometry()
    scheduler = make_scheduler(geometry, **KNOBS, **PACK)
    worker = FakeWorker(geometry)
    for index in range(12):
        scheduler.add(make_request(f"short{index}", SHORT_TOKENS, max_new_tokens=100), 0.0)
    scheduler.apply(worker.step(scheduler.schedule(0.0)), 0.0)
    scheduler.add(make_request("long", LONG_TOKENS, max_new_tokens=4), 1.0)
    long = scheduler.core._requests["long"]
    decodes = []
    for step in range(1, 20):
        plan = scheduler.schedule(float(step))
        decodes.append(plan.num_decode_tokens)
        scheduler.apply(worker.step(plan), float(step))
        if long.state is not RequestState.WAITING:
            break
    # Full decode batches until the forced round misses the head, then one step that
    # leaves it its 250 tokens: 256 - 250 = 6 decodes.
    assert long.state is not RequestState.WAITING
    assert decodes[-1] == 256 - LONG_TOKENS and set(decodes[:-1]) == {8}
    assert len(decodes) <= PACK["force_fifo_every"] + 1


# -- the step budget under a decode cap -------------------------------------------------------


def test_under_a_decode_cap_the_step_budget_bounds_the_gap_between_two_tokens():
    # 36 decoders under a cap of 8: each waits 5 steps for its next token, so a chunk
    # beside them may take a fifth of the target, not all of it.
    geometry = _geometry()
    scheduler = make_scheduler(
        geometry,
        max_num_batched_tokens=256,
        chunked_prefill=True,
        max_decode_batch_size=8,
        target_step_ms=500.0,
        **PACK,
    )
    worker = FakeWorker(geometry)
    for index in range(36):
        scheduler.add(make_request(f"short{index}", SHORT_TOKENS, max_new_tokens=200), 0.0)
    while scheduler.core._planner.waiting or scheduler.core._planner.prefilling:
        scheduler.apply(worker.step(scheduler.schedule(0.0)), 0.0)
    # Teach the cost model a worker of 20 ms + 1 ms a prompt token + 0.5 ms a decode.
    budget = scheduler.step_budget
    for prefill, decodes in [(0, 8), (64, 8), (128, 4), (256, 0), (32, 8), (200, 2)] * 5:
        budget.observe(prefill, decodes, 20.0 + prefill + 0.5 * decodes, 0)
    scheduler.add(make_request("long", 1000), 0.0)
    plan = scheduler.schedule(0.0)
    num_rounds = -(-36 // 8)
    assert plan.num_decode_tokens == 8 and plan.num_prefill_tokens > 0
    gap_ms = num_rounds * (20.0 + plan.num_prefill_tokens + 0.5 * plan.num_decode_tokens)
    # Before the fix: 248 prompt tokens, a gap of 1,390 ms between a stream's tokens.
    assert gap_ms <= 500.0 * 1.05, (plan.num_prefill_tokens, gap_ms)


def test_the_step_budget_shares_the_target_over_the_rounds_of_the_decode_cap():
    budget = make_scheduler(target_step_ms=500.0).step_budget
    for prefill, decodes in [(0, 8), (64, 8), (128, 4), (256, 0), (32, 8), (200, 2)] * 5:
        budget.observe(prefill, decodes, 20.0 + prefill + 0.5 * decodes, 0)
    # About (500 - 20 - 4) ms at 1 ms a token for one round; (100 - 20 - 4) ms for each of 5
    # (each target less the margin for the model's recent errors: step_budget.ERROR_MARGIN).
    margin = 1 + ERROR_MARGIN * budget.model.relative_error
    assert 500 / margin - 40 <= budget.max_prefill_tokens(8) <= 500 / margin - 10
    five = budget.max_prefill_tokens(8, 0, num_rounds=5)
    assert five == prefill_cap(budget.model, 100.0, 8, MIN_PREFILL_TOKENS)
    assert 100 / margin - 34 <= five <= 100 / margin - 14
