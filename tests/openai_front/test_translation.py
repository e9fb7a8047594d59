"""OpenAI bodies -> gRPC calls, without processes: defaults, fan-out, seeds, refusals."""

from __future__ import annotations

import pytest

from pagoda.openai_front.errors import FrontError
from pagoda.openai_front.schemas import ChatCompletionRequest, CompletionRequest
from pagoda.openai_front.translation import plan_chat, plan_completion

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(**{"prompt": "hi", **fields})


def test_openai_defaults_sample_at_temperature_one_and_leave_the_rest_to_the_server():
    (call,) = plan_chat(chat(), "chatcmpl-x", max_n=4).calls
    assert call.options == {"temperature": 1.0, "request_id": "chatcmpl-x-0"}
    assert call.messages == MESSAGES and call.prompt is None


def test_every_sampling_field_is_passed_on_as_given():
    body = chat(
        temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, seed=3, stop=["\n"],
        max_completion_tokens=7, min_tokens=2, ignore_eos=True, stop_token_ids=[5],
        cache_salt="tenant", user="someone",
    )  # fmt: skip
    (call,) = plan_chat(body, "id", max_n=4).calls
    assert call.options == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "seed": 3, "stop": ["\n"], "max_new_tokens": 7, "min_new_tokens": 2,
        "ignore_eos": True, "stop_token_ids": [5], "cache_salt": "tenant", "request_id": "id-0",
    }  # fmt: skip


def test_a_developer_message_is_the_system_message():
    messages = [{"role": "developer", "content": "Be brief."}, *MESSAGES]
    (call,) = plan_chat(ChatCompletionRequest(messages=messages), "id", max_n=4).calls
    assert call.messages == [{"role": "system", "content": "Be brief."}, *MESSAGES]


def test_max_completion_tokens_wins_over_max_tokens():
    (call,) = plan_chat(chat(max_tokens=9, max_completion_tokens=4), "id", 4).calls
    assert call.options["max_new_tokens"] == 4
    (call,) = plan_chat(chat(max_tokens=9), "id", 4).calls
    assert call.options["max_new_tokens"] == 9


def test_n_is_one_call_with_the_grpc_n():
    (call,) = plan_chat(chat(n=3, seed=10), "id", max_n=4).calls
    assert (call.choice_index, call.n, list(call.choice_indices)) == (0, 3, [0, 1, 2])
    # The scheduler gives sample i seed + i.
    assert (call.options["n"], call.options["seed"], call.options["request_id"]) == (3, 10, "id-0")
    (unseeded,) = plan_chat(chat(n=2), "id", max_n=4).calls
    assert "seed" not in unseeded.options
    (single,) = plan_chat(chat(), "id", max_n=4).calls
    assert "n" not in single.options and single.n == 1


def test_n_with_a_response_format_is_one_call_too():
    body = chat(n=2, seed=5, response_format={"type": "json_object"})
    (call,) = plan_chat(body, "id", max_n=4).calls
    assert (call.n, call.options["n"], call.options["constraint"]) == (2, 2, {"json_object": True})


def test_a_batch_of_prompts_times_n_indexes_choices_prompt_major():
    calls = plan_completion(completion(prompt=["a", "b"], n=2, seed=1), "id", max_n=4).calls
    assert [(c.choice_index, c.n, c.prompt_index, c.prompt) for c in calls] == [
        (0, 2, 0, "a"), (2, 2, 1, "b")
    ]  # fmt: skip
    assert [c.options["seed"] for c in calls] == [1, 1]
    assert [c.options["request_id"] for c in calls] == ["id-0", "id-1"]
    token_batches = plan_completion(completion(prompt=[[5, 6], [7]]), "id", max_n=4).calls
    assert [c.prompt for c in token_batches] == [[5, 6], [7]]
    (single,) = plan_completion(completion(prompt=[1, 2, 3]), "id", max_n=4).calls
    assert single.prompt == [1, 2, 3]


def test_fan_out_beyond_max_n_is_refused():
    with pytest.raises(FrontError) as caught:
        plan_completion(completion(prompt=["a", "b", "c"], n=2), "id", max_n=4)
    assert (caught.value.status, caught.value.param) == (400, "n")


@pytest.mark.parametrize(
    ("logprobs", "top_logprobs", "asked", "kept"),
    [(False, None, None, None), (True, None, 1, 0), (True, 0, 1, 0), (True, 5, 5, 5)],
)
def test_chat_logprobs_ask_for_at_least_one_alternative(logprobs, top_logprobs, asked, kept):
    plan = plan_chat(chat(logprobs=logprobs, top_logprobs=top_logprobs), "id", 4)
    assert plan.calls[0].options.get("logprobs") == asked
    assert plan.num_top_logprobs == kept


def test_top_logprobs_without_logprobs_is_refused():
    with pytest.raises(FrontError) as caught:
        plan_chat(chat(top_logprobs=2), "id", 4)
    assert caught.value.param == "top_logprobs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "grammar"}}, "response_format"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_what_the_grpc_api_lacks_is_refused_by_name(fields, param):
    with pytest.raises(FrontError) as caught:
        plan_chat(chat(**fields), "id", 4)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert caught.value.code == "unsupported_parameter"


def test_text_response_format_and_empty_logit_bias_are_fine():
    plan = plan_chat(chat(response_format={"type": "text"}, logit_bias={}), "id", 4)
    assert "logit_bias" not in plan.calls[0].options


def test_response_formats_become_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    json_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    plan = plan_chat(chat(response_format=json_schema), "id", 4)
    assert plan.calls[0].options["constraint"] == {"json_schema": schema}
    plan = plan_chat(chat(response_format={"type": "json_object"}), "id", 4)
    assert plan.calls[0].options["constraint"] == {"json_object": True}


def test_a_json_schema_format_without_a_schema_is_refused():
    with pytest.raises(FrontError) as caught:
        plan_chat(chat(response_format={"type": "json_schema", "json_schema": {}}), "id", 4)
    assert (caught.value.status, caught.value.param) == (400, "response_format")


def test_logit_bias_keys_become_token_ids():
    plan = plan_chat(chat(logit_bias={"5": 100, "17": -2.5}), "id", 4)
    assert plan.calls[0].options["logit_bias"] == {5: 100.0, 17: -2.5}


@pytest.mark.parametrize("key", ["x", "-1", "1.5", str(2**32)])
def test_logit_bias_keys_that_are_not_token_ids_are_refused(key):
    with pytest.raises(FrontError) as caught:
        plan_chat(chat(logit_bias={key: 1.0}), "id", 4)
    assert (caught.value.status, caught.value.param) == (400, "logit_bias")


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of")],
)
def test_completion_fields_without_grpc_support_are_refused(fields, param):
    with pytest.raises(FrontError) as caught:
        plan_completion(completion(**fields), "id", 4)
    assert caught.value.param == param


def test_content_parts_are_joined_and_other_parts_refused():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}]
    )  # fmt: skip
    assert plan_chat(body, "id", 4).calls[0].messages == [{"role": "user", "content": "ab"}]
    image = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    )
    with pytest.raises(FrontError):
        plan_chat(image, "id", 4)


def test_stream_options_need_stream():
    with pytest.raises(FrontError):
        plan_chat(chat(stream_options={"include_usage": True}), "id", 4)
    assert plan_chat(
        chat(stream=True, stream_options={"include_usage": True}), "id", 4
    ).include_usage
