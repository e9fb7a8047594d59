"""Lanes in process: two fake workers behind one serving front (data parallel).

Plans cross the same codec and framing as in test_step_loop; each worker is a
plan-checking FakeWorker. Every stream is compared with what the dummy model gives the
request alone, so a token lost or repeated when a worker is lost fails the test.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from pagoda.common import step_codec
from pagoda.protos import step_pb2
from pagoda.scheduler_svc.core import DuplicateRequestError, FinishReason, SchedulerConfig
from pagoda.scheduler_svc.front import Front
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.testing import FakeWorker
from pagoda.scheduler_svc.worker_link import WorkerInfo, WorkerLost
from tests.unit.conftest import LetterDetokenizer, expected_generation, make_hello, make_request
from tests.unit.test_step_loop import (
    HELLO_FIELDS,
    assert_all_exact,
    assert_exact,
    contending_requests,
    domain_plan_of,
    first_output,
    geometry,
    over_the_wire,
    read_to_end,
    result_of,
    scenario,
)


class FleetLink:
    """The link of several fake workers, by identity; one can be lost during a plan."""

    def __init__(self) -> None:
        self.workers: dict[bytes, FakeWorker] = {}
        self.num_plans: dict[bytes, int] = {}
        self.lose_during: tuple[bytes, int] | None = None
        self.lanes: Front | None = None

    def attach(self, name: str) -> None:
        hello = make_hello(incarnation_id=name, **HELLO_FIELDS)
        identity = name.encode()
        self.workers[identity] = FakeWorker(step_codec.geometry_from_hello(hello))
        self.num_plans[identity] = 0
        self.lanes.worker_attached(WorkerInfo(identity=identity, hello=hello))

    def start_step(
        self, plan: step_pb2.StepPlan, timeout_s: float, identity: bytes | None = None
    ) -> asyncio.Future:
        return asyncio.ensure_future(self.run_step(plan, timeout_s, identity))

    async def run_step(
        self, plan: step_pb2.StepPlan, timeout_s: float, identity: bytes | None = None
    ) -> step_pb2.StepResult:
        await asyncio.sleep(0)
        worker = self.workers.get(identity)
        if worker is None:
            raise WorkerLost("no worker attached")
        self.num_plans[identity] += 1
        result = over_the_wire(result_of(worker.step(domain_plan_of(over_the_wire(plan)))))
        if self.lose_during == (identity, self.num_plans[identity]):
            del self.workers[identity]  # as WorkerLink._drop_worker: detach, then fail
            self.lanes.worker_detached("its connection closed", identity)
            raise WorkerLost("its connection closed")
        return result


def make_lanes(link: FleetLink) -> Front:
    lanes = Front(
        SchedulerConfig(),
        link,  # type: ignore[arg-type]
        Metrics(),
        detokenizer_factory=LetterDetokenizer,  # type: ignore[arg-type]
        worker_timeout_s=10.0,
        worker_grace_s=30.0,
        status_interval_s=60.0,
        idle_tick_s=0.01,
    )
    link.lanes = lanes
    return lanes


def many_requests():
    requests = contending_requests()
    return requests + [
        make_request(f"more{i}", 12 + 5 * i, max_new_tokens=15 + 4 * i) for i in range(6)
    ]


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def test_requests_spread_over_two_workers_and_stream_as_alone():
    async def body() -> None:
        link = FleetLink()
        lanes = make_lanes(link)
        task = asyncio.create_task(lanes.run())
        link.attach("a")
        link.attach("b")
        await until(lambda: len(lanes.worker_stats()) == 2)
        requests = many_requests()
        readers = [asyncio.create_task(read_to_end(lanes, lanes.submit(r))) for r in requests]
        streams = await asyncio.gather(*readers)
        for request, stream in zip(requests, streams, strict=True):
            tokens, reason, text = expected_generation(request, geometry())
            assert (stream.token_ids, stream.finish_reason, stream.text) == (tokens, reason, text)
        assert all(n > 0 for n in link.num_plans.values()), link.num_plans
        stats = lanes.stats
        assert stats.num_steps == sum(w.num_steps for w in lanes.worker_stats())
        assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0
        # Per tenant (one here, ""), the lanes' figures added up.
        (tenant,) = lanes.tenant_stats()
        assert tenant.num_requests_finished == len(requests) == stats.num_requests_finished
        assert tenant.num_served_tokens == sum(
            len(stream.token_ids) + len(request.prompt_token_ids)
            for request, stream in zip(requests, streams, strict=True)
        )
        lanes.stop()
        await task

    scenario(body)


def test_a_lost_worker_s_requests_finish_on_the_other_without_loss_or_repeat(caplog):
    async def body() -> None:
        link = FleetLink()
        lanes = make_lanes(link)
        task = asyncio.create_task(lanes.run())
        link.attach("a")
        link.attach("b")
        await until(lambda: len(lanes.worker_stats()) == 2)
        link.lose_during = (b"b", 4)  # mid-stream: b's requests have streamed tokens
        requests = many_requests()
        readers = [asyncio.create_task(read_to_end(lanes, lanes.submit(r))) for r in requests]
        streams = await asyncio.gather(*readers)
        for request, stream in zip(requests, streams, strict=True):
            tokens, reason, text = expected_generation(request, geometry())
            assert (stream.token_ids, stream.finish_reason, stream.text) == (tokens, reason, text)
            assert stream.num_events_after_finish == 0
        assert [w.incarnation_id for w in lanes.worker_stats()] == ["a"]
        assert lanes.worker is not None and lanes.stats.num_kv_blocks_used == 0
        lanes.stop()
        await task

    scenario(body)
    (moved,) = [r.getMessage() for r in caplog.records if "requests moved" in r.getMessage()]
    assert re.search(r"; [1-9]\d* requests moved", moved), moved
    # The lost lane's loop does not say its requests wait for a new worker: they moved.
    (detached,) = [r.getMessage() for r in caplog.records if "worker detached" in r.getMessage()]
    assert detached.endswith("its lane is closed"), detached


def test_an_id_a_lane_still_holds_is_refused_until_its_cancel_is_taken():
    # Review s3 R2: "job-1" left by its client (its cancel waits for lane 1's turn) and a
    # new "job-1" placed on lane 2 shared the id's text state and stream slot: the old
    # CANCELLED end reached the new client and lane 2's next step killed the lanes task.
    async def body() -> None:
        link = FleetLink()
        lanes = make_lanes(link)
        task = asyncio.create_task(lanes.run())
        link.attach("a")
        link.attach("b")
        await until(lambda: len(lanes.worker_stats()) == 2)
        old = make_request("job-1", 8, max_new_tokens=40, ignore_eos=True)
        slot = lanes.submit(old)
        await first_output(slot)
        lanes.release(slot)  # the client left; the cancel waits for its lane's turn
        new = make_request("job-1", [5, 6, 7], max_new_tokens=6, ignore_eos=True)
        with pytest.raises(DuplicateRequestError, match="already in flight"):
            lanes.submit(new)
        await until(lambda: lanes.holder("job-1") is None)
        stream = await read_to_end(lanes, lanes.submit(new))  # the id is free again
        assert_exact(stream, new)
        assert not task.done()
        lanes.stop()
        await task

    scenario(body)


def test_a_cancel_of_an_ended_request_never_reaches_a_new_one_of_its_id_moved_by_a_loss():
    async def body() -> None:
        link = FleetLink()
        lanes = make_lanes(link)
        task = asyncio.create_task(lanes.run())
        link.attach("a")
        link.attach("b")
        await until(lambda: len(lanes.worker_stats()) == 2)
        slot = lanes.submit(make_request("job-1", 8, max_new_tokens=40, ignore_eos=True))
        await first_output(slot)
        lanes.cancel("job-1")
        assert (await read_to_end(lanes, slot)).finish_reason is FinishReason.CANCELLED
        new = make_request("job-1", 9, max_new_tokens=30, ignore_eos=True)
        slot = lanes.submit(new)
        identity = lanes.holder("job-1").identity
        link.lose_during = (identity, link.num_plans[identity] + 2)
        assert_exact(await read_to_end(lanes, slot), new)  # moved, not cancelled again
        assert link.lose_during[0] not in link.workers
        lanes.stop()
        await task

    scenario(body)


def test_a_shared_system_prompt_does_not_pin_every_request_to_one_worker():
    # Review s3 R3: affinity won whatever the load, so once lane 1 had keyed the system
    # prompt every later request queued there (plans {a: 125, b: 0}).
    async def body() -> None:
        link = FleetLink()
        lanes = make_lanes(link)
        task = asyncio.create_task(lanes.run())
        link.attach("a")
        link.attach("b")
        await until(lambda: len(lanes.worker_stats()) == 2)
        system = list(range(10, 18))  # two blocks of 4 shared by every request
        first = make_request("u0", [*system, 60], max_new_tokens=30, ignore_eos=True)
        first_slot = lanes.submit(first)
        first_stream = await first_output(first_slot)  # lane 1 has keyed the system prompt
        requests = [
            make_request(f"u{i}", [*system, 60 + i, 61], max_new_tokens=30, ignore_eos=True)
            for i in range(1, 25)
        ]
        slots = [lanes.submit(request) for request in requests]
        lanes_taken = [lanes.holder(request.request_id).number for request in requests]
        streams = await asyncio.gather(
            read_to_end(lanes, first_slot, first_stream),
            *(read_to_end(lanes, slot) for slot in slots),
        )
        assert_all_exact([first, *requests], streams)
        lanes.stop()
        await task
        # Affinity still counts: lane 1 takes more while its queue is within the gap.
        assert 0 < lanes_taken.count(2) < lanes_taken.count(1), lanes_taken
        assert min(link.num_plans.values()) > 0, link.num_plans

    scenario(body)


def test_metrics_report_each_worker_by_label():
    from prometheus_client import generate_latest

    from pagoda.scheduler_svc.worker_stats import WorkerStats

    metrics = Metrics()
    metrics.watch_workers(
        lambda: [WorkerStats("a", 1, 2, 3, 40, 0.5, 6, 7), WorkerStats("b", 0, 0, 0, 40, 0.0, 9, 1)]
    )
    text = generate_latest(metrics.registry).decode()
    assert 'pagoda_worker_steps{worker="a"} 6.0' in text
    assert 'pagoda_worker_steps{worker="b"} 9.0' in text
    assert 'pagoda_worker_kv_blocks_used{worker="a"} 3.0' in text
