"""Every refusal is one sentence that names the field and its limit (no processes)."""

from __future__ import annotations

import pytest
from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.tokenizer import load_tokenizer
from pagoda.scheduler_svc.validation import (
    Limits,
    ValidationError,
    validate_chat,
    validate_generate,
)

LIMITS = Limits(
    max_context_tokens=100,
    vocab_size=49152,
    default_max_new_tokens=32,
    max_stop_strings=4,
    max_stop_string_bytes=8,
    max_logprobs=5,
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def generate(**fields) -> pb.GenerateRequest:
    fields.setdefault("prompt_token_ids", pb.TokenIds(ids=[1, 2, 3]))
    return pb.GenerateRequest(**fields)


BAD_REQUESTS = {
    "empty prompt": (pb.GenerateRequest(prompt=""), ["prompt must not be empty"]),
    "empty prompt ids": (generate(prompt_token_ids=pb.TokenIds()), ["prompt must not be empty"]),
    "prompt id beyond vocabulary": (
        generate(prompt_token_ids=pb.TokenIds(ids=[1, 60000])),
        ["prompt_token_ids", "60000", "49152"],
    ),
    "prompt fills the context": (
        generate(prompt_token_ids=pb.TokenIds(ids=[5] * 100)),
        ["prompt has 100 tokens", "context holds 100"],
    ),
    "prompt text far too long": (pb.GenerateRequest(prompt="x" * 4000), ["prompt", "100 tokens"]),
    "max_new_tokens 0": (
        generate(stopping=pb.StoppingCriteria(max_new_tokens=0)),
        ["stopping.max_new_tokens", ">= 1"],
    ),
    "max_new_tokens beyond the context": (
        generate(stopping=pb.StoppingCriteria(max_new_tokens=500)),
        ["stopping.max_new_tokens (500)", "context of 100"],
    ),
    "prompt plus max_new_tokens beyond the context": (
        generate(
            prompt_token_ids=pb.TokenIds(ids=[5] * 90),
            stopping=pb.StoppingCriteria(max_new_tokens=11),
        ),  # fmt: skip
        ["prompt (90 tokens)", "stopping.max_new_tokens (11)", "context of 100"],
    ),
    "min above max": (
        generate(stopping=pb.StoppingCriteria(max_new_tokens=4, min_new_tokens=5)),
        ["stopping.min_new_tokens (5)", "max_new_tokens (4)"],
    ),
    "negative temperature": (
        generate(sampling=pb.SamplingParams(temperature=-0.5)),
        ["sampling.temperature", "[0, 100]", "-0.5"],
    ),
    "NaN temperature": (
        generate(sampling=pb.SamplingParams(temperature=float("nan"))),
        ["sampling.temperature", "finite"],
    ),
    "top_p 0": (generate(sampling=pb.SamplingParams(top_p=0.0)), ["sampling.top_p", "(0, 1]"]),
    "top_p above 1": (
        generate(sampling=pb.SamplingParams(top_p=1.5)),
        ["sampling.top_p", "(0, 1]", "1.5"],
    ),
    "negative top_k": (generate(sampling=pb.SamplingParams(top_k=-1)), ["sampling.top_k", ">= 0"]),
    "negative min_p": (
        generate(sampling=pb.SamplingParams(min_p=-0.1)),
        ["sampling.min_p", "[0, 1]"],
    ),
    "min_p above 1": (
        generate(sampling=pb.SamplingParams(min_p=1.1)),
        ["sampling.min_p", "[0, 1]"],
    ),
    "repetition penalty 0": (
        generate(sampling=pb.SamplingParams(repetition_penalty=0.0)),
        ["sampling.repetition_penalty", "(0, 10]"],
    ),
    "presence penalty": (
        generate(sampling=pb.SamplingParams(presence_penalty=3.0)),
        ["sampling.presence_penalty", "[-2, 2]"],
    ),
    "frequency penalty": (
        generate(sampling=pb.SamplingParams(frequency_penalty=-2.5)),
        ["sampling.frequency_penalty", "[-2, 2]"],
    ),
    "too many stop strings": (
        generate(stopping=pb.StoppingCriteria(stop=["a", "b", "c", "d", "e"])),
        ["stopping.stop", "5 strings", "at most 4"],
    ),
    "stop string too long": (
        generate(stopping=pb.StoppingCriteria(stop=["ok", "far too long"])),
        ["stopping.stop[1]", "12 bytes", "at most 8"],
    ),
    "empty stop string": (
        generate(stopping=pb.StoppingCriteria(stop=[""])),
        ["stopping.stop[0]", "empty"],
    ),
    "stop token beyond vocabulary": (
        generate(stopping=pb.StoppingCriteria(stop_token_ids=[49152])),
        ["stopping.stop_token_ids", "49152"],
    ),
    "logprobs above the cap": (generate(logprobs=6), ["logprobs", "at most 5", "6"]),
    "request id too long": (generate(request_id="r" * 200), ["request_id", "128 bytes"]),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_generate_requests_get_a_sentence_naming_field_and_limit(tokenizer, case):
    request, phrases = BAD_REQUESTS[case]
    with pytest.raises(ValidationError) as refused:
        validate_generate(request, tokenizer, LIMITS)
    for phrase in phrases:
        assert phrase in str(refused.value), (case, str(refused.value))


def test_a_good_request_keeps_its_values(tokenizer):
    valid = validate_generate(
        generate(
            sampling=pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3),
            stopping=pb.StoppingCriteria(max_new_tokens=97, stop=["end"], ignore_eos=True),
            logprobs=5,
            priority=2,
            request_id="mine",
        ),
        tokenizer,
        LIMITS,
    )
    assert valid.request_id == "mine" and valid.prompt_token_ids == (1, 2, 3)
    assert valid.sampling.temperature == pytest.approx(0.7)  # a float on the wire
    assert (valid.sampling.top_k, valid.sampling.seed) == (5, 3)
    assert valid.stopping.max_new_tokens == 97 and valid.stopping.stop_strings == ("end",)
    assert valid.priority == 2 and valid.sampling.num_logprobs == 5


def test_unset_max_new_tokens_is_the_default_clamped_to_the_room_left(tokenizer):
    short = validate_generate(generate(), tokenizer, LIMITS)
    assert short.stopping.max_new_tokens == LIMITS.default_max_new_tokens
    long = validate_generate(
        generate(prompt_token_ids=pb.TokenIds(ids=[5] * 90)), tokenizer, LIMITS
    )
    assert long.stopping.max_new_tokens == 10


def test_chat_roles_and_empty_conversations(tokenizer):
    with pytest.raises(ValidationError, match=r"messages must hold at least one message"):
        validate_chat(pb.ChatRequest(), tokenizer, LIMITS)
    wizard = pb.ChatRequest(messages=[pb.ChatMessage(role="wizard", content="hi")])
    with pytest.raises(ValidationError) as refused:
        validate_chat(wizard, tokenizer, LIMITS)
    sentence = str(refused.value)
    assert "messages[0].role 'wizard'" in sentence
    assert all(role in sentence for role in ("assistant", "system", "user"))
    valid = validate_chat(
        pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")]), tokenizer, LIMITS
    )
    assert tokenizer.decode(list(valid.prompt_token_ids)).rstrip().endswith("assistant")
