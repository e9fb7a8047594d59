"""Every StepLoop scenario of test_step_loop.py again, with a worker that announces
feeds_last_sampled, so the loop overlaps steps (plans N+1 while N runs): streams must be
as exact, cancels, detaches and losses as clean. Plus what only overlap does."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

import tests.unit.test_step_loop as serial
from pagoda.scheduler_svc import plan_timing
from pagoda.scheduler_svc.grammars import RequestGrammar
from pagoda.scheduler_svc.step_loop import overlaps
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import make_hello

SCENARIOS = sorted(name for name in dir(serial) if name.startswith("test_"))


@pytest.fixture
def overlapped(monkeypatch) -> list[int]:
    """Workers announce feeds_last_sampled; returns a list that counts, per plan run, the
    rows fed ahead of their token."""
    monkeypatch.setitem(serial.HELLO_FIELDS, "feeds_last_sampled", True)
    rows: list[int] = []
    step = FakeWorker.step

    def counting_step(self, plan, *args, **kwargs):
        rows.append(len(plan.last_sampled_rows))
        return step(self, plan, *args, **kwargs)

    monkeypatch.setattr(FakeWorker, "step", counting_step)
    return rows


@pytest.mark.parametrize("name", SCENARIOS)
def test_step_loop_scenario_with_overlapped_steps(name, overlapped):
    getattr(serial, name)()


def test_a_long_run_is_mostly_overlapped_and_exact(overlapped):
    async def body() -> None:
        async with serial.running() as h:
            await h.attach("w1")
            requests = serial.contending_requests()
            serial.assert_all_exact(requests, await h.settle(*h.submit_all(requests)))
            serial.assert_idle(h.loop)

    serial.scenario(body)
    assert sum(1 for n in overlapped if n) > len(overlapped) / 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("feeds_last_sampled", False), ("device", "cpu")],
    ids=["an older worker", "a cpu worker by default"],
)
def test_steps_run_one_at_a_time_on(field, value, overlapped, monkeypatch):
    monkeypatch.setitem(serial.HELLO_FIELDS, field, value)

    async def body() -> None:
        async with serial.running() as h:
            await h.attach("w1")
            requests = serial.contending_requests()
            serial.assert_all_exact(requests, await h.settle(*h.submit_all(requests)))

    serial.scenario(body)
    assert overlapped and not any(overlapped)


def test_the_worker_gets_its_next_plan_before_a_steps_outputs_wake_their_readers(overlapped):
    """The readers share the event loop with the step loop: woken first, they would
    hold back step N+2's plan while the worker, done with N+1, waits for it."""
    events: list[str] = []

    async def body() -> None:
        async with serial.running() as h:
            await h.attach("w1")
            start_step, streams = h.link.start_step, h.loop._streams
            publish_step = streams.publish_step

            def recording_start_step(plan, timeout_s, identity=None):
                events.append("send")
                return start_step(plan, timeout_s, identity)

            def recording_publish_step(step):
                events.append("publish")
                publish_step(step)

            h.link.start_step = recording_start_step  # type: ignore[method-assign]
            streams.publish_step = recording_publish_step  # type: ignore[method-assign]
            requests = [serial.make_request("r", 4, max_new_tokens=12)]
            serial.assert_all_exact(requests, await h.settle(*h.submit_all(requests)))

    serial.scenario(body)
    # A step's outputs (the i-th publish) wait until the step two after it is sent, but
    # for the last two steps, which have none after them.
    num_sends = events.count("send")
    for index, _ in enumerate(publish for publish in events if publish == "publish"):
        position = [i for i, event in enumerate(events) if event == "publish"][index]
        sent_before = events[:position].count("send")
        assert sent_before >= min(index + 3, num_sends), events


@pytest.mark.parametrize(
    ("setting", "device", "feeds", "expected"),
    [
        (None, "cuda:0", True, True),
        (None, "none", True, True),  # the dummy worker stands for a fast device
        (None, "cpu", True, False),  # long steps: a new request would wait one more
        (None, "cuda:0", False, False),  # an older worker cannot feed ahead
        (True, "cpu", True, True),
        (False, "cuda:0", True, False),
    ],
)
def test_overlap_is_on_unless_set_off_or_the_worker_is_a_cpu_one(setting, device, feeds, expected):
    hello = make_hello(device=device, feeds_last_sampled=feeds)
    assert overlaps(setting, hello) is expected


class RefusingMatcher:
    """A matcher that took a token it refused: its mask allows EOS alone (no llguidance)."""

    def consume_tokens(self, token_ids: list[int]) -> bool:
        return False

    def is_error(self) -> bool:
        return True


def test_the_masks_of_a_constrained_row_planned_ahead_follow_its_plan_at_once(overlapped):
    """Sent right after the step before is applied, before the next plan: the worker,
    running the plan, waits for them to sample."""
    events: list[tuple[str, int]] = []

    async def body() -> None:
        async with serial.running() as h:
            await h.attach("w1")
            start_step, send_masks = h.link.start_step, h.link.send_masks

            def recording_start_step(plan, timeout_s, identity=None):
                events.append(("plan", plan.step_id, plan.masks_follow))
                return start_step(plan, timeout_s, identity)

            def recording_send_masks(masks, identity=None):
                events.append(("masks", masks.step_id, list(masks.seq_ids)))
                send_masks(masks, identity)

            h.link.start_step = recording_start_step  # type: ignore[method-assign]
            h.link.send_masks = recording_send_masks  # type: ignore[method-assign]
            grammar = RequestGrammar(RefusingMatcher(), (2,))  # EOS
            constrained = dataclasses.replace(
                serial.make_request("json", 4, max_new_tokens=12, ignore_eos=True),
                grammar=grammar,
            )
            free = serial.make_request("free", 4, max_new_tokens=12)
            await h.settle(*h.submit_all([constrained, free]))

    serial.scenario(body)
    followed = [step_id for kind, step_id, *rest in events if kind == "plan" and rest[0]]
    assert len(followed) > 3  # planned ahead, step after step
    for step_id in followed:
        sent = events.index(("plan", step_id, True))
        (masks,) = [i for i, event in enumerate(events) if event[:2] == ("masks", step_id)]
        # After its plan; before the plan after it, which the loop plans once the step
        # before this one is applied, as it sends these masks.
        assert sent < masks
        later = [i for i, event in enumerate(events) if event[0] == "plan" and event[1] > step_id]
        assert not later or masks < later[0], events
    assert any(event[0] == "masks" and event[2] for event in events)  # a mask, not only ends


@pytest.mark.parametrize("late", [True, False], ids=["planned late", "planned at once"])
def test_a_request_that_arrives_while_a_step_runs_joins_the_next_step(late, overlapped):
    """Planned just before step N is predicted to end (plan_timing.py), step N+1 takes a
    request that arrived while N ran; planned as soon as N was sent, it could not, and the
    request waited for N+2. Each step lasts STEP_S on the loop's manual clock and says so;
    N is held on the worker while the request arrives, then the clock moves on."""
    step_s = 0.05  # also the longest real wait of the loop for its planning moment
    new_sequences: list[int] = []  # per plan sent, in order
    sent = asyncio.Event()

    async def body() -> None:
        async with serial.running(late_plan_ahead=late) as h:
            link, start_step, run_step = h.link, h.link.start_step, h.link.run_step

            def recording_start_step(plan, timeout_s, identity=None):
                new_sequences.append(len(plan.new_sequences))
                sent.set()
                return start_step(plan, timeout_s, identity)

            async def timed_run_step(plan, timeout_s):
                result = await run_step(plan, timeout_s)
                h.clock.now_s += step_s
                result.total_ms = step_s * 1000
                return result

            link.start_step = recording_start_step  # type: ignore[method-assign]
            link.run_step = timed_run_step  # type: ignore[method-assign]
            await h.attach("w1")
            first = serial.make_request("first", 4, max_new_tokens=60, ignore_eos=True)
            readers = h.submit_all([first])
            while len(new_sequences) < 2 * plan_timing.MIN_OBSERVATIONS:  # the model learns
                sent.clear()
                await h.wait(sent.wait())
            link.go_on = asyncio.Event()  # the next step to run is held: step N
            await h.wait(link.holding.wait())
            if not late:  # N+1 went out with N, before anything else arrived
                while len(new_sequences) < link.num_plans + 2:
                    sent.clear()
                    await h.wait(sent.wait())
            running_at_arrival = link.num_plans  # N's index among the plans
            late_comer = serial.make_request("late", 5, max_new_tokens=3, ignore_eos=True)
            readers += h.submit_all([late_comer])
            h.clock.now_s += step_s  # N's predicted end passes
            if late:  # N+1 is planned now, while N is still held
                num_sent = len(new_sequences)
                while len(new_sequences) == num_sent:
                    sent.clear()
                    await h.wait(sent.wait())
            link.go_on.set()
            link.go_on = None
            serial.assert_all_exact([first, late_comer], await h.settle(*readers))

        assert new_sequences.count(1) == 2 and new_sequences[0] == 1
        first_step_of_late_comer = new_sequences.index(1, 1)
        assert first_step_of_late_comer - running_at_arrival == (1 if late else 2)

    serial.scenario(body)
