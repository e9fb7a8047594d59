"""The scheduling knobs of DESIGN §3 (one frozen value, validated once at start)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagoda.scheduler_svc.core.admission import LOOKAHEAD_POLICIES
from pagoda.scheduler_svc.core.placement import DEFAULT_AFFINITY_MAX_KV_USE_GAP

ADMISSION_POLICIES = ("fifo", "pack", "prefix", "deadline", "priority")
# pack re-prices its whole lookahead every admission round: a bound keeps a step's cost flat.
MAX_ADMISSION_LOOKAHEAD = 256
# pack's forced FIFO rounds when force_fifo_every is unset: a long head waits a few rounds.
PACK_FORCE_FIFO_EVERY = 4
# The step budget's default target (docs/benchmarks.md, "Step budget"): on 2 CPU cores it
# keeps the mixed burst's ITL p99 under 1 s at about the same throughput.
DEFAULT_TARGET_STEP_MS = 500.0
# Fair share (core/tenants.py), as VTC's defaults: a generated token costs about twice a
# prompt token of worker time.
DEFAULT_PROMPT_WEIGHT = 1.0
DEFAULT_GENERATED_WEIGHT = 2.0
# Speculation's drafts add logits rows to a step: at most this many (speculative_tokens x
# speculative_max_batch), so a step stays near the worker's profiled size (kv_sizing.py).
MAX_DRAFT_ROWS = 128
# Drafts per decoding request when speculative_tokens is unset and drafts cannot change a
# token (docs/benchmarks.md, "Speculation": 1.57-1.73x one at a time on echoing output, the
# same tokens per second in a burst).
DEFAULT_SPECULATIVE_TOKENS = 4


class ConfigError(ValueError):
    """A knob out of range; the message is one sentence naming the knob and its value."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How each step's token budget and the KV pool are shared out.

    Every default is safe for any worker; `validate()` checks the ranges.
    """

    # Tokens (prefill + decode) in one step.
    max_num_batched_tokens: int = 2048
    # Cap on prompt tokens computed per step (new admissions and continued chunks); None: none.
    prefill_max_tokens: int | None = None
    # Cap on requests admitted per step; None: none.
    prefill_max_batch_size: int | None = None
    # Cap on running (admitted, unfinished) requests; when full, a step only decodes.
    max_active_requests: int = 256
    # Decode at most this many sequences per step, round-robin over the running set; None: all.
    max_decode_batch_size: int | None = None
    # "fifo", "pack" (cheapest first within the lookahead), "prefix" (longest cached prefix
    # first within the lookahead), "deadline" (the caller's earliest gRPC deadline first
    # within the lookahead) or "priority" (lower value first).
    admission_policy: str = "fifo"
    # How many waiting requests `pack`, `prefix` and `deadline` consider.
    admission_lookahead: int = 16
    # Every N-th admission round is FIFO (the oldest request first) so long prompts, and
    # prompts that share nothing cached, and requests without a deadline, are never
    # starved; None: 4 under pack, prefix and deadline, never otherwise; 0: never.
    force_fifo_every: int | None = None
    # Split a prompt across steps instead of admitting it whole.
    chunked_prefill: bool = True
    # When prefill and decode cannot share a step, decode wins.
    decode_first: bool = True
    # Reuse the KV blocks of identical prompt prefixes.
    prefix_caching: bool = True
    # Bound of the waiting queue; add() beyond it raises QueueFullError.
    max_waiting_requests: int = 1024
    # A step with decodes in it carries only the prompt tokens its learned cost model
    # (step_budget.py) fits in this many milliseconds of worker time beside them (at least
    # MIN_PREFILL_TOKENS), so a long prompt does not stall the streams; 0 or None: off.
    target_step_ms: float | None = DEFAULT_TARGET_STEP_MS
    # Several workers (placement.py): a worker that caches a prefix of a new request wins
    # it while its KV use (running and queued blocks, a share of its pool) exceeds the
    # least-loaded worker's by at most this much; 0: least load only; inf: always.
    affinity_max_kv_use_gap: float = DEFAULT_AFFINITY_MAX_KV_USE_GAP
    # Tenants (core/tenants.py): share admission, chunks and preemption by each tenant's
    # weighted tokens served while two tenants or more have work; off: one queue for all.
    fair_share: bool = True
    # A prompt token computed and a generated token, in the tenants' counters.
    fair_prompt_weight: float = DEFAULT_PROMPT_WEIGHT
    fair_generated_weight: float = DEFAULT_GENERATED_WEIGHT
    # Per tenant (per worker lane): unfinished requests (running and queued), and queued
    # ones; beyond, add() raises TenantQuotaError. None: no cap besides the global ones.
    max_tenant_requests: int | None = None
    max_tenant_waiting_requests: int | None = None
    # N-gram speculation (core/speculation.py): up to this many drafted tokens behind a
    # decoding request's last token, in steps of at most `speculative_max_batch` decoding
    # requests; 0: off; None: DEFAULT_SPECULATIVE_TOKENS on a worker whose logits are
    # batch-invariant when steps do not overlap, else off (speculative_tokens_for). Drafts
    # follow the latest earlier occurrence of the request's last n tokens, n from
    # speculative_ngram_max down to speculative_ngram_min.
    speculative_tokens: int | None = None
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    speculative_max_batch: int = 8

    def speculative_tokens_for(self, *, batch_invariant: bool, overlapped: bool) -> int:
        """The drafts per decoding request with a worker: `speculative_tokens`, or unset
        DEFAULT_SPECULATIVE_TOKENS where drafts cannot change a token (its logits are
        batch-invariant) and steps do not overlap (a draft follows a known token), else 0."""
        if self.speculative_tokens is not None:
            return self.speculative_tokens
        return DEFAULT_SPECULATIVE_TOKENS if batch_invariant and not overlapped else 0

    @property
    def step_budget_on(self) -> bool:
        """Whether steps are sized by the learned cost model (target_step_ms set, not 0)."""
        return bool(self.target_step_ms)

    @property
    def fifo_every(self) -> int:
        """The forced FIFO period in effect (0: never), `force_fifo_every` or its default."""
        gap = self.affinity_max_kv_use_gap
        if isinstance(gap, bool) or not isinstance(gap, int | float) or not gap >= 0:
            raise ConfigError(
                f"affinity_max_kv_use_gap must be a number >= 0 (inf: always), got {gap!r}"
            )
        if self.force_fifo_every is not None:
            return self.force_fifo_every
        return PACK_FORCE_FIFO_EVERY if self.admission_policy in LOOKAHEAD_POLICIES else 0

    def validate(self) -> None:
        """Raise ConfigError for the first knob out of range."""
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _at_least("max_active_requests", self.max_active_requests, 1)
        _at_least("admission_lookahead", self.admission_lookahead, 1)
        if self.admission_lookahead > MAX_ADMISSION_LOOKAHEAD:
            raise ConfigError(
                f"admission_lookahead must be <= {MAX_ADMISSION_LOOKAHEAD}, "
                f"got {self.admission_lookahead}"
            )
        _at_least("max_waiting_requests", self.max_waiting_requests, 1)
        for name in ("fair_prompt_weight", "fair_generated_weight"):
            weight = getattr(self, name)
            if (
                isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not math.isfinite(weight)
                or weight < 0
            ):
                raise ConfigError(f"{name} must be a number >= 0, got {weight!r}")
        for name in (
            "prefill_max_tokens",
            "prefill_max_batch_size",
            "max_decode_batch_size",
            "max_tenant_requests",
            "max_tenant_waiting_requests",
        ):
            value = getattr(self, name)
            if value is not None:
                _at_least(name, value, 1, suffix=" (or unset for no cap)")
        target = self.target_step_ms
        if target is not None and (
            isinstance(target, bool)
            or not isinstance(target, int | float)
            or not math.isfinite(target)
            or target < 0
        ):
            raise ConfigError(
                f"target_step_ms must be a number >= 0 (0 or unset: off), got {target!r}"
            )
        gap = self.affinity_max_kv_use_gap
        if isinstance(gap, bool) or not isinstance(gap, int | float) or not gap >= 0:
            raise ConfigError(
                f"affinity_max_kv_use_gap must be a number >= 0 (inf: always), got {gap!r}"
            )
        if self.force_fifo_every is not None:
            _at_least("force_fifo_every", self.force_fifo_every, 0, suffix=" (0 or unset: never)")
        if self.speculative_tokens is not None:
            _at_least("speculative_tokens", self.speculative_tokens, 0, suffix=" (0: off)")
        most_drafts = self.speculative_tokens_for(batch_invariant=True, overlapped=False)
        _at_least("speculative_ngram_min", self.speculative_ngram_min, 1)
        _at_least("speculative_ngram_max", self.speculative_ngram_max, self.speculative_ngram_min)
        _at_least("speculative_max_batch", self.speculative_max_batch, 1)
        if most_drafts * self.speculative_max_batch > MAX_DRAFT_ROWS:
            raise ConfigError(
                f"speculative_tokens x speculative_max_batch must be <= {MAX_DRAFT_ROWS} "
                "(the logits rows drafts may add to a step), got "
                f"{most_drafts} x {self.speculative_max_batch}"
            )
        if self.admission_policy not in ADMISSION_POLICIES:
            choices = ", ".join(ADMISSION_POLICIES)
            raise ConfigError(
                f"admission_policy must be one of {choices}, got {self.admission_policy!r}"
            )
        for name in ("chunked_prefill", "decode_first", "prefix_caching", "fair_share"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")


def _at_least(name: str, value: object, minimum: int, suffix: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}{suffix}, got {value}")
