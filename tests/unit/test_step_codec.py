"""The one step schema and its codec (pagoda.common.step, .step_codec), both directions.

The codec copies fields by name, so a field the dataclass has and the message lacks would
silently stay behind: the first test is the guard that makes copying by name safe.
"""

from __future__ import annotations

from dataclasses import fields

import pytest

from pagoda.common import step_codec
from pagoda.common.step import NewSequence, SamplingParams, StepPlan, StepResult
from pagoda.gpu_worker.engine import MAX_LOGPROBS, EngineFacts
from pagoda.protos import step_pb2

# Fields that stay in the process that owns them; every other one travels.
NOT_SENT = {StepPlan: {"num_prefill_tokens", "num_decode_tokens"}}


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (StepPlan, step_pb2.StepPlan),
        (NewSequence, step_pb2.NewSequence),
        (SamplingParams, step_pb2.SamplingParams),
        (StepResult, step_pb2.StepResult),
    ],
)
def test_every_schema_field_has_a_message_field_of_its_name(schema, message):
    on_wire = {f.name for f in message.DESCRIPTOR.fields}
    missing = {f.name for f in fields(schema)} - on_wire - NOT_SENT.get(schema, set())
    assert missing == set(), f"{schema.__name__} fields step.proto lacks: {missing}"


def a_plan() -> StepPlan:
    sampling = SamplingParams(
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        seed=9,
        num_logprobs=2,
        logit_bias_token_ids=(3, 8),
        logit_bias_values=(1.5, -100.0),
    )
    return StepPlan(
        step_id=7,
        new_sequences=[
            NewSequence(
                seq_id=3,
                sampling=sampling,
                num_prompt_tokens=4,
                cached_token_ids=[1, 2],
                min_new_tokens=2,
                min_tokens_banned_ids=frozenset({9, 5}),
            ),
            NewSequence(seq_id=4, sampling=SamplingParams(), num_prompt_tokens=1),
        ],
        seq_ids=[3, 4],
        start_positions=[2, 0],
        sample=[False, True],
        token_offsets=[0, 2, 3],
        token_ids=[11, 12, 13],
        block_offsets=[0, 1, 1],
        block_ids=[5],
        forget_seq_ids=[8],
        last_sampled_rows=[1],
        allowed_token_rows=[1],
        allowed_token_bitmask=b"\xff\x00\x00\x00",
    )


def test_a_plan_crosses_the_wire_unchanged():
    plan = a_plan()
    data = step_codec.encode_plan(plan).SerializeToString()
    decoded = step_codec.decode_plan(step_pb2.StepPlan.FromString(data))
    assert decoded == plan
    assert type(decoded.token_ids) is list  # plain lists, not protobuf containers
    assert type(decoded.new_sequences[0].sampling.logit_bias_token_ids) is tuple


def test_a_result_crosses_the_wire_unchanged():
    result = StepResult(
        step_id=7,
        seq_ids=[4],
        token_ids=[99],
        logprobs=[-0.5],
        top_offsets=[0, 2],
        top_token_ids=[99, 98],
        top_logprobs=[-0.5, -1.5],
        errors={3: "unknown sequence 3"},
        forward_ms=1.5,
        sample_ms=0.25,
        total_ms=2.0,
        num_tokens=3,
    )
    data = step_codec.encode_result(result).SerializeToString()
    assert step_codec.decode_result(step_pb2.StepResult.FromString(data)) == result
    failed = StepResult(step_id=8, step_error="boom")
    assert step_codec.decode_result(step_codec.encode_result(failed)) == failed
    assert step_codec.decode_result(step_codec.encode_result(StepResult(1))).step_error is None


def test_the_worker_clamps_sampling_it_cannot_trust():
    message = step_pb2.SamplingParams(
        temperature=-1.0, top_p=1.5, top_k=-3, min_p=2.0, repetition_penalty=-2.0
    )
    clamped = step_codec.decode_sampling(message)
    assert (clamped.temperature, clamped.top_p, clamped.top_k, clamped.min_p) == (0, 1, 0, 1)
    assert clamped.repetition_penalty == 1.0
    assert step_codec.decode_sampling(step_pb2.SamplingParams()) == SamplingParams()


def test_a_hello_carries_every_engine_fact_and_gives_the_workers_geometry():
    facts = EngineFacts(
        model_id="tiny",
        vocab_size=64,
        eos_token_ids=(2, 3),
        max_context_tokens=128,
        block_size=16,
        num_kv_blocks=9,
        device="cpu",
        dtype="float32",
        quantization="int8",
        numerics="exact",
    )
    hello = step_codec.encode_hello(facts, protocol_version=4, incarnation_id="w1")
    assert (hello.protocol_version, hello.incarnation_id) == (4, "w1")
    assert (hello.model_id, hello.device, hello.dtype) == ("tiny", "cpu", "float32")
    assert (hello.quantization, hello.numerics, hello.max_logprobs) == (
        "int8",
        "exact",
        MAX_LOGPROBS,
    )
    geometry = step_codec.geometry_from_hello(hello)
    assert (geometry.vocab_size, geometry.eos_token_ids) == (64, frozenset({2, 3}))


def test_a_hello_gives_the_workers_geometry():
    hello = step_pb2.Hello(
        vocab_size=64, eos_token_ids=[2, 3], max_context_tokens=128, block_size=16, num_kv_blocks=9
    )
    geometry = step_codec.geometry_from_hello(hello)
    assert (geometry.vocab_size, geometry.eos_token_ids) == (64, frozenset({2, 3}))
    assert (geometry.num_kv_blocks, geometry.block_size, geometry.max_context_tokens) == (
        9,
        16,
        128,
    )
