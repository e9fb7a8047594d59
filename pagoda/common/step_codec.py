"""pagoda.common.step <-> protos/step.proto, both ways, for both processes.

A dataclass field and the message field of the same name (a scalar, bytes or a repeated
scalar) are copied as they are: lists for repeated fields, tuples into the frozen
SamplingParams. So a new plan column or sampling knob needs no edit here. Written out are
the rest: the new sequences and their sampling, the result's errors, "" for no step_error,
the hello, and on the way into a worker the clamping of sampling values it cannot trust.
The only module that builds step_pb2 plans, results and hellos or turns them into the
schema's dataclasses (worker_link, the step loop and the worker's server pass them along).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from itertools import pairwise

from pagoda.common.step import (
    NewSequence,
    SamplingParams,
    StepMasks,
    StepPlan,
    StepResult,
    WorkerGeometry,
    sampled_seq_ids,
)
from pagoda.protos import step_pb2


def _shared_fields(cls: type, message: type, *, written_out: tuple[str, ...] = ()):
    """(repeated names, single names) that `cls` and `message` both have, by name."""
    on_wire = {f.name: f for f in message.DESCRIPTOR.fields}
    names = [f.name for f in fields(cls) if f.name in on_wire and f.name not in written_out]
    return (
        tuple(name for name in names if on_wire[name].is_repeated),
        tuple(name for name in names if not on_wire[name].is_repeated),
    )


_PLAN_COLUMNS, _PLAN_SCALARS = _shared_fields(
    StepPlan, step_pb2.StepPlan, written_out=("new_sequences",)
)
_NEW_COLUMNS, _NEW_SCALARS = _shared_fields(
    NewSequence, step_pb2.NewSequence, written_out=("sampling", "min_tokens_banned_ids")
)
_RESULT_COLUMNS, _RESULT_SCALARS = _shared_fields(
    StepResult, step_pb2.StepResult, written_out=("errors", "step_error")
)
_SAMPLING_COLUMNS, _SAMPLING_SCALARS = _shared_fields(SamplingParams, step_pb2.SamplingParams)
_MASKS_COLUMNS, _MASKS_SCALARS = _shared_fields(StepMasks, step_pb2.StepMasks)

# The worker's reading of sampling values (a scheduler is trusted to validate, not to be
# right): proto3 cannot tell "unset" from 0, and 0 would be meaningless for top_p and
# repetition_penalty, so it means off; out-of-range values are clamped.
_CLAMPS: dict[str, Callable] = {
    "temperature": lambda value: max(0.0, value),
    "top_p": lambda value: value if 0.0 < value < 1.0 else 1.0,
    "top_k": lambda value: max(0, value),
    "min_p": lambda value: min(max(0.0, value), 1.0),
    "repetition_penalty": lambda value: value if value > 0 else 1.0,
}


# -- the plan: scheduler -> worker -------------------------------------------------------------


def encode_plan(plan: StepPlan) -> step_pb2.StepPlan:
    message = step_pb2.StepPlan(
        new_sequences=[_encode_new(new) for new in plan.new_sequences],
        **{name: getattr(plan, name) for name in _PLAN_SCALARS},
    )
    for name in _PLAN_COLUMNS:
        getattr(message, name).extend(getattr(plan, name))
    return message


def decode_plan(message: step_pb2.StepPlan) -> StepPlan:
    """As sent; the sequence table checks that the columns line up."""
    return StepPlan(
        new_sequences=[_decode_new(new) for new in message.new_sequences],
        **{name: list(getattr(message, name)) for name in _PLAN_COLUMNS},
        **{name: getattr(message, name) for name in _PLAN_SCALARS},
    )


def _encode_new(new: NewSequence) -> step_pb2.NewSequence:
    return step_pb2.NewSequence(
        sampling=encode_sampling(new.sampling),
        min_tokens_banned_ids=sorted(new.min_tokens_banned_ids),
        **{name: getattr(new, name) for name in _NEW_COLUMNS + _NEW_SCALARS},
    )


def _decode_new(message: step_pb2.NewSequence) -> NewSequence:
    new = NewSequence(
        sampling=decode_sampling(message.sampling),
        **{name: list(getattr(message, name)) for name in _NEW_COLUMNS},
        **{name: getattr(message, name) for name in _NEW_SCALARS},
    )
    # The mask is pointless without ids, or ids without a count; one check then suffices.
    if new.min_new_tokens and message.min_tokens_banned_ids:
        new.min_tokens_banned_ids = frozenset(message.min_tokens_banned_ids)
    else:
        new.min_new_tokens = 0
    return new


def encode_sampling(sampling: SamplingParams) -> step_pb2.SamplingParams:
    return step_pb2.SamplingParams(
        **{name: getattr(sampling, name) for name in _SAMPLING_COLUMNS + _SAMPLING_SCALARS}
    )


def decode_sampling(message: step_pb2.SamplingParams) -> SamplingParams:
    """As a worker reads it: clamped into range (see _CLAMPS)."""
    values = {name: tuple(getattr(message, name)) for name in _SAMPLING_COLUMNS}
    for name in _SAMPLING_SCALARS:
        value = getattr(message, name)
        clamp = _CLAMPS.get(name)
        values[name] = clamp(value) if clamp is not None else value
    return SamplingParams(**values)


# -- the masks that follow a plan: scheduler -> worker ------------------------------------------


def encode_masks(masks: StepMasks) -> step_pb2.StepMasks:
    message = step_pb2.StepMasks(**{name: getattr(masks, name) for name in _MASKS_SCALARS})
    for name in _MASKS_COLUMNS:
        getattr(message, name).extend(getattr(masks, name))
    return message


def decode_masks(message: step_pb2.StepMasks) -> StepMasks:
    """As sent; the worker checks it against its plan when it samples."""
    return StepMasks(
        **{name: list(getattr(message, name)) for name in _MASKS_COLUMNS},
        **{name: getattr(message, name) for name in _MASKS_SCALARS},
    )


# -- the result: worker -> scheduler -----------------------------------------------------------


def encode_result(result: StepResult) -> step_pb2.StepResult:
    message = step_pb2.StepResult(
        errors=[
            step_pb2.SequenceError(seq_id=seq_id, message=text)
            for seq_id, text in result.errors.items()
        ],
        step_error=result.step_error or "",
        **{name: getattr(result, name) for name in _RESULT_SCALARS},
    )
    for name in _RESULT_COLUMNS:
        getattr(message, name).extend(getattr(result, name))
    return message


def decode_result(message: step_pb2.StepResult) -> StepResult:
    """As sent; check it against its plan with result_problem first."""
    return StepResult(
        errors={error.seq_id: error.message for error in message.errors},
        step_error=message.step_error or None,
        **{name: list(getattr(message, name)) for name in _RESULT_COLUMNS},
        **{name: getattr(message, name) for name in _RESULT_SCALARS},
    )


def result_problem(
    plan: step_pb2.StepPlan, result: step_pb2.StepResult, vocab_size: int
) -> str | None:
    """Why `result` cannot be the answer to `plan` (a sentence), or None.

    The core's apply() assumes a well-formed result (columns of equal length, only the
    plan's sampling sequences, token ids inside the vocabulary); a buggy, version-skewed or
    hostile worker is stopped at the scheduler's edge, before decode_result. A few passes
    over the columns per step.
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
    sampling = sampled_seq_ids(plan.seq_ids, plan.sample, plan.draft_counts)
    if plan.draft_counts:
        # Speculative rows sample d + 1 tokens each, consecutively; a refused row none.
        answered = set(seq_ids)
        sampling = [seq_id for seq_id in sampling if seq_id in answered]
        if list(seq_ids) != sampling:
            return "its sampled tokens do not follow the plan's rows and drafts"
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


# -- the hello: worker -> scheduler ------------------------------------------------------------


def encode_hello(facts: object, **identity) -> step_pb2.Hello:
    """A worker's hello: every field of the dataclass `facts` (its engine's, named as Hello's
    fields) and `identity` (who it is, what it speaks)."""
    on_wire = step_pb2.Hello.DESCRIPTOR.fields_by_name
    values = {f.name: getattr(facts, f.name) for f in fields(facts) if f.name in on_wire}
    return step_pb2.Hello(**values, **identity)


def geometry_from_hello(hello: step_pb2.Hello) -> WorkerGeometry:
    return WorkerGeometry(
        num_kv_blocks=hello.num_kv_blocks,
        block_size=hello.block_size,
        max_context_tokens=hello.max_context_tokens,
        eos_token_ids=frozenset(hello.eos_token_ids),
        vocab_size=hello.vocab_size,
        batch_invariant=hello.batch_invariant,
    )
