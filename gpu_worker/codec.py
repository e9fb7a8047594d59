"""The worker's codec: a step_pb2.StepPlan into a plain StepPlan, a StepResult back out.

Column for column, so a decode plan costs a list copy per column. The only worker
module besides the server's ZeroMQ loop that imports step_pb2. Imports no torch.
"""

from __future__ import annotations

from pagoda.gpu_worker.step import NewSequence, SamplingParams, StepPlan, StepResult
from pagoda.protos import step_pb2


def decode_plan(message: step_pb2.StepPlan) -> StepPlan:
    """As sent; the sequence table checks that the columns line up."""
    return StepPlan(
        step_id=message.step_id,
        new_sequences=[
            NewSequence(
                seq_id=new.seq_id,
                sampling=decode_sampling(new.sampling),
                num_prompt_tokens=new.num_prompt_tokens,
                cached_token_ids=list(new.cached_token_ids),
            )
            for new in message.new_sequences
        ],
        seq_ids=list(message.seq_ids),
        start_positions=list(message.start_positions),
        sample=list(message.sample),
        token_offsets=list(message.token_offsets),
        token_ids=list(message.token_ids),
        block_offsets=list(message.block_offsets),
        block_ids=list(message.block_ids),
        forget_seq_ids=list(message.forget_seq_ids),
        last_sampled_rows=list(message.last_sampled_rows),
        allowed_token_rows=list(message.allowed_token_rows),
        allowed_token_bitmask=message.allowed_token_bitmask,
    )


def decode_sampling(message: step_pb2.SamplingParams) -> SamplingParams:
    # proto3 cannot tell "unset" from 0; 0 would be meaningless for top_p and
    # repetition_penalty, so it means off. Out-of-range values are clamped.
    return SamplingParams(
        temperature=max(0.0, message.temperature),
        top_p=message.top_p if 0.0 < message.top_p < 1.0 else 1.0,
        top_k=max(0, message.top_k),
        min_p=min(max(0.0, message.min_p), 1.0),
        repetition_penalty=message.repetition_penalty if message.repetition_penalty > 0 else 1.0,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed,
        num_logprobs=message.num_logprobs,
        # The mask is pointless without ids, or ids without a count; one check then suffices.
        min_new_tokens=message.min_new_tokens if message.min_tokens_banned_ids else 0,
        min_tokens_banned_ids=(
            tuple(message.min_tokens_banned_ids) if message.min_new_tokens else ()
        ),
        logit_bias_token_ids=tuple(message.logit_bias_token_ids),
        logit_bias_values=tuple(message.logit_bias_values),
    )


def encode_result(result: StepResult) -> step_pb2.StepResult:
    return step_pb2.StepResult(
        step_id=result.step_id,
        seq_ids=result.seq_ids,
        token_ids=result.token_ids,
        logprobs=result.logprobs,
        top_offsets=result.top_offsets,
        top_token_ids=result.top_token_ids,
        top_logprobs=result.top_logprobs,
        errors=[step_pb2.SequenceError(seq_id=e.seq_id, message=e.message) for e in result.errors],
        step_error=result.step_error,
        forward_ms=result.forward_ms,
        sample_ms=result.sample_ms,
        total_ms=result.total_ms,
        num_tokens=result.num_tokens,
    )
