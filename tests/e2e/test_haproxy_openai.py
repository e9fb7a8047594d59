"""deploy/haproxy/haproxy-openai.cfg: pagoda-openai replicas behind HAProxy over HTTP/1.1
(docs/operations.md, "Replicas behind a load balancer").

The config's promises are checked as text: leastconn, one connection per request, GET
/health checks, retries only on a failed connection or a 503. Two small fake fronts show
what HAProxy does with those settings: a 503 is retried on the other front with its body,
a 500 is not retried. Then Debian's haproxy (installed when missing, as root) runs the file
in front of two replicas, each a scheduler, a dummy worker and a pagoda-openai whose
--target is that scheduler: concurrent chat and text completions, streamed and whole,
spread over both; a replica stopped with SIGTERM finishes its requests while the other
takes the new ones; a replica killed outright costs only its requests in flight.
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import (
    REPO_ROOT,
    Service,
    free_port,
    running_service,
    stop_process,
    wait_until,
)
from tests.e2e.test_dummy_service import dummy_continuation, prompts
from tests.e2e.test_haproxy import (
    LONG_STREAM_WORKER_ARGS,
    NUM_LONG_TOKENS,
    directives,
    haproxy_binary,
    replaced,
    running_haproxy,
    seconds,
    sections,
    server_rows,
    wait_for_server,
)
from tests.openai_front.conftest import start_front

CONFIG_PATH = REPO_ROOT / "deploy" / "haproxy" / "haproxy-openai.cfg"
GRPC_CONFIG_PATH = REPO_ROOT / "deploy" / "haproxy" / "haproxy.cfg"
BACKEND = "pagoda_openai_replicas"
FRONT_ADDRESS = "127.0.0.1:8000"
STATS_ADDRESS = "127.0.0.1:8405"
REPLICA_ADDRESSES = ("127.0.0.1:8001", "127.0.0.1:8002")
# Long enough for a drain to overlap the new calls; well inside the drain limit.
DRAIN_ARGS = ["--drain-timeout-s", "120"]
NUM_SHORT_TOKENS = 16


# --- the config, as text ------------------------------------------------------------------


def test_the_config_balances_by_requests_over_http1_and_retries_only_unanswered_calls():
    config = sections(CONFIG_PATH.read_text())
    front = config["frontend pagoda_openai"]
    backend = config[f"backend {BACKEND}"]
    (defaults,) = [body for head, body in config.items() if head == "defaults"]
    assert directives(defaults, "mode") == [["http"]]
    # Plain HTTP/1.1 both ways: no h2 on the bind or the servers.
    assert directives(front, "bind") == [[FRONT_ADDRESS]]
    assert not any("h2" in words for section in config.values() for words in section)
    assert directives(backend, "balance") == [["leastconn"]]
    servers = directives(backend, "server")
    assert [address for _, address in servers] == list(REPLICA_ADDRESSES)
    (default_server,) = directives(backend, "default-server")
    assert default_server[0] == "check"
    assert not any("on-marked-down" in words for words in backend)
    # Health: GET /health, which answers 200 only while the front's scheduler serves.
    assert ["httpchk"] in directives(backend, "option")
    (send,) = [words for words in directives(backend, "http-check") if words[0] == "send"]
    assert send[send.index("meth") + 1] == "GET" and send[send.index("uri") + 1] == "/health"
    assert [w for w in directives(backend, "http-check") if w[0] == "expect"] == [
        ["expect", "status", "200"]
    ]
    # Retries: a failed connection or a 503 (nothing streamed yet), each on another front.
    assert directives(backend, "retry-on") == [["conn-failure", "503"]]
    assert ["redispatch", "1"] in directives(backend, "option")
    assert ["http-buffer-request"] in directives(backend, "option")  # or no 503 retry
    assert ["http-server-close"] in directives(backend, "option")
    # Streams: idle limits of at least ten minutes, both ways.
    timeouts = {words[0]: seconds(words[1]) for words in directives(defaults, "timeout")}
    assert timeouts["client"] >= 600 and timeouts["server"] >= 600
    addresses = [words[0] for section in config.values() for words in directives(section, "bind")]
    assert all(a.startswith("127.0.0.1:") for a in addresses + [a for _, a in servers])


def test_both_doors_load_in_one_haproxy():
    checked = subprocess.run(
        [haproxy_binary(), "-c", "-q", "-f", str(GRPC_CONFIG_PATH), "-f", str(CONFIG_PATH)],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def config_for(front_addresses: list[str], port: int, stats_port: int) -> str:
    """The shipped config with the test's ports."""
    replacements = [
        (f"bind {FRONT_ADDRESS}\n", f"bind 127.0.0.1:{port}\n"),
        (f"bind {STATS_ADDRESS}\n", f"bind 127.0.0.1:{stats_port}\n"),
    ]
    replacements += [
        (f" {shipped}\n", f" {address}\n")
        for shipped, address in zip(REPLICA_ADDRESSES, front_addresses, strict=True)
    ]
    return replaced(CONFIG_PATH.read_text(), replacements)


# --- HAProxy's retries, against fake fronts ---------------------------------------------


@dataclass
class FakeFront:
    """An HTTP server that passes GET /health and answers every POST with `status`,
    echoing the body; counts the POSTs it got."""

    status: int
    num_posts: int = 0
    server: ThreadingHTTPServer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # HAProxy drops the connection of a 503 it retries as soon as it has the status.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextmanager
def fake_fronts(*statuses: int) -> Iterator[list[FakeFront]]:
    fakes = [FakeFront(status) for status in statuses]
    with ExitStack() as stack:
        for fake in fakes:

            class Handler(BaseHTTPRequestHandler):
                front = fake

                def do_GET(self) -> None:
                    self.answer(200, b"{}")

                def do_POST(self) -> None:
                    body = self.rfile.read(int(self.headers["Content-Length"]))
                    with self.front.lock:
                        self.front.num_posts += 1
                    self.answer(self.front.status, body)

                def answer(self, status: int, body: bytes) -> None:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                def log_message(self, *args) -> None:
                    pass

            fake.server = QuietServer(("127.0.0.1", 0), Handler)
            thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
            thread.start()
            stack.callback(thread.join, 10)
            stack.callback(fake.server.server_close)
            stack.callback(fake.server.shutdown)
        yield fakes


@contextmanager
def haproxy_for(tmp_path: Path, front_addresses: list[str]) -> Iterator[tuple[str, str]]:
    """HAProxy on the shipped file in front of `front_addresses`: (its URL, stats URL)."""
    port, stats_port = free_port(), free_port()
    stats_url = f"http://127.0.0.1:{stats_port}/stats;csv"
    config = config_for(front_addresses, port, stats_port)
    servers = lambda: server_rows(stats_url, BACKEND)  # noqa: E731
    with running_haproxy(haproxy_binary(), config, tmp_path / "haproxy.log", servers):
        yield f"http://127.0.0.1:{port}", stats_url


def test_a_503_is_retried_on_the_other_front_and_a_500_is_not(tmp_path):
    with (
        fake_fronts(503, 200) as (refusing, serving),
        haproxy_for(tmp_path, [refusing.address, serving.address]) as (url, stats_url),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        bodies = [json.dumps({"prompt": f"request {i}"}) for i in range(10)]
        answers = [http.post("/v1/completions", content=body) for body in bodies]
        # Every request reached the serving front, whole, whichever front it met first.
        assert [(a.status_code, a.text) for a in answers] == [(200, b) for b in bodies]
        assert serving.num_posts == len(bodies)
        assert refusing.num_posts > 0  # leastconn's round robin among equals sent some
        rows = server_rows(stats_url, BACKEND)
        assert int(rows["a"]["wretr"]) == refusing.num_posts
    (tmp_path / "second").mkdir()
    with (
        fake_fronts(500, 500) as fakes,
        haproxy_for(tmp_path / "second", [f.address for f in fakes]) as (url, _),
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        statuses = [http.post("/v1/completions", json={}).status_code for _ in range(4)]
        assert statuses == [500] * 4
        assert sum(f.num_posts for f in fakes) == 4  # one try each


# --- the config, live ---------------------------------------------------------------------


@dataclass
class Replica:
    """A scheduler, its dummy worker and the pagoda-openai that targets it."""

    service: Service
    front: subprocess.Popen
    url: str

    def num_held(self) -> int:
        stats = self.service.stats()
        return stats.num_running + stats.num_waiting

    def num_finished(self) -> int:
        return self.service.stats().num_requests_finished

    def accepts(self) -> bool:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except ConnectionRefusedError:
            return False
        return True


@dataclass
class Door:
    """HAProxy in front of two replicas' fronts; `url` is the one address clients use."""

    url: str
    stats_url: str
    replicas: list[Replica]

    def servers(self) -> dict[str, dict[str, str]]:
        return server_rows(self.stats_url, BACKEND)

    def wait_for(self, server: str, status: str, timeout_s: float = 30) -> dict[str, str]:
        return wait_for_server(self.servers, server, status, timeout_s)


@contextmanager
def running_door(tmp_path: Path, worker_args: list[str] = ()) -> Iterator[Door]:
    haproxy_binary()  # skip before starting anything when there is none
    with ExitStack() as stack:
        replicas = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            service = stack.enter_context(
                running_service(
                    tmp_path / name,
                    model="dummy",
                    worker_args=worker_args,
                    scheduler_args=DRAIN_ARGS,
                )
            )
            log_path = tmp_path / name / "openai-front.log"
            front, url = start_front(service.address, log_path, *DRAIN_ARGS)
            stack.callback(stop_process, front)
            replicas.append(Replica(service, front, url))
        addresses = [r.url.removeprefix("http://") for r in replicas]
        with haproxy_for(tmp_path, addresses) as (url, stats_url):
            try:
                yield Door(url, stats_url, replicas)
            except BaseException:
                for name in ("a", "b"):
                    print(
                        f"--- front {name}\n",
                        (tmp_path / name / "openai-front.log").read_text()[-3000:],
                    )
                raise


@dataclass
class Answer:
    """What one HTTP request got, whichever way it ended."""

    tokens: list[str] = field(default_factory=list)  # the logprobs' token names
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage
    error: str | None = None  # an HTTP status, an error event, a cut connection


@dataclass(frozen=True)
class Ask:
    """One request: a chat (`messages`) or a text completion of `prompt_ids`."""

    num_tokens: int
    stream: bool
    prompt_ids: list[int] | None = None
    messages: tuple[str, ...] | None = None

    @property
    def path(self) -> str:
        return "/v1/completions" if self.messages is None else "/v1/chat/completions"

    def body(self) -> dict:
        # Logprobs name each token by its text: names_of() gives the expected names.
        body = {"max_tokens": self.num_tokens, "ignore_eos": True, "stream": self.stream}
        if self.messages is None:
            body |= {"prompt": self.prompt_ids, "logprobs": 0}
        else:
            messages = [{"role": "user", "content": text} for text in self.messages]
            body |= {"messages": messages, "logprobs": True, "top_logprobs": 0}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def token_names(logprobs: dict | None) -> list[str]:
    """The logprobs' token names: each token's text as the scheduler spells it."""
    if not logprobs:
        return []
    return (
        [t["token"] for t in logprobs["content"]] if "content" in logprobs else logprobs["tokens"]
    )


@functools.cache
def _tokenizer():
    from pagoda.gpu_worker.model_loader import resolve_model_dir
    from pagoda.scheduler_svc.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_dir("default").path)


def names_of(token_ids: list[int]) -> list[str]:
    """The names the front gives these ids (the dummy service's tokenizer is the default)."""
    from pagoda.openai_front.responses import token_name

    return [token_name(i, _tokenizer().logprob_bytes(i)) for i in token_ids]


async def ask(http: httpx.AsyncClient, request: Ask) -> Answer:
    answer = Answer()
    try:
        if not request.stream:
            response = await http.post(request.path, json=request.body())
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}: {response.text[:300]}"
                return answer
            whole = response.json()
            (choice,) = whole["choices"]
            answer.tokens = token_names(choice["logprobs"])
            answer.finish_reason = choice["finish_reason"]
            answer.completion_tokens = whole["usage"]["completion_tokens"]
            return answer
        async with http.stream("POST", request.path, json=request.body()) as response:
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}: {(await response.aread())[:300]}"
                return answer
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    answer.error = f"error event: {event['error']['message']}"
                    continue
                if event.get("usage"):
                    answer.completion_tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    answer.tokens += token_names(choice["logprobs"])
                    answer.finish_reason = choice["finish_reason"] or answer.finish_reason
            if not done and answer.error is None:
                answer.error = "the stream ended without data: [DONE]"
    except httpx.TransportError as exc:  # the tokens read so far stay in the answer
        answer.error = f"{type(exc).__name__}: {exc}"
    return answer


def mixed(count: int, num_tokens: int, length: int = 40) -> list[Ask]:
    """`count` requests: text completions and chats alternately, each streamed and whole."""
    asks = []
    for i, prompt_ids in enumerate(prompts(count // 2, length)):
        for stream in (True, False):
            if i % 2:
                messages = (f"Count to {i} by {length}.",)
                asks.append(Ask(num_tokens, stream, messages=messages))
            else:
                asks.append(Ask(num_tokens, stream, prompt_ids=prompt_ids))
    return asks


def assert_complete(asks: list[Ask], answers: list[Answer]) -> None:
    by_messages: dict[tuple[str, ...], list[str]] = {}
    for request, answer in zip(asks, answers, strict=True):
        assert answer.error is None, (request, answer.error)
        assert answer.finish_reason == "length"
        assert answer.completion_tokens == request.num_tokens
        assert len(answer.tokens) == request.num_tokens
        if request.prompt_ids is not None:
            expected = names_of(dummy_continuation(request.prompt_ids, request.num_tokens))
            assert answer.tokens == expected
        else:
            # The chat template's ids are the scheduler's: every replica, streamed or
            # whole, must give the same answer to the same messages.
            expected = by_messages.setdefault(request.messages, answer.tokens)
            assert answer.tokens == expected


def client(door: Door) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=door.url, timeout=180, limits=httpx.Limits(max_connections=100)
    )


@pytest.mark.slow
def test_concurrent_completions_through_the_door_all_complete_on_both_replicas(tmp_path):
    with running_door(tmp_path) as door:
        before = [r.num_finished() for r in door.replicas]
        asks = mixed(40, 24)

        async def scenario():
            async with client(door) as http:
                return await asyncio.gather(*(ask(http, a) for a in asks))

        assert_complete(asks, asyncio.run(scenario()))
        served = [r.num_finished() - b for r, b in zip(door.replicas, before, strict=True)]
        assert sum(served) == len(asks)
        assert min(served) > 0, f"one replica served nothing: {served}"


async def start_held(http: httpx.AsyncClient, door: Door, asks: list[Ask]) -> list[asyncio.Task]:
    """Start every request; return once the schedulers hold them all (a whole answer sends
    nothing before its end, so only their counts say it has arrived)."""
    tasks = [asyncio.create_task(ask(http, a)) for a in asks]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while sum([await asyncio.to_thread(r.num_held) for r in door.replicas]) < len(asks):
        assert loop.time() < deadline, "the schedulers never held every request"
        assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
        await asyncio.sleep(0.05)
    return tasks


@pytest.mark.slow
def test_a_replica_stopped_with_sigterm_finishes_its_requests_while_the_other_takes_new_ones(
    tmp_path,
):
    with running_door(tmp_path, LONG_STREAM_WORKER_ARGS) as door:
        draining, other = door.replicas
        old_asks = mixed(8, NUM_LONG_TOKENS)
        early_asks, late_asks = mixed(8, NUM_SHORT_TOKENS, 20), mixed(8, NUM_SHORT_TOKENS, 30)

        async def scenario():
            async with client(door) as http:
                old = await start_held(http, door, old_asks)
                num_draining = await asyncio.to_thread(draining.num_held)
                before = await asyncio.to_thread(other.num_finished)
                # `systemctl stop` of both units: the front stops accepting at once and
                # keeps its open requests; the scheduler reports NOT_SERVING and drains.
                draining.front.send_signal(signal.SIGTERM)
                draining.service.scheduler.send_signal(signal.SIGTERM)
                await asyncio.to_thread(
                    wait_until, lambda: not draining.accepts(), 30, "front a to stop accepting"
                )
                # Before HAProxy's check has seen it or after: refused at connect, retried.
                early = await asyncio.gather(*(ask(http, a) for a in early_asks))
                await asyncio.to_thread(door.wait_for, "a", "DOWN")
                late = await asyncio.gather(*(ask(http, a) for a in late_asks))
                return num_draining, before, await asyncio.gather(*old), early, late

        num_draining, before, old, early, late = asyncio.run(scenario())
        assert num_draining > 0
        assert_complete(old_asks + early_asks + late_asks, old + early + late)
        assert draining.front.wait(timeout=60) == 0
        assert draining.service.scheduler.wait(timeout=60) == 0
        # The other replica finished its share of the old requests and every new one.
        num_served = other.num_finished() - before
        assert num_served == len(old_asks) - num_draining + len(early_asks) + len(late_asks)


@pytest.mark.slow
def test_a_killed_replica_costs_only_its_requests_in_flight(tmp_path):
    with running_door(tmp_path, LONG_STREAM_WORKER_ARGS) as door:
        killed, _ = door.replicas
        # Text completions only: their exact tokens are known, so a cut stream can be
        # checked to hold exactly the start of its answer.
        old_asks = [
            Ask(NUM_LONG_TOKENS, i % 4 != 3, prompt_ids=p) for i, p in enumerate(prompts(8))
        ]
        new_asks = mixed(10, NUM_SHORT_TOKENS, 20)

        async def scenario():
            async with client(door) as http:
                old = await start_held(http, door, old_asks)
                num_lost = await asyncio.to_thread(killed.num_held)
                for process in (killed.front, killed.service.scheduler, killed.service.worker):
                    process.kill()
                    process.wait()
                # New requests at once, before a health check has seen the replica gone:
                # those sent to it are refused at connect and retried on the other.
                new = await asyncio.gather(*(ask(http, a) for a in new_asks))
                return num_lost, await asyncio.gather(*old), new

        num_lost, old, new = asyncio.run(scenario())
        assert num_lost > 0
        lost = [answer for answer in old if answer.error is not None]
        assert len(lost) == num_lost, [a.error for a in lost]
        for request, answer in zip(old_asks, old, strict=True):
            # Whatever arrived is exactly the start of the right output: a cut stream has
            # its tokens so far, a whole answer lost in flight is HAProxy's 502.
            expected = names_of(dummy_continuation(request.prompt_ids, len(answer.tokens)))
            assert answer.tokens == expected
            if answer.error is None:
                assert len(answer.tokens) == NUM_LONG_TOKENS
            elif not request.stream:
                assert answer.error.startswith("HTTP 502"), answer.error
        assert_complete(new_asks, new)
