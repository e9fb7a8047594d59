"""allowed_token_ids / banned_token_ids through the front (issue 28 item 5): body extensions
on both endpoints (vLLM's allowed_token_ids; Pagoda's banned_token_ids, as vLLM bans strings
with bad_words), passed to the gRPC call, and honoured end to end by the dummy worker, whose
tokens the official client reads back with vLLM's return_token_ids."""

from __future__ import annotations

import openai
import pytest

from pagoda.openai_front.schemas import ChatCompletionRequest, CompletionRequest
from pagoda.openai_front.translation import plan_chat, plan_completion
from tests.openai_front.conftest import API_KEY

MESSAGES = [{"role": "user", "content": "hi"}]
NUM_TOKENS = 8
ALLOWED = [1000, 2000, 3000]


def test_both_lists_become_the_calls_options():
    body = CompletionRequest(prompt="hi", n=2, allowed_token_ids=[5, 6], banned_token_ids=[6])
    for call in plan_completion(body, "cmpl", max_n=4).calls:
        assert call.options["allowed_token_ids"] == [5, 6]
        assert call.options["banned_token_ids"] == [6]
    (call,) = plan_chat(
        ChatCompletionRequest(messages=MESSAGES, banned_token_ids=[9]), "c", 4
    ).calls
    assert call.options["banned_token_ids"] == [9] and "allowed_token_ids" not in call.options


def test_return_token_ids_is_asked_per_call():
    (call,) = plan_completion(CompletionRequest(prompt="hi", return_token_ids=True), "c", 4).calls
    assert call.return_token_ids
    (call,) = plan_chat(ChatCompletionRequest(messages=MESSAGES), "c", 4).calls
    assert not call.return_token_ids


@pytest.fixture(scope="module")
def sdk(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.slow
def test_completions_sample_only_allowed_ids_streamed_and_not(sdk):
    extra = {"allowed_token_ids": ALLOWED, "ignore_eos": True, "return_token_ids": True}
    whole = sdk.completions.create(
        model="dummy", prompt="one two", max_tokens=NUM_TOKENS, temperature=0, extra_body=extra
    )
    token_ids = whole.choices[0].model_extra["token_ids"]
    assert len(token_ids) == NUM_TOKENS and set(token_ids) <= set(ALLOWED)
    events = list(
        sdk.completions.create(
            model="dummy",
            prompt="one two",
            max_tokens=NUM_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    streamed = [t for e in events for c in e.choices for t in c.model_extra["token_ids"]]
    assert streamed == token_ids
    assert events[-1].usage.completion_tokens == NUM_TOKENS


@pytest.mark.slow
def test_chat_never_samples_banned_ids(sdk):
    def token_ids(extra: dict) -> list[int]:
        reply = sdk.chat.completions.create(
            model="dummy",
            messages=MESSAGES,
            max_tokens=NUM_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        )
        return reply.choices[0].model_extra["token_ids"]

    free = token_ids({})
    banned = token_ids({"banned_token_ids": free[:2]})
    assert len(banned) == NUM_TOKENS and not set(free[:2]) & set(banned)


@pytest.mark.slow
def test_a_bad_list_is_a_400_naming_the_field(sdk):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(
            model="dummy",
            prompt="x",
            max_tokens=2,
            extra_body={"allowed_token_ids": [3], "banned_token_ids": [3]},
        )
    assert "banned_token_ids" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(
            model="dummy",
            messages=MESSAGES,
            max_tokens=2,
            extra_body={"allowed_token_ids": [10**9]},
        )
    assert "allowed_token_ids" in refused.value.message
