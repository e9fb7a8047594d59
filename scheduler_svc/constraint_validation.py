"""A request's structured-output constraint, checked: its own constraint field (kind and
size), or the calls a Chat's tool_choice REQUIRED or named function constrains it to (or
AUTO with a strict tool, its calls), and the stopping and sampling rules a constraint
cannot live with. The grammar itself is compiled by grammars.py."""

from __future__ import annotations

import json

from pagoda.scheduler_svc.core import ValidRequest
from pagoda.scheduler_svc.grammars import MAX_CHOICES, MAX_CONSTRAINT_BYTES, ValidConstraint
from pagoda.scheduler_svc.tool_constraints import tool_constraint
from pagoda.scheduler_svc.tools import ValidTools
from pagoda.scheduler_svc.validation import ValidationError


def validate_constraint(request, valid: ValidRequest) -> ValidConstraint | None:
    """A request's structured-output constraint (GenerateRequest.constraint, or the calls
    of a Chat request's tool_choice REQUIRED or function, or of AUTO with a strict tool),
    checked for size and for the stopping rules it cannot live with; None when it has
    none. The grammar itself is compiled by scheduler_svc.grammars."""
    tools = valid.tools if isinstance(valid.tools, ValidTools) else None
    constraint = _request_constraint(request)
    if tools is not None and tools.reads_calls:
        if constraint is not None:
            raise ValidationError(
                "a constraint cannot be combined with tools unless tool_choice is NONE "
                "(tool_choice REQUIRED or a function constrains the output to calls)"
            )
        constraint = tool_constraint(tools)
    if constraint is None:
        return None
    auto_calls = tools is not None and tools.holds_auto_calls
    what = "a constrained request"
    if auto_calls:
        what += " (tool_choice AUTO with a strict tool constrains its calls)"
    # A grammar is done once it consumed EOS: nothing may ignore it. And a grammar ends
    # the request by allowing EOS alone, which nothing may mask; AUTO's calls' grammar
    # never does (free text follows every call, an open call allows no EOS anyway).
    if valid.stopping.ignore_eos:
        raise ValidationError(f"{what} cannot set stopping.ignore_eos")
    if valid.stopping.min_new_tokens and not auto_calls:
        raise ValidationError(f"{what} cannot set stopping.min_new_tokens")
    if valid.sampling.allowed_token_ids or valid.sampling.banned_token_ids:  # it may need any id
        raise ValidationError(f"{what} cannot set sampling.allowed_token_ids or banned_token_ids")
    return constraint


def _request_constraint(request) -> ValidConstraint | None:
    """The request's own constraint field, checked for size."""
    if not request.HasField("constraint"):
        return None
    constraint = request.constraint
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not constraint.json_object:
            return None
        source = ""
    elif kind == "choice":
        choices = list(constraint.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise ValidationError(
                f"constraint.choice must hold 1 to {MAX_CHOICES} strings, got {len(choices)}"
            )
        if not all(choices):
            raise ValidationError("constraint.choice must not hold an empty string")
        source = json.dumps(choices)
    else:
        source = getattr(constraint, kind)
        if not source:
            raise ValidationError(f"constraint.{kind} must not be empty")
    if len(source.encode()) > MAX_CONSTRAINT_BYTES:
        raise ValidationError(
            f"constraint.{kind} is {len(source.encode())} bytes; at most {MAX_CONSTRAINT_BYTES}"
        )
    return ValidConstraint(kind, source)
