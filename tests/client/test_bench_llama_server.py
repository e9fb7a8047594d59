"""make bench's llama-server peer: request bodies, stream parsing, argv, the skip, a fake server.

Everything but the last (slow) test runs without the llama-server binary: a small Python
stand-in (tests/client/fake_llama_server.py) plays the server where a process is needed.
"""

from __future__ import annotations

import asyncio
import json
import re
import stat
import sys
from pathlib import Path

import pytest

from benchmarks import llama_server
from benchmarks.llama_server import (
    Installation,
    LlamaServer,
    LlamaServerError,
    SseParser,
    TokenTimer,
    completion_body,
    context_per_slot,
    installation,
    run_workload,
    server_argv,
    skip_reason,
)
from benchmarks.scenarios import PEER_LLAMA, build_peer_workloads
from benchmarks.suite import _run_llama_server, parse_args, selected_peers
from benchmarks.suite_report import SuiteResults
from benchmarks.suite_service import REPO_ROOT, free_port
from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_report import RequestResult, summarize

FAKE_SERVER = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture
def fake_binary(tmp_path):
    """An executable that starts the fake server with whatever llama-server argv it gets."""
    path = tmp_path / "llama-server"
    bodies = tmp_path / "bodies.jsonl"
    path.write_text(
        f"#!/bin/sh\nexec {sys.executable} {FAKE_SERVER} --bodies {bodies} \"$@\"\n"
    )  # fmt: skip
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    return Installation(binary=path, model=model), bodies


# -- what it sends --------------------------------------------------------------------------


def test_completion_body_asks_for_what_the_load_generator_asks():
    config = BenchConfig(max_new_tokens=7, ignore_eos=True)
    body = completion_body([1, 2, 3], config, index=5)
    assert body["prompt"] == [1, 2, 3]
    assert body["n_predict"] == 7
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0.0
    assert body["stream"] is True
    assert "seed" not in body  # greedy: no sampling seed
    sampled = completion_body([1], BenchConfig(temperature=0.7, seed=10), index=5)
    assert sampled["seed"] == 15 and sampled["ignore_eos"] is False


def test_server_argv_binds_loopback_and_sizes_the_context_per_slot():
    argv = server_argv(
        Path("/bin/llama-server"),
        Path("/m.gguf"),
        4321,
        parallel=16,
        context_per_slot=768,
        threads=2,
    )
    options = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert argv[0] == "/bin/llama-server"
    assert options["--host"] == "127.0.0.1" and options["--port"] == "4321"
    assert options["--model"] == "/m.gguf"
    assert options["--parallel"] == "16"
    assert options["--ctx-size"] == str(16 * 768)
    assert options["--threads"] == "2" and options["--threads-batch"] == "2"


def test_context_per_slot_fits_the_longest_request():
    assert context_per_slot([[0] * 520, [0] * 16], max_new_tokens=32) == 768
    assert context_per_slot([[0] * 40], max_new_tokens=64) == 256
    # Exactly a multiple still has room for the +1.
    assert context_per_slot([[0] * 224], max_new_tokens=32) == 512


# -- what it reads --------------------------------------------------------------------------


def test_sse_parser_reassembles_events_split_anywhere():
    events = [{"content": "é", "tokens_predicted": 1}, {"content": "b", "stop": True}]
    stream = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events)
    data = stream.encode() + b"data: [DONE]\n\n"
    for cut in range(1, len(data)):
        parser = SseParser()
        assert parser.feed(data[:cut]) + parser.feed(data[cut:]) == events


def test_sse_parser_accepts_crlf_and_keeps_a_partial_event():
    parser = SseParser()
    assert parser.feed(b'data: {"a": 1}\r\n\r\ndata: {"b"') == [{"a": 1}]
    assert parser.feed(b": 2}\n\n") == [{"b": 2}]


def test_token_timer_records_one_chunk_per_event_that_adds_tokens():
    result = RequestResult(index=0, send_s=0.5)
    timer = TokenTimer(result, num_prompt_tokens=9)
    timer.on_event({"content": "", "tokens_predicted": 0}, 0.6)  # the begin event
    timer.on_event({"content": "a", "tokens_predicted": 1}, 1.0)
    timer.on_event({"content": "b", "tokens_predicted": 2}, 1.1)
    timer.on_event({"content": "cd", "tokens_predicted": 4}, 1.3)  # two tokens at once
    final = {"stop": True, "stop_type": "limit", "tokens_predicted": 4, "tokens_evaluated": 9,
             "timings": {"cache_n": 3}}  # fmt: skip
    timer.on_event(final, 1.4)
    assert timer.done
    assert result.chunk_times_s == [1.0, 1.1, 1.3]
    assert result.chunk_num_tokens == [1, 1, 2]
    assert result.end_s == 1.4 and result.finish_reason == "length" and result.ok
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (9, 4)
    assert result.usage.cached_prompt_tokens == 3
    assert result.ttft_s == pytest.approx(0.5)
    assert result.itls_s == pytest.approx([0.1, 0.1, 0.1])
    report = summarize(BenchConfig(num_requests=1), "t", [result], 1.4, num_preemptions=None)
    assert report.num_ok == 1 and report.num_completion_tokens == 4


def test_token_timer_raises_on_an_error_event():
    timer = TokenTimer(RequestResult(index=0, send_s=0), num_prompt_tokens=1)
    with pytest.raises(LlamaServerError, match="context"):
        timer.on_event({"error": {"code": 400, "message": "context too long"}}, 0.1)


# -- whether it runs ------------------------------------------------------------------------


def test_skip_reason_names_the_missing_binary_and_the_make_target(tmp_path):
    install = installation({llama_server.BINARY_ENV: str(tmp_path / "none"),
                            llama_server.MODEL_ENV: str(tmp_path / "none.gguf")})  # fmt: skip
    reason = skip_reason(install, "cpu")
    assert reason.startswith("llama-server: skipped")
    assert str(tmp_path / "none") in reason and "make llama-server" in reason


def test_skip_reason_on_a_gpu_and_none_when_present(fake_binary):
    install, _ = fake_binary
    assert skip_reason(install, "cpu") is None
    assert "cuda" in skip_reason(install, "cuda")


def test_default_installation_is_the_make_targets_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    install = installation({})
    root = tmp_path / "pagoda" / "llama.cpp" / llama_server.LLAMA_CPP_PYTHON_VERSION
    assert install.binary == root / "bin" / "llama-server"
    assert install.model.parent == root / "models"


def test_makefile_builds_the_version_the_peer_looks_for():
    makefile = (REPO_ROOT / "Makefile").read_text()
    pinned = re.search(r"^LLAMA_CPP_PYTHON_VERSION \?= (\S+)$", makefile, re.MULTILINE)
    assert pinned and pinned.group(1) == llama_server.LLAMA_CPP_PYTHON_VERSION
    assert re.search(r"^llama-server: .*## ", makefile, re.MULTILINE)


def test_suite_skips_llama_server_with_a_line_when_absent(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(llama_server.BINARY_ENV, str(tmp_path / "missing-llama-server"))
    results = SuiteResults()
    # No tokenizer is loaded and no process started: the model dir is never read.
    _run_llama_server(str(tmp_path / "no-model"), "cpu", build_peer_workloads(), results)
    assert "llama-server: skipped" in capsys.readouterr().err
    assert results.peer_workloads == {}


def test_peer_selection_from_the_command_line():
    assert selected_peers(parse_args([]))[0] == PEER_LLAMA
    assert selected_peers(parse_args(["--peer", "llama-server"])) == (PEER_LLAMA,)
    assert selected_peers(parse_args(["--no-peers", "--peer", "static"])) == ()
    with pytest.raises(SystemExit):
        parse_args(["--peer", "vllm"])


def test_issue_15_workloads_run_llama_server_with_its_slots():
    workloads = {w.name: w for w in build_peer_workloads()}
    assert all(PEER_LLAMA in w.peer_max_requests for w in workloads.values())
    mixed = workloads["burst-512-mix"]
    assert mixed.workload.prompt_repeats == (512, 8, 8, 8) and mixed.llama_parallel == 16
    trickle = workloads["trickle-short"].workload
    assert (trickle.arrival, trickle.interval_ms, trickle.num_requests) == ("interval", 250, 32)
    assert workloads["burst-short"].llama_parallel == 64


# -- against the stand-in server ------------------------------------------------------------


def test_server_waits_for_health_and_stops_by_pid(fake_binary):
    install, _ = fake_binary
    port = free_port()
    argv = [*server_argv(install.binary, install.model, port, parallel=2, context_per_slot=256,
                         threads=1), "--unhealthy-polls", "3"]  # fmt: skip
    with LlamaServer(argv, port) as server:
        # The stand-in answers 503 to its first three polls: start() returns on a 200 only.
        server.start(timeout_s=30)
        process = server.process
        assert process.poll() is None
    assert process.poll() is not None  # stopped on exit


def test_server_that_exits_is_reported_with_its_log(tmp_path):
    port = free_port()
    argv = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    with LlamaServer(argv, port) as server, pytest.raises(LlamaServerError, match="no such model"):
        server.start(timeout_s=30)


def test_a_server_that_crashes_while_loading_starts_again_without_repacking(fake_binary, capsys):
    """As the AMX build did on this machine: SIGSEGV before /health unless --no-repack."""
    install, _ = fake_binary
    crashing = install.binary.with_name("llama-server-amx")
    crashing.write_text(
        '#!/bin/sh\ncase " $* " in *" --no-repack "*) ;; *) kill -SEGV $$ ;; esac\n'
        f'exec {install.binary} "$@"\n'
    )
    crashing.chmod(install.binary.stat().st_mode)
    port = free_port()
    argv = server_argv(crashing, install.model, port, parallel=1, context_per_slot=256, threads=1)
    with LlamaServer(argv, port) as server:
        server.start(timeout_s=30)
        assert server.argv[-1] == "--no-repack" and server.process.poll() is None
    assert "crashed while loading (exit -11)" in capsys.readouterr().err


def test_run_workload_streams_every_token_of_every_request(fake_binary):
    install, bodies = fake_binary
    config = BenchConfig(num_requests=4, max_new_tokens=5, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    report = run_workload(install, config, prompts, "tag", parallel=4, threads=1)
    assert (report.num_ok, report.num_errors, report.num_unfinished) == (4, 0, 0)
    assert report.num_completion_tokens == 20
    assert report.num_prompt_tokens == 10
    assert [r.chunk_num_tokens for r in report.requests] == [[1, 1, 2, 1]] * 4
    sent = [json.loads(line) for line in bodies.read_text().splitlines()]
    measured = sent[2:]  # after the two warm-up requests
    assert sorted(b["prompt"] for b in measured) == sorted(prompts)
    assert all(b["n_predict"] == 5 and b["ignore_eos"] and b["stream"] for b in measured)


def test_an_http_error_becomes_a_failed_request():
    async def scenario() -> int:
        async def answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"error":{"message":"bad prompt"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            report = await llama_server.run_workload_async(
                port, BenchConfig(num_requests=2, max_new_tokens=2), [[1], [2]], "t"
            )
        return report.errors_by_code.get("INTERNAL", 0)

    assert asyncio.run(scenario()) == 2


# -- the real binary ------------------------------------------------------------------------


@pytest.mark.slow
def test_real_llama_server_serves_every_token():
    install = installation()
    reason = skip_reason(install, "cpu")
    if reason:
        pytest.skip(reason)
    config = BenchConfig(num_requests=4, max_new_tokens=4, ignore_eos=True)
    # Plain token ids of the default model's vocabulary (a prompt needs no tokenizer here).
    prompts = [[504, 282, 284, 288 + n] for n in range(4)]
    report = run_workload(install, config, prompts, "slow", parallel=4, threads=2)
    assert report.num_ok == 4
    assert [r.num_completion_tokens for r in report.requests] == [4] * 4
    assert all(r.usage.prompt_tokens == 4 for r in report.requests)
