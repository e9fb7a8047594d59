"""WorkerLink with several workers (--max-workers above 1): each attaches by its own
identity, a detach names its worker, and a worker beyond the limit or serving another
model is refused with a reason."""

from __future__ import annotations

import asyncio
import time

import zmq

from pagoda.common import wire
from pagoda.protos import step_pb2
from pagoda.scheduler_svc.worker_link import WorkerInfo, WorkerLink
from tests.unit.conftest import make_hello
from tests.unit.test_worker_link import until


class FleetLog:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.names: dict[bytes, str] = {}

    def worker_attached(self, info: WorkerInfo) -> None:
        self.names[info.identity] = info.hello.incarnation_id
        self.events.append(f"attach {info.hello.incarnation_id}")

    def worker_detached(self, reason: str, identity: bytes, *, suspect: bool = True) -> None:
        self.events.append(f"detach {self.names[identity]}")


def hello_from(context: zmq.Context, endpoint: str, **fields) -> zmq.Socket:
    worker = context.socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.connect(endpoint)
    worker.send_multipart(wire.encode(make_hello(**fields)))
    return worker


def ack_of(worker: zmq.Socket) -> step_pb2.HelloAck:
    assert worker.poll(10_000), "no answer to the hello"
    message = wire.decode(worker.recv_multipart())
    assert isinstance(message, step_pb2.HelloAck)
    return message


def test_workers_attach_side_by_side_up_to_the_limit_and_of_one_model(tmp_path):
    log = FleetLog()
    acks: dict[str, step_pb2.HelloAck] = {}

    async def scenario() -> None:
        link = WorkerLink(f"ipc://{tmp_path}/worker.sock", max_workers=2)
        await link.start(log)
        context = zmq.Context()
        try:
            a = hello_from(context, link.endpoint, incarnation_id="a")
            await until(lambda: len(link.workers) == 1, "a is attached")
            other = hello_from(context, link.endpoint, incarnation_id="x", model_id="other")
            acks["other"] = await asyncio.to_thread(ack_of, other)
            b = hello_from(context, link.endpoint, incarnation_id="b")
            await until(lambda: len(link.workers) == 2, "b is attached beside a")
            c = hello_from(context, link.endpoint, incarnation_id="c")
            acks["c"] = await asyncio.to_thread(ack_of, c)
            a.close()
            await until(lambda: len(link.workers) == 1, "a is dropped")
            assert [w.hello.incarnation_id for w in link.workers] == ["b"]
            b.close()
            await until(lambda: not link.workers, "b is dropped")
        finally:
            await link.close()
            context.destroy(linger=0)

    asyncio.run(scenario())
    assert log.events == ["attach a", "attach b", "detach a", "detach b"]
    assert not acks["c"].accepted and "--max-workers" in acks["c"].reason
    assert not acks["other"].accepted and "same model" in acks["other"].reason


def test_a_gone_worker_is_dropped_within_a_read_budget_while_others_keep_talking(tmp_path):
    """A worker found gone waits for the messages queued before it to be read (a goodbye
    may be among them), but another worker's steady traffic, which keeps something
    always waiting, must not keep it attached: it goes within GONE_READ_BUDGET reads."""
    from pagoda.scheduler_svc.worker_link import GONE_READ_BUDGET

    log = FleetLog()
    reads_at_drop: list[int] = []

    async def scenario() -> None:
        link = WorkerLink(f"ipc://{tmp_path}/worker.sock", max_workers=2)
        await link.start(log)
        reads = 0
        dispatch = link._dispatch

        async def counting_dispatch(*args):
            nonlocal reads
            reads += 1
            await dispatch(*args)

        link._dispatch = counting_dispatch
        detached = log.worker_detached

        def note_drop(reason, identity, *, suspect=True):
            reads_at_drop.append(reads)
            detached(reason, identity, suspect=suspect)

        log.worker_detached = note_drop
        context = zmq.Context()
        try:
            a = hello_from(context, link.endpoint, incarnation_id="a")
            await until(lambda: len(link.workers) == 1, "a is attached")
            b = hello_from(context, link.endpoint, incarnation_id="b")
            await until(lambda: len(link.workers) == 2, "b is attached beside a")
            beat = wire.encode(step_pb2.Heartbeat(incarnation_id="b"))
            for _ in range(4 * GONE_READ_BUDGET):  # queued without yielding: never drained
                b.send_multipart(beat)
            deadline = time.monotonic() + 10
            while not link._socket.get(zmq.EVENTS) & zmq.POLLIN:  # without yielding: unread
                assert time.monotonic() < deadline, "the heartbeats never arrived"
                time.sleep(0.01)
            counted = reads
            (identity_a,) = [i for i, name in log.names.items() if name == "a"]
            link._drop_when_read(identity_a, "its connection closed")
            assert len(link.workers) == 2  # deferred: messages are waiting
            await until(lambda: len(link.workers) == 1, "a is dropped")
            assert reads_at_drop[0] - counted <= GONE_READ_BUDGET
            a.close()
            b.close()
        finally:
            await link.close()
            context.destroy(linger=0)

    asyncio.run(scenario())
    assert log.events == ["attach a", "attach b", "detach a"]
