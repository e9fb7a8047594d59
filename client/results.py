"""What the client returns: plain frozen dataclasses, free of protobuf types.

`client.convert` builds them from the wire messages; nothing else here knows about gRPC.
Field names mirror the public proto so the two read the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The natural-log probability of one generated token and its best alternatives."""

    token_id: int
    logprob: float
    # Most likely first; as many as the request's `logprobs`.
    top_token_ids: list[int]
    top_logprobs: list[float]
    # The tokens' text as UTF-8 bytes (a token may hold part of a character); empty from
    # a server that sends ids only.
    token_bytes: bytes = b""
    top_token_bytes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one finished request."""

    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens served from the server's prefix cache instead of being computed.
    cached_prompt_tokens: int
    # Times the server preempted the request under KV pressure and recomputed it.
    num_preemptions: int = 0
    # Of completion_tokens, a thinking model's thinking (the tags included).
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timings:
    """Server-side milliseconds since the request arrived."""

    queued_ms: float
    first_token_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of a tool (chat's `tools`) read from the model's output."""

    id: str  # the server's: "call_" and 24 hex digits; a "tool" message answers it by id
    name: str
    arguments: str  # a JSON object's text: json.loads(call.arguments)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of one call as the model writes it (chat's `stream_tool_calls=True`).

    The first piece of a call carries its `id` and `name` (its arguments often ""); the
    later ones only more of its `arguments` text. A client joins the pieces of one
    `index`: they add up to that call's ToolCall on the sample's last chunk.
    """

    index: int  # the call's place among its sample's calls (as in Chunk.tool_calls)
    id: str  # the first piece's; "" on the later ones
    name: str  # the first piece's; "" on the later ones
    arguments: str  # more of the arguments' text


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed message: the new text and tokens since the previous one.

    `finish_reason` ("length", "stop", "tool_calls", "cancelled", "error"), `usage` and
    `timings` are set on the last chunk only; `logprobs` is None unless the request asked
    for them. With n > 1, `index` names the sample (chunks of different samples interleave),
    each sample has its own last chunk, and the stream's very last chunk also carries
    `total_usage` (the prompt counted once, the samples' completions summed). A chat with
    `tools` may end on calls: the last chunk carries them in `tool_calls` and its
    finish_reason is "tool_calls"; the text streamed is then what the output held besides
    the calls (often nothing). With `stream_tool_calls=True` the calls also come as the
    model writes them: each chunk's `tool_call_deltas` are the pieces written since the
    previous chunk, in order, and the text outside the calls streams as it comes; the last
    chunk still carries every call whole, its finish_reason "length" when the output was
    cut inside a call (whose arguments are then not JSON). A chat with a model that thinks
    (ModelInfo.thinks) streams its thinking in `reasoning_text` (the text between <think>
    and </think>) and only the answer in `text`; a sample's reasoning all comes before its
    answer, and one chunk may carry the end of one and the start of the other.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    usage: Usage | None
    timings: Timings | None
    index: int = 0
    total_usage: Usage | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_text: str = ""
    tool_call_deltas: tuple[ToolCallDelta, ...] = ()

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation: every chunk of one stream joined."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    # None only when the stream ended without a last message.
    finish_reason: str | None
    usage: Usage | None
    timings: Timings | None
    num_chunks: int
    index: int = 0  # the sample's, with n > 1
    # With finish_reason "tool_calls" (or "length" for a call cut short, streamed in pieces):
    # the last chunk's, each call whole; the pieces of the chunks are not joined again.
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_text: str = ""  # a thinking model's thoughts, apart from the answer (`text`)


def join_samples(chunks: Iterable[Chunk]) -> list[Completion]:
    """A stream of n samples as n completions, by index (join_chunks of each's chunks)."""
    by_index: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).append(chunk)
    return [join_chunks(by_index[index]) for index in sorted(by_index)]


def join_chunks(chunks: Iterable[Chunk]) -> Completion:
    """Concatenate a stream's chunks in order (one sample's); the last chunk's metadata
    wins."""
    request_id = ""
    texts: list[str] = []
    reasoning_texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    num_chunks = index = 0
    for chunk in chunks:
        num_chunks += 1
        index = chunk.index
        request_id = chunk.request_id or request_id
        texts.append(chunk.text)
        reasoning_texts.append(chunk.reasoning_text)
        token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            logprobs = (logprobs or []) + chunk.logprobs
        finish_reason = chunk.finish_reason or finish_reason
        usage = chunk.usage or usage
        timings = chunk.timings or timings
        tool_calls = chunk.tool_calls or tool_calls
    return Completion(
        request_id=request_id,
        text="".join(texts),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish_reason,
        usage=usage,
        timings=timings,
        num_chunks=num_chunks,
        index=index,
        tool_calls=tool_calls,
        reasoning_text="".join(reasoning_texts),
    )


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model and its KV capacity (GetModelInfo)."""

    model_id: str
    max_context_tokens: int
    vocab_size: int
    # Tokens per KV block.
    block_size: int
    num_kv_blocks: int
    num_kv_tokens: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    # "none" (the weights as loaded) or "int8" (dynamic int8 Linear layers on the CPU:
    # faster, and greedy text may differ from the float model's); "" with no worker yet.
    quantization: str
    # The numeric path in words (quantized layers, activation scheme, batch invariance).
    numerics: str
    worker_connected: bool
    # Chat works only with a template; the CLI's `generate` uses it when there is one.
    has_chat_template: bool
    # The template writes the model's thinking in <think> tags (Qwen3, DeepSeek-R1); Chat
    # streams it as Chunk.reasoning_text.
    thinks: bool


@dataclass(frozen=True, slots=True)
class ServerStats:
    """A snapshot of the scheduler's counters (GetServerStats); counters are since start."""

    num_waiting: int
    num_running: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    # Cached prompt tokens / prompt tokens looked up; in [0, 1].
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    worker_connected: bool
    # Blocks with no owner kept for prefix reuse (counted in neither used nor free).
    num_kv_blocks_cached: int
    num_requests_finished: int
    num_generated_tokens: int
    worker_incarnation_id: str
    draining: bool
    # Share of the last 10 s the workers spent inside steps (their sum, at most 1), and
    # their seconds inside steps since the scheduler started.
    worker_busy_fraction: float
    worker_busy_s: float
    # Each attached worker (several with --max-workers); the fields above are totals.
    workers: list[WorkerStats]
    # Steps that fed one suspect request alone, to find one that failed a step or lost
    # the worker (not after a worker stopped on purpose).
    num_isolated_steps: int
    # The caller's own tenant (one entry; never another tenant's figures).
    tenants: list[TenantStats]
    # Prompt tokens looked up in the prefix cache and found there, since start.
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # Speculation's drafted tokens and those the model agreed with, since start.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TenantStats:
    """The caller's tenant's figures (ServerStats.tenants), named, never by key."""

    tenant: str
    num_waiting: int
    num_running: int
    num_served_tokens: int  # prompt and generated tokens of its finished requests
    num_preemptions: int
    num_requests_finished: int
    # Time to first token as a cumulative histogram: ttft_bucket_counts[i] requests got
    # theirs within ttft_bucket_le_s[i] seconds (the last bound inf); their sum in s.
    ttft_bucket_le_s: list[float]
    ttft_bucket_counts: list[int]
    ttft_sum_s: float


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One attached worker's figures (ServerStats.workers)."""

    incarnation_id: str
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    busy_fraction: float  # of the last 10 s, in [0, 1]
    num_steps: int
    num_generated_tokens: int
