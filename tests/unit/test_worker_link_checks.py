"""The worker link's edge checks: a result that does not match its plan, an absurd hello or
a message of the wrong frame count is refused with a log line and the worker dropped; the
link keeps serving (security review H3 c-f)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pagoda.common import wire
from pagoda.common.step_codec import result_problem
from pagoda.protos import step_pb2
from pagoda.scheduler_svc.worker_link import WorkerLost, hello_problem
from tests.unit.conftest import make_hello
from tests.unit.test_worker_link import attached, linked, say_hello, until

VOCAB = 100


def make_plan() -> step_pb2.StepPlan:
    """Three sequences; 7 and 9 sample, 8 feeds a prompt chunk that does not."""
    return step_pb2.StepPlan(
        step_id=5,
        seq_ids=[7, 8, 9],
        sample=[True, False, True],
        start_positions=[0, 0, 0],
        token_offsets=[0, 1, 2, 3],
        token_ids=[1, 2, 3],
        block_offsets=[0, 1, 2, 3],
        block_ids=[0, 1, 2],
    )


def good_result(**fields) -> step_pb2.StepResult:
    values = dict(step_id=5, seq_ids=[7, 9], token_ids=[4, 5])
    values.update(fields)
    return step_pb2.StepResult(**values)


def test_well_formed_results_pass():
    plan = make_plan()
    assert result_problem(plan, good_result(), VOCAB) is None
    assert result_problem(plan, good_result(seq_ids=[9], token_ids=[99]), VOCAB) is None
    with_top = good_result(
        logprobs=[-0.1, -0.2],
        top_offsets=[0, 2, 3],
        top_token_ids=[4, 6, 5],
        top_logprobs=[-0.1, -3.0, -0.2],
    )
    assert result_problem(plan, with_top, VOCAB) is None
    failed = step_pb2.StepResult(step_id=5, step_error="boom", seq_ids=[1], token_ids=[])
    assert result_problem(plan, failed, VOCAB) is None
    errors = good_result(seq_ids=[7], token_ids=[4])
    errors.errors.add(seq_id=9, message="refused")
    assert result_problem(plan, errors, VOCAB) is None


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [
        ({"seq_ids": [7], "token_ids": []}, "0 token ids for 1 sequences"),
        ({"token_ids": [4]}, "1 token ids for 2"),
        ({"logprobs": [-1.0]}, "1 logprobs for 2"),
        ({"token_ids": [4, VOCAB]}, f"token id {VOCAB} outside the vocabulary"),
        ({"token_ids": [4, 2**32 - 1]}, "outside the vocabulary"),
        ({"seq_ids": [7, 8]}, "sequence 8 sampled, which the plan did not ask"),
        ({"seq_ids": [7, 12345]}, "sequence 12345 sampled"),
        ({"seq_ids": [7, 7]}, "sampled twice"),
        ({"top_offsets": [0, 1]}, "do not line up"),
        ({"top_offsets": [0, 1, 2], "top_token_ids": [1, 2]}, "do not line up"),
        (
            {"top_offsets": [0, 1, 3], "top_token_ids": [1, 2], "top_logprobs": [0.0, 0.0]},
            "do not span",
        ),
        (
            {"top_offsets": [0, 2, 1], "top_token_ids": [1], "top_logprobs": [0.0]},
            "decrease",
        ),
        (
            {"top_offsets": [0, 1, 1], "top_token_ids": [VOCAB], "top_logprobs": [0.0]},
            "outside the vocabulary",
        ),
    ],
)
def test_results_that_do_not_match_their_plan_are_refused(fields, phrase):
    assert phrase in result_problem(make_plan(), good_result(**fields), VOCAB)


def test_an_error_for_a_sequence_not_in_the_plan_is_refused():
    result = good_result()
    result.errors.add(seq_id=77, message="?")
    assert "not schedule" in result_problem(make_plan(), result, VOCAB)


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [
        ({"num_kv_blocks": 2**32 - 1}, "num_kv_blocks 4294967295 is beyond"),
        ({"vocab_size": 2**32 - 1}, "vocab_size 4294967295 is beyond"),
        ({"block_size": 4096}, "block_size 4096 is beyond"),
        ({"max_context_tokens": 2**31}, "max_context_tokens 2147483648 is beyond"),
        ({"model_id": "m" * 257}, "model_id is longer than 256 bytes"),
        ({"incarnation_id": "i" * 10_000}, "incarnation_id is longer"),
        ({"device": "d" * 1000}, "device is longer"),
        ({"eos_token_ids": [1] * 1000}, "more than 256 eos_token_ids"),
    ],
)
def test_absurd_hellos_are_refused(fields, phrase):
    assert phrase in hello_problem(make_hello(**fields))


def test_sane_large_geometry_is_accepted():
    hello = make_hello(
        vocab_size=262_144, num_kv_blocks=500_000, max_context_tokens=1 << 20, model_id="m" * 256
    )
    assert hello_problem(hello) is None


def test_a_mismatched_result_drops_the_worker_and_the_link_serves_on(tmp_path, caplog):
    events: list[str] = []

    async def scenario() -> None:
        async with linked(tmp_path, events) as (link, context):
            worker = say_hello(context, link.endpoint, "w1")
            await until(attached(link, "w1"), "w1 is attached")
            step = asyncio.ensure_future(link.run_step(make_plan(), timeout_s=30))
            while True:  # skip the hello ack; wait for the plan
                message = wire.decode(await asyncio.to_thread(worker.recv_multipart))
                if isinstance(message, step_pb2.StepPlan):
                    break
            worker.send_multipart(wire.encode(good_result(seq_ids=[7], token_ids=[])))
            with pytest.raises(WorkerLost, match="does not match its plan"):
                await step
            assert link.worker is None
            # It may say hello again, and a good result is taken.
            worker.send_multipart(wire.encode(make_hello(incarnation_id="w1")))
            await until(attached(link, "w1"), "w1 is attached again")
            step = asyncio.ensure_future(link.run_step(make_plan(), timeout_s=30))
            while True:
                message = wire.decode(await asyncio.to_thread(worker.recv_multipart))
                if isinstance(message, step_pb2.StepPlan):
                    break
            worker.send_multipart(wire.encode(good_result()))
            assert list((await step).token_ids) == [4, 5]
            worker.close()

    with caplog.at_level(logging.WARNING, logger="pagoda.worker_link"):
        asyncio.run(scenario())
    assert events[:2] == ["attach w1", events[1]] and "0 token ids for 1" in events[1]
    assert events[2] == "attach w1"


def test_extra_frames_and_garbage_drop_the_worker_without_ending_the_link(tmp_path):
    events: list[str] = []

    async def scenario() -> None:
        async with linked(tmp_path, events) as (link, context):
            receiver = next(t for t in link._tasks if t.get_name() == "worker-link-receive")
            worker = say_hello(context, link.endpoint, "w1")
            await until(attached(link, "w1"), "w1 is attached")
            worker.send_multipart([b"\x04"] + [b"x"] * 10_000)
            await until(lambda: link.worker is None, "w1 is dropped for its 10,001 frames")
            worker.send_multipart(wire.encode(make_hello(incarnation_id="w2")))
            await until(attached(link, "w2"), "w2 is attached")
            worker.send_multipart([bytes([step_pb2.RESULT]), b"\xff\xff\xff"])  # truncated
            await until(lambda: link.worker is None, "w2 is dropped for an undecodable result")
            bad = make_hello(incarnation_id="w3", num_kv_blocks=2**32 - 1)
            worker.send_multipart(wire.encode(bad))
            answer = wire.decode(await asyncio.to_thread(worker.recv_multipart))
            while answer.accepted:  # the acks of w1 and w2 come first
                answer = wire.decode(await asyncio.to_thread(worker.recv_multipart))
            assert "num_kv_blocks" in answer.reason and link.worker is None
            worker.send_multipart(wire.encode(make_hello(incarnation_id="w4")))
            await until(attached(link, "w4"), "w4 is attached")
            assert not receiver.done()
            worker.close()

    asyncio.run(scenario())
    assert events[0] == "attach w1" and "got 10001" in events[1]
    assert events[2] == "attach w2" and "malformed" in events[3]
    assert events[4:] == ["attach w4"]


async def acked_worker(link, context, name: str):
    """A worker that said hello, is attached and has read the ack."""
    worker = say_hello(context, link.endpoint, name)
    await until(attached(link, name), f"{name} is attached")
    assert isinstance(wire.decode(worker.recv_multipart()), step_pb2.HelloAck)
    return worker


def test_a_step_outlives_its_timeout_while_the_worker_sends_heartbeats(tmp_path):
    """The step timeout bounds the worker's silence, not the step: a worker whose long
    step goes on saying it is alive (gpu_worker/step_pulse.py) is waited for, for three
    timeouts here, and its result taken; then one that goes quiet is dropped."""
    events: list[str] = []

    async def scenario() -> None:
        async with linked(tmp_path, events) as (link, context):
            worker = await acked_worker(link, context, "w1")
            heartbeat = wire.encode(step_pb2.Heartbeat(incarnation_id="w1"))
            result = link.start_step(make_plan(), timeout_s=1.0)
            assert isinstance(wire.decode(worker.recv_multipart()), step_pb2.StepPlan)
            for _ in range(30):  # 3 s of a step, a heartbeat every 0.1 s
                worker.send_multipart(heartbeat)
                await asyncio.sleep(0.1)
                assert not result.done()
            assert link.heard_within(1.0)
            worker.send_multipart(wire.encode(good_result()))
            assert (await result).token_ids == [4, 5]
            quiet = link.start_step(make_plan(), timeout_s=1.0)
            with pytest.raises(WorkerLost, match="no result for step 5 and no word for 1 s"):
                await quiet
            assert link.worker is None and not link.heard_within(60)
            worker.close()

    asyncio.run(scenario())


def test_start_step_sends_the_plan_before_it_returns_and_a_silent_worker_times_out(tmp_path):
    """The plan leaves before any other task runs (stream writers must not delay it),
    and a worker that never answers is dropped at the step's timeout."""
    events: list[str] = []

    async def scenario() -> None:
        async with linked(tmp_path, events) as (link, context):
            worker = await acked_worker(link, context, "w1")
            result = link.start_step(make_plan(), timeout_s=0.2)
            # No await since: the event loop has not turned, yet the plan is there.
            assert worker.poll(timeout=5_000), "the plan was not sent by start_step"
            assert isinstance(wire.decode(worker.recv_multipart()), step_pb2.StepPlan)
            with pytest.raises(WorkerLost, match="no result for step"):
                await result
            assert link.worker is None
            worker.close()

    asyncio.run(scenario())
