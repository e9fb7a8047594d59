"""Real worker processes driven over real ZeroMQ by the test's own ROUTER socket."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from pagoda.common import wire
from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.gpu_worker.dummy_engine import DUMMY_VOCAB_SIZE
from pagoda.gpu_worker.server import prepare_endpoint
from pagoda.protos import step_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0  # importing torch + transformers on a slow CI machine
REPLY_TIMEOUT_S = 30.0


class FakeScheduler:
    """The scheduler's end: a bound ROUTER; receives with Poller timeouts, never sleeps."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.identity: bytes | None = None

    def receive(self, kind: type, timeout_s: float = REPLY_TIMEOUT_S):
        """The next message of `kind`, skipping others (heartbeats, repeated hellos)."""
        deadline_s = time.monotonic() + timeout_s
        while (remaining_s := deadline_s - time.monotonic()) > 0:
            if not self.poller.poll(int(remaining_s * 1000) + 1):
                break
            identity, *frames = self.socket.recv_multipart()
            self.identity = identity
            message = wire.decode(frames)
            if isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def send(self, message) -> None:
        self.send_frames(wire.encode(message))

    def send_frames(self, frames: list[bytes]) -> None:
        assert self.identity is not None, "the worker has not spoken yet"
        self.socket.send_multipart([self.identity, *frames])

    def step(self, plan: step_pb2.StepPlan) -> step_pb2.StepResult:
        self.send(plan)
        result = self.receive(step_pb2.StepResult)
        assert result.step_id == plan.step_id
        return result

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


class WorkerProcess:
    def __init__(self, args: list[str], log_file) -> None:
        self.log_path = Path(log_file.name)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagoda.gpu_worker", "--log-level", "DEBUG", *args],
            cwd=REPO_ROOT,
            stdout=log_file,  # a file, not a pipe: a full pipe would block the worker
            stderr=subprocess.STDOUT,
        )

    def wait(self, timeout_s: float = 10.0) -> int:
        return self.process.wait(timeout=timeout_s)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def endpoint(tmp_path) -> str:
    return f"ipc://{tmp_path}/sock/w.sock"  # the worker creates the parent directory


@pytest.fixture
def start_worker(tmp_path):
    started: list[WorkerProcess] = []
    with contextlib.ExitStack() as logs:

        def start(*args: str) -> WorkerProcess:
            log_file = logs.enter_context(open(tmp_path / f"worker-{len(started)}.log", "wb"))
            worker = WorkerProcess(list(args), log_file)
            started.append(worker)
            return worker

        yield start
        for worker in started:
            worker.stop()


@pytest.fixture
def scheduler(endpoint, tmp_path):
    (tmp_path / "sock").mkdir(mode=0o700)
    fake = FakeScheduler(endpoint)
    yield fake
    fake.close()


def plan_of(step_id, entries, new=(), forget=()) -> step_pb2.StepPlan:
    """entries: (seq_id, start, tokens, new_block_ids)."""
    plan = step_pb2.StepPlan(step_id=step_id, forget_seq_ids=list(forget))
    for seq_id, num_prompt_tokens in new:
        plan.new_sequences.add(seq_id=seq_id, num_prompt_tokens=num_prompt_tokens)
    if entries:
        plan.token_offsets.append(0)
        plan.block_offsets.append(0)
    for seq_id, start, tokens, blocks in entries:
        plan.seq_ids.append(seq_id)
        plan.start_positions.append(start)
        plan.sample.append(True)
        plan.token_ids.extend(tokens)
        plan.token_offsets.append(len(plan.token_ids))
        plan.block_ids.extend(blocks)
        plan.block_offsets.append(len(plan.block_ids))
    return plan


def accept(scheduler: FakeScheduler, incarnation: str = "scheduler-1") -> None:
    scheduler.send(
        step_pb2.HelloAck(
            accepted=True,
            protocol_version=wire.PROTOCOL_VERSION,
            scheduler_incarnation_id=incarnation,
        )
    )


def rehello(scheduler: FakeScheduler) -> None:
    """What a scheduler that does not know the worker answers: say hello again."""
    scheduler.send(step_pb2.Rehello(reason="unknown worker"))
    scheduler.receive(step_pb2.Hello)


@pytest.fixture(scope="module")
def diversified_llama_dir(llama_models, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama-diversified")
    llama_models.reference.save_pretrained(directory)
    return directory


def test_paged_worker_conversation(
    scheduler, start_worker, endpoint, llama_models, diversified_llama_dir
):
    worker = start_worker(
        "--model", str(diversified_llama_dir), "--zmq-endpoint", endpoint,
        "--num-kv-blocks", "64", "--block-size", "4", "--quantization", "none",
    )  # fmt: skip
    hello = scheduler.receive(step_pb2.Hello, STARTUP_TIMEOUT_S)
    assert hello.protocol_version == wire.PROTOCOL_VERSION
    assert hello.model_id == str(diversified_llama_dir)
    assert (hello.vocab_size, list(hello.eos_token_ids)) == (512, [2])
    assert (hello.max_context_tokens, hello.block_size, hello.num_kv_blocks) == (256, 4, 64)
    assert (hello.device, hello.dtype, hello.max_logprobs) == ("cpu", "float32", 20)
    assert hello.quantization == "none"
    assert hello.incarnation_id
    again = scheduler.receive(step_pb2.Hello, 5)  # repeated until acknowledged
    assert again.incarnation_id == hello.incarnation_id
    accept(scheduler)

    prompts = {1: [5, 6, 7, 8, 9, 10], 2: [300, 301, 302]}
    expected = {seq_id: llama_models.greedy(p, 5) for seq_id, p in prompts.items()}
    result = scheduler.step(
        plan_of(1, [(1, 0, prompts[1], [10, 11]), (2, 0, prompts[2], [12])], new=[(1, 6), (2, 3)])
    )
    assert not result.step_error and list(result.seq_ids) == [1, 2]
    generated = {1: [result.token_ids[0]], 2: [result.token_ids[1]]}
    for step_id in range(2, 5):
        entries = []
        for seq_id, tokens in generated.items():
            position = len(prompts[seq_id]) + len(tokens) - 1
            blocks = [20 + seq_id * 4 + position // 4] if position % 4 == 0 else []
            entries.append((seq_id, position, [tokens[-1]], blocks))
        result = scheduler.step(plan_of(step_id, entries))
        for seq_id, token_id in zip(result.seq_ids, result.token_ids, strict=True):
            generated[seq_id].append(token_id)
    assert generated == {seq_id: tokens[:4] for seq_id, tokens in expected.items()}

    # A bad plan: an unknown sequence and an out-of-range block are refused, seq 1 runs.
    position = len(prompts[1]) + 3
    bad = plan_of(
        5,
        [(99, 0, [5], [0]), (3, 0, [5, 6], [64]), (1, position, [generated[1][-1]], [])],
        new=[(3, 2)],
    )
    result = scheduler.step(bad)
    assert list(result.seq_ids) == [1]
    assert list(result.token_ids) == [expected[1][4]]
    assert {e.seq_id for e in result.errors} == {99, 3}

    # Malformed frames are logged and skipped; the worker keeps answering.
    scheduler.send_frames([bytes([step_pb2.PLAN]), b"\xff\xff\xff not protobuf"])
    scheduler.send_frames([b"\x63", b""])
    scheduler.send_frames([b"only one frame"])
    result = scheduler.step(plan_of(6, [], forget=[1]))
    assert not result.step_error
    result = scheduler.step(plan_of(7, [(1, position + 1, [5], [])]))
    assert "unknown sequence 1" in result.errors[0].message

    scheduler.receive(step_pb2.Heartbeat, 5)  # idle: heartbeats
    scheduler.send(step_pb2.Rehello(reason="test"))
    assert scheduler.receive(step_pb2.Hello, 5).incarnation_id == hello.incarnation_id

    worker.process.send_signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert "malformed" in worker.log


def test_dummy_worker_over_zeromq(scheduler, start_worker, endpoint):
    worker = start_worker(
        "--model", "dummy", "--zmq-endpoint", endpoint, "--fail-on-token-id", "4000"
    )  # fmt: skip
    hello = scheduler.receive(step_pb2.Hello)
    assert (hello.model_id, hello.vocab_size, list(hello.eos_token_ids)) == ("dummy", 49152, [2])
    assert (hello.max_context_tokens, hello.block_size, hello.num_kv_blocks) == (8192, 16, 4096)
    accept(scheduler, "scheduler-1")

    prompt = [11, 12, 13, 14]
    result = scheduler.step(plan_of(1, [(1, 0, prompt, [7])], new=[(1, 4)]))
    token = dummy_next_token(14, 3, DUMMY_VOCAB_SIZE)
    assert list(result.token_ids) == [token]
    result = scheduler.step(plan_of(2, [(1, 4, [token], [])]))
    assert list(result.token_ids) == [dummy_next_token(token, 4, DUMMY_VOCAB_SIZE)]

    failed = scheduler.step(plan_of(3, [(1, 5, [4000], [])]))
    assert "4000" in failed.step_error
    result = scheduler.step(plan_of(4, [(2, 0, [1, 2], [0])], new=[(2, 2)]))
    assert not result.step_error and len(result.token_ids) == 1

    accept(scheduler, "scheduler-2")  # an ack that answers no hello is ignored
    assert not scheduler.step(plan_of(5, [(2, 2, [3], [])])).errors
    rehello(scheduler)
    accept(scheduler, "scheduler-1")  # the same scheduler, which had dropped us
    result = scheduler.step(plan_of(6, [(2, 3, [3], [])]))
    assert "unknown sequence 2" in result.errors[0].message
    assert not scheduler.step(plan_of(7, [(3, 0, [1, 2], [0])], new=[(3, 2)])).errors
    rehello(scheduler)
    accept(scheduler, "scheduler-2")  # a restarted scheduler: every sequence forgotten
    result = scheduler.step(plan_of(8, [(3, 2, [3], [])]))
    assert "unknown sequence 3" in result.errors[0].message

    worker.process.send_signal(signal.SIGINT)
    assert worker.wait() == 0


def test_a_dummy_worker_runs_the_plan_after_one_whose_masks_follow(
    scheduler, start_worker, endpoint
):
    """Plan 1's masks follow it (masks_follow); plan 2 comes before them and waits."""
    worker = start_worker("--model", "dummy", "--zmq-endpoint", endpoint)
    scheduler.receive(step_pb2.Hello)
    accept(scheduler)
    first_plan = plan_of(
        1, [(1, 0, [11, 12, 13], [0]), (2, 0, [21, 22], [1])], new=[(1, 3), (2, 2)]
    )
    first_plan.masks_follow = True
    scheduler.send(first_plan)
    scheduler.send(plan_of(2, [(3, 0, [31, 32], [2])], new=[(3, 2)]))
    only_777 = bytearray(4 * ((DUMMY_VOCAB_SIZE + 31) // 32))
    only_777[777 // 8] |= 1 << (777 % 8)
    scheduler.send(
        step_pb2.StepMasks(step_id=1, seq_ids=[2], allowed_token_bitmask=bytes(only_777))
    )
    first = scheduler.receive(step_pb2.StepResult)
    assert first.step_id == 1 and not first.step_error
    # Sequence 1, not named by the masks, samples unconstrained.
    assert list(first.token_ids) == [dummy_next_token(13, 2, DUMMY_VOCAB_SIZE), 777]
    second = scheduler.receive(step_pb2.StepResult)
    assert second.step_id == 2
    assert list(second.token_ids) == [dummy_next_token(32, 1, DUMMY_VOCAB_SIZE)]
    worker.process.send_signal(signal.SIGINT)
    assert worker.wait() == 0


def test_refused_hello_exits_with_code_2(scheduler, start_worker, endpoint):
    worker = start_worker("--model", "dummy", "--zmq-endpoint", endpoint)
    scheduler.receive(step_pb2.Hello)
    scheduler.send(
        step_pb2.HelloAck(accepted=False, reason="protocol version 1 is not 7", protocol_version=7)
    )
    assert worker.wait() == 2
    assert "protocol version 1 is not 7" in worker.log


def test_ipc_directory_is_created_private(tmp_path):
    socket_dir = tmp_path / "a" / "b"
    prepare_endpoint(f"ipc://{socket_dir}/w.sock")
    assert socket_dir.is_dir()
    assert socket_dir.stat().st_mode & 0o777 == 0o700
    prepare_endpoint("tcp://127.0.0.1:5555")  # nothing to prepare
