"""A fake worker on the real scheduler's link: between good results it sends results that do
not match their plans, absurd hellos, truncated protobuf and many-framed messages. Each bad
message drops it (it says hello again) and costs its step a recompute; the scheduler never
exits, and the real dummy worker then finishes every stream exactly (security review H3)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import zmq

from pagoda.common import wire
from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.protos import generation_pb2, step_pb2
from tests.e2e.conftest import running_service, stop_process, wait_serving, wait_until
from tests.e2e.test_dummy_service import VOCAB_SIZE, dummy_continuation, many_streams, prompts

pytestmark = pytest.mark.slow

NUM_BAD_MESSAGES = 40
# Long enough that the streams outlast the fake worker, whose good results advance them.
NUM_NEW_TOKENS = 400


def fake_hello(**fields) -> step_pb2.Hello:
    values = dict(
        protocol_version=wire.PROTOCOL_VERSION,
        incarnation_id="fake",
        model_id="fake",
        vocab_size=VOCAB_SIZE,
        eos_token_ids=[2],
        max_context_tokens=8192,
        block_size=16,
        num_kv_blocks=512,
        max_logprobs=20,
    )
    values.update(fields)
    return step_pb2.Hello(**values)


def good_result(plan: step_pb2.StepPlan) -> step_pb2.StepResult:
    """What the dummy worker would answer."""
    result = step_pb2.StepResult(step_id=plan.step_id)
    offsets = plan.token_offsets
    for i, seq_id in enumerate(plan.seq_ids):
        if plan.sample[i]:
            last_position = plan.start_positions[i] + offsets[i + 1] - offsets[i] - 1
            result.seq_ids.append(seq_id)
            result.token_ids.append(
                dummy_next_token(plan.token_ids[offsets[i + 1] - 1], last_position, VOCAB_SIZE)
            )
    return result


def bad_message(plan: step_pb2.StepPlan, rng: random.Random) -> list[bytes]:
    """The frames of one malformed answer to `plan`."""
    result = good_result(plan)
    sampled = list(result.seq_ids)
    choice = rng.randrange(9)
    if choice == 0:  # one token short (zip(strict=True) in apply raised ValueError)
        del result.token_ids[-1]
    elif choice == 1:
        result.token_ids[0] = VOCAB_SIZE + rng.randrange(1 << 20)
    elif choice == 2:
        result.seq_ids[0] = max(plan.seq_ids) + 1 + rng.randrange(1000)
    elif choice == 3:
        result.seq_ids.append(sampled[0])
        result.token_ids.append(5)
    elif choice == 4:
        result.logprobs.extend([0.0] * (len(sampled) + 1))
    elif choice == 5:
        result.top_offsets.extend([0, 3])
        result.top_token_ids.extend([1])
    elif choice == 6:  # truncated protobuf
        return [bytes([step_pb2.RESULT]), result.SerializeToString()[:-1] + b"\xff"]
    elif choice == 7:  # many frames
        return [*wire.encode(result), *([b"x" * 64] * rng.randint(1, 5000))]
    else:
        return [rng.randbytes(rng.randint(0, 3)) for _ in range(rng.randint(0, 4))] or [b""]
    return wire.encode(result)


def run_fake_worker(endpoint: str, stop: threading.Event, outcome: dict) -> None:
    rng = random.Random(14)
    context = zmq.Context()
    try:
        worker = context.socket(zmq.DEALER)
        worker.setsockopt(zmq.LINGER, 0)
        worker.connect(endpoint)
        worker.send_multipart(wire.encode(fake_hello()))
        deadline = time.monotonic() + 120
        while outcome["bad"] < NUM_BAD_MESSAGES and not stop.is_set():
            assert time.monotonic() < deadline, "the fake worker got too few plans"
            if not worker.poll(200):
                continue
            message = wire.decode(worker.recv_multipart())
            if isinstance(message, step_pb2.HelloAck):
                outcome["refused" if not message.accepted else "acks"] += 1
            elif isinstance(message, step_pb2.Rehello):
                worker.send_multipart(wire.encode(fake_hello()))
            elif isinstance(message, step_pb2.StepPlan):
                outcome["plans"] += 1
                if rng.random() < 0.4:
                    worker.send_multipart(wire.encode(good_result(message)))
                    continue
                if rng.random() < 0.3:  # an absurd hello first: refused, changes nothing
                    absurd = rng.choice(
                        [
                            {"num_kv_blocks": 2**32 - 1},
                            {"vocab_size": 2**32 - 1},
                            {"block_size": 1 << 20},
                            {"max_context_tokens": 2**32 - 1},
                            {"model_id": "m" * 100_000},
                        ]
                    )
                    worker.send_multipart(wire.encode(fake_hello(**absurd)))
                worker.send_multipart(bad_message(message, rng))
                outcome["bad"] += 1
                # Dropped for it; say hello again, as a restarted worker would.
                worker.send_multipart(wire.encode(fake_hello()))
        worker.close()
    except BaseException as exc:  # reported by the test
        outcome["error"] = exc
    finally:
        context.destroy(linger=0)


def test_a_fake_worker_sending_garbage_never_stops_the_scheduler(tmp_path):
    with running_service(
        tmp_path, model="dummy", scheduler_args=["--worker-grace-s", "600"]
    ) as service:
        stop_process(service.worker)
        wait_until(lambda: not service.stats().worker_connected, 30, "the real worker to go")
        stop = threading.Event()
        outcome = {"bad": 0, "plans": 0, "acks": 0, "refused": 0}
        fake = threading.Thread(target=run_fake_worker, args=(service.endpoint, stop, outcome))
        fake.start()
        try:
            wait_until(
                lambda: service.stats().worker_incarnation_id == "fake", 60, "the fake to attach"
            )
            batch = prompts(6)
            results: list = []
            streams = threading.Thread(
                target=lambda: results.extend(
                    asyncio.run(many_streams(service.address, batch, NUM_NEW_TOKENS))
                )
            )
            streams.start()
            fake.join(timeout=180)
        finally:
            stop.set()
            fake.join()
        assert "error" not in outcome, outcome
        assert outcome["bad"] == NUM_BAD_MESSAGES, outcome
        assert outcome["refused"] > 0, outcome  # the absurd hellos
        assert service.scheduler.poll() is None, "the scheduler exited on a bad worker message"
        service.start_worker()
        streams.join(timeout=300)
        assert not streams.is_alive()
        for prompt_ids, (tokens, finish) in zip(batch, results, strict=True):
            assert finish == generation_pb2.LENGTH
            assert tokens == dummy_continuation(prompt_ids, NUM_NEW_TOKENS)
        wait_serving(service.address, [service.scheduler, service.worker])
        log = (tmp_path / "scheduler.log").read_text()
        assert "does not match its plan" in log and "expected 2 frames" in log
        assert "is beyond the bound" in log
