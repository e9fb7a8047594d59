"""The gRPC edge: a thin pagoda.v1.Generation servicer.

Validation lives in validation.py, admission and streams in the serving front (front.py),
auth in auth.py and the server around the servicer in server.py; this module maps between
protobuf and the domain and turns failures into status codes with a sentence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from pagoda.protos import generation_pb2, generation_pb2_grpc
from pagoda.scheduler_svc.auth import bearer_token, tenant_cache_salt, tenant_directory
from pagoda.scheduler_svc.bounded_executor import BoundedExecutor, ExecutorFull
from pagoda.scheduler_svc.core import (
    FinishReason,
    QueueFullError,
    RequestOutput,
    RequestTooLargeError,
    Usage,
    ValidRequest,
)
from pagoda.scheduler_svc.front import Front, Unavailable
from pagoda.scheduler_svc.grammars import (
    GrammarCompiler,
    GrammarError,
    RequestGrammar,
    ValidConstraint,
)
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.settings import ServiceConfig
from pagoda.scheduler_svc.tenants import Tenant, TokenBucket
from pagoda.scheduler_svc.tokenizer import TextTokenizer
from pagoda.scheduler_svc.tools import MAX_TOOLS, ValidTools
from pagoda.scheduler_svc.validation import (
    MAX_CHAT_MESSAGES,
    Limits,
    ValidationError,
    num_message_chars,
    validate_chat,
    validate_constraint,
    validate_generate,
    validate_tokenize_text,
)
from pagoda.scheduler_svc.write_watch import StalledWrite, WriteWatch

log = logging.getLogger("pagoda.api")

# Inputs longer than this (characters of prompt, chat contents or Tokenize text) are
# tokenized and chat-rendered on a worker thread: a big one costs milliseconds to seconds
# of tokenizer time, which on the event loop would stall every stream and the step loop.
# The HF tokenizers release the GIL while encoding. Smaller ones stay on the loop, where
# they cost less than a thread hop. Generate's and Chat's validation has its threads, the
# Tokenize RPC its own bounded one, so a flood of Tokenize calls cannot delay a Generate.
OFF_LOOP_MIN_CHARS = 4096
NUM_TOKENIZER_THREADS = 2
# How long a stalled stream's status may wait to be sent before its handler gives up.
STALLED_ABORT_TIMEOUT_S = 1.0
# Bounds a Tokenize text before any worker said hello (the limit then follows its context).
FALLBACK_MAX_CONTEXT_TOKENS = 32_768
# A refusal's sentence is cut here: whatever it quotes, it stays far below the 8 KiB of
# metadata a client accepts (security review N11).
MAX_DETAILS_CHARS = 1024

T = TypeVar("T")

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

_FINISH_REASONS = {
    FinishReason.LENGTH: generation_pb2.LENGTH,
    FinishReason.STOP: generation_pb2.STOP,
    FinishReason.CANCELLED: generation_pb2.CANCELLED,
    FinishReason.ERROR: generation_pb2.ERROR,
}


def to_response(
    output: RequestOutput,
    request_id: str | None = None,
    token_bytes: Callable[[int], bytes] | None = None,
    index: int = 0,
) -> generation_pb2.GenerateResponse:
    """`request_id`: the id the client knows the request by (default: the server's);
    `token_bytes`: each token's text, for the logprobs (None: ids only); `index`: the
    sample's (n > 1)."""
    response = generation_pb2.GenerateResponse(
        request_id=output.request_id if request_id is None else request_id,
        text=output.text,
        token_ids=output.token_ids,
        index=index,
    )
    for logprob in output.logprobs or ():
        entry = response.logprobs.add(
            token_id=logprob.token_id,
            logprob=logprob.logprob,
            top_token_ids=logprob.top_token_ids,
            top_logprobs=logprob.top_logprobs,
        )
        if token_bytes is not None:
            entry.token_bytes = token_bytes(logprob.token_id)
            entry.top_token_bytes.extend(map(token_bytes, logprob.top_token_ids))
    if output.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[output.finish_reason]
    if output.tool_calls:
        response.finish_reason = generation_pb2.TOOL_CALLS
        for call in output.tool_calls:
            response.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
    if output.usage is not None:
        response.usage.CopyFrom(_usage(output.usage))
    if output.timings is not None:
        response.timings.CopyFrom(
            generation_pb2.Timings(
                queued_ms=output.timings.queued_ms,
                first_token_ms=output.timings.first_token_ms,
                total_ms=output.timings.total_ms,
            )
        )
    return response


def _usage(usage: Usage) -> generation_pb2.Usage:
    return generation_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        num_preemptions=usage.num_preemptions,
    )


def total_usage(usages: list[Usage]) -> Usage:
    """A request's usage from its samples' (sample 0 first): the prompt once, as sample 0
    computed it; completions and preemptions summed."""
    first = usages[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(usage.completion_tokens for usage in usages),
        cached_prompt_tokens=first.cached_prompt_tokens,
        num_preemptions=sum(usage.num_preemptions for usage in usages),
    )


class Refused(Exception):
    """Ends an RPC with a status and one sentence: raised under a handler, answered at its
    top by `_answer`, which sets the status instead of calling context.abort. The exception
    abort raises stays in a reference cycle with grpc.aio's RPC state and every frame it
    passed through, the request in them, until the cyclic collector runs: with the tuned
    collector (gc_tuning) 1,000 refused 4 MiB calls held 4 GB (security review N1). So it
    is never raised inside an `except ... as exc` block either (that frame would hold exc).
    """

    def __init__(self, code: grpc.StatusCode, sentence: str, *, stalled: bool = False) -> None:
        super().__init__(sentence)
        self.code = code
        self.sentence = sentence
        self.stalled = stalled  # the client stopped reading: see _end_stalled


class Undecodable:
    """Stands in for a request whose bytes are not a valid message of its type."""

    def __init__(self, type_name: str) -> None:
        self.sentence = f"the request is not a valid {type_name} message"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        front: Front,
        metrics: Metrics,
        tokenizer: TextTokenizer,
        config: ServiceConfig,
        model_id: str,
    ) -> None:
        self._front = front
        self._metrics = metrics
        self._tokenizer = tokenizer
        self._config = config
        self._model_id = model_id
        self._tenants = tenant_directory(config)
        self._buckets: dict[str, TokenBucket] = {}  # tenant name -> its tokens per minute
        self._last_hello = None
        self._write_watch = WriteWatch(config.stream_write_timeout_s)
        # Lazy: the vocabulary is read on the first constraint, not at start.
        self._grammars = GrammarCompiler(lambda: tokenizer.tokenizer.to_str())
        self._tokenizer_threads = ThreadPoolExecutor(
            max_workers=NUM_TOKENIZER_THREADS, thread_name_prefix="pagoda-tokenize"
        )
        self._tokenize_rpcs = BoundedExecutor(
            config.max_tokenize_calls,
            num_threads=1,
            thread_name_prefix="pagoda-tokenize-rpc",
        )

    def _token_bytes(self, token_id: int) -> bytes:
        return self._tokenizer.logprob_bytes(token_id)

    async def _off_loop_if_big(self, num_chars: int, function, *args):
        """`function(*args)`, on a tokenizer thread when the input is big."""
        if num_chars <= OFF_LOOP_MIN_CHARS:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_threads, function, *args
        )

    def _limits(self) -> Limits | None:
        worker = self._front.worker
        if worker is not None:
            self._last_hello = worker.hello
        hello = self._last_hello
        if hello is None:
            return None
        return Limits(
            max_context_tokens=hello.max_context_tokens,
            vocab_size=hello.vocab_size,
            default_max_new_tokens=self._config.default_max_new_tokens,
            max_stop_strings=self._config.max_stop_strings,
            max_stop_string_bytes=self._config.max_stop_string_bytes,
            max_stop_total_bytes=self._config.max_stop_total_bytes,
            max_logprobs=min(
                self._config.max_logprobs, hello.max_logprobs or self._config.max_logprobs
            ),
            max_n=self._config.max_n,
        )

    async def Generate(self, request, context) -> None:
        handling = self._serve(validate_generate, request, context)
        del request  # held by `handling` alone, gone when it ends (see Refused)
        await self._answer(context, handling)

    async def Chat(self, request, context) -> None:
        handling = self._serve(validate_chat, request, context)
        del request
        await self._answer(context, handling)

    async def _answer(self, context, handling: Awaitable[T]) -> T | None:
        """Await a handler's work; a refusal becomes the RPC's status and None."""
        try:
            return await handling
        except Refused as refused:
            code, sentence, stalled = refused.code, refused.sentence, refused.stalled
        # Past the except block, the refusal, its traceback and the frames it holds (the
        # request's) are freed by reference counting.
        if stalled:
            await self._end_stalled(context, code, sentence)
        context.set_code(code)
        context.set_details(sentence)
        return None

    async def _serve(self, validate, request, context) -> None:
        valid = await self._admit(validate, request, context)
        # A client's own request_id names its request only within its connection: the
        # server's id is scoped by the peer, so another client can neither squat nor
        # probe it (a duplicate there is a request of its own); responses echo the
        # client's id.
        client_request_id = valid.request_id
        if request.request_id:
            scoped = f"{context.peer()}/{client_request_id}"
            valid = dataclasses.replace(valid, request_id=scoped)
        tenant = self._tenant(context)
        self._check_tokens_per_minute(tenant, valid)
        valid = dataclasses.replace(valid, tenant=tenant.name, tenant_weight=tenant.weight)
        if self._config.cache_salt_by_api_key:
            salt = tenant_cache_salt(bearer_token(context), valid.cache_salt)
            valid = dataclasses.replace(valid, cache_salt=salt)
        slots = self._submit(valid)
        try:
            if len(slots) == 1:
                slot = slots[0]
                while True:
                    output = await slot.next()
                    await self._stream(context, slot, output, client_request_id, tenant.name)
                    if output.finish_reason is not None:
                        return
            await self._stream_samples(context, slots, client_request_id, tenant.name)
        finally:
            # Reached on normal end, refusal, client cancel, deadline, disconnect or a
            # stalled write (grpc.aio raises CancelledError at the pending await): a live
            # request is cancelled so its blocks are free before the next step is planned;
            # so is every sample of one of n.
            for slot in slots:
                self._front.release(slot)

    async def _stream(
        self,
        context,
        slot,
        output: RequestOutput,
        request_id: str,
        tenant: str,
        index: int = 0,
        usages: list[Usage | None] | None = None,
    ) -> None:
        """Write one output of a sample; an ERROR ends the call with the slot's status
        (every other sample is cancelled). With `usages` (n > 1: each sample's final
        usage, by index, None until it ends), the last sample to end also carries the
        request's total_usage."""
        if output.finish_reason is FinishReason.ERROR:
            if output.token_ids or output.text:
                await self._write(
                    context, to_response(output, request_id, self._token_bytes, index)
                )
            code = getattr(grpc.StatusCode, slot.error_code or "INTERNAL")
            raise self._refused(code, output.error_message or "the request failed")
        response = to_response(output, request_id, self._token_bytes, index)
        if output.finish_reason is not None:
            self._metrics.observe_tenant_finish(tenant, output)
            if usages is not None:
                usages[index] = output.usage
                if all(usage is not None for usage in usages):
                    response.total_usage.CopyFrom(_usage(total_usage(usages)))
        await self._write(context, response)

    async def _stream_samples(self, context, slots: list, request_id: str, tenant: str) -> None:
        """Stream n samples' outputs as they come, each tagged with its index; returns once
        every sample has ended. Each slot is read by one task at a time, so a sample's
        messages stay in order and none is lost or repeated."""
        usages: list[Usage | None] = [None] * len(slots)
        reading = {asyncio.ensure_future(slot.next()): index for index, slot in enumerate(slots)}
        try:
            while reading:
                done, _ = await asyncio.wait(reading, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=reading.__getitem__):
                    index = reading.pop(task)
                    output = task.result()
                    await self._stream(
                        context, slots[index], output, request_id, tenant, index, usages
                    )
                    if output.finish_reason is None:
                        reading[asyncio.ensure_future(slots[index].next())] = index
        finally:
            for task in reading:
                task.cancel()

    async def _write(self, context, response: generation_pb2.GenerateResponse) -> None:
        """Write one message; a client that takes none for stream_write_timeout_s (flow
        control full: it stopped reading) has its stream ended, so it holds no memory."""
        gone = False
        try:
            await self._write_watch.write(context.write(response))
            return
        except StalledWrite:
            pass
        except grpc.aio.InternalError:
            # grpc refused the write: the call is over (its connection closed while the
            # write waited). An ending like a cancel, not a traceback per stream (N7).
            gone = True
        if gone:
            raise asyncio.CancelledError
        timeout_s = self._write_watch.limit_s
        raise self._refused(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the client took no message for {timeout_s:g} s; the stream was ended",
            stalled=True,
        )

    async def _end_stalled(self, context, code: grpc.StatusCode, sentence: str) -> None:
        """End a stream its client stopped reading. The status queues behind the message
        the client does not take, so it can wait for good (and grpc.aio cannot reset one
        stream): bounded, then the handler ends as cancelled, giving back its request and
        its RPC slot; the HTTP/2 stream lasts until the client's connection closes."""
        try:
            await asyncio.wait_for(context.abort(code, sentence), STALLED_ABORT_TIMEOUT_S)
        except (TimeoutError, grpc.aio.InternalError):
            # InternalError: grpc refuses the status while the write is still pending
            # (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS); expected, one per stalled stream, so
            # it is not left to grpc.aio to log with a traceback (security review N7).
            pass
        raise asyncio.CancelledError

    async def _admit(self, validate, request, context) -> ValidRequest:
        self._reject_undecodable(request)
        if self._front.draining:
            raise self._refused(grpc.StatusCode.UNAVAILABLE, "the server is draining for shutdown")
        limits = self._limits()
        if limits is None:
            raise self._refused(grpc.StatusCode.UNAVAILABLE, "no worker is connected yet")
        # Before any tokenizer time: a full queue refuses cheaply (submit checks it again).
        max_waiting = self._config.scheduler.max_waiting_requests
        if self._front.stats.num_waiting >= max_waiting:
            raise self._refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the waiting queue is full ({max_waiting} requests); retry later",
            )
        try:
            valid = await self._off_loop_if_big(
                _input_chars(request), validate, request, self._tokenizer, limits
            )
            constraint = validate_constraint(request, valid)
            if constraint is None:
                return valid
            # Compiling a schema can take a while (and the first one reads the vocabulary).
            grammar = await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_threads,
                self._compile,
                constraint,
                valid.tools,
                limits.vocab_size,
                self._last_hello.eos_token_ids,
            )
            forks = tuple(grammar.fork() for _ in range(valid.n - 1))
            return dataclasses.replace(valid, grammar=grammar, sample_grammars=forks)
        except (ValidationError, GrammarError) as exc:
            sentence = str(exc)
        raise self._refused(grpc.StatusCode.INVALID_ARGUMENT, sentence)

    def _compile(
        self, constraint: ValidConstraint, tools: object, vocab_size: int, eos_token_ids
    ) -> RequestGrammar:
        """The request's grammar. When the engine refuses tool_choice REQUIRED's, the
        sentence names the tool whose parameters it refuses (each compiled alone)."""
        try:
            return self._grammars.compile(constraint, vocab_size, eos_token_ids)
        except GrammarError:
            if not isinstance(tools, ValidTools) or constraint.field != "tools":
                raise
            for alone in tools.argument_constraints():
                self._grammars.compile(alone, vocab_size, eos_token_ids)  # raises for it
            raise

    def _tenant(self, context) -> Tenant:
        """The caller's tenant (its key's, or the trusted front's header)."""
        try:
            return self._tenants.tenant_of(context.invocation_metadata())
        except ValueError as exc:
            sentence = str(exc)
        raise self._refused(grpc.StatusCode.INVALID_ARGUMENT, sentence)

    def _check_tokens_per_minute(self, tenant: Tenant, valid: ValidRequest) -> None:
        """Refuse a request its tenant's tokens per minute cannot start now."""
        limit = self._config.tenant_tokens_per_minute
        if limit is None:
            return
        now = time.monotonic()
        bucket = self._buckets.get(tenant.name)
        if bucket is None:
            bucket = self._buckets[tenant.name] = TokenBucket(limit, now)
        cost = len(valid.prompt_token_ids) + valid.n * valid.stopping.max_new_tokens
        wait_s = bucket.take(cost, now)
        if wait_s is not None:
            raise self._refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"tenant {tenant.name} is over its {limit} tokens per minute "
                f"(tenant_tokens_per_minute); retry in {wait_s:.1f} s",
            )

    def _submit(self, valid: ValidRequest) -> list:
        """The slots of the request's samples, in index order."""
        try:
            if valid.n == 1:
                return [self._front.submit(valid)]
            return self._front.submit_samples(valid)
        except Unavailable as exc:
            code, sentence = grpc.StatusCode.UNAVAILABLE, str(exc)
        except QueueFullError as exc:
            code, sentence = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        except (RequestTooLargeError, ValueError) as exc:
            code, sentence = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        raise self._refused(code, sentence)

    def _reject_undecodable(self, request) -> None:
        if isinstance(request, Undecodable):
            raise self._refused(grpc.StatusCode.INVALID_ARGUMENT, request.sentence)

    def _refused(self, code: grpc.StatusCode, sentence: str, *, stalled: bool = False) -> Refused:
        """The refusal to raise, counted; its sentence within MAX_DETAILS_CHARS."""
        self._metrics.observe_error(code.name)
        if len(sentence) > MAX_DETAILS_CHARS:
            sentence = sentence[:MAX_DETAILS_CHARS] + "..."
        return Refused(code, sentence, stalled=stalled)

    async def Tokenize(self, request, context):
        return await self._answer(context, self._checked_tokenize(request))

    async def _checked_tokenize(self, request) -> generation_pb2.TokenizeResponse:
        self._reject_undecodable(request)
        limits = self._limits() or self._fallback_limits()
        code = grpc.StatusCode.INVALID_ARGUMENT
        try:
            validate_tokenize_text(request.text, limits)
            if len(request.text) <= OFF_LOOP_MIN_CHARS:
                return self._tokenize(request, limits.max_context_tokens)
            return await self._tokenize_rpcs.run(self._tokenize, request, limits.max_context_tokens)
        except ValidationError as exc:
            sentence = str(exc)
        except ExecutorFull:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            sentence = (
                f"{self._tokenize_rpcs.max_calls} Tokenize calls of long texts are queued or "
                "running (max_tokenize_calls); retry later"
            )
        raise self._refused(code, sentence)

    def _tokenize(self, request, max_tokens: int) -> generation_pb2.TokenizeResponse:
        """Encode, then build the pieces only for a text within the context: a piece costs
        a Python call holding the GIL, and 262k of them stalled every stream for seconds
        (security review N6)."""
        ids = self._tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        if len(ids) > max_tokens:
            raise ValidationError(
                f"text has {len(ids)} tokens, more than the context of {max_tokens}"
            )
        return generation_pb2.TokenizeResponse(
            token_ids=ids, tokens=[self._tokenizer.id_to_piece(i) for i in ids]
        )

    def _fallback_limits(self) -> Limits:
        return Limits(
            max_context_tokens=FALLBACK_MAX_CONTEXT_TOKENS,
            vocab_size=self._tokenizer.vocab_size,
            default_max_new_tokens=self._config.default_max_new_tokens,
            max_stop_strings=self._config.max_stop_strings,
            max_stop_string_bytes=self._config.max_stop_string_bytes,
            max_stop_total_bytes=self._config.max_stop_total_bytes,
            max_logprobs=self._config.max_logprobs,
            max_n=self._config.max_n,
        )

    async def GetModelInfo(self, request, context):
        return await self._answer(context, self._model_info(request))

    async def _model_info(self, request) -> generation_pb2.ModelInfo:
        self._reject_undecodable(request)
        self._limits()
        hello = self._last_hello
        info = generation_pb2.ModelInfo(
            model_id=self._model_id,
            vocab_size=self._tokenizer.vocab_size,
            eos_token_ids=sorted(self._tokenizer.eos_token_ids),
            worker_connected=self._front.worker is not None,
            has_chat_template=self._tokenizer.chat_template is not None,
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

    async def GetServerStats(self, request, context):
        return await self._answer(context, self._server_stats(request, context))

    def _own_tenant_stats(self, context) -> generation_pb2.TenantStats:
        """The caller's tenant's figures; zeros for a tenant with no request yet."""
        tenant = self._tenant(context).name
        figures = next((s for s in self._front.tenant_stats() if s.tenant == tenant), None)
        bounds, counts, total_s = self._metrics.tenant_ttft(tenant)
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

    async def _server_stats(self, request, context) -> generation_pb2.ServerStats:
        self._reject_undecodable(request)
        stats = self._front.stats
        worker = self._front.worker
        return generation_pb2.ServerStats(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_kv_blocks_used=stats.num_kv_blocks_used,
            num_kv_blocks_total=stats.num_kv_blocks_total,
            num_kv_blocks_cached=stats.num_kv_blocks_cached,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            num_preemptions=stats.num_preemptions,
            num_steps=stats.num_steps,
            num_isolated_steps=stats.num_isolated_steps,
            num_requests_finished=stats.num_requests_finished,
            num_generated_tokens=stats.num_generated_tokens,
            worker_connected=worker is not None,
            worker_incarnation_id=worker.hello.incarnation_id if worker else "",
            draining=self._front.draining,
            worker_busy_fraction=self._metrics.worker_busy.fraction(),
            worker_busy_s=self._metrics.worker_busy.total_s,
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
                for each in self._front.worker_stats()
            ],
            tenants=[self._own_tenant_stats(context)],
        )


def _input_chars(request) -> int:
    """Characters a request gives the tokenizer (or the chat template) to work through."""
    messages = getattr(request, "messages", None)
    if messages is None:
        return len(request.prompt)
    if len(messages) > MAX_CHAT_MESSAGES or len(request.tools) > MAX_TOOLS:
        return 0  # refused before any rendering
    tools = sum(len(tool.description) + len(tool.parameters) for tool in request.tools)
    return tools + sum(num_message_chars(message) for message in messages)
