"""A thinking model through the whole stack: a tiny random-weight model whose template opens
<think> (tests.conftest.make_thinking), a real worker and scheduler, pagoda-openai and the
official SDK. The front gives what the gRPC Chat gives: reasoning apart from the answer,
whole and streamed, on both APIs; chat_template_kwargs reaches the template."""

from __future__ import annotations

import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.protos import generation_pb2_grpc
from tests.conftest import long_context_copy, make_thinking
from tests.openai_front.conftest import sdk_stack

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Paris is the capital of"}]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def stack(tiny_model_factory, tmp_path_factory):
    model = long_context_copy(tiny_model_factory("llama"), tmp_path_factory.mktemp("thinking"))
    close = make_thinking(model)["</think>"]
    with sdk_stack(model, tmp_path_factory.mktemp("thinking-front")) as (service, sdk, name):
        yield service, sdk, name, close


def grpc_chat(service, **fields) -> tuple[str, str, int]:
    """The reasoning, the answer and the thinking's tokens of a gRPC Chat."""
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(**m) for m in MESSAGES],
        stopping=pb.StoppingCriteria(max_new_tokens=NUM_TOKENS, ignore_eos=True),
        **fields,
    )
    with service.channel() as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Chat(request, timeout=120))
    reasoning = "".join(r.reasoning_text for r in responses)
    return reasoning, "".join(r.text for r in responses), responses[-1].usage.reasoning_tokens


def test_chat_completions_give_the_grpc_reasoning_whole_and_streamed(stack):
    service, sdk, model, close = stack
    # A seed whose sample closes its thinking on the way (a bias makes "</think>" likely).
    for seed in range(32):
        sampling = pb.SamplingParams(temperature=1.0, seed=seed, logit_bias={close: 4.0})
        reasoning, text, num_thinking = grpc_chat(service, sampling=sampling)
        if reasoning and text:
            break
    assert reasoning and text
    options = dict(
        model=model,
        messages=MESSAGES,
        max_tokens=NUM_TOKENS,
        temperature=1.0,
        seed=seed,
        extra_body={"ignore_eos": True, "logit_bias": {str(close): 4.0}},
    )
    completion = sdk.chat.completions.create(**options)
    whole = completion.choices[0].message
    assert (whole.model_extra.get("reasoning_content"), whole.content) == (reasoning, text)
    assert 0 < completion.usage.completion_tokens_details.reasoning_tokens == num_thinking
    deltas = [c.choices[0].delta for c in sdk.chat.completions.create(stream=True, **options)]
    streamed = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert (streamed, "".join(d.content or "" for d in deltas)) == (reasoning, text)


def test_template_variables_reach_the_template_through_the_front(stack):
    service, sdk, model, close = stack
    body = {"ignore_eos": True, "logit_bias": {str(close): 100.0}}
    answers = []
    for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        message = (
            sdk.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=3, extra_body={**body, **kwargs}
            )
            .choices[0]
            .message
        )
        answers.append((message.model_extra.get("reasoning_content"), message.content))
    # Thinking open, the first "</think>" closes it; closed already, all three are answer.
    assert answers == [(None, "</think></think>"), (None, "</think></think></think>")]


def test_the_responses_api_puts_the_reasoning_item_first(stack):
    service, sdk, model, _ = stack
    reasoning, text, num_thinking = grpc_chat(service)
    response = sdk.responses.create(
        model=model,
        input=MESSAGES[0]["content"],
        max_output_tokens=NUM_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    first = response.output[0]
    assert first.type == "reasoning" and [part.text for part in first.content] == [reasoning]
    assert response.output_text == text
    assert response.usage.output_tokens_details.reasoning_tokens == num_thinking
