"""Chat completions of a model that thinks: its reasoning as the message's
`reasoning_content` (whole) and as `reasoning_content` deltas (streamed, with the tokens'
logprobs on the event of the chunk that carried them), no such key for an answer without
reasoning, and chat_template_kwargs passed on; without processes, then through the whole
front in this process against the client tests' fake gRPC server, read by the official
`openai` package."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest
from openai.types.chat import ChatCompletion

from pagoda.client.results import Chunk, TokenLogprob, ToolCall, Usage
from pagoda.openai_front import responses
from pagoda.openai_front.responses import Choice, Header
from pagoda.openai_front.stream_events import chunk_events, role_event
from pagoda.openai_front.translation import Call
from tests.client.fake_server import FAKE_THOUGHT, FakeGenerationServicer, FakeServer
from tests.openai_front.conftest import with_front

MESSAGES = [{"role": "user", "content": "hi"}]
ANSWER = "(1 messages) you said: hi"
HEADER = Header("chatcmpl-1", 5, "m", "chat")
USAGE = Usage(prompt_tokens=9, completion_tokens=3, cached_prompt_tokens=0)
CALL = ToolCall("call_" + "a" * 24, "get_weather", '{"city":"Paris"}')


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[FakeServer]:
    with FakeServer(FakeGenerationServicer(thinks=True)) as server:
        yield server


def sse_data(text: str) -> list[dict]:
    """The events of a chat stream, which ends with data: [DONE]."""
    *events, done = [line for line in text.splitlines() if line.startswith("data: ")]
    assert done == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in events]


def token(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5, [token_id], [-0.5])


def thinking_chunks(**last) -> list[Chunk]:
    """Reasoning alone, reasoning and text in one chunk, text alone, then the finish: one
    token each but the finish."""
    return [
        Chunk("r", "", [5], [token(5)], None, None, None, reasoning_text="Hm"),
        Chunk("r", "Yes", [6], [token(6)], None, None, None, reasoning_text=", ok."),
        Chunk("r", ".", [7], [token(7)], None, None, None),
        Chunk("r", "", [], None, last.pop("reason", "stop"), USAGE, None, **last),
    ]


# -- without processes ----------------------------------------------------------------------


def test_a_whole_message_carries_the_reasoning_beside_the_content_and_the_calls():
    choice = Choice(Call(0, 0, None, MESSAGES, {}))
    for chunk in thinking_chunks():
        choice.add(chunk)
    called = Choice(Call(0, 0, None, MESSAGES, {}))
    for chunk in thinking_chunks(reason="tool_calls", tool_calls=(CALL,)):
        called.add(chunk)
    (out,) = responses.whole_response(HEADER, [choice], None)["choices"]
    assert out["message"] == {
        "role": "assistant",
        "content": "Yes.",
        "reasoning_content": "Hm, ok.",
        "reasoning": "Hm, ok.",  # vLLM's newer name, as vLLM sends both
    }
    body = responses.whole_response(HEADER, [called], None)
    message = ChatCompletion.model_validate(body).choices[0].message
    assert (message.content, message.reasoning_content) == ("Yes.", "Hm, ok.")
    assert [call.id for call in message.tool_calls] == [CALL.id]


def test_a_stream_sends_reasoning_deltas_then_content_each_with_its_tokens_logprobs():
    call = Call(2, 0, None, MESSAGES, {}, n=2, return_token_ids=True)
    chunks = [dataclasses.replace(chunk, index=1) for chunk in thinking_chunks()]
    events = [role_event(HEADER, 3, False)]
    for chunk in chunks:
        events += chunk_events(HEADER, call, chunk, 0, False)
    choices = [event["choices"][0] for event in events]
    assert [(c["index"], c["delta"], c["finish_reason"]) for c in choices] == [
        (3, {"role": "assistant", "content": ""}, None),
        (3, {"reasoning_content": "Hm", "reasoning": "Hm"}, None),
        (3, {"reasoning_content": ", ok.", "reasoning": ", ok.", "content": "Yes"}, None),
        (3, {"content": "."}, None),
        (3, {}, "stop"),
    ]
    assert [c["token_ids"] for c in choices[1:]] == [[5], [6], [7], []]
    logprobs = [c["logprobs"]["content"] if c["logprobs"] else [] for c in choices[1:]]
    assert [[t["token"] for t in tokens] for tokens in logprobs] == [
        ["token_id:5"],
        ["token_id:6"],
        ["token_id:7"],
        [],
    ]


def test_a_stream_of_reasoning_then_calls_sends_no_reasoning_on_the_calls_or_the_finish():
    last = Chunk(
        "r", "", [7], None, "tool_calls", USAGE, None, tool_calls=(CALL,), reasoning_text="Go."
    )
    tokens, calls, end = chunk_events(HEADER, Call(0, 0, None, MESSAGES, {}), last, None, False)
    assert tokens["choices"][0]["delta"] == {"reasoning_content": "Go.", "reasoning": "Go."}
    assert list(calls["choices"][0]["delta"]) == ["tool_calls"]
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "tool_calls"


# -- through the front ----------------------------------------------------------------------


def test_the_whole_answer_has_reasoning_content_and_the_sdk_reads_it(thinking_server):
    async def scenario(sdk, http):
        completion = await sdk.chat.completions.create(model="fake-model", messages=MESSAGES)
        raw = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
        return completion, raw.json()

    completion, raw = with_front(thinking_server, scenario)
    message = completion.choices[0].message
    assert (message.content, message.reasoning_content) == (ANSWER, FAKE_THOUGHT)
    assert raw["choices"][0]["message"] == {
        "role": "assistant",
        "content": ANSWER,
        "reasoning_content": FAKE_THOUGHT,
        "reasoning": FAKE_THOUGHT,
    }
    assert raw["usage"]["completion_tokens"] == 7  # thinking and answer, one count
    # Of them, the thinking's: the fake's last thought shares its token with the answer.
    assert raw["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert completion.usage.completion_tokens_details.reasoning_tokens == 2


def test_the_stream_sends_the_reasoning_first_the_role_once_every_logprob_once(thinking_server):
    body = {
        "messages": MESSAGES,
        "stream": True,
        "logprobs": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }

    async def scenario(sdk, http):
        raw = await http.post("/v1/chat/completions", json=body)
        stream = await sdk.chat.completions.create(
            model="fake-model", messages=MESSAGES, stream=True
        )
        return sse_data(raw.text), [chunk.choices[0].delta async for chunk in stream]

    events, sdk_deltas = with_front(thinking_server, scenario)
    *chunks, usage = events
    deltas = [event["choices"][0]["delta"] for event in chunks]
    assert [("role" in delta) for delta in deltas] == [True] + [False] * (len(deltas) - 1)
    kinds = [tuple(key for key in ("reasoning_content", "content") if key in d) for d in deltas]
    # Reasoning alone, one event of both (the last thought, the first word), then content.
    first_both = kinds.index(("reasoning_content", "content"))
    assert set(kinds[1:first_both]) == {("reasoning_content",)}
    assert set(kinds[first_both + 1 : -1]) == {("content",)} and kinds[-1] == ()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == FAKE_THOUGHT
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    # Every token's id and logprob once, on the event of the chunk that carried it.
    choices = [event["choices"][0] for event in chunks[1:]]
    token_ids = [i for c in choices for i in c["token_ids"]]
    logprobs = [t for c in choices if c["logprobs"] for t in c["logprobs"]["content"]]
    assert [len(c["token_ids"]) for c in choices] == [
        len(c["logprobs"]["content"]) if c["logprobs"] else 0 for c in choices
    ]
    assert len(token_ids) == len(logprobs) == usage["usage"]["completion_tokens"] == 7
    # The official client reads the reasoning deltas too (an extra field of its type).
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in sdk_deltas) == (
        FAKE_THOUGHT
    )
    assert "".join(d.content or "" for d in sdk_deltas) == ANSWER


def test_an_answer_without_reasoning_has_no_reasoning_content_key(fake_server):
    body = {"messages": MESSAGES}

    async def scenario(_, http):
        whole = await http.post("/v1/chat/completions", json=body)
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        return whole.json(), sse_data(streamed.text)

    whole, events = with_front(fake_server, scenario)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert "completion_tokens_details" not in whole["usage"]  # as before thinking models
    deltas = [event["choices"][0]["delta"] for event in events]
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    assert not any("reasoning_content" in delta for delta in deltas)


def test_chat_template_kwargs_reach_the_grpc_chat_as_json(thinking_server):
    async def scenario(sdk, _):
        return await sdk.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )

    completion = with_front(thinking_server, scenario)
    sent = thinking_server.servicer.last_request("Chat")
    assert json.loads(sent.chat_template_kwargs) == {"enable_thinking": False}
    # The fake model then answers without thinking: no reasoning_content at all.
    message = completion.choices[0].message
    assert message.content == ANSWER and "reasoning_content" not in message.model_dump()


@pytest.mark.parametrize("kwargs", ["enable_thinking=false", ["enable_thinking"], 1, True])
def test_chat_template_kwargs_that_are_no_object_are_a_400_naming_it(fake_server, kwargs):
    async def scenario(_, http):
        body = {"messages": MESSAGES, "chat_template_kwargs": kwargs}
        return await http.post("/v1/chat/completions", json=body)

    reply = with_front(fake_server, scenario)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "chat_template_kwargs")


def test_an_assistant_turns_reasoning_content_goes_back_to_the_template(thinking_server):
    """A conversation sent back with its thinking (a tool loop): the gRPC message has it."""
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
        {"role": "user", "content": "more"},
    ]

    async def scenario(sdk, _):
        return await sdk.chat.completions.create(model="fake-model", messages=conversation)

    with_front(thinking_server, scenario)
    sent = thinking_server.servicer.last_request("Chat").messages
    assert [m.reasoning_content for m in sent] == ["", "Greet back.", ""]
    # Under vLLM's newer name too; under both, they must agree.
    conversation[1] = {"role": "assistant", "content": "Hello.", "reasoning": "Greet back."}
    with_front(thinking_server, scenario)
    sent = thinking_server.servicer.last_request("Chat").messages
    assert [m.reasoning_content for m in sent] == ["", "Greet back.", ""]
    conversation[1] = {**conversation[1], "reasoning_content": "Something else."}

    async def refused(_, http):
        return await http.post("/v1/chat/completions", json={"messages": conversation})

    reply = with_front(thinking_server, refused)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[1].reasoning"
