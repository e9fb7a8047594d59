"""One step as the worker's engines see it: a plan in, a result out, plain data.

The same column-wise layout as protos/step.proto (entry i of every per-sequence column
is the i-th scheduled sequence; ragged runs are framed by offsets), so decoding a plan
is a handful of list copies. pagoda.gpu_worker.codec converts to and from the wire;
nothing here knows protobuf. Unchecked: the sequence table validates a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-sequence sampling knobs; 1.0 top_p / repetition_penalty mean off."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    num_logprobs: int = 0
    # While fewer than min_new_tokens tokens were generated, these ids (the request's
    # EOS and stop token ids) are masked out of the logits.
    min_new_tokens: int = 0
    min_tokens_banned_ids: tuple[int, ...] = ()
    # Added to the logits of these ids before temperature and the filters (OpenAI's
    # logit_bias); same length, distinct ids (the sequence table checks both).
    logit_bias_token_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has not seen; sent once, in the plan that first schedules it."""

    seq_id: int
    sampling: SamplingParams
    num_prompt_tokens: int  # tokens at positions >= this were generated
    cached_token_ids: list[int] = field(default_factory=list)  # prefix-cache hit, not fed


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    # Per scheduled sequence, all of one length N.
    seq_ids: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    # Sequence i feeds token_ids[token_offsets[i] : token_offsets[i + 1]] and appends
    # block_ids[block_offsets[i] : block_offsets[i + 1]] to its block table.
    token_offsets: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_offsets: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    forget_seq_ids: list[int] = field(default_factory=list)  # dropped after the forward
    # Rows (indices into seq_ids) whose one fed token is a placeholder for the token the
    # worker sampled for that sequence last (overlapped steps, see step.proto).
    last_sampled_rows: list[int] = field(default_factory=list)
    # Structured output: rows whose next token is constrained, and their allowed-token
    # bitmasks (ceil(vocab / 32) little-endian 32-bit words per listed row, step.proto).
    allowed_token_rows: list[int] = field(default_factory=list)
    allowed_token_bitmask: bytes = b""

    def named_seq_ids(self) -> set[int]:
        """Every sequence id the plan mentions, readable even when its columns are malformed."""
        ids = set(self.seq_ids) | set(self.forget_seq_ids)
        ids.update(new.seq_id for new in self.new_sequences)
        return ids


@dataclass(frozen=True, slots=True)
class SequenceError:
    """A plan entry the worker refused; its sequence sampled nothing and is forgotten."""

    seq_id: int
    message: str


@dataclass(slots=True)
class StepResult:
    step_id: int
    # One entry per sequence that sampled, in plan order.
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Filled only when some sequence asked for logprobs; then one per sampled token, and
    # entry i's top-n alternatives are top_*[top_offsets[i] : top_offsets[i + 1]].
    logprobs: list[float] = field(default_factory=list)
    top_offsets: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    errors: list[SequenceError] = field(default_factory=list)
    step_error: str = ""  # the whole step failed: nothing sampled, the plan's sequences forgotten
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    total_ms: float = 0.0
    num_tokens: int = 0
