"""POST /v1/responses through the whole front in this process, against the client tests'
fake gRPC server, driven by the official `openai` client (whole and streamed: text, calls,
incomplete), by raw HTTP (statuses, the error event, the key passed on) and by raw ASGI (a
client that goes away cancels its gRPC call)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.client.fake_server import FAKE_CALL_ARGUMENTS, FAKE_CALL_ID
from tests.openai_front.conftest import front_app, with_front

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL_WEATHER = {"type": "function", "name": "get_weather"}


def sse_data(text: str) -> list[dict]:
    return [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def test_text_whole_and_streamed_parse_in_the_sdk(fake_server):
    # The fake answers "(<n> messages) you said: <last content>" and finishes by length.
    async def scenario(sdk, _):
        whole = await sdk.responses.create(
            model="fake-model", input="hello there", instructions="Be nice.", metadata={"k": "v"}
        )
        async with sdk.responses.stream(model="fake-model", input="hello there") as stream:
            deltas = [event.delta async for event in stream if event.type.endswith("text.delta")]
        events = [event async for event in await sdk.responses.create(input="echo", stream=True)]
        return whole, deltas, events

    whole, deltas, events = with_front(fake_server, scenario)
    assert whole.output_text == "(2 messages) you said: hello there"
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert whole.metadata == {"k": "v"} and whole.instructions == "Be nice."
    assert whole.id.startswith("resp_") and whole.model == "fake-model"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (6, 6)
    assert "".join(deltas) == "(1 messages) you said: hello there"
    # "echo" finishes by stop: completed; its text is the gRPC request the front sent.
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    text = events[-1].response.output_text
    assert 'role: "user" content: "echo"' in text and "temperature: 1" in text


def test_a_named_function_is_one_function_call_item_whole_and_streamed(fake_server):
    fields = dict(model="fake-model", input="Weather?", tools=[WEATHER], tool_choice=CALL_WEATHER)

    async def scenario(sdk, _):
        whole = await sdk.responses.create(**fields, parallel_tool_calls=False)
        async with sdk.responses.stream(**fields) as stream:
            streamed = await stream.get_final_response()
        return whole, streamed

    whole, streamed = with_front(fake_server, scenario)
    sent = fake_server.servicer.last_request("Chat")
    assert [t.name for t in sent.tools] == ["get_weather"]
    assert sent.tool_choice.function_name == "get_weather"
    for response in (whole, streamed):
        assert response.status == "completed"
        (call,) = response.output
        assert (call.type, call.call_id, call.name) == (
            "function_call",
            FAKE_CALL_ID,
            "get_weather",
        )
        assert json.loads(call.arguments) == json.loads(FAKE_CALL_ARGUMENTS)
        assert call.id.startswith("fc_")
    assert whole.parallel_tool_calls is False and whole.tool_choice.name == "get_weather"


def test_a_conversation_with_a_calls_output_reaches_the_grpc_chat(fake_server):
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]

    async def scenario(sdk, _):
        return await sdk.responses.create(model="fake-model", input=items, tools=[WEATHER])

    response = with_front(fake_server, scenario)
    assert response.output_text.endswith("you said: sunny")
    user, assistant, tool = fake_server.servicer.last_request("Chat").messages
    assert [(c.id, c.name) for c in assistant.tool_calls] == [("call_1", "get_weather")]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "sunny")


def test_refusals_and_failures_have_their_http_status(fake_server):
    bodies = {
        "previous_response_id": (400, {"input": "hi", "previous_response_id": "resp_0"}),
        "input[0].type": (400, {"input": [{"type": "input_image", "image_url": "u"}]}),
        "model": (404, {"input": "hi", "model": "another-model"}),
        "max_output_tokens": (400, {"input": "hi", "max_output_tokens": 0}),
        # The scheduler's refusal before the first chunk: its status, not a 200 stream.
        "rate": (429, {"input": "error:RESOURCE_EXHAUSTED", "stream": True}),
        "invalid": (400, {"input": "error:INVALID_ARGUMENT"}),
    }

    async def scenario(_, http):
        return {
            name: await http.post("/v1/responses", json=body) for name, (_, body) in bodies.items()
        }

    replies = with_front(fake_server, scenario)
    for name, (status, _) in bodies.items():
        reply = replies[name]
        assert reply.status_code == status, (name, reply.text)
        error = reply.json()["error"]
        assert error["message"], reply.text
        if status == 400 and name != "invalid":
            assert error["param"] == name, reply.text


def test_a_failure_after_the_stream_began_is_an_error_event(fake_server):
    async def scenario(_, http):
        body = {"input": "error-after:UNAVAILABLE", "stream": True}
        return await http.post("/v1/responses", json=body, headers={"Authorization": "Bearer k2"})

    reply = with_front(fake_server, scenario)
    assert reply.status_code == 200
    events = sse_data(reply.text)
    assert events[-1]["type"] == "error" and events[-1]["code"] == "service_unavailable"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert not any(e["type"] == "response.completed" for e in events)
    assert "[DONE]" not in reply.text
    # The caller's key travels with the gRPC call.
    assert fake_server.servicer.requests[-1].metadata["authorization"] == "Bearer k2"


def test_the_sdk_raises_the_refusal(fake_server):
    async def scenario(sdk, _):
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.create(input="hi", conversation="conv_1")
        return caught.value

    error = with_front(fake_server, scenario)
    assert error.body["param"] == "conversation" and error.body["code"] == "unsupported_parameter"


async def post_then_leave(app, body: dict, leave_after_s: float) -> list[dict]:
    """POST `body` to /v1/responses over raw ASGI; the client disconnects `leave_after_s`
    after the response's first body bytes (or after the request, for a whole response)."""
    payload = json.dumps(body).encode()
    incoming = [{"type": "http.request", "body": payload, "more_body": False}]
    gone = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        if incoming:
            return incoming.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            asyncio.get_running_loop().call_later(leave_after_s, gone.set)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/responses", "raw_path": b"/v1/responses",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("front", 80),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode())],
    }  # fmt: skip
    if not body.get("stream"):
        asyncio.get_running_loop().call_later(leave_after_s, gone.set)
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_its_grpc_call(fake_server, stream):
    # "hang": one chunk, then the fake waits until the call is cancelled (at most 30 s).
    async def main() -> list[dict]:
        async with front_app(fake_server.target) as app:
            body = {"input": "hang", "stream": stream}
            return await asyncio.wait_for(post_then_leave(app, body, 0.2), timeout=20)

    sent = asyncio.run(main())
    request_id = fake_server.servicer.last_request("Chat").request_id
    assert request_id.startswith("resp_")
    assert fake_server.servicer.wait_cancelled(request_id, timeout_s=10)
    start = sent[0]
    assert start["status"] == (200 if stream else 499)
