"""WorkerLink over a real ZeroMQ socket: a hello is attached only after every disconnect
event queued before it has been acted on.

A new connection may get the file descriptor of one that just closed, and disconnect
events name connections by fd: an event left for later would drop the new worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq

from pagoda.common import wire
from pagoda.protos import step_pb2
from pagoda.scheduler_svc.worker_link import WorkerInfo, WorkerLink, WorkerLost
from tests.unit.conftest import make_hello

DEADLINE_S = 10.0


class EventLog:
    """WorkerEvents that log attaches and detaches into a list."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def worker_attached(self, info: WorkerInfo) -> None:
        self.events.append(f"attach {info.hello.incarnation_id}")

    def worker_detached(self, reason: str, *, suspect: bool = True) -> None:
        self.events.append(f"detach: {reason}" + ("" if suspect else " (not suspect)"))


def say_hello(context: zmq.Context, endpoint: str, incarnation_id: str) -> zmq.Socket:
    worker = context.socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.connect(endpoint)
    worker.send_multipart(wire.encode(make_hello(incarnation_id=incarnation_id)))
    return worker


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def linked(tmp_path, events: list[str]) -> AsyncIterator[tuple[WorkerLink, zmq.Context]]:
    """A started WorkerLink that logs attaches and detaches into `events`, and a context
    for the test's workers (their sockets die with it)."""
    link = WorkerLink(f"ipc://{tmp_path}/worker.sock")
    await link.start(EventLog(events))
    context = zmq.Context()
    try:
        yield link, context
    finally:
        await link.close()
        context.destroy(linger=0)


def attached(link: WorkerLink, incarnation_id: str) -> Callable[[], bool]:
    return lambda: link.worker is not None and link.worker.hello.incarnation_id == incarnation_id


def test_a_hello_is_attached_after_the_disconnects_queued_before_it(tmp_path):
    events: list[str] = []

    async def scenario() -> None:
        async with linked(tmp_path, events) as (link, context):
            # The hello must win the race against the disconnect watcher: stop the
            # watcher, so the old connection's event is still queued when the hello arrives.
            (watcher,) = [t for t in link._tasks if t.get_name() == "worker-link-disconnects"]
            watcher.cancel()
            monitor = link._monitor
            first = say_hello(context, link.endpoint, "first")
            await until(attached(link, "first"), "the first worker is attached")
            first.close()
            await until(lambda: monitor.get(zmq.EVENTS) & zmq.POLLIN, "its disconnect is queued")
            second = say_hello(context, link.endpoint, "second")  # kept: a dropped socket closes
            await until(attached(link, "second"), "the second worker is attached")
            assert not monitor.get(zmq.EVENTS) & zmq.POLLIN  # no event left to misread
            second.close()

    asyncio.run(scenario())
    assert events == ["attach first", "detach: its connection closed", "attach second"]


def test_each_of_several_workers_on_one_fd_is_dropped_when_its_connection_closes(tmp_path):
    """The watcher alone (no hello racing it) notices every close, fd reused or not."""
    events: list[str] = []

    async def scenario() -> None:
        async with linked(tmp_path, events) as (link, context):
            for name in ("a", "b", "c"):
                worker = say_hello(context, link.endpoint, name)
                await until(attached(link, name), f"worker {name} is attached")
                worker.close()
                await until(lambda: link.worker is None, f"worker {name} is dropped")

    asyncio.run(scenario())
    closed = "detach: its connection closed"
    assert events == ["attach a", closed, "attach b", closed, "attach c", closed]


def test_a_goodbye_loses_the_steps_in_flight_without_suspecting_their_requests(tmp_path):
    """A worker stopped on purpose answers the plan it was running, then says goodbye:
    the plan it never started fails as not suspect, so its requests are only recomputed
    (not run alone each); a goodbye that names another incarnation is ignored, and the
    close that follows a goodbye is no second loss."""
    events: list[str] = []

    async def scenario() -> None:
        async with linked(tmp_path, events) as (link, context):
            worker = say_hello(context, link.endpoint, "w1")
            await until(attached(link, "w1"), "w1 is attached")
            plan = step_pb2.StepPlan(
                step_id=1,
                seq_ids=[7],
                sample=[True],
                start_positions=[0],
                token_offsets=[0, 1],
                token_ids=[1],
                block_offsets=[0, 1],
                block_ids=[0],
            )
            step = link.start_step(plan, timeout_s=30)
            while not isinstance(
                wire.decode(await asyncio.to_thread(worker.recv_multipart)), step_pb2.StepPlan
            ):
                pass  # the hello ack
            (peer,) = link._peers.values()
            seen_s = peer.last_seen_s
            forged = step_pb2.Goodbye(incarnation_id="someone else", reason="SIGTERM")
            worker.send_multipart(wire.encode(forged))
            await until(lambda: peer.last_seen_s > seen_s, "the forged goodbye is read")
            assert attached(link, "w1")() and not step.done()
            goodbye = step_pb2.Goodbye(incarnation_id="w1", reason="SIGTERM")
            worker.send_multipart(wire.encode(goodbye))
            with pytest.raises(WorkerLost) as lost:
                await step
            assert not lost.value.suspect
            worker.close()
            # The next hello is attached only after the close's disconnect is acted on.
            second = say_hello(context, link.endpoint, "w2")
            await until(attached(link, "w2"), "w2 is attached")
            second.close()

    asyncio.run(scenario())
    assert events == ["attach w1", "detach: it stopped (SIGTERM) (not suspect)", "attach w2"]


def test_a_goodbye_read_after_its_connection_closed_still_clears_the_worker(tmp_path):
    """The close that follows a goodbye may be noticed first (its disconnect event, or a
    plan that cannot be sent): the worker is then dropped only once the messages waiting
    to be read are read, so the goodbye still decides that its requests are not suspect."""
    events: list[str] = []

    async def scenario() -> None:
        async with linked(tmp_path, events) as (link, context):
            (watcher,) = [t for t in link._tasks if t.get_name() == "worker-link-disconnects"]
            watcher.cancel()  # the test acts on the disconnect itself, at a chosen moment
            worker = say_hello(context, link.endpoint, "w1")
            await until(attached(link, "w1"), "w1 is attached")
            worker.send_multipart(wire.encode(step_pb2.Goodbye(incarnation_id="w1")))
            worker.close()
            # Without yielding to the event loop, so the link has read neither yet:
            deadline = time.monotonic() + DEADLINE_S
            while not (
                link._socket.get(zmq.EVENTS) & zmq.POLLIN
                and link._monitor.get(zmq.EVENTS) & zmq.POLLIN
            ):
                assert time.monotonic() < deadline, "the goodbye and the close never arrived"
                time.sleep(0.01)
            link._take_disconnects()
            assert attached(link, "w1")()  # not yet: a message is waiting
            await until(lambda: link.worker is None, "w1 is dropped")

    asyncio.run(scenario())
    assert events == ["attach w1", "detach: it stopped (no reason given) (not suspect)"]
