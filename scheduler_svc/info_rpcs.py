"""The bodies of the unary information RPCs: Tokenize, Detokenize, GetModelInfo and
GetServerStats.

Plain functions over explicit inputs that build the reply messages; the servicer keeps
what makes them RPCs (decoding checks, the caller's tenant, limits, refusals) and calls
these. Part of the gRPC edge: they build pagoda.v1 messages.
"""

from __future__ import annotations

from pagoda.protos import generation_pb2
from pagoda.scheduler_svc.front import Front
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.settings import ServiceConfig
from pagoda.scheduler_svc.tokenizer import TextTokenizer
from pagoda.scheduler_svc.validation import Limits, ValidationError

# Bounds a Tokenize text (Detokenize ids) before any worker said hello (the limit then follows its context).
FALLBACK_MAX_CONTEXT_TOKENS = 32_768


def tokenize(tokenizer: TextTokenizer, request, max_tokens: int) -> generation_pb2.TokenizeResponse:
    """Encode, then build the pieces only for a text within the context: a piece costs
    a Python call holding the GIL, and 262k of them stalled every stream for seconds
    (security review N6)."""
    ids = tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
    if len(ids) > max_tokens:
        raise ValidationError(f"text has {len(ids)} tokens, more than the context of {max_tokens}")
    return generation_pb2.TokenizeResponse(
        token_ids=ids, tokens=[tokenizer.id_to_piece(i) for i in ids]
    )


def detokenize(
    tokenizer: TextTokenizer, token_ids: list[int], skip_special_tokens: bool
) -> generation_pb2.DetokenizeResponse:
    return generation_pb2.DetokenizeResponse(
        text=tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    )


def fallback_limits(tokenizer: TextTokenizer, config: ServiceConfig) -> Limits:
    """The limits a Tokenize text is checked against before any worker said hello."""
    return Limits(
        max_context_tokens=FALLBACK_MAX_CONTEXT_TOKENS,
        vocab_size=tokenizer.vocab_size,
        default_max_new_tokens=config.default_max_new_tokens,
        max_stop_strings=config.max_stop_strings,
        max_stop_string_bytes=config.max_stop_string_bytes,
        max_stop_total_bytes=config.max_stop_total_bytes,
        max_logprobs=config.max_logprobs,
        max_n=config.max_n,
    )


def model_info(
    model_id: str, tokenizer: TextTokenizer, front: Front, hello
) -> generation_pb2.ModelInfo:
    """`hello`: the last worker's Hello (None before any); its figures win over the
    scheduler's own model id and tokenizer."""
    info = generation_pb2.ModelInfo(
        model_id=model_id,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        worker_connected=front.worker is not None,
        has_chat_template=tokenizer.chat_template is not None,
        thinks=tokenizer.thinks,
    )
    if hello is not None:
        info.model_id = hello.model_id
        info.max_context_tokens = hello.max_context_tokens
        info.vocab_size = hello.vocab_size
        info.block_size = hello.block_size
        info.num_kv_blocks = hello.num_kv_blocks
        info.num_kv_tokens = hello.num_kv_blocks * hello.block_size
        info.device = hello.device
        info.dtype = hello.dtype
        info.quantization = hello.quantization or "none"  # empty from an older worker
        info.numerics = hello.numerics
        del info.eos_token_ids[:]
        info.eos_token_ids.extend(sorted(hello.eos_token_ids))
    return info


def _own_tenant_stats(front: Front, metrics: Metrics, tenant: str) -> generation_pb2.TenantStats:
    """The caller's tenant's figures; zeros for a tenant with no request yet."""
    figures = next((s for s in front.tenant_stats() if s.tenant == tenant), None)
    bounds, counts, total_s = metrics.tenant_ttft(tenant)
    stats = generation_pb2.TenantStats(
        tenant=tenant, ttft_bucket_le_s=bounds, ttft_bucket_counts=counts, ttft_sum_s=total_s
    )
    if figures is not None:
        stats.num_waiting = figures.num_waiting
        stats.num_running = figures.num_running
        stats.num_served_tokens = figures.num_served_tokens
        stats.num_preemptions = figures.num_preemptions
        stats.num_requests_finished = figures.num_requests_finished
    return stats


def server_stats(front: Front, metrics: Metrics, tenant: str) -> generation_pb2.ServerStats:
    """The server's figures, each worker's, and those of the caller's `tenant` alone."""
    stats = front.stats
    worker = front.worker
    return generation_pb2.ServerStats(
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        num_kv_blocks_used=stats.num_kv_blocks_used,
        num_kv_blocks_total=stats.num_kv_blocks_total,
        num_kv_blocks_cached=stats.num_kv_blocks_cached,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        num_prefix_queried_tokens=stats.num_prefix_queries_tokens,
        num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_draft_tokens=stats.num_accepted_draft_tokens,
        num_preemptions=stats.num_preemptions,
        num_steps=stats.num_steps,
        num_isolated_steps=stats.num_isolated_steps,
        num_requests_finished=stats.num_requests_finished,
        num_generated_tokens=stats.num_generated_tokens,
        worker_connected=worker is not None,
        worker_incarnation_id=worker.hello.incarnation_id if worker else "",
        draining=front.draining,
        worker_busy_fraction=metrics.worker_busy.fraction(),
        worker_busy_s=metrics.worker_busy.total_s,
        workers=[
            generation_pb2.WorkerStats(
                incarnation_id=each.incarnation_id,
                num_running=each.num_running,
                num_waiting=each.num_waiting,
                num_kv_blocks_used=each.num_kv_blocks_used,
                num_kv_blocks_total=each.num_kv_blocks_total,
                busy_fraction=each.busy_fraction,
                num_steps=each.num_steps,
                num_generated_tokens=each.num_generated_tokens,
            )
            for each in front.worker_stats()
        ],
        tenants=[_own_tenant_stats(front, metrics, tenant)],
    )
