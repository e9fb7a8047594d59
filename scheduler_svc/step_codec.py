"""Domain <-> step protocol: StepDecision -> StepPlan, StepResult -> StepOutcome, Hello -> geometry.

The only scheduler module besides the servicer that touches step_pb2. Both sides are
column-wise, so encoding is a handful of list copies whatever the batch size.
"""

from __future__ import annotations

from pagoda.protos import step_pb2
from pagoda.scheduler_svc.core.request import ValidSampling
from pagoda.scheduler_svc.core.scheduler import StepDecision, StepOutcome, WorkerGeometry


def _sampling_to_proto(sampling: ValidSampling) -> step_pb2.SamplingParams:
    return step_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        seed=sampling.seed,
        num_logprobs=sampling.num_logprobs,
    )


def encode_plan(decision: StepDecision) -> step_pb2.StepPlan:
    plan = step_pb2.StepPlan(step_id=decision.step_id)
    for new in decision.new_sequences:
        plan.new_sequences.add(
            seq_id=new.seq_id,
            sampling=_sampling_to_proto(new.sampling),
            cached_token_ids=new.cached_token_ids,
            num_prompt_tokens=new.num_prompt_tokens,
        )
    plan.seq_ids.extend(decision.seq_ids)
    plan.start_positions.extend(decision.start_positions)
    plan.sample.extend(decision.sample)
    plan.token_offsets.extend(decision.token_offsets)
    plan.token_ids.extend(decision.token_ids)
    plan.block_offsets.extend(decision.block_offsets)
    plan.block_ids.extend(decision.block_ids)
    plan.forget_seq_ids.extend(decision.forget_seq_ids)
    return plan


def decode_result(result: step_pb2.StepResult) -> StepOutcome:
    return StepOutcome(
        step_id=result.step_id,
        seq_ids=list(result.seq_ids),
        token_ids=list(result.token_ids),
        logprobs=list(result.logprobs),
        top_offsets=list(result.top_offsets),
        top_token_ids=list(result.top_token_ids),
        top_logprobs=list(result.top_logprobs),
        errors={error.seq_id: error.message for error in result.errors},
        step_error=result.step_error or None,
        forward_ms=result.forward_ms,
        sample_ms=result.sample_ms,
    )


def geometry_from_hello(hello: step_pb2.Hello) -> WorkerGeometry:
    return WorkerGeometry(
        num_kv_blocks=hello.num_kv_blocks,
        block_size=hello.block_size,
        max_context_tokens=hello.max_context_tokens,
        eos_token_ids=frozenset(hello.eos_token_ids),
        vocab_size=hello.vocab_size,
    )
