"""llama.cpp's `llama-server` as a `make bench` peer (built by `make llama-server`).

The server a CPU user would pick instead of Pagoda, serving the same model's Q4_1 GGUF (the
very file Pagoda's default model is converted from). Each peer workload starts one server
(`--parallel` slots, a context of slots x the workload's longest request, one thread per
core, bound to 127.0.0.1 on a free port), waits for /health to answer 200, warms it up, then
sends the workload's requests on the load generator's schedule (the same arrival offsets) to
/completion: the same prompts as token ids, `n_predict` = max new tokens, `ignore_eos`,
temperature 0 (greedy), streamed. Every streamed event's arrival time is recorded with the
number of tokens it carried (the growth of `tokens_predicted`), so `summarize` computes TTFT,
ITL and the rest exactly as for Pagoda. The server is stopped by its PID. The peer
`llama-server /v1` runs the same server through the OpenAI peer's client instead
(benchmarks.openai_peer), to show the two paths agree.

The HTTP client is asyncio streams and the stdlib only: one connection per request, HTTP/1.1,
chunked or plain body, server-sent events.

    python -m benchmarks.llama_server --where          # the binary and model the suite uses
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.suite_service import REPO_ROOT, free_port, stop_process
from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_report import BenchReport, RequestResult
from pagoda.client.bench_workload import run_open_loop
from pagoda.client.results import Usage

# The llama-cpp-python release whose vendored llama.cpp `make llama-server` builds; the
# Makefile's LLAMA_CPP_PYTHON_VERSION must say the same (a test checks).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# general.file_type of a GGUF whose weights are mostly Q4_1 (llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_1).
GGUF_FILE_TYPE_Q4_1 = 3
# Overrides for a llama-server / GGUF built elsewhere.
BINARY_ENV = "PAGODA_LLAMA_SERVER"
MODEL_ENV = "PAGODA_LLAMA_MODEL"

HOST = "127.0.0.1"
DEFAULT_PARALLEL = 64
# Slack on top of a slot's longest request (prompt + new tokens), then rounded up to this.
CONTEXT_ROUND_TOKENS = 256
READY_TIMEOUT_S = 120.0
POLL_INTERVAL_S = 0.1
HTTP_TIMEOUT_S = 2.0


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagoda" / "llama.cpp" / version


@dataclass(frozen=True, slots=True)
class Installation:
    binary: Path
    model: Path

    @property
    def missing(self) -> list[Path]:
        return [p for p in (self.binary, self.model) if not p.is_file()]


def skip_reason(install: Installation, device: str) -> str | None:
    """The line the suite prints when the peer cannot run here (None: it can)."""
    if install.missing:
        names = ", ".join(str(p) for p in install.missing)
        return f"llama-server: skipped, {names} missing (`make llama-server` builds it)"
    if device != "cpu":
        return f"llama-server: skipped, it is built for the CPU and the suite runs on {device}"
    return None


def installation(environ: dict[str, str] | None = None) -> Installation:
    """Where `make llama-server` puts the binary and the model, unless the environment says."""
    env = os.environ if environ is None else environ
    root = cache_dir()
    return Installation(
        binary=Path(env.get(BINARY_ENV) or root / "bin" / "llama-server"),
        model=Path(env.get(MODEL_ENV) or root / "models" / MODEL_FILE),
    )


def gguf_is_q4_1(path: str) -> bool:
    from gguf import GGUFReader

    field = GGUFReader(path).get_field("general.file_type")
    return field is not None and field.contents() == GGUF_FILE_TYPE_Q4_1


# -- the server -----------------------------------------------------------------------------


def context_per_slot(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """A slot's context: the longest prompt plus its new tokens, with slack, rounded up."""
    longest = max(len(ids) for ids in prompt_ids) + max_new_tokens + 1
    return -(-longest // CONTEXT_ROUND_TOKENS) * CONTEXT_ROUND_TOKENS


def server_argv(
    binary: Path, model: Path, port: int, *, parallel: int, context_per_slot: int, threads: int
) -> list[str]:
    return [
        str(binary),
        "--model", str(model),
        "--host", HOST,
        "--port", str(port),
        "--parallel", str(parallel),
        # The context is shared by the slots: each gets context_per_slot.
        "--ctx-size", str(parallel * context_per_slot),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--no-webui",
    ]  # fmt: skip


class LlamaServerError(RuntimeError):
    """The server failed to start, died, or answered an error; the message says which."""


# Weight repacking puts the weights in the CPU's extra buffer types: on an AMX CPU, AMX
# tiles for this Q4_1 model (its only one here). A GGML_NATIVE build of llama.cpp 0.3.36
# crashed in ggml_backend_amx_mul_mat on such a CPU (2026-11-25, SIGSEGV at the warm-up
# before /health); without repacking it serves, from the plain AVX-512 kernels.
NO_REPACK = "--no-repack"
CRASH_SIGNALS = (-signal.SIGSEGV, -signal.SIGILL, -signal.SIGBUS)


@dataclass(slots=True)
class LlamaServer:
    """One llama-server process; `start()` returns once /health answers 200."""

    argv: list[str]
    port: int
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Start it and poll /health until 200; the seconds it took. A server that crashes
        while loading is started once more without weight repacking (NO_REPACK), and says
        so on stderr."""
        try:
            return self._start(timeout_s)
        except LlamaServerError:
            crashed = self.process is not None and self.process.returncode in CRASH_SIGNALS
            if not crashed or NO_REPACK in self.argv:
                raise
        print(
            f"  llama-server crashed while loading (exit {self.process.returncode}); "
            f"starting it again with {NO_REPACK} (no AMX/repacked weights)",
            file=sys.stderr,
        )
        self.cleanup()
        self.argv = [*self.argv, NO_REPACK]
        return self._start(timeout_s)

    def _start(self, timeout_s: float) -> float:
        fd, name = tempfile.mkstemp(prefix="pagoda-llama-server-", suffix=".log")
        self.log_path = Path(name)
        with os.fdopen(fd, "w") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise LlamaServerError(
                    f"llama-server exited with {self.process.returncode}\n{self.log_tail()}"
                )
            if self.health() == 200:
                return time.monotonic() - start
            time.sleep(POLL_INTERVAL_S)
        self.stop()
        raise LlamaServerError(f"llama-server not healthy within {timeout_s:.0f} s")

    def health(self) -> int | None:
        """The HTTP status of GET /health (503 while the model loads), None if not listening."""
        connection = http.client.HTTPConnection(HOST, self.port, timeout=HTTP_TIMEOUT_S)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status
        except OSError:
            return None
        finally:
            connection.close()

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None

    def log_tail(self, num_chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def cleanup(self) -> None:
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
        self.cleanup()


# -- one request ----------------------------------------------------------------------------


def completion_body(prompt_ids: Sequence[int], config: BenchConfig, index: int) -> dict:
    """The /completion request for request `index`: what Pagoda's load generator asks for."""
    body = {
        "prompt": list(prompt_ids),
        "n_predict": config.max_new_tokens,
        "ignore_eos": config.ignore_eos,
        "temperature": config.temperature,
        "stream": True,
        # Like Pagoda's prefix cache (the workloads' prompts are unique, so it rarely hits).
        "cache_prompt": True,
    }
    if config.temperature > 0:
        body["seed"] = config.seed + index
    return body


class SseParser:
    """Server-sent events from byte chunks: `feed()` returns the JSON of each complete
    `data:` event (a chunk may end anywhere, even inside a UTF-8 character)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[dict]:
        self._buffer += data.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = []
        for event in events:
            payload = b"\n".join(
                line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
            )
            if payload and payload != b"[DONE]":
                out.append(json.loads(payload))
        return out


@dataclass(slots=True)
class TokenTimer:
    """Turns one request's streamed events into its RequestResult's chunks."""

    result: RequestResult
    num_prompt_tokens: int
    num_tokens_seen: int = 0
    done: bool = field(default=False)

    def on_event(self, event: dict, now_s: float) -> None:
        if "error" in event:
            raise LlamaServerError(f"llama-server error: {event['error']}")
        # tokens_predicted counts every token generated so far; a token whose text ends in an
        # incomplete UTF-8 character is not streamed alone, so one event may carry several.
        num_tokens = int(event.get("tokens_predicted", self.num_tokens_seen))
        if num_tokens > self.num_tokens_seen:
            self.result.chunk_times_s.append(now_s)
            self.result.chunk_num_tokens.append(num_tokens - self.num_tokens_seen)
            self.num_tokens_seen = num_tokens
        if event.get("stop"):
            self.done = True
            self.result.end_s = now_s
            self.result.finish_reason = "length" if event.get("stop_type") == "limit" else "stop"
            timings = event.get("timings") or {}
            self.result.usage = Usage(
                prompt_tokens=int(event.get("tokens_evaluated", self.num_prompt_tokens)),
                completion_tokens=self.num_tokens_seen,
                cached_prompt_tokens=int(timings.get("cache_n", 0)),
            )


def http_request(path: str, body: dict, port: int) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + payload


async def _body_chunks(reader: asyncio.StreamReader, chunked: bool):
    """The response body as it arrives (de-chunked)."""
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after each chunk
        yield data


async def stream_completion(
    port: int, body: dict, timer: TokenTimer, clock, host: str = HOST
) -> None:
    """POST /completion and feed every streamed event to `timer` with `clock()`'s time."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(http_request("/completion", body, port))
        await writer.drain()
        status_line = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        status = int(status_line.split()[1]) if status_line.split()[1:] else 0
        if status != 200:
            text = b"".join([c async for c in _body_chunks(reader, chunked)])
            raise LlamaServerError(f"HTTP {status}: {text[:300].decode(errors='replace')}")
        parser = SseParser()
        async for data in _body_chunks(reader, chunked):
            for event in parser.feed(data):
                timer.on_event(event, clock())
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


# -- one workload ---------------------------------------------------------------------------


async def run_workload_async(
    port: int, config: BenchConfig, prompt_ids: list[list[int]], run_tag: str
) -> BenchReport:
    """Send `config`'s requests on its arrival schedule; its report, as the load generator's."""
    if config.arrival == "closed":
        raise ValueError("the llama-server peer runs open-loop arrivals only")
    start = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - start

    results: list[RequestResult] = []

    async def one(index: int) -> None:
        result = RequestResult(index=index, send_s=now())
        results.append(result)
        timer = TokenTimer(result, len(prompt_ids[index]))
        try:
            await stream_completion(port, completion_body(prompt_ids[index], config, index),
                                    timer, now)  # fmt: skip
            if not timer.done:
                raise LlamaServerError("the stream ended without a final event")
        except (LlamaServerError, OSError, ValueError) as exc:
            print(f"  llama-server request {index}: {exc}", file=sys.stderr)
            result.error_code = "INTERNAL"
            result.end_s = now()
        except asyncio.CancelledError:
            result.unfinished = True
            raise

    return await run_open_loop(config, run_tag, results, one, now)


def run_workload(
    install: Installation,
    config: BenchConfig,
    prompt_ids: list[list[int]],
    run_tag: str,
    *,
    parallel: int = DEFAULT_PARALLEL,
    threads: int | None = None,
    warm_up: bool = True,
    api: str = "native",
) -> BenchReport:
    """Start a server sized for the workload, warm it up, run the workload, stop the server.
    `api` "openai" sends the requests to its /v1/completions through the OpenAI peer's
    client (benchmarks.openai_peer) instead of its native /completion."""
    port = free_port()
    argv = server_argv(
        install.binary,
        install.model,
        port,
        parallel=parallel,
        context_per_slot=context_per_slot(prompt_ids, config.max_new_tokens),
        threads=threads or os.cpu_count() or 1,
    )
    with LlamaServer(argv, port) as server:
        ready_s = server.start()
        print(f"  llama-server --parallel {parallel}: healthy after {ready_s:.1f} s",
              file=sys.stderr)  # fmt: skip
        if api == "openai":
            from benchmarks import openai_peer

            url = f"http://{HOST}:{port}"
            return openai_peer.run_workload(url, config, prompt_ids, run_tag, warm_up=warm_up)
        if warm_up:
            # The first requests pay one-time costs (allocations, page faults); not measured.
            short = BenchConfig(num_requests=2, max_new_tokens=4, ignore_eos=True)
            asyncio.run(run_workload_async(port, short, [prompt_ids[0]] * 2, "warm-up"))
        return asyncio.run(run_workload_async(port, config, prompt_ids, run_tag))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llama_server")
    parser.add_argument("--where", action="store_true", help="print the binary and model paths")
    parser.add_argument("--gguf-is-q4-1", metavar="GGUF", help="exit 0 if the file is Q4_1")
    args = parser.parse_args(argv)
    if args.gguf_is_q4_1:
        return 0 if gguf_is_q4_1(args.gguf_is_q4_1) else 1
    if args.where:
        install = installation()
        print(f"binary: {install.binary}\nmodel: {install.model}")
        reason = skip_reason(install, "cpu")
        if reason:
            print(reason)
        return 1 if reason else 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
