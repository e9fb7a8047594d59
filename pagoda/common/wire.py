"""Framing of the step protocol: a one-byte kind frame, then the protobuf bytes.

Shared by pagoda.scheduler_svc.worker_link and pagoda.gpu_worker.server so both sides agree on
the kinds and the version by construction. Never pickle.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError, Message

from pagoda.protos import step_pb2

PROTOCOL_VERSION = 7

# Largest frame either side accepts; a 1024-sequence plan with 8k-token prompt
# chunks stays far below it.
MAX_FRAME_BYTES = 64 * 1024 * 1024

MESSAGE_OF_KIND: dict[int, type[Message]] = {
    step_pb2.HELLO: step_pb2.Hello,
    step_pb2.HELLO_ACK: step_pb2.HelloAck,
    step_pb2.PLAN: step_pb2.StepPlan,
    step_pb2.RESULT: step_pb2.StepResult,
    step_pb2.HEARTBEAT: step_pb2.Heartbeat,
    step_pb2.REHELLO: step_pb2.Rehello,
    step_pb2.GOODBYE: step_pb2.Goodbye,
    step_pb2.MASKS: step_pb2.StepMasks,
}
KIND_OF_MESSAGE: dict[type[Message], int] = {cls: kind for kind, cls in MESSAGE_OF_KIND.items()}


class FrameError(ValueError):
    """A multipart message that is not a well-formed step-protocol frame."""


def encode(message: Message) -> list[bytes]:
    """The two frames of `message`: its kind byte and its serialized bytes."""
    return [bytes([KIND_OF_MESSAGE[type(message)]]), message.SerializeToString()]


def decode(frames: list[bytes]) -> Message:
    """Parse two frames back into a message; FrameError for anything malformed."""
    if len(frames) != 2:
        raise FrameError(f"expected 2 frames (kind, body), got {len(frames)}")
    kind_frame, body = frames
    if len(kind_frame) != 1 or kind_frame[0] not in MESSAGE_OF_KIND:
        raise FrameError(f"unknown frame kind {kind_frame[:4]!r}")
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    message = MESSAGE_OF_KIND[kind_frame[0]]()
    try:
        message.ParseFromString(body)
    except DecodeError as exc:
        raise FrameError(f"undecodable {message.DESCRIPTOR.name}: {exc}") from exc
    return message
