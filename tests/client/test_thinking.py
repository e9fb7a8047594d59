"""Models that think: reasoning_text into chunks and completions, the chat_template_kwargs
option (sent as JSON text, refused client-side when it cannot be), ModelInfo.thinks, both
clients and the CLI against a fake server whose model thinks."""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest

from pagoda.client import AsyncClient, Client
from pagoda.client.convert import chat_request, chunk_from_response, generate_request
from pagoda.client.errors import InvalidArgumentError
from pagoda.client.results import join_chunks, join_samples
from pagoda.protos import generation_pb2 as pb
from tests.client.fake_server import FAKE_THOUGHT
from tests.client.test_cli import run_cli

USER = {"role": "user", "content": "hi"}
ANSWER = "(1 messages) you said: hi"
NO_THINKING = {"enable_thinking": False}


def test_reasoning_text_reaches_the_chunk_and_is_joined_apart_from_the_text():
    responses = [
        pb.GenerateResponse(request_id="r", reasoning_text="Hm", token_ids=[1]),
        pb.GenerateResponse(request_id="r", reasoning_text=", ok.", text="Yes", token_ids=[2]),
        pb.GenerateResponse(
            request_id="r",
            text=".",
            token_ids=[3],
            finish_reason=pb.STOP,
            usage=pb.Usage(completion_tokens=3, reasoning_tokens=1),
        ),
    ]
    chunks = [chunk_from_response(response) for response in responses]
    assert [(c.reasoning_text, c.text) for c in chunks] == [("Hm", ""), (", ok.", "Yes"), ("", ".")]
    completion = join_chunks(chunks)
    assert (completion.reasoning_text, completion.text) == ("Hm, ok.", "Yes.")
    assert completion.token_ids == [1, 2, 3]
    assert (completion.usage.completion_tokens, completion.usage.reasoning_tokens) == (3, 1)
    (sample,) = join_samples(chunks)
    assert sample.reasoning_text == "Hm, ok."
    assert join_chunks([chunks[-1]]).reasoning_text == ""


def test_chat_template_kwargs_go_as_json_text():
    kwargs = {"enable_thinking": False, "style": {"terse": True}}
    request = chat_request([USER], chat_template_kwargs=kwargs)
    assert json.loads(request.chat_template_kwargs) == kwargs
    assert chat_request([USER]).chat_template_kwargs == ""


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ('{"enable_thinking": false}', "must be a dict with string keys"),
        ([("enable_thinking", False)], "must be a dict with string keys"),
        ({1: True}, "must be a dict with string keys"),
        ({"when": {1, 2}}, "not JSON-serializable"),
        ({"temperature": math.nan}, "not JSON-serializable"),
    ],
)
def test_chat_template_kwargs_that_are_no_json_object_are_refused_before_sending(kwargs, words):
    with pytest.raises(InvalidArgumentError) as caught:
        chat_request([USER], chat_template_kwargs=kwargs)
    assert "chat_template_kwargs" in caught.value.details and words in caught.value.details


def test_generate_refuses_chat_template_kwargs():
    with pytest.raises(InvalidArgumentError) as caught:
        generate_request("x", chat_template_kwargs=NO_THINKING)
    assert "chat_template_kwargs is an option of chat()" in caught.value.details


def test_both_clients_stream_the_thinking_before_the_answer(make_server):
    server = make_server(thinks=True)

    async def scenario() -> tuple:
        async with AsyncClient(server.target) as client:
            info = await client.model_info()
            return info, [chunk async for chunk in client.chat([USER])]

    info, async_chunks = asyncio.run(asyncio.wait_for(scenario(), timeout=20))
    assert info.thinks is True
    with Client(server.target) as client:
        chunks = list(client.chat([USER]))
        plain = join_chunks(client.chat([USER], chat_template_kwargs=NO_THINKING))
    for received in (async_chunks, chunks):
        completion = join_chunks(received)
        assert (completion.reasoning_text, completion.text) == (FAKE_THOUGHT, ANSWER)
        # All thinking comes first: no chunk after the first text carries any.
        first_text = next(i for i, chunk in enumerate(received) if chunk.text)
        assert all(not chunk.reasoning_text for chunk in received[first_text + 1 :])
        assert received[first_text].reasoning_text  # the last thought beside the first word
    sent = server.servicer.last_request("Chat")
    assert json.loads(sent.chat_template_kwargs) == NO_THINKING
    assert (plain.reasoning_text, plain.text) == ("", ANSWER)


def test_the_cli_shows_the_thinking_on_stderr_between_think_lines(make_server):
    server = make_server(thinks=True, has_chat_template=True)
    result = run_cli("generate", "hi", target=server.target)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n"
    assert result.stderr == f"<think>\n{FAKE_THOUGHT}\n</think>\n"
    # Cut short while thinking: the frame is closed, the answer is an empty line.
    cut = run_cli("generate", "hi", "--max-new-tokens", "2", target=server.target)
    assert (cut.stdout, cut.stderr) == ("\n", "<think>\nHm, a\n</think>\n")


def test_the_cli_sends_chat_template_kwargs_and_shows_thinks(make_server):
    server = make_server(thinks=True, has_chat_template=True)
    kwargs = json.dumps(NO_THINKING)
    result = run_cli("chat", "--chat-template-kwargs", kwargs, stdin="hi\n", target=server.target)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ANSWER + "\n" and "<think>" not in result.stderr
    assert json.loads(server.servicer.last_request("Chat").chat_template_kwargs) == NO_THINKING
    bad = run_cli("chat", "--chat-template-kwargs", "[1]", stdin="hi\n", target=server.target)
    assert bad.returncode == 2 and "expected a JSON object" in bad.stderr
    info = run_cli("info", target=server.target)
    assert info.returncode == 0 and re.search(r"^thinks +True$", info.stdout, re.M)


def test_an_assistant_messages_reasoning_content_is_sent_and_checked():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
    ]
    assert [m.reasoning_content for m in chat_request(messages).messages] == ["", "Greet back."]
    bad = [{"role": "assistant", "content": "Hello.", "reasoning_content": 1}]
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\].reasoning_content"):
        chat_request(bad)
