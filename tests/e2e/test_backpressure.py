"""Streams whose client stops reading, under real HTTP/2 flow control (issue 14 item 8).

grpc's Python client reads the socket into its own buffers whatever its caller does, so
tests/e2e/test_unread_streams.py never stalls a server write. Here a raw HTTP/2 client
(h2) grants each stream a 1 KiB window and never sends WINDOW_UPDATE: once that KiB is
out, the server's next write for the stream waits for the client, for good. Then:
- the unread-output cap (output_streams.MAX_UNREAD_TOKENS) ends each request long
  before its max_new_tokens, so the scheduler's memory stays bounded;
- the stalled-write timeout (--stream-write-timeout-s) ends each stream's handler, which
  gives back its output slot: a SIGTERM drain with the stalled connections still open
  has no stream left to wait for;
- a normal client is served in full meanwhile.
What the server cannot do: reset the HTTP/2 stream. grpc.aio has no per-stream cancel and
the status queues behind the data the client does not take, so the stream lasts until the
client's connection closes; each connection holds at most --max-concurrent-streams of them.
Its place under --max-concurrent-rpcs does not: that limit counts handlers
(scheduler_svc/rpc_limit.py), so other clients are served once the stalled ones end.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess

import grpc
import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, ResponseReceived, StreamReset, TrailersReceived
from h2.settings import SettingCodes, Settings

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import running_service, wait_until
from tests.e2e.test_dummy_service import dummy_continuation, prompts, stream_tokens
from tests.e2e.test_unread_streams import memory_kb

pytestmark = pytest.mark.slow

GENERATE_PATH = (
    "/" + generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name + "/Generate"
)
STREAM_WINDOW_BYTES = 1024
NUM_STALLED_STREAMS = 50
NUM_CONNECTIONS = 2  # 25 streams x 1 KiB each stay inside a connection's 64 KiB window
NUM_NEW_TOKENS = 8000  # what a stalled request would run to without the unread cap
NUM_LOGPROBS = 20  # each alternative counts as an unread token: the cap comes early
WRITE_TIMEOUT_S = 3
# A stalled request generates what fits the 1 KiB window (a few messages), then at most
# MAX_UNREAD_TOKENS / (1 + NUM_LOGPROBS) = 97 tokens unread, then one step more: 160 is
# ample. Without the cap it runs until the write timeout ends it (thousands of tokens).
MAX_TOKENS_PER_STALLED_REQUEST = 160
# Peak RSS over the RSS before, while 50 stalled streams run and end (measured: about
# 2 MB with the caps).
MAX_RSS_GROWTH_MB = 64
# A SIGTERM drain waits this long for open streams; the scheduler must exit well before
# (its handlers gone), within EXIT_TIMEOUT_S.
DRAIN_TIMEOUT_S = 120
EXIT_TIMEOUT_S = 40
SCHEDULER_ARGS = [
    "--stream-write-timeout-s", str(WRITE_TIMEOUT_S),
    "--drain-timeout-s", str(DRAIN_TIMEOUT_S),
]  # fmt: skip


class StalledConnection:
    """An HTTP/2 client connection that opens Generate streams and never reads them:
    a STREAM_WINDOW_BYTES stream window and no WINDOW_UPDATE, ever (h2 sends one only
    when told acknowledge_received_data, which this never calls)."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=10)
        self._h2 = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self._h2.local_settings = Settings(
            client=True,
            initial_values={
                SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW_BYTES,
                SettingCodes.ENABLE_PUSH: 0,
            },
        )
        self._h2.initiate_connection()
        self._authority = address
        self.num_data_bytes: dict[int, int] = {}  # by stream id
        self.responded: set[int] = set()
        self.ends: dict[int, str] = {}  # how the server ended a stream, by stream id
        self._flush()

    def _flush(self) -> None:
        if outgoing := self._h2.data_to_send():
            self._sock.sendall(outgoing)

    def open_generate(self, request: generation_pb2.GenerateRequest) -> int:
        stream_id = self._h2.get_next_available_stream_id()
        self._h2.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", GENERATE_PATH),
                (":authority", self._authority),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        body = request.SerializeToString()
        # The gRPC frame: not compressed, 4-byte big-endian length, the message.
        self._h2.send_data(
            stream_id, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True
        )
        self._flush()
        self.num_data_bytes[stream_id] = 0
        return stream_id

    def pump(self, timeout_s: float) -> None:
        """Take the frames that arrive within `timeout_s` (answering SETTINGS and PING,
        as any client does; DATA is counted, never acknowledged)."""
        self._sock.settimeout(timeout_s)
        try:
            data = self._sock.recv(65536)
        except TimeoutError:
            return
        if not data:
            for stream_id in self.num_data_bytes:
                self.ends.setdefault(stream_id, "connection closed")
            return
        for event in self._h2.receive_data(data):
            if isinstance(event, DataReceived):
                self.num_data_bytes[event.stream_id] += len(event.data)
            elif isinstance(event, ResponseReceived | TrailersReceived):
                self.responded.add(event.stream_id)
                headers = dict(event.headers)
                if "grpc-status" in headers:
                    code = grpc.StatusCode(int(headers["grpc-status"]))
                    self.ends[event.stream_id] = code.name
            elif isinstance(event, StreamReset):
                self.ends[event.stream_id] = f"RST_STREAM {event.error_code!r}"
        self._flush()

    def close(self) -> None:
        self._sock.close()


def stalled_request(i: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=[5, 6, 7, 100 + i]),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True),
        logprobs=NUM_LOGPROBS,
    )


async def concurrent_streams(address: str, batch: list[list[int]], max_new_tokens: int):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(stream_tokens(stub, p, max_new_tokens) for p in batch))


def test_stalled_streams_end_and_hold_bounded_memory(tmp_path):
    with running_service(tmp_path, model="dummy", scheduler_args=SCHEDULER_ARGS) as service:
        scheduler = service.scheduler
        # Warm up the stream code paths before the baseline.
        asyncio.run(concurrent_streams(service.address, prompts(8), 16))
        before = service.stats()
        before_kb = memory_kb(scheduler.pid)["VmRSS"]

        connections = [StalledConnection(service.address) for _ in range(NUM_CONNECTIONS)]
        try:
            streams = [
                (connection, connection.open_generate(stalled_request(i)))
                for i in range(NUM_STALLED_STREAMS)
                for connection in [connections[i % NUM_CONNECTIONS]]
            ]

            # Every stalled request is ended on the server, by the unread cap, while its
            # client still reads nothing.
            def stalled_requests_gone() -> bool:
                for connection in connections:
                    connection.pump(0.05)
                stats = service.stats()
                return (
                    stats.num_requests_finished - before.num_requests_finished
                    >= NUM_STALLED_STREAMS
                    and stats.num_running == 0
                    and stats.num_waiting == 0
                )

            wait_until(stalled_requests_gone, 40, "the stalled requests to end on the server")
            stats = service.stats()
            peak_kb = memory_kb(scheduler.pid)["VmHWM"]
            num_generated = stats.num_generated_tokens - before.num_generated_tokens
            print(
                f"stalled requests generated {num_generated} tokens; scheduler RSS "
                f"{before_kb / 1024:.0f} MB before, peak {peak_kb / 1024:.0f} MB"
            )
            for connection, stream_id in streams:
                # The server answered, then stopped at the window: real backpressure.
                assert stream_id in connection.responded
                assert 0 < connection.num_data_bytes[stream_id] <= STREAM_WINDOW_BYTES
            assert num_generated <= NUM_STALLED_STREAMS * MAX_TOKENS_PER_STALLED_REQUEST
            assert (peak_kb - before_kb) / 1024 < MAX_RSS_GROWTH_MB

            # A normal client, meanwhile: served in full.
            batch = prompts(4)
            results = asyncio.run(concurrent_streams(service.address, batch, 16))
            for prompt_ids, (tokens, _) in zip(batch, results, strict=True):
                assert tokens == dummy_continuation(prompt_ids, 16)

            # The stalled-write timeout ends every stalled handler, so a drain finds no
            # stream to wait for, with the stalled connections still open.
            scheduler.send_signal(signal.SIGTERM)
            try:
                returncode = scheduler.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"the scheduler's drain still waits for stalled streams after "
                    f"{EXIT_TIMEOUT_S} s (it waits up to {DRAIN_TIMEOUT_S} s)"
                ) from None
            assert returncode == 0
            ends = sorted(
                {connection.ends.get(stream_id, "open") for connection, stream_id in streams}
            )
            print(f"the stalled streams, as their client saw them: {ends}")
        finally:
            for connection in connections:
                connection.close()


def test_stalled_streams_give_back_their_rpc_places_once_their_handlers_end(tmp_path):
    """A stalled stream outlives its handler (its status waits behind data its client
    never takes), but not its place under --max-concurrent-rpcs: once the handlers end,
    another client's RPCs are served, with the stalled connection still open."""
    max_rpcs = 8
    scheduler_args = ["--stream-write-timeout-s", "2", "--max-concurrent-rpcs", str(max_rpcs)]
    with running_service(tmp_path, model="dummy", scheduler_args=scheduler_args) as service:
        connection = StalledConnection(service.address)
        try:
            streams = [connection.open_generate(stalled_request(i)) for i in range(max_rpcs)]

            def every_stalled_handler_started() -> bool:
                connection.pump(0.05)
                return all(stream_id in connection.responded for stream_id in streams)

            # Each stalled stream took a place (its handler answered) before anyone else asks.
            wait_until(every_stalled_handler_started, 30, "the stalled streams' handlers")

            def another_client_is_served() -> bool:
                connection.pump(0.05)
                try:
                    (result,) = asyncio.run(concurrent_streams(service.address, [[5, 6]], 4))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    return False
                return result[0] == dummy_continuation([5, 6], 4)

            wait_until(another_client_is_served, 60, "the stalled streams' places to be free")
            assert service.stats().num_running == 0
        finally:
            connection.close()
