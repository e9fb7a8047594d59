"""What one step is, in domain form: the scheduler's decision and the worker's outcome.

Both are column-wise and mirror step.proto's StepPlan and StepResult field for field,
so step_codec copies lists and never loops over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.scheduler_svc.core.request import ValidSampling


@dataclass(frozen=True, slots=True)
class WorkerGeometry:
    """What a worker's hello says about its model and KV pool."""

    num_kv_blocks: int
    block_size: int  # tokens per KV block
    max_context_tokens: int  # longest sequence (prompt + generated)
    eos_token_ids: frozenset[int]
    vocab_size: int


@dataclass(slots=True)
class NewSequenceSpec:
    """A sequence the worker has not seen; sent with the first plan that feeds it."""

    seq_id: int
    sampling: ValidSampling
    # Tokens at positions before the first fed one, whose KV is in shared prefix blocks.
    cached_token_ids: list[int]
    num_prompt_tokens: int  # positions from here on hold generated tokens (penalties)


@dataclass(slots=True)
class StepDecision:
    """One step's plan. Entry i of each per-sequence column is the i-th scheduled sequence.

    Sequence i feeds token_ids[token_offsets[i]:token_offsets[i + 1]] from position
    start_positions[i], and first appends block_ids[block_offsets[i]:block_offsets[i + 1]]
    to its block table (tables are append-only and cover every fed position).
    """

    step_id: int
    new_sequences: list[NewSequenceSpec] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    token_offsets: list[int] = field(default_factory=lambda: [0])
    token_ids: list[int] = field(default_factory=list)
    block_offsets: list[int] = field(default_factory=lambda: [0])
    block_ids: list[int] = field(default_factory=list)
    # Sequences to drop after this step's forward (finished, cancelled or preempted).
    forget_seq_ids: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0  # prompt and recompute tokens fed
    num_decode_tokens: int = 0  # one per decoding sequence

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sampling(self) -> int:
        return sum(self.sample)


@dataclass(slots=True)
class StepOutcome:
    """The worker's StepResult: one sampled token per sequence that sampled, in plan order."""

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    # Empty unless some sequence asked for logprobs; then one per sampled token, and the
    # top-n of entry i are top_*[top_offsets[i]:top_offsets[i + 1]].
    logprobs: list[float] = field(default_factory=list)
    top_offsets: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # seq_id -> why the worker refused it
    # The whole step failed; the worker forgot every sequence the plan named.
    step_error: str | None = None
    forward_ms: float = 0.0
    sample_ms: float = 0.0
