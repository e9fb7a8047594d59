"""Every step-protocol message survives encode -> frames -> decode unchanged."""

from __future__ import annotations

import pytest

from pagoda.common import dummy_tokens, wire
from pagoda.protos import step_pb2


def _hello() -> step_pb2.Hello:
    return step_pb2.Hello(
        protocol_version=wire.PROTOCOL_VERSION,
        incarnation_id="w-1",
        model_id="tiny",
        vocab_size=512,
        eos_token_ids=[2, 7],
        max_context_tokens=256,
        block_size=16,
        num_kv_blocks=64,
        device="cpu",
        dtype="float32",
        max_logprobs=20,
    )


def _plan() -> step_pb2.StepPlan:
    plan = step_pb2.StepPlan(step_id=42)
    plan.new_sequences.add(
        seq_id=7,
        sampling=step_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=123),
        cached_token_ids=[1, 2, 3],
        num_prompt_tokens=20,
    )
    plan.seq_ids.extend([7, 8])
    plan.start_positions.extend([16, 30])
    plan.sample.extend([True, False])
    plan.token_offsets.extend([0, 4, 5])
    plan.token_ids.extend([10, 11, 12, 13, 99])
    plan.block_offsets.extend([0, 1, 1])
    plan.block_ids.extend([5])
    plan.forget_seq_ids.extend([3])
    return plan


def _result() -> step_pb2.StepResult:
    result = step_pb2.StepResult(step_id=42, forward_ms=1.5, sample_ms=0.25, total_ms=2.0)
    result.seq_ids.extend([7])
    result.token_ids.extend([301])
    result.logprobs.extend([-0.5])
    result.top_offsets.extend([0, 2])
    result.top_token_ids.extend([301, 17])
    result.top_logprobs.extend([-0.5, -1.25])
    result.errors.add(seq_id=8, message="block id 999 out of range")
    return result


MESSAGES = {
    "hello": _hello,
    "hello_ack": lambda: step_pb2.HelloAck(
        accepted=True, protocol_version=1, scheduler_incarnation_id="s-1"
    ),
    "hello_refused": lambda: step_pb2.HelloAck(accepted=False, reason="unknown version 9"),
    "plan": _plan,
    "result": _result,
    "failed_result": lambda: step_pb2.StepResult(step_id=3, step_error="RuntimeError: boom"),
    "heartbeat": lambda: step_pb2.Heartbeat(incarnation_id="w-1"),
    "rehello": lambda: step_pb2.Rehello(reason="unknown worker"),
}


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_round_trip(name):
    message = MESSAGES[name]()
    frames = wire.encode(message)
    assert len(frames) == 2 and len(frames[0]) == 1
    decoded = wire.decode(frames)
    assert type(decoded) is type(message)
    assert decoded == message


def test_every_kind_has_a_message():
    kinds = {v.number for v in step_pb2.Kind.DESCRIPTOR.values if v.number}
    assert kinds == set(wire.MESSAGE_OF_KIND)


@pytest.mark.parametrize(
    "frames, match",
    [
        ([b"\x03"], "expected 2 frames"),
        ([b"\x03", b"x", b"y"], "expected 2 frames"),
        ([b"\x63", b""], "unknown frame kind"),
        ([b"", b""], "unknown frame kind"),
        ([b"\x03\x03", b""], "unknown frame kind"),
        ([b"\x03", b"\xff\xff\xff"], "undecodable StepPlan"),
    ],
)
def test_malformed_frames_raise_frame_error(frames, match):
    with pytest.raises(wire.FrameError, match=match):
        wire.decode(frames)


def test_dummy_tokens_stay_in_the_vocabulary():
    assert all(
        0 <= dummy_tokens.dummy_next_token(t, p, 512) < 512 for t in range(600) for p in (0, 9)
    )
