"""Tool calling end to end: a scheduler, a tiny random-weight model on a real worker, and the
gRPC Chat API. A named function and REQUIRED are constrained, so even a random model calls
declared tools with arguments that fit their schemas; the calls come on the last message
with TOOL_CALLS, and token_ids stream every token. AUTO output that is not a call (all a
random model writes) comes back as text, whole. A conversation that goes on after a call
renders and runs; a bad tool is INVALID_ARGUMENT."""

from __future__ import annotations

import json

import grpc
import pytest
from tokenizers import Tokenizer

from pagoda.protos import generation_pb2 as pb
from pagoda.protos import generation_pb2_grpc
from tests.conftest import add_tag_tokens, long_context_copy
from tests.e2e.conftest import running_service

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = pb.Tool(name="get_weather", description="Weather in a city", parameters=json.dumps(CITY))
TIME = pb.Tool(
    name="get_time",
    parameters=json.dumps({"type": "object", "properties": {}, "additionalProperties": False}),
)
QUESTION = pb.ChatMessage(role="user", content="The weather in Paris?")
STRICT_WEATHER = pb.Tool(
    name=WEATHER.name, description=WEATHER.description, parameters=WEATHER.parameters, strict=True
)


@pytest.fixture(scope="module")
def service(tiny_model_factory, tmp_path_factory):
    model = long_context_copy(tiny_model_factory("llama"), tmp_path_factory.mktemp("model"))
    with running_service(tmp_path_factory.mktemp("tools"), model=str(model)) as running:
        yield running


def chat(service, max_new_tokens: int = 64, **fields) -> list[pb.GenerateResponse]:
    """The responses of a Chat (QUESTION, and `max_new_tokens`, unless `fields` say)."""
    fields.setdefault("messages", [QUESTION])
    fields.setdefault("stopping", pb.StoppingCriteria(max_new_tokens=max_new_tokens))
    with service.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return list(stub.Chat(pb.ChatRequest(**fields), timeout=300))


def test_a_named_function_is_called_with_arguments_that_fit_its_schema(service):
    for sampling in (pb.SamplingParams(), pb.SamplingParams(temperature=1.0, seed=3)):
        responses = chat(
            service,
            tools=[WEATHER, TIME],
            tool_choice=pb.ToolChoice(function_name="get_weather"),
            sampling=sampling,
        )
        last = responses[-1]
        assert last.finish_reason == pb.TOOL_CALLS
        assert "".join(r.text for r in responses) == ""
        (call,) = last.tool_calls
        assert call.name == "get_weather" and call.id.startswith("call_")
        arguments = json.loads(call.arguments)
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
        assert all(not r.tool_calls for r in responses[:-1])
        assert sum(len(r.token_ids) for r in responses) == last.usage.completion_tokens


def test_required_calls_declared_tools_once_each_sample(service):
    responses = chat(
        service,
        tools=[WEATHER, TIME],
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
        parallel_tool_calls=False,
        sampling=pb.SamplingParams(temperature=1.0, seed=11),
        n=4,
    )
    lasts = [r for r in responses if r.finish_reason]
    assert sorted(r.index for r in lasts) == [0, 1, 2, 3]
    for last in lasts:
        assert last.finish_reason == pb.TOOL_CALLS, last
        (call,) = last.tool_calls
        arguments = json.loads(call.arguments)
        if call.name == "get_weather":
            assert set(arguments) == {"city"}
        else:
            assert call.name == "get_time" and arguments == {}
    assert len({call.id for last in lasts for call in last.tool_calls}) == 4


def test_auto_output_that_is_no_call_is_text_whole(service):
    responses = chat(service, tools=[WEATHER, TIME], sampling=pb.SamplingParams(seed=5))
    last = responses[-1]
    assert last.finish_reason in (pb.LENGTH, pb.STOP) and not last.tool_calls
    tokens = [t for r in responses for t in r.token_ids]
    plain = chat(service, sampling=pb.SamplingParams(seed=5), tools=[WEATHER, TIME],
                 tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE))  # fmt: skip
    assert [t for r in plain for t in r.token_ids] == tokens  # the same prompt, greedy
    assert "".join(r.text for r in responses) == "".join(r.text for r in plain)


@pytest.fixture(scope="module")
def tagged_service(tiny_model_factory, tmp_path_factory):
    """A service whose tiny model has Qwen's tags as tokens of their own: (it, their ids)."""
    model = long_context_copy(tiny_model_factory("llama"), tmp_path_factory.mktemp("tagged"))
    ids = add_tag_tokens(model)
    with running_service(tmp_path_factory.mktemp("tagged-run"), model=str(model)) as running:
        yield running, ids


def test_a_strict_tool_under_auto_holds_a_call_the_model_opens(tagged_service):
    """A bias makes the random model open a call at once: with its tool strict the call
    is one of the tool, its arguments fitting the schema; without, what follows the tag
    is a random model's, which comes back as text."""
    service, ids = tagged_service
    plain, held = plain_and_strict(service, ids["<tool_call>"])
    assert plain[-1].finish_reason == pb.LENGTH and not plain[-1].tool_calls
    assert "".join(r.text for r in plain).startswith("<tool_call>")
    assert_one_city_call(held)
    assert [t for r in held for t in r.token_ids][0] == ids["<tool_call>"]


def plain_and_strict(service, token_id: int) -> tuple[list, list]:
    """The same chat with WEATHER, then with it strict: a bias makes the model write
    `token_id` wherever it may; one call at most."""
    fields = {
        "sampling": pb.SamplingParams(logit_bias={token_id: 100.0}),
        "stopping": pb.StoppingCriteria(max_new_tokens=160),
        "parallel_tool_calls": False,
    }
    return chat(service, tools=[WEATHER], **fields), chat(service, tools=[STRICT_WEATHER], **fields)


def assert_one_city_call(responses: list) -> None:
    assert responses[-1].finish_reason == pb.TOOL_CALLS, responses[-1]
    (call,) = responses[-1].tool_calls
    arguments = json.loads(call.arguments)
    assert call.name == "get_weather" and set(arguments) == {"city"}
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 8


# A template that takes tools and writes calls as the whole answer (Llama 3's JSON format).
JSON_FORMAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nFunctions: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def json_format_service(tiny_model_factory, tmp_path_factory):
    """A service whose tiny model's template writes calls as JSON answers: (it, the id
    of "{")."""
    model = long_context_copy(tiny_model_factory("llama"), tmp_path_factory.mktemp("json"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": JSON_FORMAT_TEMPLATE})
    )
    brace = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("{")
    with running_service(tmp_path_factory.mktemp("json-run"), model=str(model)) as running:
        yield running, brace


def test_a_strict_tool_under_auto_holds_an_answer_that_begins_as_a_call(json_format_service):
    """In the JSON format an answer that begins with "{" is a call: a bias makes the
    random model begin so; strict, the answer is a call of the tool, its arguments
    fitting the schema, and nothing after it; without, it comes back as text."""
    service, brace = json_format_service
    plain, held = plain_and_strict(service, brace)
    assert not plain[-1].tool_calls
    assert "".join(r.text for r in plain).startswith("{")
    assert_one_city_call(held)


def test_a_conversation_goes_on_after_a_call(service):
    first = chat(service, tools=[WEATHER], tool_choice=pb.ToolChoice(function_name="get_weather"))
    (call,) = first[-1].tool_calls
    answer = pb.ChatMessage(role="tool", content='{"celsius": 18}', tool_call_id=call.id)
    turn = pb.ChatMessage(role="assistant", tool_calls=[call])
    responses = chat(service, messages=[QUESTION, turn, answer], tools=[WEATHER])
    assert responses[-1].finish_reason in (pb.LENGTH, pb.STOP, pb.TOOL_CALLS)
    assert responses[-1].usage.prompt_tokens > first[-1].usage.prompt_tokens


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [
        ({"tools": [pb.Tool(name="f", parameters="[1]")]}, "tools[0].parameters"),
        ({"tools": [WEATHER], "tool_choice": pb.ToolChoice(function_name="nope")}, "nope"),
        ({"tools": [WEATHER], "constraint": pb.Constraint(json_object=True)}, "constraint"),
        (
            {
                "tools": [WEATHER, pb.Tool(name="f", parameters='{"type": "nope"}')],
                "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
            },
            "tools[1].parameters is invalid",
        ),
        (
            {
                "tools": [WEATHER, pb.Tool(name="f", parameters='{"type": "nope"}')],
                "tool_choice": pb.ToolChoice(function_name="f"),
            },
            "tools[1].parameters is invalid",
        ),
        (
            {"tools": [WEATHER, pb.Tool(name="f", parameters='{"type": "nope"}', strict=True)]},
            "tools[1].parameters is invalid",
        ),
        (
            {"tools": [STRICT_WEATHER], "stopping": pb.StoppingCriteria(ignore_eos=True)},
            "AUTO with a strict tool",
        ),
    ],
)
def test_bad_tools_are_invalid_argument(service, fields, phrase):
    with pytest.raises(grpc.RpcError) as refused:
        chat(service, **fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert phrase in refused.value.details()


def streamed_and_whole(service, **fields) -> tuple[list, list]:
    """The same chat with its calls streamed (stream_tool_calls), then whole."""
    return chat(service, stream_tool_calls=True, **fields), chat(service, **fields)


def assert_streamed_as_whole(streamed: list, whole: list) -> None:
    """Each sample's streamed calls are its whole calls, piece by piece: the same tokens,
    text and finish, and pieces that add up to the last message's calls, which are the
    whole reading's."""
    assert not any(r.tool_call_deltas for r in whole)
    for sample in {r.index for r in whole}:
        mine = [r for r in streamed if r.index == sample]
        theirs = [r for r in whole if r.index == sample]
        assert [t for r in mine for t in r.token_ids] == [t for r in theirs for t in r.token_ids]
        assert "".join(r.text for r in mine) == "".join(r.text for r in theirs)
        assert mine[-1].finish_reason == theirs[-1].finish_reason
        calls: list[list[str]] = []
        for delta in (d for r in mine for d in r.tool_call_deltas):
            if delta.index == len(calls):
                calls.append([delta.id, delta.name, delta.arguments])
            else:
                assert not delta.id and not delta.name
                calls[delta.index][2] += delta.arguments
        assert [[c.id, c.name, c.arguments] for c in mine[-1].tool_calls] == calls
        assert [(c.name, c.arguments) for c in mine[-1].tool_calls] == [
            (c.name, c.arguments) for c in theirs[-1].tool_calls
        ]


def test_streamed_calls_of_a_named_function_and_of_required(service):
    for sampling in (pb.SamplingParams(), pb.SamplingParams(temperature=1.0, seed=3)):
        function = pb.ToolChoice(function_name="get_weather")
        streamed, whole = streamed_and_whole(
            service, tools=[WEATHER, TIME], tool_choice=function, sampling=sampling
        )
        assert_streamed_as_whole(streamed, whole)
        assert streamed[-1].finish_reason == pb.TOOL_CALLS
    required = pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED)
    sampling = pb.SamplingParams(temperature=1.0, seed=11)
    streamed, whole = streamed_and_whole(
        service, tools=[WEATHER, TIME], tool_choice=required, sampling=sampling, n=3,
        parallel_tool_calls=False,  # one call each: a list that goes on is cut by the limit
    )  # fmt: skip
    assert_streamed_as_whole(streamed, whole)
    assert sum(len(r.tool_calls) for r in streamed) == 3


def test_streamed_auto_text_that_is_no_call_is_the_same_text(service):
    streamed, whole = streamed_and_whole(
        service, tools=[WEATHER, TIME], sampling=pb.SamplingParams(seed=5)
    )
    assert_streamed_as_whole(streamed, whole)
    assert not streamed[-1].tool_calls


def test_streamed_calls_a_strict_tool_holds(tagged_service, json_format_service):
    """The tagged and the JSON format: a bias opens a call at once, a strict tool holds
    it (one call; the tagged format ends at its close)."""
    for service, token_id in ((tagged_service[0], tagged_service[1]["<tool_call>"]),
                              json_format_service):  # fmt: skip
        fields = {
            "tools": [STRICT_WEATHER],
            "sampling": pb.SamplingParams(logit_bias={token_id: 100.0}),
            "stopping": pb.StoppingCriteria(max_new_tokens=160),
            "parallel_tool_calls": False,
        }
        streamed, whole = streamed_and_whole(service, **fields)
        assert_streamed_as_whole(streamed, whole)
        assert_one_city_call(streamed)


def test_a_streamed_call_cut_by_the_limit_keeps_its_pieces_and_length(service):
    function = pb.ToolChoice(function_name="get_weather")
    streamed = chat(service, tools=[WEATHER], tool_choice=function, stream_tool_calls=True,
                    stopping=pb.StoppingCriteria(max_new_tokens=3))  # fmt: skip
    last = streamed[-1]
    assert last.finish_reason == pb.LENGTH
    (call,) = last.tool_calls
    assert call.arguments == "".join(d.arguments for r in streamed for d in r.tool_call_deltas)
    assert call.arguments.startswith("{") and "".join(r.text for r in streamed) == ""
