"""The serving front with one worker (one StepLoop) in process, against a fake link whose
worker is the plan-checking FakeWorker.

Plans leave the loop as protobuf (step_codec.encode_plan), cross the wire framing, are
turned back into a domain StepPlan for FakeWorker, and its result returns as a StepResult
that the loop decodes (step_codec.decode_result): the scheduler's codec is in the path.
Every stream is compared with what the dummy model gives the request alone
(conftest.expected_generation), so a lost or repeated token fails the test.

No processes, no sleeps: the test waits on the loop's own signals (outputs, worker changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from pagoda.common import step_codec, wire
from pagoda.protos import step_pb2
from pagoda.scheduler_svc.core import (
    FinishReason,
    NewSequence,
    SamplingParams,
    SchedulerConfig,
    StepPlan,
    StepResult,
    ValidRequest,
)
from pagoda.scheduler_svc.front import Front, Unavailable
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.output_streams import OutputSlot
from pagoda.scheduler_svc.testing import FakeWorker
from pagoda.scheduler_svc.worker_link import WorkerEvents, WorkerInfo, WorkerLost
from tests.unit.conftest import (
    LetterDetokenizer,
    Stream,
    expected_generation,
    make_hello,
    make_request,
)

# A pool of 128 token slots: contending_requests() outgrow it and get preempted.
HELLO_FIELDS = dict(block_size=4, num_kv_blocks=32, max_context_tokens=512, vocab_size=100)
GRACE_S = 30.0
# A safety net so a broken loop fails the test instead of hanging it; never reached when green.
SCENARIO_LIMIT_S = 20.0


# -- the worker end, in process -------------------------------------------------------------


def over_the_wire(message):
    """`message` as the other process would receive it: framed, sent as bytes, parsed."""
    return wire.decode(wire.encode(message))


def domain_plan_of(plan: step_pb2.StepPlan) -> StepPlan:
    """A StepPlan message as the domain StepPlan that FakeWorker runs (the worker's reading)."""
    return StepPlan(
        step_id=plan.step_id,
        new_sequences=[
            NewSequence(
                seq_id=new.seq_id,
                sampling=SamplingParams(
                    temperature=new.sampling.temperature,
                    top_p=new.sampling.top_p,
                    top_k=new.sampling.top_k,
                    min_p=new.sampling.min_p,
                    repetition_penalty=new.sampling.repetition_penalty,
                    presence_penalty=new.sampling.presence_penalty,
                    frequency_penalty=new.sampling.frequency_penalty,
                    seed=new.sampling.seed,
                    num_logprobs=new.sampling.num_logprobs,
                ),
                cached_token_ids=list(new.cached_token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
            )
            for new in plan.new_sequences
        ],
        seq_ids=list(plan.seq_ids),
        start_positions=list(plan.start_positions),
        sample=list(plan.sample),
        token_offsets=list(plan.token_offsets),
        token_ids=list(plan.token_ids),
        block_offsets=list(plan.block_offsets),
        block_ids=list(plan.block_ids),
        forget_seq_ids=list(plan.forget_seq_ids),
        last_sampled_rows=list(plan.last_sampled_rows),
    )


def result_of(outcome: StepResult) -> step_pb2.StepResult:
    """FakeWorker's result as the StepResult message a worker sends."""
    result = step_pb2.StepResult(
        step_id=outcome.step_id,
        seq_ids=outcome.seq_ids,
        token_ids=outcome.token_ids,
        logprobs=outcome.logprobs,
        top_offsets=outcome.top_offsets,
        top_token_ids=outcome.top_token_ids,
        top_logprobs=outcome.top_logprobs,
        step_error=outcome.step_error or "",
    )
    for seq_id, message in outcome.errors.items():
        result.errors.add(seq_id=seq_id, message=message)
    return result


class FakeLink:
    """The StepLink of the loop, answering with a FakeWorker; the test attaches and
    detaches workers and can make one vanish after, or during, a given plan."""

    def __init__(self) -> None:
        self.worker: FakeWorker | None = None
        self.num_plans = 0
        self._events: WorkerEvents | None = None
        self._detach_after_plan: int | None = None
        self._lose_during_plan: int | None = None
        # A long step: plans wait on this event; `heard` is what heard_within answers.
        self.go_on: asyncio.Event | None = None
        self.holding = asyncio.Event()
        self.heard = False

    async def start(self, events: WorkerEvents) -> None:
        self._events = events

    def attach(self, incarnation_id: str) -> FakeWorker:
        assert self._events is not None
        hello = make_hello(incarnation_id=incarnation_id, **HELLO_FIELDS)
        self.worker = FakeWorker(step_codec.geometry_from_hello(hello))
        self._events.worker_attached(WorkerInfo(identity=incarnation_id.encode(), hello=hello))
        return self.worker

    def detach(self, reason: str = "its connection closed") -> None:
        """The worker goes away between steps, as a closed connection reports it."""
        assert self._events is not None
        self.worker = None
        self._events.worker_detached(reason)

    def detach_after(self, num_plans: int) -> None:
        """The worker answers plan `num_plans` (counted from 1), then goes away."""
        self._detach_after_plan = num_plans

    def lose_during(self, num_plans: int) -> None:
        """Plan `num_plans` runs on the worker but its result never comes back."""
        self._lose_during_plan = num_plans

    def start_step(
        self, plan: step_pb2.StepPlan, timeout_s: float, identity: bytes | None = None
    ) -> asyncio.Future:
        return asyncio.ensure_future(self.run_step(plan, timeout_s))

    def send_masks(self, masks: step_pb2.StepMasks, identity: bytes | None = None) -> None:
        pass  # the FakeWorker samples unconstrained

    def heard_within(self, seconds: float, identity: bytes | None = None) -> bool:
        return self.heard

    async def run_step(self, plan: step_pb2.StepPlan, timeout_s: float) -> step_pb2.StepResult:
        # A real link awaits the worker's answer; other tasks (readers, cancels) run meanwhile.
        await asyncio.sleep(0)
        if self.go_on is not None:
            self.holding.set()
            await self.go_on.wait()
        if self.worker is None:
            raise WorkerLost("no worker attached")
        self.num_plans += 1
        result = over_the_wire(result_of(self.worker.step(domain_plan_of(over_the_wire(plan)))))
        if self.num_plans == self._lose_during_plan:
            # As WorkerLink._drop_worker: the detach is reported, then the step fails.
            self.detach(f"no result for step {plan.step_id}")
            raise WorkerLost(f"no result for step {plan.step_id}")
        if self.num_plans == self._detach_after_plan:
            self.detach()
        return result


class ManualClock:
    """The loop's clock; it moves only when the test says (the grace period test)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


# -- the harness ------------------------------------------------------------------------------


@dataclass
class Harness:
    loop: Front
    link: FakeLink
    clock: ManualClock
    worker_changes: asyncio.Queue[bool]  # what on_worker_change said, in order
    task: asyncio.Task

    async def settle(self, *readers: Awaitable) -> list:
        """Await `readers`, failing at once if the loop dies (a PlanError, say)."""
        together = asyncio.ensure_future(asyncio.gather(*readers))
        await asyncio.wait({together, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not together.done():
            together.cancel()
            self.task.result()  # raises what killed the loop
            raise AssertionError("the step loop stopped before the readers were done")
        return together.result()

    async def wait(self, awaitable: Awaitable):
        (result,) = await self.settle(awaitable)
        return result

    async def next_worker_change(self) -> bool:
        return await self.wait(self.worker_changes.get())

    async def attach(self, incarnation_id: str) -> FakeWorker:
        """A worker says hello; returns once the loop has attached it."""
        worker = self.link.attach(incarnation_id)
        assert await self.next_worker_change() is True
        assert self.loop.worker is not None
        assert self.loop.worker.hello.incarnation_id == incarnation_id
        return worker

    def submit_all(self, requests: list[ValidRequest]) -> list[asyncio.Task[Stream]]:
        return [asyncio.create_task(read_to_end(self.loop, self.loop.submit(r))) for r in requests]


@contextlib.asynccontextmanager
async def running(**front_args) -> AsyncIterator[Harness]:
    """The front turning on a FakeLink with no worker attached yet; `front_args` go to
    Front as they are."""
    link = FakeLink()
    clock = ManualClock()
    worker_changes: asyncio.Queue[bool] = asyncio.Queue()
    loop = Front(
        SchedulerConfig(),
        link,  # type: ignore[arg-type]
        Metrics(),
        detokenizer_factory=LetterDetokenizer,  # type: ignore[arg-type]
        worker_timeout_s=10.0,
        worker_grace_s=GRACE_S,
        status_interval_s=60.0,
        on_worker_change=worker_changes.put_nowait,
        clock=clock,
        # Only the grace period test waits on an idle turn; keep that wait short.
        idle_tick_s=0.01,
        **front_args,
    )
    await link.start(loop)
    task = asyncio.create_task(loop.run(), name="step-loop")
    try:
        yield Harness(loop, link, clock, worker_changes, task)
    finally:
        loop.stop()
        await task


def scenario(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), SCENARIO_LIMIT_S))


async def read_to_end(loop: Front, slot: OutputSlot, stream: Stream | None = None) -> Stream:
    """What the servicer does: take outputs until the last one, then release the slot."""
    stream = stream if stream is not None else Stream()
    try:
        while stream.finish_reason is None:
            stream.take(await slot.next())
    finally:
        loop.release(slot)
    return stream


async def first_output(slot: OutputSlot) -> Stream:
    stream = Stream()
    stream.take(await slot.next())
    assert stream.token_ids and stream.finish_reason is None, "expected a running request"
    return stream


def assert_exact(stream: Stream, request: ValidRequest) -> None:
    token_ids, finish_reason, text = expected_generation(request, geometry())
    assert stream.token_ids == token_ids
    assert stream.text == text
    assert stream.finish_reason is finish_reason
    assert stream.num_events_after_finish == 0


def assert_all_exact(requests: list[ValidRequest], streams: list[Stream]) -> None:
    for request, stream in zip(requests, streams, strict=True):
        assert_exact(stream, request)


def assert_prefix(stream: Stream, request: ValidRequest) -> None:
    """What streamed before an early end is the start of the request's own output."""
    token_ids, _, _ = expected_generation(request, geometry())
    assert stream.token_ids == token_ids[: len(stream.token_ids)]


def geometry():
    return step_codec.geometry_from_hello(make_hello(**HELLO_FIELDS))


def assert_idle(loop: Front) -> None:
    stats = loop.stats
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)


def long_request(request_id: str, max_new_tokens: int = 100) -> ValidRequest:
    return make_request(request_id, 8, max_new_tokens=max_new_tokens, ignore_eos=True)


def contending_requests() -> list[ValidRequest]:
    """Requests whose KV together outgrows the pool (preemptions), one with a stop string."""
    requests = [
        make_request(f"r{i}", 10 + 7 * i, max_new_tokens=20 + 9 * i, ignore_eos=i % 2 == 0)
        for i in range(5)
    ]
    text = expected_generation(requests[1], geometry())[2]
    requests.append(make_request("stops", 10 + 7, max_new_tokens=29, stop_strings=(text[6:8],)))
    return requests


# -- attach ------------------------------------------------------------------------------------


def test_a_step_longer_than_the_worker_timeout_keeps_the_loop_turning_while_its_worker_speaks():
    """The systemd watchdog's question (is_turning): a loop awaiting a step for longer than
    the worker timeout is stuck only if the worker went quiet meanwhile."""

    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            h.link.go_on = asyncio.Event()
            (reader,) = h.submit_all([long_request("long", max_new_tokens=2)])
            await h.wait(h.link.holding.wait())
            assert h.loop.is_turning()
            h.clock.now_s += 60.0  # six worker timeouts into the step
            h.link.heard = True  # its worker sends heartbeats
            assert h.loop.is_turning()
            h.link.heard = False  # it went quiet
            assert not h.loop.is_turning()
            h.link.go_on.set()
            assert_exact(await h.wait(reader), long_request("long", max_new_tokens=2))

    scenario(body)


def test_before_any_worker_requests_are_refused_and_after_its_hello_they_are_served():
    async def body() -> None:
        async with running() as h:
            with pytest.raises(Unavailable, match="no worker is connected yet"):
                h.loop.submit(make_request("early"))
            await h.attach("w1")
            requests = contending_requests()
            assert_all_exact(requests, await h.settle(*h.submit_all(requests)))
            assert h.loop.stats.num_preemptions > 0  # the pool was contended
            assert_idle(h.loop)

    scenario(body)


def test_requests_submitted_while_no_worker_is_attached_are_served_after_one_attaches():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            h.link.detach()
            assert await h.next_worker_change() is False
            assert h.loop.worker is None
            requests = contending_requests()
            readers = h.submit_all(requests)
            assert h.loop.stats.num_waiting == len(requests)
            worker = await h.attach("w2")
            assert_all_exact(requests, await h.settle(*readers))
            assert worker.num_steps > 0
            assert_idle(h.loop)

    scenario(body)


# -- detach, re-attach, worker lost mid-step ---------------------------------------------------


def test_a_detach_between_steps_recomputes_on_the_next_worker_and_every_stream_is_exact():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            h.link.detach_after(5)
            requests = contending_requests()
            readers = h.submit_all(requests)
            assert await h.next_worker_change() is False
            assert h.link.num_plans == 5 and h.loop.stats.num_running == 0
            late = make_request("late", 12, max_new_tokens=15)  # queued while detached
            readers += h.submit_all([late])
            second = await h.attach("w2")
            streams = await h.settle(*readers)
            assert_all_exact([*requests, late], streams)
            assert second.num_steps > 0
            assert_idle(h.loop)

    scenario(body)


def test_a_worker_lost_mid_step_requeues_the_step_and_its_requests_finish_with_the_same_tokens():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            h.link.lose_during(4)
            requests = contending_requests()
            readers = h.submit_all(requests)
            assert await h.next_worker_change() is False
            assert h.link.num_plans == 4 and h.loop.stats.num_running == 0
            # The lost step's tokens were sampled by the old worker but never reached the
            # loop: no stream may have them, and the new worker must sample them again.
            await h.attach("w2")
            assert_all_exact(requests, await h.settle(*readers))
            assert_idle(h.loop)

    scenario(body)


# -- cancel ------------------------------------------------------------------------------------


def test_cancel_ends_the_stream_cancelled_and_frees_its_blocks():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            request = long_request("long")
            slot = h.loop.submit(request)
            stream = await h.wait(first_output(slot))
            h.loop.cancel("long")
            stream = await h.wait(read_to_end(h.loop, slot, stream))
            assert stream.finish_reason is FinishReason.CANCELLED
            assert 0 < len(stream.token_ids) < request.stopping.max_new_tokens
            assert_prefix(stream, request)
            assert_idle(h.loop)

    scenario(body)


def test_a_reader_that_leaves_early_cancels_its_request():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            slot = h.loop.submit(long_request("left"))
            await h.wait(first_output(slot))
            h.loop.release(slot)  # the client went away mid-stream
            # A later request runs alone: the cancel was acted on before it was scheduled.
            after = make_request("after", 9, max_new_tokens=6)
            (stream,) = await h.settle(*h.submit_all([after]))
            assert_exact(stream, after)
            assert h.loop.stats.num_requests_finished == 2
            assert_idle(h.loop)

    scenario(body)


# -- drain and the grace period ----------------------------------------------------------------


def test_drain_refuses_new_requests_and_lets_those_in_flight_finish():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            requests = contending_requests()
            readers = h.submit_all(requests)
            h.loop.stop_accepting()
            with pytest.raises(Unavailable, match="draining"):
                h.loop.submit(make_request("refused"))
            await h.wait(h.loop.drain(timeout_s=SCENARIO_LIMIT_S))
            # drain() returns once every stream was read to its end and released.
            assert all(reader.done() for reader in readers)
            assert_all_exact(requests, await h.settle(*readers))
            assert h.loop.draining
            assert_idle(h.loop)

    scenario(body)


def test_drain_cancels_the_requests_still_running_at_its_timeout():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            request = long_request("long")
            slot = h.loop.submit(request)
            stream = await h.wait(first_output(slot))
            reader = asyncio.create_task(read_to_end(h.loop, slot, stream))
            await h.wait(h.loop.drain(timeout_s=0.0))
            assert reader.done()
            stream = reader.result()
            assert stream.finish_reason is FinishReason.CANCELLED
            assert_prefix(stream, request)
            assert_idle(h.loop)

    scenario(body)


def test_past_the_grace_period_without_a_worker_requests_end_unavailable():
    async def body() -> None:
        async with running() as h:
            await h.attach("w1")
            running_request = long_request("running")
            running_slot = h.loop.submit(running_request)
            running_stream = await h.wait(first_output(running_slot))
            h.link.detach()
            assert await h.next_worker_change() is False
            waiting_request = make_request("waiting")  # still within the grace period
            waiting_slot = h.loop.submit(waiting_request)
            h.clock.now_s += GRACE_S + 1.0
            with pytest.raises(Unavailable, match="no worker has been connected for over"):
                h.loop.submit(make_request("refused"))
            running_stream, waiting_stream = await h.settle(
                read_to_end(h.loop, running_slot, running_stream),
                read_to_end(h.loop, waiting_slot),
            )
            for slot, stream in ((running_slot, running_stream), (waiting_slot, waiting_stream)):
                assert stream.finish_reason is FinishReason.ERROR
                assert slot.error_code == "UNAVAILABLE"
            assert_prefix(running_stream, running_request)
            assert waiting_stream.token_ids == []
            assert_idle(h.loop)

    scenario(body)


def test_the_log_says_whether_a_worker_s_requests_speculate():
    """The hello in these tests says nothing of batch invariance: speculation stays off
    unless set, and the attach line says so (and whether steps overlap)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("pagoda.step_loop")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)

    async def body() -> None:
        async with running() as h:
            await h.attach("w1")

    try:
        scenario(body)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    (line,) = [line for line in lines if line.startswith("worker w1: ")]
    assert line.endswith(", no speculation")
