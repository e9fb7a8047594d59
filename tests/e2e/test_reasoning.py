"""A thinking model end to end: a scheduler, a tiny random-weight model whose chat template
opens <think> (tests.conftest.THINKING_TEMPLATE), a real worker and the gRPC Chat API.
What the model writes before </think> streams as reasoning_text and only the rest as
text; token_ids stream every token; the caller's template variables close the thinking
before it begins; a constraint's grammar lets the model think, then holds the answer."""

from __future__ import annotations

import json

import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.protos import generation_pb2_grpc
from pagoda.scheduler_svc.reasoning import Thinking
from tests.conftest import long_context_copy, make_thinking
from tests.e2e.conftest import running_service
from tests.e2e.test_tool_calls import assert_streamed_as_whole
from tests.e2e.test_tool_calls import chat as tool_calls_chat
from tests.unit.test_reasoning import expected

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def thinking_service(tiny_model_factory, tmp_path_factory):
    """A service of a thinking model: (it, the id of "</think>")."""
    model = long_context_copy(tiny_model_factory("llama"), tmp_path_factory.mktemp("thinking"))
    close = make_thinking(model)["</think>"]
    with running_service(tmp_path_factory.mktemp("thinking-run"), model=str(model)) as running:
        yield running, close


def chat(service, **fields) -> list[pb.GenerateResponse]:
    return tool_calls_chat(service, max_new_tokens=24, **fields)


def decoded(service, responses) -> str:
    """The text of every token the responses streamed."""
    token_ids = [token_id for response in responses for token_id in response.token_ids]
    with service.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=True)
        return stub.Detokenize(request, timeout=30).text


def num_thinking_tokens(service, responses) -> int:
    """The tokens before the one whose text begins the answer, found by decoding ever
    longer prefixes of the tokens streamed."""
    token_ids = [token_id for response in responses for token_id in response.token_ids]
    with service.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for count in range(1, len(token_ids) + 1):
            request = pb.DetokenizeRequest(token_ids=token_ids[:count], skip_special_tokens=True)
            if expected(Thinking.BEGUN, stub.Detokenize(request, timeout=30).text)[1]:
                return count - 1
    return len(token_ids)


def joined(responses) -> tuple[str, str]:
    return "".join(r.reasoning_text for r in responses), "".join(r.text for r in responses)


def test_the_model_says_it_thinks(thinking_service):
    service, _ = thinking_service
    with service.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30).thinks


def test_what_comes_before_the_closing_tag_is_reasoning(thinking_service):
    service, close = thinking_service
    for sampling in (pb.SamplingParams(), pb.SamplingParams(temperature=1.0, seed=5)):
        responses = chat(service, sampling=sampling)
        reasoning, text = joined(responses)
        assert reasoning and (reasoning, text) == expected(
            Thinking.BEGUN, decoded(service, responses)
        )
        usage = responses[-1].usage
        assert sum(len(r.token_ids) for r in responses) == usage.completion_tokens
        assert usage.reasoning_tokens == num_thinking_tokens(service, responses)
    # Every token "</think>": the first closes the thinking, empty; the rest are answer.
    responses = chat(
        service,
        sampling=pb.SamplingParams(logit_bias={close: 100.0}),
        stopping=pb.StoppingCriteria(max_new_tokens=4),
    )
    assert joined(responses) == ("", "</think>" * 3)
    assert responses[-1].usage.reasoning_tokens == 1  # the closing tag


def test_with_tools_the_thinking_passes_the_calls_reader_unread(thinking_service):
    service, _ = thinking_service
    tool = pb.Tool(name="get_time", parameters='{"type": "object", "properties": {}}')
    responses = chat(
        service, tools=[tool], stopping=pb.StoppingCriteria(max_new_tokens=24, stop=["zzz"])
    )
    assert joined(responses) == expected(Thinking.BEGUN, decoded(service, responses))
    assert not responses[-1].tool_calls and responses[-1].finish_reason != pb.TOOL_CALLS


def test_template_variables_close_the_thinking_before_it_begins(thinking_service):
    service, close = thinking_service
    open_, closed = (
        chat(service, sampling=pb.SamplingParams(logit_bias={close: 100.0}), **fields)
        for fields in ({}, {"chat_template_kwargs": '{"enable_thinking": false}'})
    )
    assert closed[-1].usage.prompt_tokens > open_[-1].usage.prompt_tokens
    assert joined(closed) == ("", decoded(service, closed))  # no thinking: all answer
    assert closed[-1].usage.reasoning_tokens == 0
    assert joined(open_)[0] == "" and joined(open_)[1] != joined(closed)[1]


ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_a_constraint_holds_the_answer_after_the_thinking(thinking_service):
    """The grammar lets the model think first, then holds the answer: with "</think>"
    forced, an empty thinking; with it likely, a seed whose sample thinks a while."""
    service, close = thinking_service
    constraint = pb.Constraint(json_schema=json.dumps(ANSWER))
    stopping = pb.StoppingCriteria(max_new_tokens=64)
    forced = chat(
        service,
        constraint=constraint,
        stopping=stopping,
        sampling=pb.SamplingParams(logit_bias={close: 100.0}),
    )
    assert forced[0].token_ids[0] == close
    reasoning, text = joined(forced)
    assert reasoning == "" and json.loads(text)["answer"] in ("yes", "no")
    for seed in range(32):
        sampling = pb.SamplingParams(temperature=1.0, seed=seed, logit_bias={close: 4.0})
        responses = chat(service, constraint=constraint, stopping=stopping, sampling=sampling)
        reasoning, text = joined(responses)
        if reasoning and responses[-1].finish_reason == pb.STOP:
            break
    assert reasoning and responses[-1].finish_reason == pb.STOP
    assert json.loads(text)["answer"] in ("yes", "no")
    assert (reasoning, text) == expected(Thinking.BEGUN, decoded(service, responses))
    usage = responses[-1].usage
    assert 0 < usage.reasoning_tokens == num_thinking_tokens(service, responses)
    assert usage.reasoning_tokens < usage.completion_tokens


def test_required_calls_come_after_the_thinking(thinking_service):
    service, close = thinking_service
    tool = pb.Tool(
        name="get_weather",
        parameters=json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}),
    )
    responses = chat(
        service,
        tools=[tool],
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
        sampling=pb.SamplingParams(logit_bias={close: 100.0}),
        stopping=pb.StoppingCriteria(max_new_tokens=64),
    )
    assert responses[-1].finish_reason == pb.TOOL_CALLS, responses[-1]
    assert [call.name for call in responses[-1].tool_calls][:1] == ["get_weather"]
    assert joined(responses) == ("", "")


def test_streamed_calls_come_after_the_thinking(thinking_service):
    """A seed whose sample thinks a while, then calls: streamed, the thinking is the same
    reasoning_text and the call's pieces come after it."""
    service, close = thinking_service
    tool = pb.Tool(name="get_time", parameters='{"type": "object", "properties": {}}')
    fields = {
        "tools": [tool],
        "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
        "parallel_tool_calls": False,
        "stopping": pb.StoppingCriteria(max_new_tokens=64),
    }
    for seed in range(32):
        sampling = pb.SamplingParams(temperature=1.0, seed=seed, logit_bias={close: 4.0})
        whole = chat(service, sampling=sampling, **fields)
        if joined(whole)[0] and whole[-1].finish_reason == pb.TOOL_CALLS:
            break
    assert joined(whole)[0] and whole[-1].finish_reason == pb.TOOL_CALLS
    streamed = chat(service, sampling=sampling, stream_tool_calls=True, **fields)
    assert joined(streamed) == joined(whole)
    assert_streamed_as_whole(streamed, whole)
    first = next(i for i, r in enumerate(streamed) if r.tool_call_deltas)
    assert not any(r.reasoning_text for r in streamed[first + 1 :])


def test_each_sample_counts_its_thinking_and_the_total_adds_them_up(thinking_service):
    service, close = thinking_service
    responses = chat(
        service,
        n=3,
        sampling=pb.SamplingParams(temperature=1.0, seed=2, logit_bias={close: 4.0}),
    )
    lasts = [r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(r.index for r in lasts) == [0, 1, 2]
    for last in lasts:
        sample = [r for r in responses if r.index == last.index]
        assert last.usage.reasoning_tokens == num_thinking_tokens(service, sample)
    total = responses[-1].total_usage.reasoning_tokens
    assert total == sum(last.usage.reasoning_tokens for last in lasts) > 0
