"""The shared converter: every request field from keywords, every response field back."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from pagoda.client.convert import (
    chat_request,
    chunk_from_response,
    detokenize_request,
    generate_request,
    model_info_from_proto,
    server_stats_from_proto,
    tokenize_request,
)
from pagoda.client.errors import InvalidArgumentError
from pagoda.client.results import Chunk, TokenLogprob, Usage, join_chunks, join_samples
from pagoda.protos import generation_pb2 as pb

ALL_OPTIONS = dict(
    temperature=0.5,
    top_p=0.75,
    top_k=40,
    min_p=0.125,
    repetition_penalty=1.25,
    presence_penalty=-0.5,
    frequency_penalty=1.5,
    seed=2**40 + 7,
    max_new_tokens=32,
    min_new_tokens=4,
    stop=["###", "\n\n"],
    stop_token_ids=[2, 7],
    ignore_eos=True,
    priority=-3,
    logprobs=5,
    request_id="req-1",
)


def assert_all_options(request) -> None:
    sampling, stopping = request.sampling, request.stopping
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.75, 40)
    assert (sampling.min_p, sampling.repetition_penalty) == (0.125, 1.25)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-0.5, 1.5)
    assert sampling.HasField("seed") and sampling.seed == 2**40 + 7
    assert (stopping.max_new_tokens, stopping.min_new_tokens) == (32, 4)
    assert list(stopping.stop) == ["###", "\n\n"]
    assert list(stopping.stop_token_ids) == [2, 7]
    assert stopping.ignore_eos is True
    assert (request.priority, request.logprobs, request.request_id) == (-3, 5, "req-1")


def test_generate_request_sets_every_field():
    request = generate_request("Hello", **ALL_OPTIONS)
    assert request.WhichOneof("input") == "prompt" and request.prompt == "Hello"
    assert_all_options(request)


def test_generate_request_from_token_ids():
    request = generate_request([1, 2, 3])
    assert request.WhichOneof("input") == "prompt_token_ids"
    assert list(request.prompt_token_ids.ids) == [1, 2, 3]


def test_omitted_options_stay_unset():
    request = generate_request("Hello")
    assert request.sampling == pb.SamplingParams()
    assert not request.sampling.HasField("seed")
    assert request.stopping == pb.StoppingCriteria()
    assert (request.priority, request.logprobs, request.request_id) == (0, 0, "")
    # seed=0 is a real seed, distinct from "unset".
    assert generate_request("x", seed=0).sampling.HasField("seed")


def test_a_single_stop_string_is_not_split_into_characters():
    assert list(generate_request("x", stop="END").stopping.stop) == ["END"]


def test_chat_request_accepts_dicts_and_pairs():
    request = chat_request(
        [{"role": "system", "content": "Be brief."}, ("user", "Hi")], **ALL_OPTIONS
    )
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]
    assert_all_options(request)


@pytest.mark.parametrize("bad", [{"role": "user"}, ("user",), "user: hi", ("user", 3)])
def test_chat_request_rejects_malformed_messages(bad):
    with pytest.raises(InvalidArgumentError, match=r"messages\[1\]"):
        chat_request([("user", "ok"), bad])


@pytest.mark.parametrize(
    "options", [{"max_new_tokens": -1}, {"top_k": "many"}, {"stop_token_ids": [-5]}]
)
def test_out_of_range_values_are_invalid_argument(options):
    with pytest.raises(InvalidArgumentError) as info:
        generate_request("x", **options)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert next(iter(options)) in info.value.details


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="max_tokens"):
        generate_request("x", max_tokens=3)


def test_prompt_of_wrong_type_is_invalid_argument():
    with pytest.raises(InvalidArgumentError, match="prompt"):
        generate_request(3.5)


def test_detokenize_request_takes_non_negative_ints_only():
    assert list(detokenize_request([3, 0], skip_special_tokens=True).token_ids) == [3, 0]
    for bad in ("12", [1, -2], [1.0], [True]):
        with pytest.raises(InvalidArgumentError):
            detokenize_request(bad)


def test_tokenize_request():
    request = tokenize_request("hi", add_special_tokens=True)
    assert (request.text, request.add_special_tokens) == ("hi", True)


def test_streaming_response_becomes_a_chunk():
    response = pb.GenerateResponse(request_id="r", text="ab", token_ids=[5, 6])
    response.logprobs.add(token_id=5, logprob=-0.5, top_token_ids=[5, 9], top_logprobs=[-0.5, -2])
    response.logprobs.add(token_id=6, logprob=-1.0, top_token_ids=[6], top_logprobs=[-1.0])
    chunk = chunk_from_response(response)
    assert chunk == Chunk(
        request_id="r",
        text="ab",
        token_ids=[5, 6],
        logprobs=[TokenLogprob(5, -0.5, [5, 9], [-0.5, -2.0]), TokenLogprob(6, -1.0, [6], [-1.0])],
        finish_reason=None,
        usage=None,
        timings=None,
    )
    assert not chunk.is_last


@pytest.mark.parametrize(
    ("reason", "name"),
    [(pb.LENGTH, "length"), (pb.STOP, "stop"), (pb.CANCELLED, "cancelled"), (pb.ERROR, "error")],
)
def test_last_response_carries_finish_usage_and_timings(reason, name):
    response = pb.GenerateResponse(
        request_id="r",
        finish_reason=reason,
        usage=pb.Usage(
            prompt_tokens=10, completion_tokens=3, cached_prompt_tokens=8, num_preemptions=2
        ),
        timings=pb.Timings(queued_ms=1.5, first_token_ms=20.25, total_ms=80.5),
    )
    chunk = chunk_from_response(response)
    assert chunk.finish_reason == name and chunk.is_last
    assert chunk.usage == Usage(10, 3, 8, 2) and chunk.usage.total_tokens == 13
    assert (chunk.timings.queued_ms, chunk.timings.first_token_ms) == (1.5, 20.25)
    assert chunk.timings.total_ms == 80.5
    assert chunk.logprobs is None


def test_model_info_covers_every_proto_field():
    message = pb.ModelInfo(
        model_id="m",
        max_context_tokens=2048,
        vocab_size=49152,
        block_size=16,
        num_kv_blocks=100,
        num_kv_tokens=1600,
        eos_token_ids=[0, 2],
        device="cuda",
        dtype="bfloat16",
        quantization="int8",
        numerics="int8: q_proj as int8; activations per-token symmetric int8",
        worker_connected=True,
        has_chat_template=True,
        thinks=True,
    )
    info = model_info_from_proto(message)
    assert {f.name for f in dataclasses.fields(info)} == set(pb.ModelInfo.DESCRIPTOR.fields_by_name)
    for name in pb.ModelInfo.DESCRIPTOR.fields_by_name:
        value = getattr(message, name)
        expected = value if isinstance(value, str | int | float) else list(value)
        assert getattr(info, name) == expected, name
    assert type(info.eos_token_ids) is list


def test_server_stats_covers_every_proto_field():
    values = dict(
        num_waiting=1,
        num_running=2,
        num_kv_blocks_used=3,
        num_kv_blocks_total=4,
        prefix_cache_hit_rate=0.5,
        num_preemptions=6,
        num_steps=7,
        worker_connected=True,
        num_kv_blocks_cached=9,
        num_requests_finished=10,
        num_generated_tokens=11,
        worker_incarnation_id="inc-12",
        draining=True,
        worker_busy_fraction=0.25,
        worker_busy_s=15.5,
        workers=[
            dict(
                incarnation_id="inc-12",
                num_running=1,
                num_waiting=2,
                num_kv_blocks_used=3,
                num_kv_blocks_total=4,
                busy_fraction=0.5,
                num_steps=7,
                num_generated_tokens=11,
            )
        ],
        num_isolated_steps=17,
        tenants=[
            dict(
                tenant="alice",
                num_waiting=1,
                num_running=2,
                num_served_tokens=3,
                num_preemptions=4,
                num_requests_finished=5,
                ttft_bucket_le_s=[0.5, float("inf")],
                ttft_bucket_counts=[1, 5],
                ttft_sum_s=2.5,
            )
        ],
        num_prefix_queried_tokens=19,
        num_prefix_hit_tokens=20,
        num_draft_tokens=21,
        num_accepted_draft_tokens=22,
    )
    assert set(values) == set(pb.ServerStats.DESCRIPTOR.fields_by_name)
    assert set(values["tenants"][0]) == set(pb.TenantStats.DESCRIPTOR.fields_by_name)
    assert set(values["workers"][0]) == set(pb.WorkerStats.DESCRIPTOR.fields_by_name)
    assert dataclasses.asdict(server_stats_from_proto(pb.ServerStats(**values))) == values


def test_join_chunks_concatenates_and_keeps_the_last_metadata():
    chunks = [
        chunk_from_response(pb.GenerateResponse(request_id="r", text="He", token_ids=[1])),
        chunk_from_response(pb.GenerateResponse(request_id="r", text="llo", token_ids=[2, 3])),
        chunk_from_response(
            pb.GenerateResponse(
                request_id="r", finish_reason=pb.STOP, usage=pb.Usage(completion_tokens=3)
            )
        ),
    ]
    completion = join_chunks(chunks)
    assert (completion.text, completion.token_ids) == ("Hello", [1, 2, 3])
    assert (completion.finish_reason, completion.num_chunks) == ("stop", 3)
    assert completion.usage.completion_tokens == 3 and completion.logprobs is None
    assert join_chunks([]).finish_reason is None


def test_n_and_the_sample_index_round_trip():
    assert generate_request("x", n=3).n == 3
    assert chat_request([("user", "hi")], n=2).n == 2
    usage = pb.Usage(prompt_tokens=5, completion_tokens=2)
    total = pb.Usage(prompt_tokens=5, completion_tokens=6)
    responses = [
        pb.GenerateResponse(request_id="r", index=1, text="b", token_ids=[2]),
        pb.GenerateResponse(request_id="r", index=0, text="a", token_ids=[1]),
        pb.GenerateResponse(request_id="r", index=0, text="c", finish_reason=pb.STOP, usage=usage),
        pb.GenerateResponse(
            request_id="r", index=1, finish_reason=pb.LENGTH, usage=usage, total_usage=total
        ),
    ]
    chunks = [chunk_from_response(response) for response in responses]
    assert [chunk.index for chunk in chunks] == [1, 0, 0, 1]
    assert chunks[-1].total_usage == Usage(5, 6, 0) and chunks[0].total_usage is None
    samples = join_samples(chunks)
    assert [(c.index, c.text, c.finish_reason) for c in samples] == [
        (0, "ac", "stop"),
        (1, "b", "length"),
    ]
