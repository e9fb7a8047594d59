"""Tool calling through the front, without a model: OpenAI's tools, tool_choice,
parallel_tool_calls and call messages into the gRPC Chat request, the calls back as a whole
message and as stream events (assembled by the official `openai` package), the refusals, and
the whole route in-process against the client tests' fake gRPC server."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pagoda.client.convert import chat_request
from pagoda.client.errors import InvalidArgumentError
from pagoda.client.results import Chunk, TokenLogprob, ToolCall, Usage
from pagoda.openai_front import responses
from pagoda.openai_front.errors import FrontError
from pagoda.openai_front.responses import Choice, Header
from pagoda.openai_front.schemas import ChatCompletionRequest
from pagoda.openai_front.stream_events import chunk_events, role_event
from pagoda.openai_front.translation import Call, plan_chat
from pagoda.protos import generation_pb2 as pb
from tests.client.fake_server import (
    FAKE_CALL_ARGUMENTS,
    FAKE_CALL_ID,
    TOOL_CHOICES,
    WEATHER,
    WEATHER_SCHEMA,
)
from tests.openai_front.conftest import with_front

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL_A = ToolCall("call_" + "a" * 24, "get_weather", '{"city":"Paris"}')
CALL_B = ToolCall("call_" + "b" * 24, "get_time", "{}")


def grpc_request(**fields) -> pb.ChatRequest:
    """The gRPC request the front sends for a chat body."""
    body = ChatCompletionRequest(**{"messages": MESSAGES, **fields})
    (call,) = plan_chat(body, "id", max_n=4).calls
    return chat_request(call.messages, **call.options)


# -- request ------------------------------------------------------------------------------


def test_tools_become_the_grpc_tools_with_their_schema_as_text():
    request = grpc_request(tools=[WEATHER, TIME])
    assert [(t.name, t.description) for t in request.tools] == [
        ("get_weather", "The weather of a city."),
        ("get_time", ""),
    ]
    assert json.loads(request.tools[0].parameters) == WEATHER_SCHEMA
    assert request.tools[1].parameters == ""  # none given: any object
    assert not request.HasField("tool_choice") and not request.HasField("parallel_tool_calls")


def test_parameters_that_are_not_an_object_go_on_as_json_for_the_scheduler_to_check():
    tool = {"type": "function", "function": {"name": "f", "parameters": "nope"}}
    assert grpc_request(tools=[tool]).tools[0].parameters == '"nope"'


@pytest.mark.parametrize("strict", [None, False, True])
def test_a_functions_strict_is_passed_on_false_when_absent(strict):
    function = {**WEATHER["function"], "strict": strict}
    request = grpc_request(tools=[{"type": "function", "function": function}])
    assert request.tools[0].strict is bool(strict)


@pytest.mark.parametrize(
    ("tool_choice", "field", "value"),
    TOOL_CHOICES,
)
def test_tool_choice_becomes_the_grpc_choice(tool_choice, field, value):
    request = grpc_request(tools=[WEATHER], tool_choice=tool_choice)
    assert request.tool_choice.WhichOneof("choice") == field
    assert getattr(request.tool_choice, field) == value


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_is_passed_on(parallel):
    request = grpc_request(tools=[WEATHER], parallel_tool_calls=parallel)
    assert request.HasField("parallel_tool_calls") and request.parallel_tool_calls is parallel


def test_a_conversation_with_calls_and_tool_answers():
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": CALL_A.id, "type": "function",
                 "function": {"name": CALL_A.name, "arguments": CALL_A.arguments}},
                {"id": CALL_B.id, "type": "function",
                 "function": {"name": CALL_B.name, "arguments": CALL_B.arguments}},
            ],
        },
        {"role": "tool", "tool_call_id": CALL_A.id, "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": CALL_B.id,
         "content": [{"type": "text", "text": "noon"}]},
        {"role": "assistant", "content": "Sunny at noon."},
        {"role": "user", "name": "ann", "content": "Thanks"},
    ]  # fmt: skip
    request = grpc_request(messages=messages, tools=[WEATHER, TIME])
    user, assistant, weather, time, answer, thanks = request.messages
    assert (assistant.role, assistant.content) == ("assistant", "")
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [
        (CALL_A.id, CALL_A.name, CALL_A.arguments),
        (CALL_B.id, CALL_B.name, CALL_B.arguments),
    ]
    assert (weather.role, weather.tool_call_id, weather.name, weather.content) == (
        "tool", CALL_A.id, "get_weather", "sunny"
    )  # fmt: skip
    assert (time.tool_call_id, time.name, time.content) == (CALL_B.id, "", "noon")
    assert (answer.content, list(answer.tool_calls)) == ("Sunny at noon.", [])
    # A participant's name on another role goes on too (the template may show it).
    assert (thanks.role, thanks.name, thanks.content) == ("user", "ann", "Thanks")
    assert not user.tool_call_id


def test_without_tools_the_request_is_as_before():
    (call,) = plan_chat(ChatCompletionRequest(messages=MESSAGES), "id", 4).calls
    assert call.messages == MESSAGES
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(call.options)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEATHER, {"type": "web_search"}]}, "tools[1].type", "'web_search'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "must be given"),
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
        ({"function_call": "auto"}, "function_call", "use tool_choice"),
        ({"function_call": {"name": "f"}}, "function_call", "use tool_choice"),
        (
            {"messages": [*MESSAGES, {"role": "assistant", "content": None}]},
            "messages[1].content",
            "must be given",
        ),
        (
            {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "custom", "function": {"name": "f", "arguments": "{}"}}
            ]}]},
            "messages[1].tool_calls[0].type",
            "'custom'",
        ),
    ],
)  # fmt: skip
def test_what_the_grpc_api_cannot_express_is_a_400_naming_it(fields, param, words):
    body = ChatCompletionRequest(**{"messages": MESSAGES, **fields})
    with pytest.raises(FrontError) as caught:
        plan_chat(body, "id", 4)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert param in caught.value.message and words in caught.value.message


@pytest.mark.parametrize(
    ("tool_choice", "named"),
    [
        ("get_weather", "tool_choice"),
        ({"type": "function", "function": {}}, "tool_choice.function.name"),
        ({"type": "allowed_tools", "allowed_tools": {}}, "tool_choice.type"),
    ],
)
def test_a_tool_choice_of_no_grpc_form_is_refused_by_the_clients_converter(tool_choice, named):
    # The front's handler turns this PagodaError into a 400 with the same sentence.
    with pytest.raises(InvalidArgumentError) as caught:
        grpc_request(tools=[WEATHER], tool_choice=tool_choice)
    assert named in caught.value.details


# -- response -----------------------------------------------------------------------------

HEADER = Header("chatcmpl-1", 5, "m", "chat")
USAGE = Usage(prompt_tokens=9, completion_tokens=4, cached_prompt_tokens=0)


def chat_call(**fields) -> Call:
    return Call(0, 0, None, MESSAGES, {}, **fields)


def last_chunk(text: str = "", calls=(CALL_A, CALL_B)) -> Chunk:
    reason = "tool_calls" if calls else "stop"
    return Chunk("r", text, [7], None, reason, USAGE, None, tool_calls=calls)


@pytest.mark.parametrize(
    ("text", "content"), [("", None), (" \n", None), ("Checking.", "Checking.")]
)
def test_a_whole_response_gives_the_calls_in_its_message(text, content):
    choice = Choice(chat_call())
    choice.add(Chunk("r", text, [5, 6], None, None, None, None))
    choice.add(last_chunk())
    (out,) = responses.whole_response(HEADER, [choice], None)["choices"]
    assert out["finish_reason"] == "tool_calls"
    assert out["message"] == {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": CALL_A.id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": CALL_B.id, "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }  # fmt: skip
    parsed = openai.types.chat.ChatCompletion.model_validate(
        responses.whole_response(HEADER, [choice], None)
    )
    assert [c.function.name for c in parsed.choices[0].message.tool_calls] == [
        "get_weather",
        "get_time",
    ]


def test_a_response_without_calls_keeps_its_content():
    choice = Choice(chat_call())
    choice.add(last_chunk(" ", calls=()))
    (out,) = responses.whole_response(HEADER, [choice], None)["choices"]
    assert out["message"] == {"role": "assistant", "content": " "}
    assert out["finish_reason"] == "stop"


def stream_events(chunks, call: Call | None = None) -> list[dict]:
    call = call or chat_call()
    events = [role_event(HEADER, 0, False)]
    for chunk in chunks:
        events += chunk_events(HEADER, call, chunk, None, False)
    return events


def test_a_stream_sends_the_text_then_the_calls_then_the_finish():
    events = stream_events([Chunk("r", "Hm", [5], None, None, None, None), last_chunk(".")])
    deltas = [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events]
    assert deltas == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Hm"}, None),
        ({"content": "."}, None),
        (
            {"tool_calls": [
                {"index": 0, "id": CALL_A.id, "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                {"index": 1, "id": CALL_B.id, "type": "function",
                 "function": {"name": "get_time", "arguments": "{}"}},
            ]},
            None,
        ),
        ({}, "tool_calls"),
    ]  # fmt: skip


def test_a_last_chunk_of_no_tokens_sends_the_calls_and_the_finish_only():
    empty = Chunk("r", "", [], None, "tool_calls", USAGE, None, tool_calls=(CALL_B,))
    events = chunk_events(HEADER, chat_call(), empty, None, False)
    assert [list(e["choices"][0]["delta"]) for e in events] == [["tool_calls"], []]


def test_tokens_of_held_text_send_no_empty_content_delta():
    """The call's own tokens come with no text: unless ids or logprobs were asked for, they
    are no event (a live stream showed a {"content": ""} before the calls)."""
    held = Chunk("r", "", [5, 6], None, None, None, None)
    last = Chunk("r", "", [7], None, "tool_calls", USAGE, None, tool_calls=(CALL_A,))
    events = stream_events([held, last])
    assert [e["choices"][0]["delta"] for e in events][1:] == [
        {"tool_calls": [{"index": 0, "id": CALL_A.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {},
    ]  # fmt: skip


def test_the_streamed_calls_keep_tokens_logprobs_and_the_choice_index():
    entry = TokenLogprob(token_id=7, logprob=-0.5, top_token_ids=[7], top_logprobs=[-0.5])
    chunk = Chunk("r", "", [7], [entry], "tool_calls", USAGE, None, index=1, tool_calls=(CALL_A,))
    call = Call(2, 0, None, MESSAGES, {}, n=2, return_token_ids=True)
    tokens, calls, end = chunk_events(HEADER, call, chunk, 0, True)
    assert [e["choices"][0]["index"] for e in (tokens, calls, end)] == [3, 3, 3]
    assert tokens["choices"][0]["token_ids"] == [7] and tokens["choices"][0]["logprobs"]
    assert calls["choices"][0]["token_ids"] == [] and calls["choices"][0]["logprobs"] is None
    assert end["choices"][0]["token_ids"] == [] and end["choices"][0]["logprobs"] is None
    assert all("usage" in e and e["usage"] is None for e in (tokens, calls, end))


def test_the_openai_package_assembles_the_streamed_calls():
    events = stream_events([Chunk("r", "", [5], None, None, None, None), last_chunk()])
    state = ChatCompletionStreamState(input_tools=[WEATHER, TIME])
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        (CALL_A.id, "get_weather", '{"city":"Paris"}'),
        (CALL_B.id, "get_time", "{}"),
    ]
    # A strict tool's arguments are parsed by the package too.
    assert choice.message.tool_calls[0].function.parsed_arguments == {"city": "Paris"}


# -- the whole route, in-process against the fake gRPC server -------------------------------


def test_a_named_tool_choice_through_the_front_whole_and_streamed(fake_server):
    choice = {"type": "function", "function": {"name": "get_weather"}}

    async def scenario(sdk, _):
        whole = await sdk.chat.completions.create(
            model="fake-model", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice,
            parallel_tool_calls=False,
        )  # fmt: skip
        async with sdk.chat.completions.stream(
            model="fake-model", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice
        ) as stream:
            streamed = await stream.get_final_completion()
        return whole, streamed

    whole, streamed = with_front(fake_server, scenario)
    sent = fake_server.servicer.last_request("Chat")
    assert [t.name for t in sent.tools] == ["get_weather", "get_time"]
    assert sent.tool_choice.function_name == "get_weather"
    for completion in (whole, streamed):
        (choice_out,) = completion.choices
        assert choice_out.finish_reason == "tool_calls"
        assert choice_out.message.content in (None, "")
        (tool_call,) = choice_out.message.tool_calls
        assert (tool_call.id, tool_call.function.name) == (FAKE_CALL_ID, "get_weather")
        assert json.loads(tool_call.function.arguments) == json.loads(FAKE_CALL_ARGUMENTS)
    assert whole.choices[0].message.content is None
    assert whole.usage.completion_tokens == 3


def test_refusals_through_the_front_are_400s_naming_the_field(fake_server):
    bodies = {
        "tools.0.function.name": {"tools": [{"type": "function", "function": {}}]},
        "tools[0].type": {"tools": [{"type": "code_interpreter"}]},
        "tool_choice": {"tools": [WEATHER], "tool_choice": "get_weather"},
        "functions": {"functions": [{"name": "get_weather"}]},
        "messages.1.tool_calls.0.function.arguments": {
            "messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
            ]}]
        },
    }  # fmt: skip

    async def scenario(_, http):
        return {
            field: await http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
            for field, body in bodies.items()
        }

    for field, response in with_front(fake_server, scenario).items():
        assert response.status_code == 400, (field, response.text)
        assert field in response.json()["error"]["message"], response.text
