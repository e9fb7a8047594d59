from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    HELLO: _ClassVar[Kind]
    HELLO_ACK: _ClassVar[Kind]
    PLAN: _ClassVar[Kind]
    RESULT: _ClassVar[Kind]
    HEARTBEAT: _ClassVar[Kind]
    REHELLO: _ClassVar[Kind]
    GOODBYE: _ClassVar[Kind]
    MASKS: _ClassVar[Kind]
KIND_UNSPECIFIED: Kind
HELLO: Kind
HELLO_ACK: Kind
PLAN: Kind
RESULT: Kind
HEARTBEAT: Kind
REHELLO: Kind
GOODBYE: Kind
MASKS: Kind

class Hello(_message.Message):
    __slots__ = ("protocol_version", "incarnation_id", "model_id", "vocab_size", "eos_token_ids", "max_context_tokens", "block_size", "num_kv_blocks", "device", "dtype", "max_logprobs", "quantization", "feeds_last_sampled", "numerics", "batch_invariant")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    FEEDS_LAST_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    incarnation_id: str
    model_id: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context_tokens: int
    block_size: int
    num_kv_blocks: int
    device: str
    dtype: str
    max_logprobs: int
    quantization: str
    feeds_last_sampled: bool
    numerics: str
    batch_invariant: bool
    def __init__(self, protocol_version: _Optional[int] = ..., incarnation_id: _Optional[str] = ..., model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_logprobs: _Optional[int] = ..., quantization: _Optional[str] = ..., feeds_last_sampled: _Optional[bool] = ..., numerics: _Optional[str] = ..., batch_invariant: _Optional[bool] = ...) -> None: ...

class HelloAck(_message.Message):
    __slots__ = ("accepted", "reason", "protocol_version", "scheduler_incarnation_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    protocol_version: int
    scheduler_incarnation_id: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., protocol_version: _Optional[int] = ..., scheduler_incarnation_id: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("incarnation_id",)
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    incarnation_id: str
    def __init__(self, incarnation_id: _Optional[str] = ...) -> None: ...

class Rehello(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("incarnation_id", "reason")
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    incarnation_id: str
    reason: str
    def __init__(self, incarnation_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "num_logprobs", "logit_bias_token_ids", "logit_bias_values", "allowed_token_ids", "banned_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    num_logprobs: int
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    banned_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., num_logprobs: _Optional[int] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., banned_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "sampling", "cached_token_ids", "num_prompt_tokens", "min_new_tokens", "min_tokens_banned_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_BANNED_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    sampling: SamplingParams
    cached_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    min_new_tokens: int
    min_tokens_banned_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cached_token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., min_tokens_banned_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_sequences", "seq_ids", "start_positions", "sample", "token_offsets", "token_ids", "block_offsets", "block_ids", "forget_seq_ids", "last_sampled_rows", "allowed_token_rows", "allowed_token_bitmask", "masks_follow", "draft_counts")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FORGET_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_SAMPLED_ROWS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    MASKS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    start_positions: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[bool]
    token_offsets: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_offsets: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    forget_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    last_sampled_rows: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_rows: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_bitmask: bytes
    masks_follow: bool
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., seq_ids: _Optional[_Iterable[int]] = ..., start_positions: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[bool]] = ..., token_offsets: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_offsets: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., forget_seq_ids: _Optional[_Iterable[int]] = ..., last_sampled_rows: _Optional[_Iterable[int]] = ..., allowed_token_rows: _Optional[_Iterable[int]] = ..., allowed_token_bitmask: _Optional[bytes] = ..., masks_follow: _Optional[bool] = ..., draft_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class StepMasks(_message.Message):
    __slots__ = ("step_id", "seq_ids", "allowed_token_bitmask")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_bitmask: bytes
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., allowed_token_bitmask: _Optional[bytes] = ...) -> None: ...

class SequenceError(_message.Message):
    __slots__ = ("seq_id", "message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    message: str
    def __init__(self, seq_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "seq_ids", "token_ids", "logprobs", "top_offsets", "top_token_ids", "top_logprobs", "errors", "step_error", "forward_ms", "sample_ms", "total_ms", "num_tokens")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    STEP_ERROR_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_offsets: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    errors: _containers.RepeatedCompositeFieldContainer[SequenceError]
    step_error: str
    forward_ms: float
    sample_ms: float
    total_ms: float
    num_tokens: int
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_offsets: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., errors: _Optional[_Iterable[_Union[SequenceError, _Mapping]]] = ..., step_error: _Optional[str] = ..., forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., num_tokens: _Optional[int] = ...) -> None: ...
