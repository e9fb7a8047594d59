"""The gRPC edge: a thin pagoda.v1.Generation servicer.

Validation lives in validation.py and chat_validation.py, admission and streams in the
serving front (front.py), auth in auth.py and the server around the servicer in server.py.
This module admits a request (limits, tenant, tokens per minute, its grammar) and serves
its RPC; what it sends is built by responses.py and written by response_writer.py, the
information RPCs' replies by info_rpcs.py, and a failure becomes a status code with a
sentence through refusals.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from pagoda.protos import generation_pb2, generation_pb2_grpc
from pagoda.scheduler_svc.access_log import CallRecord, answer_logged, call_record
from pagoda.scheduler_svc.auth import bearer_token, tenant_cache_salt, tenant_directory
from pagoda.scheduler_svc.bounded_executor import BoundedExecutor, ExecutorFull
from pagoda.scheduler_svc.chat_validation import MAX_CHAT_MESSAGES, num_message_chars, validate_chat
from pagoda.scheduler_svc.constraint_validation import validate_constraint
from pagoda.scheduler_svc.core import QueueFullError, RequestTooLargeError, ValidRequest
from pagoda.scheduler_svc.front import Front, Unavailable
from pagoda.scheduler_svc.grammars import (
    GrammarCompiler,
    GrammarError,
    RequestGrammar,
    ThinkingFirst,
    ValidConstraint,
)
from pagoda.scheduler_svc.info_rpcs import (
    detokenize,
    fallback_limits,
    model_info,
    server_stats,
    tokenize,
)
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.reasoning import Thinking
from pagoda.scheduler_svc.refusals import Undecodable, answer, refusal
from pagoda.scheduler_svc.response_writer import ResponseWriter
from pagoda.scheduler_svc.sample_edge import sample_edges
from pagoda.scheduler_svc.settings import ServiceConfig
from pagoda.scheduler_svc.tenants import Tenant, TokenBucket
from pagoda.scheduler_svc.tokenizer import TextTokenizer
from pagoda.scheduler_svc.tool_constraints import argument_constraints
from pagoda.scheduler_svc.tools import MAX_TOOLS, ValidTools
from pagoda.scheduler_svc.validation import (
    Limits,
    ValidationError,
    validate_detokenize_ids,
    validate_generate,
    validate_tokenize_text,
)
from pagoda.scheduler_svc.write_watch import WriteWatch

# Inputs longer than this (characters of prompt, chat contents or Tokenize text) are
# tokenized and chat-rendered on a worker thread: a big one costs milliseconds to seconds
# of tokenizer time, which on the event loop would stall every stream and the step loop.
# The HF tokenizers release the GIL while encoding. Smaller ones stay on the loop, where
# they cost less than a thread hop. Generate's and Chat's validation has its threads, the
# Tokenize RPC its own bounded one, so a flood of Tokenize calls cannot delay a Generate.
OFF_LOOP_MIN_CHARS = 4096
OFF_LOOP_MIN_IDS = 1024  # the same for the ids of a Detokenize call
NUM_TOKENIZER_THREADS = 2

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


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
        self._writer = ResponseWriter(metrics, tokenizer, WriteWatch(config.stream_write_timeout_s))
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
        record = self._call_record("Generate", context)
        handling = self._serve(validate_generate, request, context, record)
        del request  # held by `handling` alone, gone when it ends (see Refused)
        await answer_logged(context, handling, record)

    async def Chat(self, request, context) -> None:
        record = self._call_record("Chat", context)
        handling = self._serve(validate_chat, request, context, record)
        del request
        await answer_logged(context, handling, record)

    def _call_record(self, method: str, context) -> CallRecord | None:
        return call_record(method, context) if self._config.access_log else None

    async def _serve(self, validate, request, context, record: CallRecord | None) -> None:
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
        if record is not None:
            record.request_id, record.tenant = client_request_id, tenant.name
        # The caller's deadline, for the `deadline` admission policy (the call itself ends
        # with DEADLINE_EXCEEDED, and its request is cancelled, under any policy).
        valid = dataclasses.replace(valid, time_limit_s=context.time_remaining())
        slots = self._submit(valid)
        edges = sample_edges(valid, len(slots), self._tokenizer.decoded_bytes)
        try:
            if len(slots) == 1:
                slot, edge = slots[0], edges[0]
                while True:
                    output = await slot.next()
                    await self._writer.stream(
                        context,
                        slot,
                        output,
                        client_request_id,
                        tenant.name,
                        record=record,
                        edge=edge,
                    )
                    if output.finish_reason is not None:
                        return
            await self._writer.stream_samples(
                context, slots, client_request_id, tenant.name, record, edges
            )
        finally:
            # Reached on normal end, refusal, client cancel, deadline, disconnect or a
            # stalled write (grpc.aio raises CancelledError at the pending await): a live
            # request is cancelled so its blocks are free before the next step is planned;
            # so is every sample of one of n.
            for slot in slots:
                self._front.release(slot)

    async def _admit(self, validate, request, context) -> ValidRequest:
        self._reject_undecodable(request)
        if self._front.draining:
            raise refusal(
                self._metrics, grpc.StatusCode.UNAVAILABLE, "the server is draining for shutdown"
            )
        limits = self._limits()
        if limits is None:
            raise refusal(self._metrics, grpc.StatusCode.UNAVAILABLE, "no worker is connected yet")
        # Before any tokenizer time: a full queue refuses cheaply (submit checks it again).
        max_waiting = self._config.scheduler.max_waiting_requests
        if self._front.stats.num_waiting >= max_waiting:
            raise refusal(
                self._metrics,
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
            # A thinking model thinks before the constrained output; under AUTO with a
            # strict tool the grammar's free text takes the thinking already.
            thinking_first = None
            auto_calls = isinstance(valid.tools, ValidTools) and valid.tools.holds_auto_calls
            if isinstance(valid.thinking, Thinking) and not auto_calls:
                thinking_first = ThinkingFirst(valid.thinking, self._tokenizer.added_tokens)
            # Compiling a schema can take a while (and the first one reads the vocabulary).
            grammar = await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_threads,
                self._compile,
                constraint,
                valid.tools,
                limits.vocab_size,
                self._last_hello.eos_token_ids,
                thinking_first,
            )
            forks = tuple(grammar.fork() for _ in range(valid.n - 1))
            return dataclasses.replace(valid, grammar=grammar, sample_grammars=forks)
        except (ValidationError, GrammarError) as exc:
            sentence = str(exc)
        raise refusal(self._metrics, grpc.StatusCode.INVALID_ARGUMENT, sentence)

    def _compile(
        self,
        constraint: ValidConstraint,
        tools: object,
        vocab_size: int,
        eos_token_ids,
        thinking_first: ThinkingFirst | None,
    ) -> RequestGrammar:
        """The request's grammar. When the engine refuses tool_choice REQUIRED's, the
        sentence names the tool whose parameters it refuses (each compiled alone)."""
        try:
            return self._grammars.compile(constraint, vocab_size, eos_token_ids, thinking_first)
        except GrammarError:
            if not isinstance(tools, ValidTools) or constraint.field != "tools":
                raise
            for alone in argument_constraints(tools):
                self._grammars.compile(alone, vocab_size, eos_token_ids)  # raises for it
            raise

    def _tenant(self, context) -> Tenant:
        """The caller's tenant (its key's, or the trusted front's header)."""
        try:
            return self._tenants.tenant_of(context.invocation_metadata())
        except ValueError as exc:
            sentence = str(exc)
        raise refusal(self._metrics, grpc.StatusCode.INVALID_ARGUMENT, sentence)

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
            raise refusal(
                self._metrics,
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
        raise refusal(self._metrics, code, sentence)

    def _reject_undecodable(self, request) -> None:
        if isinstance(request, Undecodable):
            raise refusal(self._metrics, grpc.StatusCode.INVALID_ARGUMENT, request.sentence)

    async def Tokenize(self, request, context):
        return await answer(context, self._checked_tokenize(request))

    async def _checked_tokenize(self, request) -> generation_pb2.TokenizeResponse:
        self._reject_undecodable(request)
        limits = self._limits() or fallback_limits(self._tokenizer, self._config)

        def check() -> tuple:
            validate_tokenize_text(request.text, limits)
            return self._tokenizer, request, limits.max_context_tokens

        return await self._tokenizer_call(
            tokenize, check, big=len(request.text) > OFF_LOOP_MIN_CHARS
        )

    async def Detokenize(self, request, context):
        return await answer(context, self._checked_detokenize(request))

    async def _checked_detokenize(self, request) -> generation_pb2.DetokenizeResponse:
        self._reject_undecodable(request)
        limits = self._limits() or fallback_limits(self._tokenizer, self._config)

        def check() -> tuple:
            ids = validate_detokenize_ids(request.token_ids, limits)
            return self._tokenizer, ids, request.skip_special_tokens

        return await self._tokenizer_call(
            detokenize, check, big=len(request.token_ids) > OFF_LOOP_MIN_IDS
        )

    async def _tokenizer_call(self, function, check, *, big: bool):
        """`function(*check())` on the loop, or on the Tokenize calls' own bounded thread
        when the input is `big`; a ValidationError or a full queue is the call's refusal."""
        code = grpc.StatusCode.INVALID_ARGUMENT
        try:
            args = check()
            if not big:
                return function(*args)
            return await self._tokenize_rpcs.run(function, *args)
        except ValidationError as exc:
            sentence = str(exc)
        except ExecutorFull:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            sentence = (
                f"{self._tokenize_rpcs.max_calls} Tokenize or Detokenize calls of long inputs "
                "are queued or running (max_tokenize_calls); retry later"
            )
        raise refusal(self._metrics, code, sentence)

    async def GetModelInfo(self, request, context):
        return await answer(context, self._model_info(request))

    async def _model_info(self, request) -> generation_pb2.ModelInfo:
        self._reject_undecodable(request)
        self._limits()  # remembers the connected worker's hello
        return model_info(self._model_id, self._tokenizer, self._front, self._last_hello)

    async def GetServerStats(self, request, context):
        return await answer(context, self._server_stats(request, context))

    async def _server_stats(self, request, context) -> generation_pb2.ServerStats:
        self._reject_undecodable(request)
        return server_stats(self._front, self._metrics, self._tenant(context).name)


def _input_chars(request) -> int:
    """Characters a request gives the tokenizer (or the chat template) to work through."""
    messages = getattr(request, "messages", None)
    if messages is None:
        return len(request.prompt)
    if len(messages) > MAX_CHAT_MESSAGES or len(request.tools) > MAX_TOOLS:
        return 0  # refused before any rendering
    tools = sum(len(tool.description) + len(tool.parameters) for tool in request.tools)
    return tools + sum(num_message_chars(message) for message in messages)
