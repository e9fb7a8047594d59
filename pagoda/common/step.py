"""One step, as both processes see it: the plan, the worker's result, the sampling knobs.

Plain data, written once: the scheduler's core builds StepPlans and reads StepResults, the
worker's engines read the plans and build the results, and pagoda.common.step_codec copies
them to and from protos/step.proto's messages of the same names field by field (a field
the message also has travels without a codec edit). Column-wise: entry i of every
per-sequence column is the i-th scheduled sequence and ragged runs are framed by offsets,
so a step costs a handful of list copies whatever its batch size. Imports no protobuf and
no torch (the pure core imports it). Unchecked: the worker's sequence table validates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One sequence's sampling knobs, from validation to the worker's sampler (as vLLM's).

    The defaults are "off": greedy, top_p and repetition_penalty 1.0, top_k 0. A new knob
    is a field here and in step.proto's SamplingParams of the same name (the codec copies
    by name), a check in validation and its use in the sampler.
    """

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    num_logprobs: int = 0  # top-n alternatives per generated token; 0: no logprobs at all
    # Added to the logits of these ids before temperature and the filters (OpenAI's
    # logit_bias): ascending distinct ids, one value each.
    logit_bias_token_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    # Only these ids may be sampled (empty: any), and never these; ascending, distinct.
    allowed_token_ids: tuple[int, ...] = ()
    banned_token_ids: tuple[int, ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]:
        """(token id, bias) pairs, ascending ids."""
        return tuple(zip(self.logit_bias_token_ids, self.logit_bias_values, strict=True))

    @property
    def token_id_fields(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(name, ids) of every knob that names token ids (the worker checks them against
        its vocabulary before the sampler indexes the logits with them)."""
        return tuple(
            (name, getattr(self, name)) for name in _TOKEN_ID_FIELDS if getattr(self, name)
        )


def has_penalty(params: SamplingParams) -> bool:
    """Whether sampling reads the sequence's own token counts (a repetition, presence or
    frequency penalty): only such a sequence gets counts on the worker (token_counts.py,
    which counts a row's drafts before each of its sample points)."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


# SamplingParams' fields that hold token ids: every `*_token_ids` one.
_TOKEN_ID_FIELDS = tuple(
    name for name in SamplingParams.__dataclass_fields__ if name.endswith("_token_ids")
)


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has not seen; sent once, in the plan that first feeds it."""

    seq_id: int
    sampling: SamplingParams
    num_prompt_tokens: int  # positions from here on hold generated tokens (penalties)
    # Tokens at positions before the first fed one, whose KV is in shared prefix blocks.
    cached_token_ids: list[int] = field(default_factory=list)
    # While fewer than min_new_tokens tokens are generated, the worker masks these ids
    # (EOS unless ignored, stop token ids) out of the logits; 0 and empty once reached.
    min_new_tokens: int = 0
    min_tokens_banned_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class StepPlan:
    """One step's plan. Entry i of each per-sequence column is the i-th scheduled sequence.

    Sequence i feeds token_ids[token_offsets[i]:token_offsets[i + 1]] from position
    start_positions[i], and first appends block_ids[block_offsets[i]:block_offsets[i + 1]]
    to its block table (tables are append-only and cover every fed position).
    """

    step_id: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    token_offsets: list[int] = field(default_factory=lambda: [0])
    token_ids: list[int] = field(default_factory=list)
    block_offsets: list[int] = field(default_factory=lambda: [0])
    block_ids: list[int] = field(default_factory=list)
    # Sequences to drop after this step's forward (finished, cancelled or preempted).
    forget_seq_ids: list[int] = field(default_factory=list)
    # Entries (indices into seq_ids) that feed the token the step in flight samples for
    # them: the worker substitutes it for their token_ids entry (overlapped steps).
    last_sampled_rows: list[int] = field(default_factory=list)
    # Structured output (filled by the service's grammars after schedule()): rows whose
    # samples are constrained, and their allowed-token bitmasks (ceil(vocab / 32)
    # little-endian 32-bit words per sample point of the listed rows: num_masks).
    allowed_token_rows: list[int] = field(default_factory=list)
    allowed_token_bitmask: bytes = b""
    # Rows planned ahead sample constrained tokens whose masks come after the plan, in the
    # StepMasks of this step_id (the worker waits for it only to sample).
    masks_follow: bool = False
    # Speculative rows: empty, or per row the drafted tokens among its last fed ones; such
    # a row samples after each of its last draft_counts[i] + 1 fed tokens (step.proto).
    draft_counts: list[int] = field(default_factory=list)
    # The scheduler's own counts; not sent.
    num_prefill_tokens: int = 0  # prompt and recompute tokens fed
    num_decode_tokens: int = 0  # one per decoding sequence

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_context_tokens(self) -> int:
        """The KV the step's attention reads: each sequence's context after the step (its
        start position + the tokens it feeds), summed; a step cost model's feature."""
        return sum(self.start_positions) + len(self.token_ids)

    @property
    def num_sampling(self) -> int:
        """Tokens the plan samples: one per sampling row, d more for a row with d drafts."""
        return sum(self.sample) + self.num_draft_tokens

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.draft_counts)

    @property
    def num_extra_tokens(self) -> int:
        """Tokens fed beyond one per decoding row, prompt chunks and drafts: what a step's
        cost model counts at a prompt token's price."""
        return self.num_prefill_tokens + self.num_draft_tokens

    def sampled_seq_ids(self) -> list[int]:
        return sampled_seq_ids(self.seq_ids, self.sample, self.draft_counts)

    def drafts(self, row: int) -> list[int]:
        """The drafted tokens row `row` feeds (its last draft_counts[row]; [] for none)."""
        num_drafts = self.draft_counts[row] if self.draft_counts else 0
        if not num_drafts:
            return []
        end = self.token_offsets[row + 1]
        return self.token_ids[end - num_drafts : end]

    def named_seq_ids(self) -> set[int]:
        """Every sequence id the plan mentions, readable even when its columns are malformed."""
        ids = set(self.seq_ids) | set(self.forget_seq_ids)
        ids.update(new.seq_id for new in self.new_sequences)
        return ids


def sampled_seq_ids(
    seq_ids: Sequence[int], sample: Sequence[bool], draft_counts: Sequence[int]
) -> list[int]:
    """The sequence of each token a plan's columns (a StepPlan's or its message's) sample,
    in the result's order: one entry per sampling row, d + 1 consecutive ones for a row
    with d drafts."""
    if not draft_counts:
        if all(sample):
            return list(seq_ids)
        return [s for s, smp in zip(seq_ids, sample, strict=True) if smp]
    sampled: list[int] = []
    for seq_id, smp, num_drafts in zip(seq_ids, sample, draft_counts, strict=True):
        if smp:
            sampled += [seq_id] * (num_drafts + 1)
    return sampled


def mask_words(vocab_size: int) -> int:
    """32-bit words of one allowed-token bitmask (StepPlan.allowed_token_bitmask)."""
    return (vocab_size + 31) // 32


def num_masks(draft_counts: Sequence[int], rows: Sequence[int]) -> list[int]:
    """How many masks allowed_token_bitmask holds for each of `rows` (allowed_token_rows)
    of a plan with these draft_counts: one per sample point, d + 1 for a row with d drafts."""
    if not draft_counts:
        return [1] * len(rows)
    return [draft_counts[row] + 1 for row in rows]


@dataclass(slots=True)
class StepMasks:
    """The allowed-token bitmasks of a plan with masks_follow, sent once the step before it
    is answered: one row of StepPlan.allowed_token_bitmask's layout per sequence of
    `seq_ids` (by id: the worker may have refused rows). A sampling row it does not name
    samples unconstrained; the scheduler drops that token."""

    step_id: int
    seq_ids: list[int] = field(default_factory=list)
    allowed_token_bitmask: bytes = b""


@dataclass(slots=True)
class StepResult:
    """The worker's answer to a StepPlan: one sampled token per sequence that sampled, in
    plan order."""

    step_id: int
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Empty unless some sequence asked for logprobs; then one per sampled token, and the
    # top-n of entry i are top_*[top_offsets[i]:top_offsets[i + 1]].
    logprobs: list[float] = field(default_factory=list)
    top_offsets: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # seq_id -> why the worker refused it; it sampled nothing and is forgotten.
    errors: dict[int, str] = field(default_factory=dict)
    # The whole step failed; the worker forgot every sequence the plan named.
    step_error: str | None = None
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    total_ms: float = 0.0
    num_tokens: int = 0  # tokens the worker fed


@dataclass(frozen=True, slots=True)
class WorkerGeometry:
    """What a worker's hello says about its model and KV pool."""

    num_kv_blocks: int
    block_size: int  # tokens per KV block
    max_context_tokens: int  # longest sequence (prompt + generated)
    eos_token_ids: frozenset[int]
    vocab_size: int
    # A row's logits never depend on its batch (Hello.batch_invariant): speculation's
    # default (core/speculation.py).
    batch_invariant: bool = False
