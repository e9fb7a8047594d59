"""Hostile input on both wires and a SIGTERM drain: nothing crashes, nobody loses a token."""

from __future__ import annotations

import asyncio
import random
import signal

import grpc
import pytest
import zmq

from pagoda.common import dummy_tokens, wire
from pagoda.protos import generation_pb2, generation_pb2_grpc, step_pb2
from tests.e2e.conftest import running_service, wait_serving, wait_until
from tests.e2e.test_dummy_service import dummy_continuation, many_streams, prompts, request

pytestmark = pytest.mark.slow

NUM_ZMQ_FRAMES = 10_000
NUM_GRPC_REQUESTS = 2_000


def mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.6 and data:
            del data[rng.randrange(len(data))]
        elif choice < 0.8:
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
        else:
            data = data[: rng.randrange(len(data) + 1)]
    return bytes(data)


def hostile_step_frames(rng: random.Random) -> list[bytes]:
    """A random frame, a mutated real message, or a well-formed message with wild values."""
    seeds = [
        step_pb2.Hello(
            protocol_version=wire.PROTOCOL_VERSION + 1, incarnation_id="x", vocab_size=5
        ),
        step_pb2.StepResult(step_id=rng.randrange(1 << 40), seq_ids=[1, 2], token_ids=[7, 99999]),
        step_pb2.Heartbeat(incarnation_id="stranger"),
        step_pb2.StepPlan(step_id=1, seq_ids=[1], token_offsets=[0, 5], token_ids=[1]),
        step_pb2.HelloAck(accepted=True),
    ]
    kind = rng.random()
    if kind < 0.3:
        return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 3))]
    frames = wire.encode(rng.choice(seeds))
    if kind < 0.8:
        return [mutate(frames[0], rng) if rng.random() < 0.2 else frames[0], mutate(frames[1], rng)]
    return frames


@pytest.fixture(scope="module")
def dummy_service(tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("abuse"), model="dummy") as service:
        yield service


def assert_still_serves_correctly(service) -> None:
    wait_serving(service.address, [service.scheduler, service.worker])
    batch = prompts(4)
    results = asyncio.run(many_streams(service.address, batch, 16))
    for prompt_ids, (tokens, finish) in zip(batch, results, strict=True):
        assert finish == generation_pb2.LENGTH
        assert tokens == dummy_continuation(prompt_ids, 16)


def test_random_frames_at_the_scheduler_endpoint(dummy_service):
    rng = random.Random(1)
    incarnation = dummy_service.stats().worker_incarnation_id
    context = zmq.Context()
    try:
        fuzzer = context.socket(zmq.DEALER)
        fuzzer.setsockopt(zmq.LINGER, 0)
        fuzzer.setsockopt(zmq.SNDHWM, 0)
        fuzzer.connect(dummy_service.endpoint)
        for _ in range(NUM_ZMQ_FRAMES):
            frames = hostile_step_frames(rng)
            if frames:
                fuzzer.send_multipart(frames)
        fuzzer.close()
    finally:
        context.term()
    # A mutated hello may have passed for a worker for a moment; the real worker's
    # heartbeats earn it a REHELLO and it attaches again.
    wait_until(
        lambda: (
            (s := dummy_service.stats()).worker_connected and s.worker_incarnation_id == incarnation
        ),
        60,
        "the real worker to be attached again",
    )
    assert dummy_service.scheduler.poll() is None and dummy_service.worker.poll() is None
    assert_still_serves_correctly(dummy_service)


def test_mutated_generate_requests_at_the_grpc_port(dummy_service):
    rng = random.Random(2)
    valid = generation_pb2.GenerateRequest(
        prompt="fuzz me",
        sampling=generation_pb2.SamplingParams(temperature=0.5, top_p=0.9, top_k=5, seed=3),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=8, stop=["x"], stop_token_ids=[4]),
        logprobs=2,
        request_id="fuzz",
    ).SerializeToString()

    async def fuzz() -> dict[str, int]:
        codes: dict[str, int] = {}
        async with grpc.aio.insecure_channel(dummy_service.address) as channel:
            call = channel.unary_stream(
                "/pagoda.v1.Generation/Generate",
                request_serializer=lambda raw: raw,
                response_deserializer=generation_pb2.GenerateResponse.FromString,
            )
            limit = asyncio.Semaphore(32)

            async def one(payload: bytes) -> None:
                async with limit:
                    try:
                        async for _ in call(payload, timeout=5):
                            pass
                        code = "OK"
                    except grpc.RpcError as exc:
                        code = exc.code().name
                    codes[code] = codes.get(code, 0) + 1

            # Mutated request ids may collide; the server must still answer each call.
            await asyncio.gather(*(one(mutate(valid, rng)) for _ in range(NUM_GRPC_REQUESTS)))
        return codes

    codes = asyncio.run(fuzz())
    assert sum(codes.values()) == NUM_GRPC_REQUESTS
    assert set(codes) <= {
        "OK",
        "INVALID_ARGUMENT",
        "INTERNAL",
        "DEADLINE_EXCEEDED",
        "RESOURCE_EXHAUSTED",
    }, codes
    assert dummy_service.scheduler.poll() is None
    wait_until(
        lambda: (
            (s := dummy_service.stats()).num_running == 0
            and s.num_waiting == 0
            and s.num_kv_blocks_used == 0
        ),
        60,
        "every fuzzed request to be gone",
    )
    assert_still_serves_correctly(dummy_service)


def test_random_frames_at_a_worker(tmp_path):
    """A hostile 'scheduler' feeds the dummy worker garbage; it keeps answering real plans."""
    import subprocess
    import sys

    endpoint = f"ipc://{tmp_path}/fuzz.sock"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    # A ROUTER silently drops what exceeds its high-water mark; unbounded queues make
    # sure every fuzz frame and then the real plan reach the worker on a slow machine.
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    router.bind(endpoint)
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagoda.gpu_worker", "--model", "dummy", "--zmq-endpoint", endpoint]
    )
    try:
        assert router.poll(60_000), "no hello from the worker"
        identity, *frames = router.recv_multipart()
        assert isinstance(wire.decode(frames), step_pb2.Hello)
        router.send_multipart(
            [
                identity,
                *wire.encode(
                    step_pb2.HelloAck(
                        accepted=True, protocol_version=1, scheduler_incarnation_id="s"
                    )
                ),
            ]
        )
        rng = random.Random(3)
        for _ in range(NUM_ZMQ_FRAMES):
            frames = hostile_step_frames(rng)
            router.send_multipart([identity, *frames])
        plan = step_pb2.StepPlan(step_id=987654321, seq_ids=[1], start_positions=[0], sample=[True],
                                 token_offsets=[0, 3], token_ids=[5, 6, 7], block_offsets=[0, 1], block_ids=[0])  # fmt: skip
        plan.new_sequences.add(
            seq_id=1, sampling=step_pb2.SamplingParams(seed=1), num_prompt_tokens=3
        )
        router.send_multipart([identity, *wire.encode(plan)])

        def our_result():
            while router.poll(100):
                _, *reply = router.recv_multipart()
                message = wire.decode(reply)
                if isinstance(message, step_pb2.StepResult) and message.step_id == plan.step_id:
                    return message
            return None

        result = wait_until(our_result, 60, "the worker to answer the real plan after the fuzz")
        assert list(result.token_ids) == [dummy_tokens.dummy_next_token(7, 2, 49152)]
        assert worker.poll() is None
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        router.close()
        context.term()
    assert worker.returncode == 0


def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(tmp_path):
    with running_service(
        tmp_path, model="dummy", scheduler_args=["--drain-timeout-s", "30"]
    ) as service:
        batch = prompts(6)

        async def scenario():
            async with grpc.aio.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                calls = [stub.Generate(request(p, 400), timeout=120) for p in batch]
                firsts = [await call.read() for call in calls]  # every stream has begun
                service.scheduler.send_signal(signal.SIGTERM)
                await asyncio.to_thread(
                    wait_until,
                    lambda: service.scheduler.poll() is not None or _refuses(service),
                    30,
                    "refusal",
                )
                results = []
                for first, call in zip(firsts, calls, strict=True):
                    tokens = list(first.token_ids)
                    finish = first.finish_reason
                    while (response := await call.read()) is not grpc.aio.EOF:
                        tokens.extend(response.token_ids)
                        finish = response.finish_reason
                    results.append((tokens, finish))
                return results

        results = asyncio.run(scenario())
        for prompt_ids, (tokens, finish) in zip(batch, results, strict=True):
            assert finish == generation_pb2.LENGTH
            assert tokens == dummy_continuation(prompt_ids, 400)
        assert service.scheduler.wait(timeout=60) == 0


def _refuses(service) -> bool:
    with service.channel() as channel:
        try:
            list(service.stub(channel).Generate(request([1, 2, 3], 2), timeout=5))
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


def test_big_tokenize_and_chat_requests_are_refused_while_a_stream_flows(dummy_service):
    """4 threads send 1 MB Tokenize texts and huge chats (just under the 1 MiB request cap)
    while a stream runs: each is refused with INVALID_ARGUMENT before any tokenizer time, the
    stream ends exactly (review M1)."""
    import threading

    huge_text = "a" * 1_000_000
    huge_chats = [
        generation_pb2.ChatRequest(messages=[generation_pb2.ChatMessage(role="user", content="a")] * 60_000),
        generation_pb2.ChatRequest(messages=[generation_pb2.ChatMessage(role="user", content=huge_text)]),
    ]  # fmt: skip
    codes: list[str] = []
    stop = threading.Event()

    def hammer(index: int) -> None:
        with dummy_service.channel() as channel:
            stub = dummy_service.stub(channel)
            while not stop.is_set():
                try:
                    if index % 2:
                        stub.Tokenize(generation_pb2.TokenizeRequest(text=huge_text), timeout=60)
                    else:
                        list(stub.Chat(huge_chats[len(codes) % 2], timeout=60))
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        prompt_ids = prompts(1)[0]
        wait_until(lambda: len(codes) >= 4, 120, "the first big requests to be answered")
        [(tokens, finish)] = asyncio.run(many_streams(dummy_service.address, [prompt_ids], 256))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert finish == generation_pb2.LENGTH
    assert tokens == dummy_continuation(prompt_ids, 256)
    assert set(codes) == {"INVALID_ARGUMENT"}, set(codes)
    assert dummy_service.scheduler.poll() is None
    # A big but allowed text is still tokenized (off the loop).
    with dummy_service.channel() as channel:
        reply = dummy_service.stub(channel).Tokenize(
            generation_pb2.TokenizeRequest(text="hello " * 2000), timeout=60
        )
    assert len(reply.token_ids) >= 2000


def test_one_client_cannot_squat_or_probe_another_clients_request_id(dummy_service):
    """Review L1: the same request_id from two connections names two requests; each stream is
    exact and echoes the id, and neither client learns the other's id is in flight."""
    batch = prompts(2)

    async def two_clients():
        channels = [
            grpc.aio.insecure_channel(dummy_service.address, options=[("pagoda.test.conn", i)])
            for i in range(2)
        ]
        try:

            async def one(channel, prompt_ids):
                stub = generation_pb2_grpc.GenerationStub(channel)
                message = request(prompt_ids, 64)
                message.request_id = "job-1"
                tokens, ids = [], set()
                async for response in stub.Generate(message, timeout=120):
                    tokens.extend(response.token_ids)
                    ids.add(response.request_id)
                return tokens, ids

            return await asyncio.gather(*(one(c, p) for c, p in zip(channels, batch, strict=True)))
        finally:
            for channel in channels:
                await channel.close()

    for prompt_ids, (tokens, ids) in zip(batch, asyncio.run(two_clients()), strict=True):
        assert tokens == dummy_continuation(prompt_ids, 64)
        assert ids == {"job-1"}
