"""Public requests -> Valid* domain values, or one sentence naming the field and its limit.

Works on the pagoda.v1 request messages by their field names (it never builds one),
so the servicer stays thin and every limit lives here, in chat_validation.py for a
chat's messages and tools (it renders a chat to its prompt, then finishes it with the
checks here that every request shares, `valid_request`), or in constraint_validation.py
for a structured-output constraint.
"""

from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass

from pagoda.scheduler_svc.core import SamplingParams, ValidRequest, ValidStopping
from pagoda.scheduler_svc.tokenizer import TextTokenizer
from pagoda.scheduler_svc.tools import ValidTools

MAX_REQUEST_ID_BYTES = 128
MAX_CACHE_SALT_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPERATURE = 100.0
# Below this a temperature divides logits into infinities: it means greedy (as in vLLM).
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PRESENCE_FREQUENCY = 2.0
MAX_ABS_PRIORITY = 1_000_000
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ALLOWED_OR_BANNED_IDS = 1024  # each of sampling.allowed_token_ids and banned_token_ids
# Text is bounded before tokenizing or rendering, so a huge input costs no tokenizer time.
MAX_PROMPT_BYTES_PER_TOKEN = 32


class ValidationError(ValueError):
    """A request the server refuses with INVALID_ARGUMENT; the message is the sentence."""


# Characters of a client's own input a refusal repeats: a 3 MB role came back whole in the
# status details, past the client's metadata limit (security review N11).
MAX_ECHOED_CHARS = 64


def echoed(value: str) -> str:
    """`value` quoted for a refusal, cut to MAX_ECHOED_CHARS characters."""
    if len(value) <= MAX_ECHOED_CHARS:
        return repr(value)
    return f"{value[:MAX_ECHOED_CHARS]!r}... ({len(value)} characters)"


@dataclass(frozen=True, slots=True)
class Limits:
    max_context_tokens: int
    vocab_size: int
    default_max_new_tokens: int
    max_stop_strings: int
    max_stop_string_bytes: int
    max_logprobs: int
    max_stop_total_bytes: int = 1024
    max_n: int = 16  # samples per request (ServiceConfig.max_n)


def validate_generate(request, tokenizer: TextTokenizer, limits: Limits) -> ValidRequest:
    """A pagoda.v1.GenerateRequest -> ValidRequest."""
    which = request.WhichOneof("input")
    if which == "prompt_token_ids":
        prompt_token_ids = request.prompt_token_ids.ids
        _check_num_prompt_tokens(len(prompt_token_ids), limits)  # before reading any id
        _check_in_vocabulary("prompt_token_ids", prompt_token_ids, limits)
    else:
        prompt = request.prompt if which == "prompt" else ""
        check_prompt_text(prompt, limits)
        prompt_token_ids = tokenizer.encode(prompt, add_special_tokens=True)
    return valid_request(request, tuple(prompt_token_ids), limits)


def validate_tokenize_text(text: str, limits: Limits) -> None:
    """A Tokenize text: bounded like a prompt before any tokenizer time is spent."""
    _check_text_length("text", text, limits)


def validate_detokenize_ids(token_ids, limits: Limits) -> list[int]:
    """Detokenize's ids: at most a context of them (counted before any is read), each in
    the vocabulary."""
    if len(token_ids) > limits.max_context_tokens:
        raise ValidationError(
            f"token_ids has {len(token_ids)} ids, more than the context of "
            f"{limits.max_context_tokens} tokens"
        )
    _check_in_vocabulary("token_ids", token_ids, limits)
    return list(token_ids)


def _check_in_vocabulary(name: str, token_ids, limits: Limits) -> None:
    largest = max(token_ids, default=0)
    if largest >= limits.vocab_size:
        raise ValidationError(
            f"{name} contains {largest}, beyond the vocabulary of {limits.vocab_size} tokens"
        )


def check_prompt_text(prompt: str, limits: Limits) -> None:
    if not prompt:
        raise ValidationError("prompt must not be empty")
    _check_text_length("prompt", prompt, limits)


def _check_text_length(name: str, text: str, limits: Limits) -> None:
    if len(text) > limits.max_context_tokens * MAX_PROMPT_BYTES_PER_TOKEN:
        raise ValidationError(
            f"{name} of {len(text)} characters is far beyond the context of "
            f"{limits.max_context_tokens} tokens"
        )


def _check_num_prompt_tokens(num_prompt_tokens: int, limits: Limits) -> None:
    if num_prompt_tokens == 0:
        raise ValidationError("prompt must not be empty")
    if num_prompt_tokens >= limits.max_context_tokens:
        raise ValidationError(
            f"prompt has {num_prompt_tokens} tokens; the context holds {limits.max_context_tokens} "
            "including at least one generated token"
        )


def valid_request(
    request, prompt_token_ids: tuple[int, ...], limits: Limits, tools: ValidTools | None = None
) -> ValidRequest:
    """The fields every request shares (Generate's and Chat's), checked around its prompt."""
    num_prompt_tokens = len(prompt_token_ids)
    _check_num_prompt_tokens(num_prompt_tokens, limits)
    if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise ValidationError(f"request_id must be at most {MAX_REQUEST_ID_BYTES} bytes")
    if not request.request_id.isprintable():
        # A newline in an id that is logged could forge log lines.
        raise ValidationError("request_id must be printable (no control characters)")
    if len(request.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise ValidationError(
            f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes, "
            f"got {len(request.cache_salt.encode())}"
        )
    if not -MAX_ABS_PRIORITY <= request.priority <= MAX_ABS_PRIORITY:
        raise ValidationError(
            f"priority must be in [-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}], got {request.priority}"
        )
    if request.logprobs > limits.max_logprobs:
        raise ValidationError(
            f"logprobs must be at most {limits.max_logprobs}, got {request.logprobs}"
        )
    n = request.n or 1
    if n > limits.max_n:
        raise ValidationError(f"n must be at most {limits.max_n} (the server's --max-n), got {n}")
    return ValidRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_token_ids,
        sampling=_sampling(request.sampling, request.logprobs, limits.vocab_size),
        stopping=_stopping(request.stopping, num_prompt_tokens, limits),
        priority=request.priority,
        cache_salt=request.cache_salt,
        n=n,
        tools=tools,
    )


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValidationError(f"{name} must be a finite number, got {value}")
    return value


def _sampling(sampling, num_logprobs: int, vocab_size: int) -> SamplingParams:
    temperature = _finite("sampling.temperature", sampling.temperature)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise ValidationError(
            f"sampling.temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature:g}"
        )
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_p = _finite("sampling.top_p", sampling.top_p) if sampling.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise ValidationError(f"sampling.top_p must be in (0, 1], got {top_p:g}")
    if sampling.top_k < 0:
        raise ValidationError(f"sampling.top_k must be >= 0 (0 is off), got {sampling.top_k}")
    min_p = _finite("sampling.min_p", sampling.min_p)
    if not 0.0 <= min_p <= 1.0:
        raise ValidationError(f"sampling.min_p must be in [0, 1], got {min_p:g}")
    repetition_penalty = 1.0
    if sampling.HasField("repetition_penalty"):
        repetition_penalty = _finite("sampling.repetition_penalty", sampling.repetition_penalty)
    if not MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY:
        raise ValidationError(
            f"sampling.repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
            f"{MAX_REPETITION_PENALTY:g}], got {repetition_penalty:g}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = _finite(f"sampling.{name}", getattr(sampling, name))
        if abs(value) > MAX_ABS_PRESENCE_FREQUENCY:
            raise ValidationError(f"sampling.{name} must be in [-2, 2], got {value:g}")
    logit_bias = _logit_bias(sampling.logit_bias, vocab_size)
    allowed = _token_id_set("allowed_token_ids", sampling.allowed_token_ids, vocab_size)
    banned = _token_id_set("banned_token_ids", sampling.banned_token_ids, vocab_size)
    if allowed and set(allowed) <= set(banned):
        raise ValidationError("sampling.banned_token_ids bans every one of allowed_token_ids")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=sampling.top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        # Every request is seeded so a recompute after preemption draws the same tokens.
        seed=sampling.seed if sampling.HasField("seed") else secrets.randbits(63),
        num_logprobs=num_logprobs,
        logit_bias_token_ids=tuple(token_id for token_id, _ in logit_bias),
        logit_bias_values=tuple(bias for _, bias in logit_bias),
        allowed_token_ids=allowed,
        banned_token_ids=banned,
    )


def _logit_bias(logit_bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The map as (token id, bias) pairs in id order (a map's order is arbitrary on the wire)."""
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValidationError(
            f"sampling.logit_bias holds {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}"
        )
    pairs = sorted(logit_bias.items())
    for token_id, bias in pairs:
        if token_id >= vocab_size:
            raise ValidationError(
                f"sampling.logit_bias names token {token_id}, beyond the vocabulary of {vocab_size}"
            )
        _finite(f"sampling.logit_bias[{token_id}]", bias)
        if abs(bias) > MAX_ABS_LOGIT_BIAS:
            raise ValidationError(
                f"sampling.logit_bias[{token_id}] must be in [-100, 100], got {bias:g}"
            )
    return tuple(pairs)


def _token_id_set(name: str, token_ids, vocab_size: int) -> tuple[int, ...]:
    """The ids ascending and distinct; at most MAX_ALLOWED_OR_BANNED_IDS, each in the vocabulary."""
    if len(token_ids) > MAX_ALLOWED_OR_BANNED_IDS:
        raise ValidationError(
            f"sampling.{name} holds {len(token_ids)} ids; at most {MAX_ALLOWED_OR_BANNED_IDS}"
        )
    if token_ids and max(token_ids) >= vocab_size:
        raise ValidationError(
            f"sampling.{name} names token {max(token_ids)}, beyond the vocabulary of {vocab_size}"
        )
    return tuple(sorted(set(token_ids)))


def _stopping(stopping, num_prompt_tokens: int, limits: Limits) -> ValidStopping:
    room = limits.max_context_tokens - num_prompt_tokens
    if stopping.HasField("max_new_tokens"):
        max_new_tokens = stopping.max_new_tokens
        if max_new_tokens == 0:
            raise ValidationError(
                "stopping.max_new_tokens must be >= 1 (leave it unset for the default)"
            )
        if max_new_tokens > room:
            raise ValidationError(
                f"prompt ({num_prompt_tokens} tokens) plus stopping.max_new_tokens ({max_new_tokens}) "
                f"exceeds the context of {limits.max_context_tokens} tokens"
            )
    else:
        max_new_tokens = min(limits.default_max_new_tokens, room)
    if stopping.min_new_tokens > max_new_tokens:
        raise ValidationError(
            f"stopping.min_new_tokens ({stopping.min_new_tokens}) must not exceed max_new_tokens ({max_new_tokens})"
        )
    if len(stopping.stop) > limits.max_stop_strings:
        raise ValidationError(
            f"stopping.stop holds {len(stopping.stop)} strings; at most {limits.max_stop_strings}"
        )
    for index, stop in enumerate(stopping.stop):
        if not stop:
            raise ValidationError(f"stopping.stop[{index}] must not be empty")
        if len(stop.encode()) > limits.max_stop_string_bytes:
            raise ValidationError(
                f"stopping.stop[{index}] is {len(stop.encode())} bytes; at most {limits.max_stop_string_bytes}"
            )
    num_stop_bytes = sum(len(stop.encode()) for stop in stopping.stop)
    if num_stop_bytes > limits.max_stop_total_bytes:
        raise ValidationError(
            f"stopping.stop holds {num_stop_bytes} bytes in all; at most {limits.max_stop_total_bytes}"
        )
    if len(stopping.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValidationError(f"stopping.stop_token_ids holds more than {MAX_STOP_TOKEN_IDS} ids")
    for token_id in stopping.stop_token_ids:
        if token_id >= limits.vocab_size:
            raise ValidationError(
                f"stopping.stop_token_ids contains {token_id}, beyond the vocabulary of {limits.vocab_size}"
            )
    return ValidStopping(
        max_new_tokens=max_new_tokens,
        min_new_tokens=stopping.min_new_tokens,
        stop_strings=tuple(stopping.stop),
        stop_token_ids=frozenset(stopping.stop_token_ids),
        ignore_eos=stopping.ignore_eos,
    )
