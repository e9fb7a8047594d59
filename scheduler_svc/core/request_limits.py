"""Requests the scheduler refuses at add(), each with one human sentence."""

from __future__ import annotations

from pagoda.scheduler_svc.core.step_decision import WorkerGeometry


class QueueFullError(Exception):
    """The waiting queue is at max_waiting_requests (RESOURCE_EXHAUSTED)."""


class RequestTooLargeError(ValueError):
    """Prompt plus max_new_tokens can never fit the context or the whole KV pool."""


class DuplicateRequestError(ValueError):
    """A request with this id is already queued or running."""


def too_large_reason(
    num_prompt_tokens: int, max_new_tokens: int, geometry: WorkerGeometry
) -> str | None:
    """Why a request can never run on this worker, as a sentence; None if it can."""
    num_tokens = num_prompt_tokens + max_new_tokens
    if num_tokens > geometry.max_context_tokens:
        return (
            f"prompt ({num_prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) "
            f"exceeds the context of {geometry.max_context_tokens} tokens"
        )
    # The last generated token is never fed, so it needs no KV slot.
    num_blocks = -(-(num_tokens - 1) // geometry.block_size)
    if num_blocks > geometry.num_kv_blocks:
        return (
            f"prompt ({num_prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) needs "
            f"{num_blocks} KV blocks of {geometry.block_size} tokens but the worker's pool "
            f"holds {geometry.num_kv_blocks}"
        )
    return None
