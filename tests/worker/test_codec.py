"""The step codec as a worker uses it: protobuf plans into plain step objects and plain results
back (no torch)."""

from __future__ import annotations

from pathlib import Path

import pagoda.gpu_worker
from pagoda.common.step import SamplingParams, StepResult
from pagoda.common.step_codec import decode_plan, decode_sampling, encode_result
from pagoda.protos import step_pb2


def test_a_plan_decodes_column_for_column():
    message = step_pb2.StepPlan(
        step_id=7,
        seq_ids=[3, 4],
        start_positions=[0, 9],
        sample=[False, True],
        token_offsets=[0, 2, 3],
        token_ids=[11, 12, 13],
        block_offsets=[0, 1, 1],
        block_ids=[5],
        forget_seq_ids=[8],
        draft_counts=[0, 1],
    )
    message.new_sequences.add(
        seq_id=3,
        num_prompt_tokens=4,
        cached_token_ids=[1, 2],
        sampling=step_pb2.SamplingParams(temperature=0.5, top_k=40, seed=9, num_logprobs=2),
    )
    plan = decode_plan(message)
    assert (plan.step_id, plan.seq_ids, plan.start_positions, plan.sample) == (
        7, [3, 4], [0, 9], [False, True],
    )  # fmt: skip
    assert (plan.token_offsets, plan.token_ids) == ([0, 2, 3], [11, 12, 13])
    assert (plan.block_offsets, plan.block_ids, plan.forget_seq_ids) == ([0, 1, 1], [5], [8])
    assert plan.draft_counts == [0, 1] and plan.sampled_seq_ids() == [4, 4]
    (new,) = plan.new_sequences
    assert (new.seq_id, new.num_prompt_tokens, new.cached_token_ids) == (3, 4, [1, 2])
    assert new.sampling == SamplingParams(temperature=0.5, top_k=40, seed=9, num_logprobs=2)
    assert plan.named_seq_ids() == {3, 4, 8}
    assert type(plan.token_ids) is list  # plain lists, not protobuf containers


def test_unset_sampling_fields_mean_off_and_out_of_range_ones_are_clamped():
    assert decode_sampling(step_pb2.SamplingParams()) == SamplingParams()
    clamped = decode_sampling(
        step_pb2.SamplingParams(temperature=-1.0, top_p=1.5, top_k=-3, min_p=2.0)
    )
    assert (clamped.temperature, clamped.top_p, clamped.top_k, clamped.min_p) == (0, 1, 0, 1)


def test_a_result_encodes_every_column():
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
    message = encode_result(result)
    assert step_pb2.StepResult.FromString(message.SerializeToString()) == message
    assert (message.step_id, list(message.seq_ids), list(message.token_ids)) == (7, [4], [99])
    assert list(message.top_offsets) == [0, 2] and list(message.top_token_ids) == [99, 98]
    assert list(message.logprobs) == [-0.5] and list(message.top_logprobs) == [-0.5, -1.5]
    assert [(e.seq_id, e.message) for e in message.errors] == [(3, "unknown sequence 3")]
    assert (message.forward_ms, message.sample_ms, message.total_ms) == (1.5, 0.25, 2.0)
    assert message.num_tokens == 3 and not message.step_error
    assert encode_result(StepResult(step_id=8, step_error="boom")).step_error == "boom"


def test_only_the_codec_and_the_server_import_step_pb2():
    """The worker's codec is pagoda.common.step_codec now; its server is the only other
    worker module that sees step_pb2."""
    folder = Path(pagoda.gpu_worker.__file__).parent
    importers = sorted(p.name for p in folder.glob("*.py") if "step_pb2" in p.read_text())
    assert importers == ["server.py"]
