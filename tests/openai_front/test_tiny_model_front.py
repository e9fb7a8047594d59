"""Through the front and straight over gRPC, a real (tiny, random-weight) model gives the same
text: greedy on both endpoints, and seeded sampling where choice i is seed + i."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.openai_front.conftest import sdk_stack

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Paris is the capital of"}]
NUM_TOKENS = 10
KEEP_GOING = {"ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model_factory, tmp_path_factory):
    with sdk_stack(tiny_model_factory("llama"), tmp_path_factory.mktemp("tiny-front")) as stack:
        yield stack


def grpc_text(service, rpc: str, request) -> str:
    with service.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return "".join(r.text for r in getattr(stub, rpc)(request, timeout=120))


def stopping() -> generation_pb2.StoppingCriteria:
    return generation_pb2.StoppingCriteria(max_new_tokens=NUM_TOKENS, ignore_eos=True)


def test_greedy_completion_equals_the_generate_stream(stack):
    service, sdk, model = stack
    expected = grpc_text(
        service, "Generate", generation_pb2.GenerateRequest(prompt="The quick", stopping=stopping())
    )
    whole = sdk.completions.create(
        model=model, prompt="The quick", max_tokens=NUM_TOKENS, temperature=0, extra_body=KEEP_GOING
    )
    streamed = sdk.completions.create(
        model=model,
        prompt="The quick",
        max_tokens=NUM_TOKENS,
        temperature=0,
        stream=True,
        extra_body=KEEP_GOING,
    )
    assert expected
    assert whole.choices[0].text == expected
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_greedy_chat_equals_the_chat_stream(stack):
    service, sdk, model = stack
    request = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(**m) for m in MESSAGES], stopping=stopping()
    )
    expected = grpc_text(service, "Chat", request)
    chat = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=NUM_TOKENS, temperature=0, extra_body=KEEP_GOING
    )
    assert chat.choices[0].message.content == expected


def test_seeded_choices_are_the_grpc_samples_of_seed_plus_index(stack):
    service, sdk, model = stack
    expected = [
        grpc_text(
            service,
            "Generate",
            generation_pb2.GenerateRequest(
                prompt="The quick",
                sampling=generation_pb2.SamplingParams(temperature=1.0, seed=100 + i),
                stopping=stopping(),
            ),
        )
        for i in range(3)
    ]
    completion = sdk.completions.create(
        model=model, prompt="The quick", max_tokens=NUM_TOKENS, n=3, seed=100, extra_body=KEEP_GOING
    )
    assert [c.text for c in completion.choices] == expected
    assert len(set(expected)) > 1  # a random tiny model: the seeds really differ


def test_n_greedy_choices_are_one_grpc_call_sharing_the_prompt(stack):
    service, sdk, model = stack
    prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away " * 2
    single = sdk.completions.create(
        model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0, extra_body=KEEP_GOING
    )
    before = _num_requests_finished(service)
    whole = sdk.completions.create(
        model=model, prompt=prompt, max_tokens=NUM_TOKENS, n=4, temperature=0,
        extra_body=KEEP_GOING,
    )  # fmt: skip
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [single.choices[0].text] * 4
    # The prompt counted once.
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens
    assert whole.usage.completion_tokens == 4 * NUM_TOKENS
    # One gRPC call of n = 4: its four samples are four core requests.
    assert _num_requests_finished(service) - before == 4
    streamed = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=NUM_TOKENS, n=3, temperature=0, stream=True,
        extra_body=KEEP_GOING,
    )  # fmt: skip
    texts = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert len(set(texts.values())) == 1 and texts[0]


def _num_requests_finished(service) -> int:
    with service.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.GetServerStats(generation_pb2.ServerStatsRequest()).num_requests_finished


FORCED_TOKEN_ID = 300  # an ordinary BPE merge of the tiny tokenizer


def test_logit_bias_forces_and_bans_over_grpc_and_through_the_front(stack):
    service, sdk, model = stack

    def generate(logit_bias: dict[int, float]) -> list[int]:
        request = generation_pb2.GenerateRequest(
            prompt="The quick",
            sampling=generation_pb2.SamplingParams(logit_bias=logit_bias),
            stopping=stopping(),
        )
        with service.channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]

    assert generate({FORCED_TOKEN_ID: 100.0}) == [FORCED_TOKEN_ID] * NUM_TOKENS
    plain = generate({})
    banned = generate({plain[0]: -100.0})
    assert plain[0] not in banned  # greedy never picks it at any position

    forced_text = grpc_text(
        service,
        "Generate",
        generation_pb2.GenerateRequest(
            prompt="The quick",
            sampling=generation_pb2.SamplingParams(logit_bias={FORCED_TOKEN_ID: 100.0}),
            stopping=stopping(),
        ),
    )
    completion = sdk.completions.create(
        model=model,
        prompt="The quick",
        max_tokens=NUM_TOKENS,
        temperature=0,
        logit_bias={str(FORCED_TOKEN_ID): 100},
        extra_body=KEEP_GOING,
    )
    assert completion.choices[0].text == forced_text
    sampled = sdk.completions.create(
        model=model,
        prompt="The quick",
        max_tokens=NUM_TOKENS,
        seed=5,
        logit_bias={str(FORCED_TOKEN_ID): 100},
        extra_body=KEEP_GOING,
    )
    assert sampled.choices[0].text == forced_text  # +100 dominates a temperature-1 draw too


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_gives_valid_json(stack, stream):
    _, sdk, model = stack
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
    for seed in range(3):
        reply = sdk.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=64,
            seed=seed,
            response_format=response_format,
            stream=stream,
        )
        if stream:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
        else:
            assert reply.choices[0].finish_reason == "stop"
            text = reply.choices[0].message.content
        value = json.loads(text)
        assert set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no")
        assert isinstance(value["sure"], bool)


def test_response_format_json_object_through_completions(stack):
    _, sdk, model = stack
    completion = sdk.completions.create(
        model=model,
        prompt="The quick",
        max_tokens=64,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert completion.choices[0].text.startswith("{")


def test_logprob_tokens_carry_their_text(stack, tiny_model_factory):
    service, sdk, model = stack
    tokenizer = Tokenizer.from_file(str(tiny_model_factory("llama") / "tokenizer.json"))
    request = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(**m) for m in MESSAGES],
        stopping=stopping(),
        logprobs=2,
    )
    with service.channel() as channel:
        responses = list(generation_pb2_grpc.GenerationStub(channel).Chat(request, timeout=120))
    entries = [e for r in responses for e in r.logprobs]
    assert len(entries) == NUM_TOKENS
    for entry in entries:
        assert len(entry.top_token_bytes) == 2
        pairs = [
            (entry.token_id, entry.token_bytes),
            *zip(entry.top_token_ids, entry.top_token_bytes, strict=True),
        ]
        for token_id, token_bytes in pairs:
            if token_id < tokenizer.get_vocab_size() and token_id > 2:  # not special
                assert token_bytes.decode(errors="replace") == tokenizer.decode([token_id])

    chat = sdk.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=NUM_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=KEEP_GOING,
    )
    expected = [
        e.token_bytes.decode(errors="replace") if e.token_bytes else f"token_id:{e.token_id}"
        for e in entries
    ]
    assert [entry.token for entry in chat.choices[0].logprobs.content] == expected
