"""allowed_token_ids / banned_token_ids in the gRPC API (issue 28 item 5): validated into
ascending distinct ids, refused (INVALID_ARGUMENT: a ValidationError) with a sentence naming
the field and its limit, and carried to the worker in the new sequence's SamplingParams
without a codec edit."""

from __future__ import annotations

import dataclasses

import pytest

from pagoda.common.step_codec import decode_sampling, encode_sampling
from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.constraint_validation import validate_constraint
from pagoda.scheduler_svc.validation import (
    Limits,
    ValidationError,
    validate_generate,
)

LIMITS = Limits(
    max_context_tokens=100,
    vocab_size=1000,
    default_max_new_tokens=8,
    max_stop_strings=4,
    max_stop_string_bytes=8,
    max_logprobs=5,
)


def validated(**sampling):
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(**sampling)
    )
    return validate_generate(request, None, LIMITS)  # token ids: no tokenizer needed


def test_valid_ids_become_ascending_distinct_tuples():
    sampling = validated(allowed_token_ids=[9, 3, 9, 999], banned_token_ids=[7]).sampling
    assert sampling.allowed_token_ids == (3, 9, 999)
    assert sampling.banned_token_ids == (7,)
    empty = validated().sampling  # empty allowed: every id
    assert (empty.allowed_token_ids, empty.banned_token_ids) == ((), ())


@pytest.mark.parametrize("field", ["allowed_token_ids", "banned_token_ids"])
@pytest.mark.parametrize(
    ("token_ids", "phrases"),
    [
        ([5, 1000], ["names token 1000", "vocabulary of 1000"]),
        (list(range(1025)), ["1025 ids", "at most 1024"]),
    ],
)
def test_bad_ids_are_refused_by_name(field, token_ids, phrases):
    with pytest.raises(ValidationError) as refused:
        validated(**{field: token_ids})
    for phrase in [f"sampling.{field}", *phrases]:
        assert phrase in str(refused.value)


def test_1024_ids_each_are_the_limit():
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[1, 2]),
        sampling=pb.SamplingParams(allowed_token_ids=range(1024), banned_token_ids=[5] * 1024),
    )
    sampling = validate_generate(request, None, dataclasses.replace(LIMITS, vocab_size=2000))
    assert len(sampling.sampling.allowed_token_ids) == 1024


def test_banning_every_allowed_id_is_refused():
    with pytest.raises(ValidationError, match="bans every one of allowed_token_ids"):
        validated(allowed_token_ids=[4, 5], banned_token_ids=[5, 4, 6])


def test_a_constrained_request_cannot_limit_its_ids():
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[1, 2]),
        sampling=pb.SamplingParams(banned_token_ids=[4]),
        constraint=pb.Constraint(regex="a+"),
    )
    valid = validate_generate(request, None, LIMITS)
    with pytest.raises(ValidationError, match="cannot set sampling.allowed_token_ids"):
        validate_constraint(request, valid)


def test_the_ids_reach_the_worker_unchanged():
    sampling = validated(allowed_token_ids=[9, 3], banned_token_ids=[7]).sampling
    params = decode_sampling(encode_sampling(sampling))
    assert (params.allowed_token_ids, params.banned_token_ids) == ((3, 9), (7,))


def test_the_dummy_takes_the_next_allowed_id_up_that_is_not_banned():
    from pagoda.common.dummy_tokens import dummy_next_token

    free = dummy_next_token(5, 3, 1000)
    assert dummy_next_token(5, 3, 1000, allowed_token_ids=[free]) == free
    assert dummy_next_token(5, 3, 1000, allowed_token_ids=[free - 1, free + 2]) == free + 2
    assert dummy_next_token(5, 3, 1000, {free + 2}, [free - 1, free + 2]) == free - 1
    assert dummy_next_token(5, 3, 1000, {free}) == free + 1
