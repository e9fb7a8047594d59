"""Masks that follow their plan (StepPlan.masks_follow, step.proto's StepMasks): the engine
waits for them only to sample, after its forward, and samples each named sequence under
its mask; a row the masks do not name samples unconstrained; masks that do not fit, or
never come, fail the step instead of hanging it. The worker's server receives them
while the engine waits, keeping every other message for its loop, in order."""

from __future__ import annotations

import pytest
import zmq

from pagoda.common import step_codec, wire
from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.common.step import StepMasks
from pagoda.gpu_worker import dummy_engine
from pagoda.gpu_worker.dummy_engine import DUMMY_VOCAB_SIZE, DummyEngine
from pagoda.gpu_worker.sequence_table import allowed_token_mask_bytes
from pagoda.gpu_worker.server import MasksNotComing, WorkerServer
from pagoda.protos import step_pb2
from tests.worker.conftest import run_plan
from tests.worker.test_server import plan_of

MASK_BYTES = allowed_token_mask_bytes(DUMMY_VOCAB_SIZE)


def only(token_id: int) -> bytes:
    """A bitmask that allows `token_id` alone (the process test is in test_server.py)."""
    mask = bytearray(MASK_BYTES)
    mask[token_id // 8] |= 1 << (token_id % 8)
    return bytes(mask)


def two_prefills(step_id: int = 1, *, masks_follow: bool = False) -> step_pb2.StepPlan:
    plan = plan_of(
        step_id, [(1, 0, [11, 12, 13], [0]), (2, 0, [21, 22], [1])], new=[(1, 3), (2, 2)]
    )
    plan.masks_follow = masks_follow
    return plan


def test_the_engine_waits_after_its_forward_and_samples_under_the_masks(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(dummy_engine.time, "sleep", lambda s: events.append("forward"))
    engine = DummyEngine(step_ms=20.0)

    def wait_masks(step_id: int) -> StepMasks:
        events.append(f"masks of {step_id}")
        # Sequence 1 under a mask, 2 not named (it samples unconstrained), 9 refused.
        return StepMasks(step_id, [9, 1], only(4321) + only(4321))

    engine.wait_masks = wait_masks
    plan = two_prefills(5, masks_follow=True)
    plan.seq_ids.append(9)  # unknown: refused at admit, its mask skipped
    plan.start_positions.append(0)
    plan.sample.append(True)
    plan.token_ids.append(1)
    plan.token_offsets.append(len(plan.token_ids))
    plan.block_offsets.append(len(plan.block_ids))
    result = run_plan(engine, plan)
    assert events == ["forward", "masks of 5"]
    assert list(result.seq_ids) == [1, 2] and "unknown sequence 9" in result.errors[0].message
    assert list(result.token_ids) == [4321, dummy_next_token(22, 1, DUMMY_VOCAB_SIZE)]


def test_no_wait_without_masks_that_follow():
    engine = DummyEngine()
    engine.wait_masks = lambda step_id: pytest.fail("waited for masks that do not follow")
    result = run_plan(engine, two_prefills())
    assert not result.step_error and len(result.token_ids) == 2


@pytest.mark.parametrize(
    ("wait_masks", "phrase"),
    [
        (None, "nothing brings them"),
        (lambda step_id: StepMasks(step_id, [1], b"\0" * 12), "hold 12 bytes for 1 sequences"),
        (lambda step_id: (_ for _ in ()).throw(MasksNotComing("did not come")), "did not come"),
    ],
)
def test_masks_that_do_not_fit_or_never_come_fail_the_step(wait_masks, phrase):
    engine = DummyEngine()
    engine.wait_masks = wait_masks
    result = run_plan(engine, two_prefills(masks_follow=True))
    assert phrase in result.step_error
    assert len(engine.table) == 0  # forgotten: the scheduler recomputes them


@pytest.fixture
def wired_server(tmp_path):
    """A WorkerServer whose socket is a DEALER connected to the test's ROUTER (no run())."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/w.sock"
    router.bind(endpoint)
    server = WorkerServer(DummyEngine(), endpoint)
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    server._socket = dealer
    dealer.send_multipart(wire.encode(step_pb2.Heartbeat(incarnation_id="x")))
    identity, *_ = router.recv_multipart()

    def send(message) -> None:
        router.send_multipart([identity, *wire.encode(message)])

    yield server, send
    dealer.close(linger=0)
    router.close(linger=0)
    context.term()


def test_the_server_keeps_other_messages_for_its_loop_while_it_waits(wired_server):
    server, send = wired_server
    later_plan = plan_of(8, [(3, 0, [1, 2], [2])], new=[(3, 2)])
    send(later_plan)
    send(step_codec.encode_masks(StepMasks(6, [1], only(7))))  # a step not waited for
    send(step_codec.encode_masks(StepMasks(7, [1], only(5))))
    masks = server.wait_masks(7)
    assert masks == StepMasks(7, [1], only(5))
    assert [wire.decode(frames) for frames in server._deferred] == [later_plan]


def test_masks_that_never_come_end_the_wait(wired_server):
    server, send = wired_server
    server.masks_timeout_s = 0.2
    with pytest.raises(MasksNotComing, match="did not come within 0.2 s"):
        server.wait_masks(3)
    send(step_pb2.Rehello(reason="unknown worker"))
    server.masks_timeout_s = 60.0
    with pytest.raises(MasksNotComing, match="new hello"):
        server.wait_masks(4)  # at once: a scheduler that does not know us sends none
    assert isinstance(wire.decode(server._deferred[0]), step_pb2.Rehello)  # for the loop
