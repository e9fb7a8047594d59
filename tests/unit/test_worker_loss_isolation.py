"""A request that kills (or hangs) the worker is isolated like one that makes its step fail
(sched_review finding 6, issue 14 item 4): the lost step's requests become suspects, the
suspects and their solo failures survive the next worker's hello, and a request whose
step alone loses the worker twice ends with an error (INTERNAL) while the others finish.

The StepLoop runs in process on test_step_loop's fake link, whose worker here dies on any
plan that feeds POISON; every death is followed by a new worker's hello.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from pagoda.scheduler_svc.core import FinishReason
from pagoda.scheduler_svc.testing import FakeWorker
from pagoda.scheduler_svc.worker_link import WorkerLost
from tests.unit.conftest import (
    Stream,
    check_invariants,
    expected_generation,
    make_geometry,
    make_request,
    make_scheduler,
)
from tests.unit.test_step_loop import (
    Harness,
    assert_exact,
    assert_idle,
    read_to_end,
    running,
    scenario,
)

POISON = 62  # inside the vocabulary (a hello does not refuse it); no good request feeds it
MAX_CRASHES = 8  # far above the 4 isolation needs: a crash loop fails the test at once


class CrashingWorkers:
    """Makes `harness.link` lose its worker on every plan that feeds POISON (the loss
    reported as WorkerLink reports it: the detach, then WorkerLost), and says hello with
    a fresh worker after each loss."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.num_crashes = 0
        self.solo_crashes = 0  # crashes of a plan that fed one sequence only
        link = harness.link
        run_step = link.run_step

        async def crashing_run_step(plan, timeout_s):
            if POISON not in plan.token_ids:
                return await run_step(plan, timeout_s)
            await asyncio.sleep(0)
            self.num_crashes += 1
            self.solo_crashes += len(plan.seq_ids) == 1
            if self.num_crashes > MAX_CRASHES:
                raise AssertionError("the poison request crashes worker after worker")
            link.num_plans += 1
            link.detach(f"the worker died in step {plan.step_id}")
            raise WorkerLost(f"the worker died in step {plan.step_id}")

        link.run_step = crashing_run_step  # type: ignore[method-assign]
        self.task = asyncio.create_task(self._reattach())

    async def _reattach(self) -> None:
        number = 1
        while True:
            attached = await self.harness.worker_changes.get()
            if not attached:
                number += 1
                self.harness.link.attach(f"w{number}")


def test_a_request_that_kills_the_worker_ends_alone_with_an_error_and_the_others_finish():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            crashes = CrashingWorkers(h)
            good = [
                make_request(f"good{i}", 6 + 3 * i, max_new_tokens=12, ignore_eos=True)
                for i in range(5)
            ]
            poison = make_request("poison", [5, 6, POISON, 7], max_new_tokens=12)
            slots = [h.loop.submit(r) for r in (*good[:2], poison, *good[2:])]
            streams = await h.settle(*(read_to_end(h.loop, slot) for slot in slots))
            crashes.task.cancel()
            by_id = {
                slot.request_id: (slot, stream) for slot, stream in zip(slots, streams, strict=True)
            }
            slot, stream = by_id["poison"]
            assert stream.finish_reason is FinishReason.ERROR and stream.token_ids == []
            assert slot.error_code is None  # a failure of this request alone: INTERNAL
            for request in good:
                assert_exact(by_id[request.request_id][1], request)
            # The mixed step of 6, the half of 3 holding it, then the poison request alone
            # twice: the second solo loss convicts it.
            assert (crashes.num_crashes, crashes.solo_crashes) == (4, 2)
            assert_idle(h.loop)

    scenario(body)


@pytest.mark.parametrize("detach_first", [False, True], ids=["lost-then-detach", "detach-first"])
def test_the_core_convicts_a_worker_killer_whichever_the_loop_hears_first(detach_first):
    """The loop may hear of the detach before the step's WorkerLost (overlapped steps:
    a send fails while an earlier step is awaited): the lost steps count either way,
    once."""
    geometry = make_geometry(vocab_size=100)
    scheduler = make_scheduler(geometry)
    worker = FakeWorker(geometry)
    good = [
        make_request(f"good{i}", 6 + 3 * i, max_new_tokens=12, ignore_eos=True) for i in range(5)
    ]
    poison = make_request("poison", [5, 6, POISON, 7], max_new_tokens=12)
    for request in (*good[:2], poison, *good[2:]):
        scheduler.add(request, 0.0)
    streams: dict[str, Stream] = defaultdict(Stream)
    num_crashes = 0
    for step in range(500):
        plan = scheduler.schedule(float(step))
        if plan is None:
            break
        if POISON in plan.token_ids:
            num_crashes += 1
            assert num_crashes <= MAX_CRASHES, "the poison request crashes worker after worker"
            core = scheduler.core
            if detach_first:
                outputs = core.detach_worker("its connection closed")
                outputs += core.fail_step(plan, "its connection closed", float(step))
            else:
                outputs = core.fail_step(plan, "its connection closed", float(step))
                outputs += core.detach_worker("its connection closed")
            outputs = scheduler.processor.process(outputs)
            outputs += scheduler.attach_worker(geometry)
            worker = FakeWorker(geometry)
        else:
            outputs = scheduler.apply(worker.step(plan), step + 0.5)
        for output in outputs:
            streams[output.request_id].take(output)
        check_invariants(scheduler)
    assert streams["poison"].finish_reason is FinishReason.ERROR
    assert num_crashes == 4  # 6 together, 3, then 1 twice
    for request in good:
        tokens, reason, _ = expected_generation(request, geometry)
        assert streams[request.request_id].token_ids == tokens
        assert streams[request.request_id].finish_reason is reason


@pytest.mark.parametrize("how", ["fail_step", "detach_worker"])
def test_a_worker_dropped_for_breaking_the_protocol_convicts_no_request(how):
    """A worker that answers a plan with a malformed result is dropped (WorkerLost with
    suspect=False): its step's requests are recomputed, never counted towards isolation, so
    a buggy worker cannot make a lone request end with an error however often it fails."""
    geometry = make_geometry(vocab_size=100)
    scheduler = make_scheduler(geometry)
    request = make_request("alone", [5, 6, 7, 8], max_new_tokens=6, ignore_eos=True)
    scheduler.add(request, 0.0)
    stream = Stream()
    worker = FakeWorker(geometry)
    num_drops = 0
    for step in range(100):
        plan = scheduler.schedule(float(step))
        if plan is None:
            break
        if num_drops < 4:  # the first four plans each get a malformed answer
            num_drops += 1
            core = scheduler.core
            if how == "fail_step":
                outputs = core.fail_step(plan, "it sent garbage", float(step), suspect=False)
                outputs += core.detach_worker("it sent garbage", suspect=False)
            else:
                outputs = core.detach_worker("it sent garbage", suspect=False)
            outputs = scheduler.processor.process(outputs)
            outputs += scheduler.attach_worker(geometry)
            worker = FakeWorker(geometry)
        else:
            outputs = scheduler.apply(worker.step(plan), step + 0.5)
        for output in outputs:
            stream.take(output)
        check_invariants(scheduler)
    tokens, reason, _ = expected_generation(request, geometry)
    assert stream.token_ids == tokens and stream.finish_reason is reason
