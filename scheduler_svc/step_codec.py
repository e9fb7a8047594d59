"""Domain <-> step protocol: StepPlan, StepResult and Hello (WorkerGeometry), each both ways
named as in step.proto.

The only scheduler module besides the servicer that touches step_pb2. Both sides are
column-wise, so encoding is a handful of list copies whatever the batch size.
"""

from __future__ import annotations

from itertools import pairwise

from pagoda.protos import step_pb2
from pagoda.scheduler_svc.core import StepPlan, StepResult, ValidSampling, WorkerGeometry


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
        logit_bias_token_ids=[token_id for token_id, _ in sampling.logit_bias],
        logit_bias_values=[bias for _, bias in sampling.logit_bias],
    )


def encode_plan(plan: StepPlan) -> step_pb2.StepPlan:
    message = step_pb2.StepPlan(step_id=plan.step_id)
    for new in plan.new_sequences:
        added = message.new_sequences.add(
            seq_id=new.seq_id,
            sampling=_sampling_to_proto(new.sampling),
            cached_token_ids=new.cached_token_ids,
            num_prompt_tokens=new.num_prompt_tokens,
        )
        if new.min_new_tokens:  # the worker masks min_tokens_banned_ids until then
            added.sampling.min_new_tokens = new.min_new_tokens
            added.sampling.min_tokens_banned_ids.extend(sorted(new.min_tokens_banned_ids))
    message.seq_ids.extend(plan.seq_ids)
    message.start_positions.extend(plan.start_positions)
    message.sample.extend(plan.sample)
    message.token_offsets.extend(plan.token_offsets)
    message.token_ids.extend(plan.token_ids)
    message.block_offsets.extend(plan.block_offsets)
    message.block_ids.extend(plan.block_ids)
    message.forget_seq_ids.extend(plan.forget_seq_ids)
    message.last_sampled_rows.extend(plan.last_sampled_rows)
    if plan.allowed_token_rows:
        message.allowed_token_rows.extend(plan.allowed_token_rows)
        message.allowed_token_bitmask = plan.allowed_token_bitmask
    return message


def result_problem(
    plan: step_pb2.StepPlan, result: step_pb2.StepResult, vocab_size: int
) -> str | None:
    """Why `result` cannot be the answer to `plan` (a sentence), or None.

    The core's apply() assumes a well-formed result (columns of equal length, only the
    plan's sampling sequences, token ids inside the vocabulary); a buggy, version-skewed or
    hostile worker is stopped here, at the edge. A few passes over the columns per step.
    """
    if result.step_error:
        return None  # nothing was sampled; the rest of the message is not read
    seq_ids, token_ids = result.seq_ids, list(result.token_ids)
    num_sampled = len(seq_ids)
    if len(token_ids) != num_sampled:
        return f"{len(token_ids)} token ids for {num_sampled} sequences"
    if result.logprobs and len(result.logprobs) != num_sampled:
        return f"{len(result.logprobs)} logprobs for {num_sampled} sequences"
    if token_ids and max(token_ids) >= vocab_size:
        return f"token id {max(token_ids)} outside the vocabulary of {vocab_size}"
    top_offsets = result.top_offsets
    if top_offsets or result.top_token_ids or result.top_logprobs:
        num_top = len(result.top_token_ids)
        if len(top_offsets) != num_sampled + 1 or len(result.top_logprobs) != num_top:
            return "its top-logprob columns do not line up with its sampled tokens"
        if top_offsets[0] != 0 or top_offsets[-1] != num_top:
            return "its top_offsets do not span the top-logprob columns"
        if any(end < start for start, end in pairwise(top_offsets)):
            return "its top_offsets decrease"
        if num_top and max(result.top_token_ids) >= vocab_size:
            return "a top-logprob token id is outside the vocabulary"
    plan_seq_ids, sample = list(plan.seq_ids), list(plan.sample)
    sampling = (
        plan_seq_ids
        if all(sample)
        else [s for s, smp in zip(plan_seq_ids, sample, strict=True) if smp]
    )
    if list(seq_ids) == sampling:
        pass  # the usual answer: every sampling sequence, in plan order (plan ids are distinct)
    elif len(set(seq_ids)) != num_sampled:
        return "a sequence sampled twice"
    elif not set(seq_ids) <= set(sampling):
        stray = min(set(seq_ids) - set(sampling))
        return f"sequence {stray} sampled, which the plan did not ask to sample"
    if result.errors and not {error.seq_id for error in result.errors} <= set(plan.seq_ids):
        return "an error names a sequence the plan did not schedule"
    return None


def decode_result(message: step_pb2.StepResult) -> StepResult:
    return StepResult(
        step_id=message.step_id,
        seq_ids=list(message.seq_ids),
        token_ids=list(message.token_ids),
        logprobs=list(message.logprobs),
        top_offsets=list(message.top_offsets),
        top_token_ids=list(message.top_token_ids),
        top_logprobs=list(message.top_logprobs),
        errors={error.seq_id: error.message for error in message.errors},
        step_error=message.step_error or None,
        forward_ms=message.forward_ms,
        sample_ms=message.sample_ms,
    )


def geometry_from_hello(hello: step_pb2.Hello) -> WorkerGeometry:
    return WorkerGeometry(
        num_kv_blocks=hello.num_kv_blocks,
        block_size=hello.block_size,
        max_context_tokens=hello.max_context_tokens,
        eos_token_ids=frozenset(hello.eos_token_ids),
        vocab_size=hello.vocab_size,
    )
