"""Structured output with the real default model (SmolLM2-135M-Instruct) over gRPC Chat: a
schema with strings, integers and an enum gives JSON that parses and validates, greedy
and sampled, and the request ends on its own (STOP) when the object is complete."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.protos import generation_pb2_grpc
from tests.e2e.conftest import running_service

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "calm"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Describe a person called Ann who is 31 and happy, as JSON.",
    "Invent a character for a story. Reply with JSON.",
    "Who is the oldest person you can think of? Answer in JSON.",
]


def valid_person(value) -> bool:
    return (
        set(value) == {"name", "age", "mood"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 20
        and isinstance(value["age"], int)
        and 0 <= value["age"] <= 150
        and value["mood"] in ("happy", "sad", "calm")
    )


def test_a_person_schema_gives_valid_json(default_model_dir, tmp_path):
    samplings = (pb.SamplingParams(), pb.SamplingParams(temperature=0.8, seed=1))
    requests = [
        pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content=question)],
            sampling=sampling,
            stopping=pb.StoppingCriteria(max_new_tokens=96),
            constraint=pb.Constraint(json_schema=json.dumps(PERSON)),
        )
        for question in QUESTIONS
        for sampling in samplings
    ]
    with running_service(tmp_path, model="default") as service, service.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with ThreadPoolExecutor(len(requests)) as pool:  # one batch: constrained rows together
            replies = list(pool.map(lambda r: list(stub.Chat(r, timeout=600)), requests))
    for request, responses in zip(requests, replies, strict=True):
        text = "".join(r.text for r in responses)
        assert responses[-1].finish_reason == pb.STOP, (request.messages[0].content, text)
        assert valid_person(json.loads(text)), (request.messages[0].content, text)


WEATHER = pb.Tool(
    name="get_weather",
    description="Get the current weather in a city",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        }
    ),
)
TIME = pb.Tool(
    name="get_time",
    description="Get the current time in a time zone",
    parameters=json.dumps({"type": "object", "properties": {"timezone": {"type": "string"}}}),
)


def test_required_tool_choice_calls_the_fitting_tool_with_the_city(default_model_dir, tmp_path):
    """The default template takes no tools: the server describes them in the system message,
    and REQUIRED constrains the answer to calls. The schema leaves extra properties open; the
    constraint closes it, so the call ends instead of inventing fields."""
    request = pb.ChatRequest(
        messages=[
            pb.ChatMessage(role="user", content="What is the weather like in Paris right now?")
        ],
        tools=[WEATHER, TIME],
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
        stopping=pb.StoppingCriteria(max_new_tokens=80),
    )
    with (
        running_service(tmp_path, model=str(default_model_dir)) as service,
        service.channel() as channel,
    ):
        responses = list(generation_pb2_grpc.GenerationStub(channel).Chat(request, timeout=300))
    assert responses[-1].finish_reason == pb.TOOL_CALLS, responses[-1]
    (call,) = responses[-1].tool_calls
    assert call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert arguments["city"] == "Paris" and set(arguments) <= {"city", "unit"}


def test_a_strict_tool_under_auto_leaves_an_answer_without_calls_as_it_was(
    default_model_dir, tmp_path
):
    """The default model answers these in text, never opening a call: with its tools
    strict (AUTO's lazy grammar, live each step) the tokens are the same, greedy and seeded,
    since free text allows every token a model writes in text."""
    strict = [
        pb.Tool(name=t.name, description=t.description, parameters=t.parameters, strict=True)
        for t in (WEATHER, TIME)
    ]
    questions = ["Is it raining in London right now?", "Tell me a joke.", "What is 2+2?"]
    samplings = (pb.SamplingParams(), pb.SamplingParams(temperature=0.7, seed=3))
    requests = [
        pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content=question)],
            tools=tools,
            sampling=sampling,
            stopping=pb.StoppingCriteria(max_new_tokens=48),
        )
        for tools in ([WEATHER, TIME], strict)
        for question in questions
        for sampling in samplings
    ]
    with (
        running_service(tmp_path, model=str(default_model_dir)) as service,
        service.channel() as channel,
        ThreadPoolExecutor(len(requests)) as pool,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)
        replies = list(pool.map(lambda r: list(stub.Chat(r, timeout=600)), requests))
    half = len(requests) // 2
    for plain, held in zip(replies[:half], replies[half:], strict=True):
        assert not held[-1].tool_calls
        assert [t for r in held for t in r.token_ids] == [t for r in plain for t in r.token_ids]
        assert "".join(r.text for r in held) == "".join(r.text for r in plain)
