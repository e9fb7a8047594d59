"""Each gRPC status the scheduler returns has one HTTP status and OpenAI error type."""

from __future__ import annotations

import grpc
import pytest

from pagoda.client.errors import error_for_code
from pagoda.openai_front.errors import (
    from_pagoda,
    in_endpoint_terms,
    model_not_found,
    param_for,
    unsupported,
)
from pagoda.openai_front.upstream import call_metadata


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "invalid_request_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
        (grpc.StatusCode.UNKNOWN, 500, "server_error"),
    ],
)
def test_grpc_status_to_http(code, status, kind):
    error = from_pagoda(error_for_code(code, "the sentence"))
    assert (error.status, error.type) == (status, kind)
    assert error.body() == {
        "error": {"message": "the sentence", "type": kind, "param": None, "code": error.code}
    }


@pytest.mark.parametrize(
    ("sentence", "endpoint", "param"),
    [
        ("sampling.temperature must be in [0, 100], got -1", "chat", "temperature"),
        ("sampling.logit_bias[5] must be in [-100, 100]", "completions", "logit_bias"),
        ("stopping.max_new_tokens must be >= 1", "completions", "max_tokens"),
        ("stopping.max_new_tokens must be >= 1", "responses", "max_output_tokens"),
        ("stopping.stop[0] must not be empty", "chat", "stop"),
        ("logprobs must be at most 20", "chat", "top_logprobs"),
        ("logprobs must be at most 20", "completions", "logprobs"),
        ("prompt must not be empty", "completions", "prompt"),
        ("messages[1].role 'x' is not a role", "chat", "messages"),
        ("messages[1].role 'x' is not a role", "responses", "input"),
        ("tool_choice.function_name 'f' is not one of the tools", "chat", "tool_choice"),
        (
            "chat_template_kwargs cannot set messages: the server gives",
            "chat",
            "chat_template_kwargs",
        ),
        ("constraint.json_schema is not a schema", "chat", "response_format"),
        ("constraint.json_schema is not a schema", "responses", "text.format"),
        ("a constrained request cannot set sampling.logit_bias", "chat", None),
    ],
)
def test_a_scheduler_refusal_names_the_body_field_of_the_endpoint(sentence, endpoint, param):
    error = from_pagoda(error_for_code(grpc.StatusCode.INVALID_ARGUMENT, sentence))
    assert param_for(error.refused_field, endpoint) == param


@pytest.mark.parametrize(
    ("sentence", "endpoint", "spoken"),
    [
        (
            "prompt (1 tokens) plus stopping.max_new_tokens (9000) exceeds the context",
            "completions",
            "prompt (1 tokens) plus max_tokens (9000) exceeds the context",
        ),
        (
            "prompt (1 tokens) plus stopping.max_new_tokens (9000) exceeds the context",
            "responses",
            "input (1 tokens) plus max_output_tokens (9000) exceeds the context",
        ),
        ("sampling.logit_bias names token 9, beyond", "chat", "logit_bias names token 9, beyond"),
        ("logprobs must be at most 20", "chat", "top_logprobs must be at most 20"),
        ("messages[1].role 'x' is not a role", "responses", "input[1].role 'x' is not a role"),
        ("constraint.json_schema is invalid: no", "chat", "response_format is invalid: no"),
        (
            "a constrained request cannot set sampling.logit_bias",
            "chat",
            "a constrained request cannot set logit_bias",
        ),
        ("stopping.stop[0] must not be empty", None, "stop[0] must not be empty"),
        ("cache_salt must be at most 256 bytes", "chat", "cache_salt must be at most 256 bytes"),
    ],
)
def test_a_refusal_names_fields_as_the_endpoint_spells_them(sentence, endpoint, spoken):
    assert in_endpoint_terms(sentence, endpoint) == spoken


def test_only_invalid_arguments_name_a_field():
    error = from_pagoda(error_for_code(grpc.StatusCode.RESOURCE_EXHAUSTED, "n is over the queue"))
    assert error.refused_field is None


def test_unknown_model_and_unsupported_fields_name_their_param():
    assert (model_not_found("m").status, model_not_found("m").param) == (404, "model")
    refusal = unsupported("logit_bias", "(bias)")
    assert (refusal.status, refusal.param, refusal.code) == (
        400,
        "logit_bias",
        "unsupported_parameter",
    )


def test_the_bearer_key_is_passed_on_as_grpc_metadata():
    assert call_metadata("Bearer k1") == (("authorization", "Bearer k1"),)
    assert call_metadata("bearer  k1 ") == (("authorization", "Bearer k1"),)
    assert call_metadata(None) == ()
    assert call_metadata("Basic abc") == ()
    with pytest.raises(Exception) as caught:
        call_metadata("Bearer kéy")
    assert caught.value.status == 401


def test_a_w3c_traceparent_is_passed_on_and_anything_else_dropped():
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert call_metadata("Bearer k1", traceparent) == (
        ("authorization", "Bearer k1"),
        ("traceparent", traceparent),
    )
    assert call_metadata(None, traceparent) == (("traceparent", traceparent),)
    assert call_metadata(None, "00-not-a-trace\nx: y") == ()
