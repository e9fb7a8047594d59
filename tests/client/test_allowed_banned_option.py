"""The client's allowed_token_ids / banned_token_ids options (issue 28 item 5): the
converter, both clients' keywords and the CLI's --allowed-token-ids / --banned-token-ids put
them in the request's sampling parameters."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.client import AsyncClient, Client
from pagoda.client.convert import chat_request, generate_request
from pagoda.client.errors import InvalidArgumentError
from tests.client.test_cli import run_cli


def test_converter_sets_both_lists_on_generate_and_chat():
    request = generate_request("hi", allowed_token_ids=[5, 3], banned_token_ids=(7,))
    assert list(request.sampling.allowed_token_ids) == [5, 3]
    assert list(request.sampling.banned_token_ids) == [7]
    chat = chat_request([("user", "hi")], banned_token_ids=[1, 2])
    assert list(chat.sampling.banned_token_ids) == [1, 2]
    assert list(generate_request("hi").sampling.allowed_token_ids) == []


def test_converter_refuses_a_negative_id_before_sending():
    with pytest.raises(InvalidArgumentError, match="allowed_token_ids"):
        generate_request("hi", allowed_token_ids=[-1])


def test_both_clients_send_the_lists(fake_server):
    async def scenario():
        async with AsyncClient(fake_server.target) as client:
            await client.complete("echo", allowed_token_ids=[4, 9])

    asyncio.run(asyncio.wait_for(scenario(), timeout=20))
    assert list(fake_server.servicer.last_request("Generate").sampling.allowed_token_ids) == [4, 9]
    with Client(fake_server.target) as client:
        client.complete("echo", banned_token_ids=[2])
        list(client.chat([("user", "hi")], allowed_token_ids=[6]))
    assert list(fake_server.servicer.last_request("Generate").sampling.banned_token_ids) == [2]
    assert list(fake_server.servicer.last_request("Chat").sampling.allowed_token_ids) == [6]


def test_cli_flags_reach_the_server(fake_server):
    result = run_cli(
        "--target", fake_server.target, "generate", "--raw", "echo",
        "--allowed-token-ids", "1,2,3", "--banned-token-ids", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sampling = fake_server.servicer.last_request("Generate").sampling
    assert list(sampling.allowed_token_ids) == [1, 2, 3]
    assert list(sampling.banned_token_ids) == [2]
    result = run_cli("chat", "--banned-token-ids", "8, 9", stdin="hi\n", target=fake_server.target)
    assert result.returncode == 0, result.stderr
    assert list(fake_server.servicer.last_request("Chat").sampling.banned_token_ids) == [8, 9]


def test_cli_refuses_a_list_that_is_not_ids(fake_server):
    result = run_cli("--target", fake_server.target, "generate", "x", "--allowed-token-ids", "a,b")
    assert result.returncode == 2
    assert "--allowed-token-ids" in result.stderr
