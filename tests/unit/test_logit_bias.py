"""logit_bias in the gRPC API (issue 28 item 5): validated into sorted (id, bias) pairs,
refused with a sentence naming the field and its limit, and carried to the worker once, in
the new sequence's sampling parameters."""

from __future__ import annotations

import pytest

from pagoda.common.step_codec import decode_sampling, encode_sampling
from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.validation import Limits, ValidationError, validate_generate

LIMITS = Limits(
    max_context_tokens=100,
    vocab_size=1000,
    default_max_new_tokens=8,
    max_stop_strings=4,
    max_stop_string_bytes=8,
    max_logprobs=5,
)


def validated(logit_bias: dict[int, float]):
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(logit_bias=logit_bias)
    )
    return validate_generate(request, None, LIMITS)  # token ids: no tokenizer needed


def test_a_valid_bias_becomes_sorted_pairs():
    assert validated({9: -100.0, 3: 2.5, 999: 100.0}).sampling.logit_bias == (
        (3, 2.5),
        (9, -100.0),
        (999, 100.0),
    )
    assert validated({}).sampling.logit_bias == ()


@pytest.mark.parametrize(
    ("logit_bias", "phrases"),
    [
        ({1000: 1.0}, ["sampling.logit_bias", "1000", "vocabulary of 1000"]),
        ({3: 100.5}, ["sampling.logit_bias[3]", "[-100, 100]", "100.5"]),
        ({3: -101.0}, ["sampling.logit_bias[3]", "[-100, 100]"]),
        ({3: float("nan")}, ["sampling.logit_bias[3]", "finite"]),
        ({i: 1.0 for i in range(301)}, ["sampling.logit_bias", "301 entries", "at most 300"]),
    ],
)
def test_bad_biases_are_refused_by_name(logit_bias, phrases):
    with pytest.raises(ValidationError) as refused:
        validated(logit_bias)
    for phrase in phrases:
        assert phrase in str(refused.value)


def test_the_bias_reaches_the_worker_codec_unchanged():
    sampling = validated({9: -100.0, 3: 2.5}).sampling
    params = decode_sampling(encode_sampling(sampling))
    assert params.logit_bias_token_ids == (3, 9)
    assert params.logit_bias_values == (2.5, -100.0)
