"""deploy/haproxy/haproxy.cfg: replicas behind HAProxy (docs/operations.md, "Replicas
behind a load balancer").

The config's promises are checked always: leastconn, HTTP/2 both ways, retries only on a
failed connection, and a health check whose raw HTTP/2 bytes decode to a grpc.health.v1
Check for pagoda.v1.Generation that accepts only SERVING. Then Debian's haproxy (installed
here when missing, as root) runs a copy of the config with free ports in front of two
dummy replicas (scheduler + worker each): concurrent streams spread over both, a replica
stopped with SIGTERM drains while the other takes the new calls, a replica killed outright
costs only its streams in flight.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagoda.client.errors import PagodaError, UnavailableError, error_from_rpc
from pagoda.protos import generation_pb2, generation_pb2_grpc
from pagoda.scheduler_svc.api import SERVICE_NAME
from tests.e2e.conftest import (
    REPO_ROOT,
    Service,
    _spawn,
    free_port,
    running_service,
    stop_process,
    wait_until,
)
from tests.e2e.test_dummy_service import dummy_continuation, prompts, request
from tests.e2e.test_lifecycle import read_until_end

CONFIG_PATH = REPO_ROOT / "deploy" / "haproxy" / "haproxy.cfg"
FRONT_ADDRESS = "127.0.0.1:8080"
STATS_ADDRESS = "127.0.0.1:8404"
REPLICA_ADDRESSES = ("127.0.0.1:50051", "127.0.0.1:50052")
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Long enough that a draining replica still has streams open when HAProxy's next check
# (every second) finds it NOT_SERVING: 1,000 steps of at least 5 ms each.
NUM_LONG_TOKENS = 1000
LONG_STREAM_WORKER_ARGS = ["--dummy-step-ms", "5"]
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


# --- the config, as text ------------------------------------------------------------------


def sections(text: str) -> dict[str, list[list[str]]]:
    """{"backend pagoda_replicas": [["balance", "leastconn"], ...], ...}: each section's
    directives as words, comments dropped."""
    found: dict[str, list[list[str]]] = {}
    current = None
    for line in text.splitlines():
        words = shlex.split(line, comments=True)  # HAProxy quotes and comments as sh does
        if not words:
            continue
        if not line[0].isspace():
            current = found.setdefault(" ".join(words), [])
        else:
            current.append(words)
    return found


def directives(section: list[list[str]], name: str) -> list[list[str]]:
    return [words[1:] for words in section if words[0] == name]


def without_comment(words: list[str]) -> list[str]:
    if "comment" not in words:
        return words
    at = words.index("comment")
    return words[:at] + words[at + 2 :]


def seconds(duration: str) -> float:
    assert duration.endswith("s"), duration
    return float(duration[:-1])


def http2_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each frame after the client preface."""
    assert data.startswith(HTTP2_PREFACE)
    frames, at = [], len(HTTP2_PREFACE)
    while at < len(data):
        length = int.from_bytes(data[at : at + 3], "big")
        kind, flags = data[at + 3], data[at + 4]
        stream_id = int.from_bytes(data[at + 5 : at + 9], "big")
        frames.append((kind, flags, stream_id, data[at + 9 : at + 9 + length]))
        at += 9 + length
    assert at == len(data), "the last frame's length runs past the bytes sent"
    return frames


# HPACK static table entries the check uses (RFC 7541, appendix A).
HPACK_STATIC = {1: ":authority", 3: (":method", "POST"), 4: ":path", 6: (":scheme", "http"),
                31: "content-type"}  # fmt: skip


def hpack_headers(block: bytes) -> list[tuple[str, str]]:
    """The subset of HPACK the check writes: indexed static fields and literals without
    indexing or Huffman coding."""
    headers, at = [], 0

    def string() -> str:
        nonlocal at
        length = block[at]
        assert length < 0x7F, "Huffman-coded or long strings are not used"
        at += 1 + length
        return block[at - length : at].decode()

    while at < len(block):
        first = block[at]
        at += 1
        if first & 0x80:
            headers.append(HPACK_STATIC[first & 0x7F])
            continue
        assert first & 0xF0 == 0, "only literals without indexing"
        index = first & 0x0F
        if index == 0x0F:
            index += block[at]
            at += 1
        name = HPACK_STATIC[index] if index else string()
        headers.append((name, string()))
    return headers


def grpc_message(payload: bytes) -> bytes:
    """The one uncompressed message of a gRPC body."""
    assert payload[0] == 0, "uncompressed"
    length = int.from_bytes(payload[1:5], "big")
    assert len(payload) == 5 + length
    return payload[5:]


def grpc_frame(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def test_the_config_balances_by_connections_over_http2_and_retries_only_refused_calls():
    config = sections(CONFIG_PATH.read_text())
    front = config["frontend pagoda_grpc"]
    backend = config["backend pagoda_replicas"]
    (defaults,) = [body for head, body in config.items() if head == "defaults"]
    assert directives(front, "bind") == [[FRONT_ADDRESS, "proto", "h2"]]
    assert directives(backend, "balance") == [["leastconn"]]
    # Every server speaks h2c and is checked; none is cut off when marked down.
    (default_server,) = directives(backend, "default-server")
    assert default_server[:3] == ["proto", "h2", "check"]
    servers = directives(backend, "server")
    assert [address for _, address in servers] == list(REPLICA_ADDRESSES)
    assert not any("on-marked-down" in words for words in backend)
    # Retries: only calls that never reached a replica, each on another one.
    assert directives(backend, "retry-on") == [["conn-failure"]]
    assert directives(backend, "option") == [["redispatch", "1"], ["tcp-check"]]
    # Streams: idle limits of at least ten minutes, both ways, no total.
    timeouts = {words[0]: seconds(words[1]) for words in directives(defaults, "timeout")}
    assert timeouts["client"] >= 600 and timeouts["server"] >= 600
    # Loopback only.
    addresses = [words[0] for section in config.values() for words in directives(section, "bind")]
    assert all(a.startswith("127.0.0.1:") for a in addresses + [a for _, a in servers])


def test_the_health_check_asks_grpc_health_for_generation_and_accepts_only_serving():
    backend = sections(CONFIG_PATH.read_text())["backend pagoda_replicas"]
    checks = directives(backend, "tcp-check")
    sent = b"".join(bytes.fromhex(words[1]) for words in checks if words[0] == "send-binary")
    settings, headers, data = http2_frames(sent)
    assert settings == (0x4, 0, 0, b"")
    kind, flags, stream_id, block = headers
    assert (kind, flags, stream_id) == (0x1, 0x4, 1)  # HEADERS, END_HEADERS
    assert hpack_headers(block) == [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/grpc.health.v1.Health/Check"),
        (":authority", "localhost"),  # grpc refuses a call without one
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    kind, flags, stream_id, body = data
    assert (kind, flags, stream_id) == (0x0, 0x1, 1)  # DATA, END_STREAM
    check = health_pb2.HealthCheckRequest.FromString(grpc_message(body))
    assert check.service == SERVICE_NAME
    # The answer's message is awaited in any status, then must be SERVING.
    expects = [without_comment(words[1:]) for words in checks if words[0] == "expect"]
    assert expects[0][0] == "rbinary"
    assert expects[1][:3] == ["min-recv", "0", "binary"]  # conclusive: NOT_SERVING fails now
    ((_, pattern), (*_, serving)) = expects
    answers = {
        status: grpc_frame(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        for status in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
    }  # fmt: skip
    assert all(re.search(pattern, answer.hex()) for answer in answers.values())
    assert bytes.fromhex(serving) == answers[health_pb2.HealthCheckResponse.SERVING]


# --- the config, live ----------------------------------------------------------------------


def haproxy_binary() -> str:
    """Debian's haproxy, installed with apt-get when missing (as root); skips only when it
    cannot be installed."""
    found = shutil.which("haproxy", path=SEARCH_PATH)
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("haproxy is not installed and there is no apt-get to install it")
    if os.geteuid() != 0:
        pytest.skip("haproxy is not installed; `apt-get install haproxy` needs root")
    try:
        install = subprocess.run(
            ["sh", "-c", "apt-get update -qq && apt-get install -y -qq haproxy"],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
        )
    except subprocess.TimeoutExpired:
        pytest.skip("apt-get install haproxy took more than 300 s (no package mirror?)")
    found = shutil.which("haproxy", path=SEARCH_PATH)
    if install.returncode != 0 or found is None:
        pytest.skip(f"apt-get could not install haproxy: {install.stderr.strip()[-500:]}")
    return found


def config_for(replica_addresses: list[str], front_port: int, stats_port: int) -> str:
    """The shipped config with the test's ports: each address replaced where it is used."""
    replacements = [
        (f"bind {FRONT_ADDRESS} ", f"bind 127.0.0.1:{front_port} "),
        (f"bind {STATS_ADDRESS}\n", f"bind 127.0.0.1:{stats_port}\n"),
    ]
    replacements += [
        (f" {shipped}\n", f" {address}\n")
        for shipped, address in zip(REPLICA_ADDRESSES, replica_addresses, strict=True)
    ]
    return replaced(CONFIG_PATH.read_text(), replacements)


def replaced(text: str, replacements: list[tuple[str, str]]) -> str:
    """`text` with each `old` replaced by its `new`; each must occur exactly once."""
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def server_rows(stats_url: str, backend: str) -> dict[str, dict[str, str]]:
    """HAProxy's view of each server of `backend`: status, check_status, last_chk, the
    count of 5xx answers (hrsp_5xx), of retries (wretr)..."""
    with urllib.request.urlopen(stats_url, timeout=5) as reply:
        text = reply.read().decode().removeprefix("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {
        row["svname"]: row
        for row in rows
        if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND")
    }


def wait_for_server(
    servers: Callable[[], dict[str, dict[str, str]]], server: str, status: str, timeout_s: float
) -> dict[str, str]:
    return wait_until(
        lambda: (row := servers()[server])["status"] == status and row,
        timeout_s,
        f"haproxy to see server {server} {status}",
    )


@contextmanager
def running_haproxy(
    haproxy: str,
    config: str,
    log_path: Path,
    servers: Callable[[], dict[str, dict[str, str]]],
) -> Iterator[subprocess.Popen]:
    """HAProxy on `config` (checked first), yielded once every server in `servers()` has
    passed a layer-7 health check; stopped on the way out, its log printed on a failure."""
    config_path = log_path.with_suffix(".cfg")
    config_path.write_text(config)
    checked = subprocess.run(
        [haproxy, "-c", "-q", "-f", str(config_path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    process = _spawn([haproxy, "-db", "-f", str(config_path)], log_path)
    try:

        def all_checked_up() -> bool:
            assert process.poll() is None, "haproxy exited"
            try:
                rows = servers()
            except OSError:
                return False
            return all(r["status"] == "UP" and r["check_status"] == "L7OK" for r in rows.values())

        wait_until(all_checked_up, 30, "haproxy to pass a health check on every server")
        yield process
    except BaseException:
        print(log_path.read_text()[-4000:])
        raise
    finally:
        stop_process(process)


@dataclass
class Front:
    """HAProxy in front of two replicas; `address` is the one door clients use."""

    address: str
    stats_url: str
    replicas: list[Service]
    log_path: Path

    def servers(self) -> dict[str, dict[str, str]]:
        """HAProxy's view of each replica ("a", "b"): status, check_status, last_chk..."""
        return server_rows(self.stats_url, "pagoda_replicas")

    def wait_for(self, server: str, status: str, timeout_s: float = 30) -> dict[str, str]:
        return wait_for_server(self.servers, server, status, timeout_s)

    def num_finished(self) -> list[int]:
        return [replica.stats().num_requests_finished for replica in self.replicas]


@contextmanager
def running_front(tmp_path: Path, worker_args: list[str] = ()) -> Iterator[Front]:
    haproxy = haproxy_binary()
    with ExitStack() as stack:
        replicas = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            replica = running_service(tmp_path / name, model="dummy", worker_args=worker_args)
            replicas.append(stack.enter_context(replica))
        front_port, stats_port = free_port(), free_port()
        config = config_for([r.address for r in replicas], front_port, stats_port)
        log_path = tmp_path / "haproxy.log"
        front = Front(
            address=f"127.0.0.1:{front_port}",
            stats_url=f"http://127.0.0.1:{stats_port}/stats;csv",
            replicas=replicas,
            log_path=log_path,
        )
        with running_haproxy(haproxy, config, log_path, front.servers):
            yield front


async def open_streams(stub, batch: list[list[int]], num_tokens: int):
    """Start one stream per prompt and read each one's first message: all are running."""
    calls = [stub.Generate(request(p, num_tokens), timeout=120) for p in batch]
    firsts = [list((await call.read()).token_ids) for call in calls]
    return calls, firsts


async def short_calls(stub, batch: list[list[int]]):
    return await asyncio.gather(
        *(read_until_end(stub.Generate(request(p, 16), timeout=60), []) for p in batch)
    )


def assert_complete(batch, results, num_tokens: int) -> None:
    for prompt_ids, (tokens, finish, code) in zip(batch, results, strict=True):
        assert code == grpc.StatusCode.OK
        assert finish == generation_pb2.LENGTH
        assert tokens == dummy_continuation(prompt_ids, num_tokens)


@pytest.mark.slow
def test_concurrent_streams_through_the_front_all_complete_on_both_replicas(tmp_path):
    with running_front(tmp_path) as front:
        before = front.num_finished()
        batch = prompts(40)

        async def scenario():
            async with grpc.aio.insecure_channel(front.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                calls = [stub.Generate(request(p, 32), timeout=60) for p in batch]
                return await asyncio.gather(*(read_until_end(c, []) for c in calls))

        assert_complete(batch, asyncio.run(scenario()), 32)
        served = [after - b for after, b in zip(front.num_finished(), before, strict=True)]
        assert sum(served) == len(batch)
        assert min(served) > 0, f"one replica served nothing: {served}"


@pytest.mark.slow
def test_a_replica_stopped_with_sigterm_drains_while_the_other_takes_new_calls(tmp_path):
    with running_front(tmp_path, LONG_STREAM_WORKER_ARGS) as front:
        draining, other = front.replicas
        old_batch, new_batch = prompts(8), prompts(8, length=20)

        async def scenario():
            async with grpc.aio.insecure_channel(front.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                calls, firsts = await open_streams(stub, old_batch, NUM_LONG_TOKENS)
                stats = draining.stats()
                num_draining = stats.num_running + stats.num_waiting
                before = other.stats().num_requests_finished
                draining.scheduler.send_signal(signal.SIGTERM)
                # Out of rotation because its health check read NOT_SERVING (not because
                # the port closed: it is still finishing its streams).
                row = await asyncio.to_thread(front.wait_for, "a", "DOWN")
                assert "comment: SERVING" in row["last_chk"], row["last_chk"]
                new_results = await short_calls(stub, new_batch)
                old_results = await asyncio.gather(
                    *(read_until_end(c, f) for c, f in zip(calls, firsts, strict=True))
                )
                return num_draining, before, old_results, new_results

        num_draining, before, old_results, new_results = asyncio.run(scenario())
        assert num_draining > 0
        assert_complete(old_batch, old_results, NUM_LONG_TOKENS)
        assert_complete(new_batch, new_results, 16)
        assert draining.scheduler.wait(timeout=60) == 0
        # The other replica finished its share of the old streams and every new call.
        num_served = other.stats().num_requests_finished - before
        assert num_served == len(old_batch) - num_draining + len(new_batch)


@pytest.mark.slow
def test_a_killed_replica_costs_only_its_streams_in_flight(tmp_path):
    with running_front(tmp_path, LONG_STREAM_WORKER_ARGS) as front:
        killed, _ = front.replicas
        batch, new_batch = prompts(8), prompts(10, length=20)

        async def scenario():
            async with grpc.aio.insecure_channel(front.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                calls, firsts = await open_streams(stub, batch, NUM_LONG_TOKENS)
                stats = killed.stats()
                num_lost = stats.num_running + stats.num_waiting
                for process in (killed.scheduler, killed.worker):
                    process.kill()
                    process.wait()
                # New calls at once, before a health check has seen the replica gone:
                # those sent to it are refused at connect and retried on the other.
                new_results = asyncio.create_task(short_calls(stub, new_batch))
                results = await asyncio.gather(
                    *(read_to_error(c, f) for c, f in zip(calls, firsts, strict=True))
                )
                return num_lost, results, await new_results

        num_lost, results, new_results = asyncio.run(scenario())
        assert num_lost > 0
        lost = [error for _, _, error in results if error is not None]
        assert len(lost) == num_lost
        for prompt_ids, (tokens, finish, error) in zip(batch, results, strict=True):
            if error is None:
                assert finish == generation_pb2.LENGTH
                assert len(tokens) == NUM_LONG_TOKENS
            else:
                # HAProxy 2.6 ends a stream whose replica vanished after its response
                # headers with an empty DATA frame and no trailers (grpc: UNKNOWN, "Stream
                # removed"); one that had no headers yet gets a 502 (grpc: UNAVAILABLE).
                # The Pagoda client calls both what they are: UNAVAILABLE, retryable.
                assert type(error) is UnavailableError, error
            # Whatever arrived is exactly the start of the right output.
            assert tokens == dummy_continuation(prompt_ids, len(tokens))
        assert_complete(new_batch, new_results, 16)


async def read_to_error(call, tokens: list[int]) -> tuple[list[int], int, PagodaError | None]:
    """Tokens (after those already read), finish reason and the error the Pagoda client
    makes of the stream's failure, if it fails."""
    finish = 0
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            tokens.extend(response.token_ids)
            finish = response.finish_reason or finish
    except grpc.RpcError as exc:
        return tokens, finish, error_from_rpc(exc)
    return tokens, finish, None
