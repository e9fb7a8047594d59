"""What strangers can make the scheduler log is bounded (security review N7)."""

from __future__ import annotations

import asyncio
import logging

import zmq

from pagoda.common import wire
from pagoda.protos import step_pb2
from pagoda.scheduler_svc.log_budget import LogBudget
from tests.unit.test_worker_link import linked, until

NUM_STRANGER_MESSAGES = 2000


def test_a_kind_gets_its_lines_per_interval_then_says_how_many_it_left_out():
    budget = LogBudget(lines_per_interval=2, interval_s=10.0)
    taken = [budget.take("stranger", now_s) for now_s in (0.0, 1.0, 2.0, 3.0, 9.9)]
    assert taken == [0, 0, None, None, None]
    assert budget.take("answer", 5.0) == 0  # kinds are budgeted apart
    assert budget.take("stranger", 10.0) == 3  # a new interval: 3 were left out
    assert budget.take("stranger", 11.0) == 0


def test_a_strangers_flood_of_bad_messages_logs_a_bounded_number_of_lines(tmp_path, caplog):
    events: list[str] = []

    async def scenario() -> None:
        async with linked(tmp_path, events) as (link, context):
            stranger = context.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.connect(link.endpoint)
            for _ in range(NUM_STRANGER_MESSAGES):
                stranger.send_multipart([b"\x04", b"x", b"y"])  # one frame too many
            receiver = next(t for t in link._tasks if t.get_name() == "worker-link-receive")
            await until(
                lambda: sum("ignored" in r.getMessage() for r in caplog.records) > 0,
                "the first message is refused",
            )
            # Past the flood: a well-formed heartbeat is answered (a Rehello to a stranger).
            stranger.send_multipart(wire.encode(step_pb2.Heartbeat()))
            while True:
                answer = wire.decode(await asyncio.to_thread(stranger.recv_multipart))
                if isinstance(answer, step_pb2.Rehello):
                    break
            assert not receiver.done()
            stranger.close()

    with caplog.at_level(logging.WARNING, logger="pagoda.worker_link"):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if r.name == "pagoda.worker_link"]
    assert 1 <= len(lines) <= 20, len(lines)
