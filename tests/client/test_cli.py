"""`python -m pagoda.client ...` as a subprocess against the fake server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.client.cli_commands import _stream_to_stdout
from pagoda.client.results import Chunk, ToolCallDelta
from tests.client.conftest import TEST_API_KEY
from tests.client.fake_server import FAKE_CALL_ARGUMENTS, WEATHER

REPO_ROOT = Path(__file__).resolve().parents[2]


def cli_env(target: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PAGODA_TARGET"}
    env["PYTHONFAULTHANDLER"] = "1"  # a hung CLI killed by SIGABRT prints its stacks
    if target is not None:
        env["PAGODA_TARGET"] = target
    return env


def run_cli(*args: str, stdin: str = "", target: str | None = None):
    return subprocess.run(
        [sys.executable, "-m", "pagoda.client", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=cli_env(target),
        timeout=60,
    )


def test_generate_streams_text_and_reports_usage(fake_server):
    result = run_cli(
        "generate", "one two", "--max-new-tokens", "3", "--show-usage", "--logprobs", "2",
        target=fake_server.target,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == " t0 t1 t2\n"
    assert "finish: length" in result.stderr
    assert "tokens: prompt 2 (0 cached), completion 3" in result.stderr
    assert "1000:-0.250 1001:-1.250" in result.stderr


def test_generate_sends_one_user_turn_when_the_model_has_a_chat_template(make_server):
    server = make_server(has_chat_template=True)
    result = run_cli("generate", "hello there", "--max-new-tokens", "4", target=server.target)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "(1 messages) you said:\n"
    request = server.servicer.last_request("Chat")
    assert [(m.role, m.content) for m in request.messages] == [("user", "hello there")]
    assert request.stopping.max_new_tokens == 4
    assert not [call for call in server.servicer.requests if call.method == "Generate"]


def test_generate_raw_continues_the_prompt_even_with_a_chat_template(make_server):
    server = make_server(has_chat_template=True)
    result = run_cli("generate", "one two", "--raw", "--max-new-tokens", "2", target=server.target)
    assert result.returncode == 0, result.stderr
    assert result.stdout == " t0 t1\n"
    assert server.servicer.last_request("Generate").prompt == "one two"
    assert not [call for call in server.servicer.requests if call.method == "Chat"]


def test_the_cli_asks_for_a_mild_repetition_penalty_unless_told_otherwise(make_server):
    server = make_server()
    assert run_cli("generate", "a b", target=server.target).returncode == 0
    assert server.servicer.last_request("Generate").sampling.repetition_penalty == (
        pytest.approx(1.1)
    )
    assert (
        run_cli("generate", "a b", "--repetition-penalty", "1", target=server.target).returncode
        == 0
    )
    assert server.servicer.last_request("Generate").sampling.repetition_penalty == 1.0


def test_generate_options_reach_the_server(fake_server):
    result = run_cli(
        "--target", fake_server.target, "generate", "echo",
        "--temperature", "0.5", "--top-p", "0.25", "--top-k", "9", "--seed", "7",
        "--stop", "END", "--stop", "###", "--ignore-eos", "--max-new-tokens", "12",
        "--request-id", "cli-echo",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    request = fake_server.servicer.last_request("Generate")
    assert request.request_id == "cli-echo"
    assert (request.sampling.temperature, request.sampling.top_p) == (0.5, 0.25)
    assert (request.sampling.top_k, request.sampling.seed) == (9, 7)
    assert list(request.stopping.stop) == ["END", "###"]
    assert request.stopping.ignore_eos and request.stopping.max_new_tokens == 12
    assert 'stop: "END"' in result.stdout


def test_generate_with_tools_prints_the_calls(make_server, tmp_path):
    server = make_server(has_chat_template=True)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    result = run_cli(
        "generate", "Weather in Paris?", "--tools", str(tools), "--tool-choice", "get_weather",
        target=server.target,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"get_weather({FAKE_CALL_ARGUMENTS})\n"  # written as it streamed
    request = server.servicer.last_request("Chat")
    assert [tool.name for tool in request.tools] == ["get_weather"]
    assert request.tool_choice.function_name == "get_weather" and request.stream_tool_calls
    two = run_cli(
        "generate", "Weather?", "--tools", str(tools), "--tool-choice", "get_weather", "--n", "2",
        target=server.target,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr
    assert f"--- sample 0 ---\nget_weather({FAKE_CALL_ARGUMENTS})\n" in two.stdout
    assert not server.servicer.last_request("Chat").stream_tool_calls  # samples print whole
    bad = run_cli("generate", "x", "--tools", str(tmp_path / "missing.json"), target=server.target)
    assert bad.returncode == 2 and "cannot read tools from" in bad.stderr


def test_prompt_from_stdin_and_target_after_the_command(fake_server):
    result = run_cli("generate", "-", "--target", fake_server.target, stdin="a b c d\n")
    assert result.returncode == 0, result.stderr
    assert fake_server.servicer.last_request("Generate").prompt == "a b c d\n"


def test_server_error_prints_one_line_and_exits_1(fake_server):
    result = run_cli("generate", "error:RESOURCE_EXHAUSTED", target=fake_server.target)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        "pagoda: RESOURCE_EXHAUSTED: The fake server was asked to fail with RESOURCE_EXHAUSTED.\n"
    )


def test_error_mid_stream_ends_the_partial_line(fake_server):
    result = run_cli("generate", "error-after:INTERNAL", target=fake_server.target)
    assert (result.returncode, result.stdout) == (1, " t0\n")
    assert result.stderr.startswith("pagoda: INTERNAL: ")


def test_client_side_invalid_value_exits_1(fake_server):
    result = run_cli("generate", "x", "--max-new-tokens", "-1", target=fake_server.target)
    assert result.returncode == 1
    assert result.stderr.startswith("pagoda: INVALID_ARGUMENT: max_new_tokens=-1")


def test_usage_errors_exit_2(fake_server, tmp_path):
    assert run_cli("generate", target=fake_server.target).returncode == 2
    assert run_cli("generate", "x", "--top-k", "many").returncode == 2
    missing = tmp_path / "missing-key"
    result = run_cli("--api-key-file", str(missing), "info", target=fake_server.target)
    assert result.returncode == 2 and "cannot read --api-key-file" in result.stderr


def test_unreachable_server_is_an_unavailable_line():
    result = run_cli("info", "--target", "127.0.0.1:1", "--timeout-s", "5")
    assert result.returncode == 1
    assert result.stderr.startswith("pagoda: UNAVAILABLE: ")


def test_api_key_file(auth_server, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(TEST_API_KEY + "\n")
    ok = run_cli("--api-key-file", str(key_file), "generate", "hi", target=auth_server.target)
    assert (ok.returncode, ok.stdout) == (0, " t0 t1 t2 t3\n")
    refused = run_cli("generate", "hi", target=auth_server.target)
    assert refused.returncode == 1 and refused.stderr.startswith("pagoda: UNAUTHENTICATED: ")


# The CLI as an interactive shell starts it: SIGINT raises KeyboardInterrupt. A test run
# started in the background (`make test &` without job control) ignores SIGINT, its children
# inherit that, and Python then installs no handler: Ctrl-C would never reach the CLI.
INTERACTIVE_CLI = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'pagoda'; runpy.run_module('pagoda.client', run_name='__main__')"
)


def test_ctrl_c_cancels_the_stream_and_exits_130(fake_server):
    process = subprocess.Popen(
        [sys.executable, "-c", INTERACTIVE_CLI, "generate", "hang", "--request-id", "cli-sigint"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=cli_env(fake_server.target),
    )
    try:
        # The first chunk arrives while the server still holds the stream: it was flushed.
        assert process.stdout.read(3) == " t0"
        process.send_signal(signal.SIGINT)
        try:
            returncode = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Hung: SIGABRT makes faulthandler print every thread's stack into the failure.
            process.send_signal(signal.SIGABRT)
            _, stderr = process.communicate(timeout=30)
            pytest.fail(f"the CLI did not exit after SIGINT; its threads:\n{stderr[-6000:]}")
        assert returncode == 130
    finally:
        process.kill()
        process.communicate()
    assert fake_server.servicer.wait_cancelled("cli-sigint", timeout_s=10)


def test_chat_with_piped_turns(fake_server):
    turns = "hello\n\nhow are you\n/reset\nagain\n/exit\nnever sent\n"
    result = run_cli("chat", "--system", "Be kind.", stdin=turns, target=fake_server.target)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "(2 messages) you said: hello",
        "(4 messages) you said: how are you",
        "(2 messages) you said: again",
    ]
    assert "conversation reset" in result.stderr
    chats = [c.request for c in fake_server.servicer.requests if c.method == "Chat"]
    second = [(m.role, m.content) for m in chats[-2].messages]
    assert second == [
        ("system", "Be kind."),
        ("user", "hello"),
        ("assistant", "(2 messages) you said: hello"),
        ("user", "how are you"),
    ]


def test_chat_reports_a_failed_turn_and_goes_on(fake_server):
    result = run_cli("chat", stdin="error:UNAVAILABLE\nhi\n", target=fake_server.target)
    assert result.returncode == 1
    assert result.stdout == "(1 messages) you said: hi\n"
    assert result.stderr.startswith("pagoda: UNAVAILABLE: ")


def test_tokenize_and_detokenize(fake_server):
    tokens = run_cli("tokenize", "ok", "--special", target=fake_server.target)
    assert tokens.returncode == 0, tokens.stderr
    assert tokens.stdout == "1 111 107\n" and tokens.stderr == "3 tokens\n"
    text = run_cli("detokenize", *tokens.stdout.split(), target=fake_server.target)
    assert text.returncode == 0 and text.stdout == "<s>ok\n"
    skipped = run_cli("detokenize", "1", "111", "--skip-special", target=fake_server.target)
    assert skipped.stdout == "o\n"


def test_info_and_stats(fake_server):
    info = run_cli("info", target=fake_server.target)
    assert info.returncode == 0 and "model_id            fake-model" in info.stdout
    assert "quantization        int8" in info.stdout
    stats = json.loads(run_cli("stats", "--json", target=fake_server.target).stdout)
    assert stats["num_kv_blocks_total"] == 128 and stats["worker_connected"] is True
    info_json = json.loads(run_cli("info", "--json", target=fake_server.target).stdout)
    assert info_json["eos_token_ids"] == [2]
    table = run_cli("stats", target=fake_server.target).stdout
    assert re.search(r"^prefix_cache_hit_rate +0\.25$", table, re.M)
    # A list of records is one indented line each, its fields inline.
    assert re.search(r"^workers\n  incarnation_id=fake-incarnation  num_running=0 ", table, re.M)


def test_calls_print_as_they_stream_between_the_text_in_the_order_written(capsys):
    """A chunk's parts in order: more of the open call, its text, the calls it begins."""

    def chunk(text="", *deltas, finish=None, calls=()):
        return Chunk(
            "r", text, [1], None, finish, None, None, tool_calls=calls, tool_call_deltas=deltas
        )

    time_call = ToolCallDelta(1, "call_2", "get_time", "{")
    chunks = [
        chunk("Let me see.", ToolCallDelta(0, "call_1", "get_weather", '{"city"')),
        chunk("Then", ToolCallDelta(0, "", "", ': "Oslo"}'), time_call),
        chunk("", ToolCallDelta(1, "", "", "}"), finish="tool_calls"),
    ]
    completion, _, num_calls = _stream_to_stdout(chunks)
    assert capsys.readouterr().out == (
        'Let me see.\nget_weather({"city": "Oslo"})\nThen\nget_time({})\n'
    )
    assert num_calls == 2 and completion.text == "Let me see.Then"
