"""The client's cache_salt option (issue 14 item 12): the converter, both clients' keyword
and the CLI's --cache-salt put it in the request."""

from __future__ import annotations

from pagoda.client.convert import chat_request, generate_request
from tests.client.test_cli import run_cli


def test_converter_sets_cache_salt_on_generate_and_chat():
    assert generate_request("hi", cache_salt="tenant-a").cache_salt == "tenant-a"
    assert chat_request([("user", "hi")], cache_salt="tenant-b").cache_salt == "tenant-b"
    assert generate_request("hi").cache_salt == ""


def test_cli_cache_salt_reaches_the_server(fake_server):
    result = run_cli(
        "--target", fake_server.target, "generate", "echo", "--cache-salt", "tenant-a",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert fake_server.servicer.last_request("Generate").cache_salt == "tenant-a"
    result = run_cli("chat", "--cache-salt", "t-b", stdin="hi\n", target=fake_server.target)
    assert result.returncode == 0, result.stderr
    assert fake_server.servicer.last_request("Chat").cache_salt == "t-b"
