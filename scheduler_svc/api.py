"""The gRPC edge: a thin pagoda.v1.Generation servicer, health, reflection and auth.

Validation lives in validation.py and scheduling in the step loop; this module maps
between protobuf and the domain and turns failures into status codes with a sentence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pagoda.protos import generation_pb2, generation_pb2_grpc
from pagoda.scheduler_svc.core import (
    ConfigError,
    FinishReason,
    QueueFullError,
    RequestOutput,
    RequestTooLargeError,
    ValidRequest,
)
from pagoda.scheduler_svc.lanes import Lanes
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.rpc_limit import RpcLimit
from pagoda.scheduler_svc.settings import ServiceConfig
from pagoda.scheduler_svc.step_loop import StepLoop, Unavailable
from pagoda.scheduler_svc.tokenizer import TextTokenizer
from pagoda.scheduler_svc.validation import (
    MAX_CHAT_MESSAGES,
    Limits,
    ValidationError,
    validate_chat,
    validate_generate,
    validate_tokenize_text,
)
from pagoda.scheduler_svc.write_watch import StalledWrite, WriteWatch

log = logging.getLogger("pagoda.api")

# Inputs longer than this (characters of prompt, chat contents or Tokenize text) are
# tokenized and chat-rendered on a worker thread: a big one costs milliseconds to seconds
# of tokenizer time, which on the event loop would stall every stream and the step loop.
# The HF tokenizers release the GIL while encoding. Smaller ones stay on the loop, where
# they cost less than a thread hop.
OFF_LOOP_MIN_CHARS = 4096
NUM_TOKENIZER_THREADS = 2
# How long a stalled stream's status may wait to be sent before its handler gives up.
STALLED_ABORT_TIMEOUT_S = 1.0
# Bounds a Tokenize text before any worker said hello (the limit then follows its context).
FALLBACK_MAX_CONTEXT_TOKENS = 32_768

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

_FINISH_REASONS = {
    FinishReason.LENGTH: generation_pb2.LENGTH,
    FinishReason.STOP: generation_pb2.STOP,
    FinishReason.CANCELLED: generation_pb2.CANCELLED,
    FinishReason.ERROR: generation_pb2.ERROR,
}


def to_response(
    output: RequestOutput, request_id: str | None = None
) -> generation_pb2.GenerateResponse:
    """`request_id`: the id the client knows the request by (default: the server's)."""
    response = generation_pb2.GenerateResponse(
        request_id=output.request_id if request_id is None else request_id,
        text=output.text,
        token_ids=output.token_ids,
    )
    for logprob in output.logprobs or ():
        response.logprobs.add(
            token_id=logprob.token_id,
            logprob=logprob.logprob,
            top_token_ids=logprob.top_token_ids,
            top_logprobs=logprob.top_logprobs,
        )
    if output.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[output.finish_reason]
    if output.usage is not None:
        response.usage.CopyFrom(
            generation_pb2.Usage(
                prompt_tokens=output.usage.prompt_tokens,
                completion_tokens=output.usage.completion_tokens,
                cached_prompt_tokens=output.usage.cached_prompt_tokens,
                num_preemptions=output.usage.num_preemptions,
            )
        )
    if output.timings is not None:
        response.timings.CopyFrom(
            generation_pb2.Timings(
                queued_ms=output.timings.queued_ms,
                first_token_ms=output.timings.first_token_ms,
                total_ms=output.timings.total_ms,
            )
        )
    return response


class Undecodable:
    """Stands in for a request whose bytes are not a valid message of its type."""

    def __init__(self, type_name: str) -> None:
        self.sentence = f"the request is not a valid {type_name} message"


def _tolerant_parser(message_class):
    """A deserializer that never raises: grpc.aio would answer UNKNOWN and log a traceback."""

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return Undecodable(message_class.DESCRIPTOR.full_name)

    return parse


def _generation_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """The Generation service, registered with parsers that turn bad bytes into INVALID_ARGUMENT."""
    pb = generation_pb2
    streams = {"Generate": pb.GenerateRequest, "Chat": pb.ChatRequest}
    unaries = {
        "Tokenize": pb.TokenizeRequest,
        "GetModelInfo": pb.ModelInfoRequest,
        "GetServerStats": pb.ServerStatsRequest,
    }
    handlers = {
        name: grpc.unary_stream_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=_tolerant_parser(request_class),
            response_serializer=pb.GenerateResponse.SerializeToString,
        )
        for name, request_class in streams.items()
    }
    handlers.update(
        {
            name: grpc.unary_unary_rpc_method_handler(
                getattr(servicer, name),
                request_deserializer=_tolerant_parser(request_class),
                response_serializer=lambda message: message.SerializeToString(),
            )
            for name, request_class in unaries.items()
        }
    )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        loop: StepLoop | Lanes,
        metrics: Metrics,
        tokenizer: TextTokenizer,
        config: ServiceConfig,
        model_id: str,
    ) -> None:
        self._loop = loop
        self._metrics = metrics
        self._tokenizer = tokenizer
        self._config = config
        self._model_id = model_id
        self._last_hello = None
        self._write_watch = WriteWatch(config.stream_write_timeout_s)
        self._tokenizer_threads = ThreadPoolExecutor(
            max_workers=NUM_TOKENIZER_THREADS, thread_name_prefix="pagoda-tokenize"
        )

    async def _off_loop_if_big(self, num_chars: int, function, *args):
        """`function(*args)`, on a tokenizer thread when the input is big."""
        if num_chars <= OFF_LOOP_MIN_CHARS:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_threads, function, *args
        )

    def _limits(self) -> Limits | None:
        worker = self._loop.worker
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
            max_logprobs=min(
                self._config.max_logprobs, hello.max_logprobs or self._config.max_logprobs
            ),
        )

    async def Generate(self, request, context) -> None:
        await self._serve(validate_generate, request, context)

    async def Chat(self, request, context) -> None:
        await self._serve(validate_chat, request, context)

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
        if self._config.cache_salt_by_api_key:
            salt = tenant_cache_salt(_bearer_token(context), valid.cache_salt)
            valid = dataclasses.replace(valid, cache_salt=salt)
        slot = await self._submit(valid, context)
        try:
            while True:
                output = await slot.next()
                if output.finish_reason is FinishReason.ERROR:
                    if output.token_ids or output.text:
                        await self._write(context, to_response(output, client_request_id))
                    code = getattr(grpc.StatusCode, slot.error_code or "INTERNAL")
                    self._metrics.observe_error(code.name)
                    await context.abort(code, output.error_message or "the request failed")
                await self._write(context, to_response(output, client_request_id))
                if output.finish_reason is not None:
                    return
        finally:
            # Reached on normal end, client cancel, deadline, disconnect or a stalled
            # write (grpc.aio raises CancelledError at the pending await): a live request
            # is cancelled so its blocks are free before the next step is planned.
            self._loop.release(slot)

    async def _write(self, context, response: generation_pb2.GenerateResponse) -> None:
        """Write one message; a client that takes none for stream_write_timeout_s (flow
        control full: it stopped reading) has its stream ended, so it holds no memory."""
        try:
            await self._write_watch.write(context.write(response))
        except StalledWrite:
            timeout_s = self._write_watch.limit_s
            self._metrics.observe_error("DEADLINE_EXCEEDED")
            # The status queues behind the message the client does not take, so this
            # abort can wait for good (and grpc.aio cannot reset one stream): bounded,
            # then the handler ends as cancelled, giving back its request and its RPC
            # slot; the HTTP/2 stream lasts until the client's connection closes.
            try:
                await asyncio.wait_for(
                    context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the client took no message for {timeout_s:g} s; the stream was ended",
                    ),
                    STALLED_ABORT_TIMEOUT_S,
                )
            except TimeoutError:
                raise asyncio.CancelledError from None

    async def _admit(self, validate, request, context) -> ValidRequest:
        await self._reject_undecodable(request, context)
        if self._loop.draining:
            await self._abort(
                context, grpc.StatusCode.UNAVAILABLE, "the server is draining for shutdown"
            )
        limits = self._limits()
        if limits is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "no worker is connected yet")
        # Before any tokenizer time: a full queue refuses cheaply (submit checks it again).
        max_waiting = self._config.scheduler.max_waiting_requests
        if self._loop.stats.num_waiting >= max_waiting:
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the waiting queue is full ({max_waiting} requests); retry later",
            )
        try:
            return await self._off_loop_if_big(
                _input_chars(request), validate, request, self._tokenizer, limits
            )
        except ValidationError as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _submit(self, valid: ValidRequest, context):
        try:
            return self._loop.submit(valid)
        except Unavailable as exc:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except QueueFullError as exc:
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (RequestTooLargeError, ValueError) as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _reject_undecodable(self, request, context) -> None:
        if isinstance(request, Undecodable):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.sentence)

    async def _abort(self, context, code: grpc.StatusCode, sentence: str):
        self._metrics.observe_error(code.name)
        await context.abort(code, sentence)

    async def Tokenize(self, request, context):
        await self._reject_undecodable(request, context)
        limits = self._limits()
        try:
            validate_tokenize_text(request.text, limits or self._fallback_limits())
        except ValidationError as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return await self._off_loop_if_big(len(request.text), self._tokenize, request)

    def _tokenize(self, request) -> generation_pb2.TokenizeResponse:
        ids = self._tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
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
            max_logprobs=self._config.max_logprobs,
        )

    async def GetModelInfo(self, request, context):
        await self._reject_undecodable(request, context)
        self._limits()
        hello = self._last_hello
        info = generation_pb2.ModelInfo(
            model_id=self._model_id,
            vocab_size=self._tokenizer.vocab_size,
            eos_token_ids=sorted(self._tokenizer.eos_token_ids),
            worker_connected=self._loop.worker is not None,
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
        await self._reject_undecodable(request, context)
        stats = self._loop.stats
        worker = self._loop.worker
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
            draining=self._loop.draining,
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
                for each in self._loop.worker_stats()
            ],
        )


def _input_chars(request) -> int:
    """Characters a request gives the tokenizer (or the chat template) to work through."""
    messages = getattr(request, "messages", None)
    if messages is None:
        return len(request.prompt)
    if len(messages) > MAX_CHAT_MESSAGES:
        return 0  # refused before any rendering
    return sum(len(message.content) for message in messages)


# Connection liveness: the server pings a connection silent for a minute and closes it
# if no answer comes in 20 s (a vanished client's streams end); clients may ping every
# 30 s, also between calls, and more often is refused (GOAWAY) as abuse.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
    ("grpc.http2.max_ping_strikes", 2),
]

# The one RPC open without the token: a load balancer's or orchestrator's probe. Watch
# is a stream a client keeps open, so it is authenticated like the API.
_OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
# Longest service name a health Watch may name: each watched name is a key the health
# servicer keeps while watched; real ones are "" and "pagoda.v1.Generation".
MAX_HEALTH_SERVICE_NAME_CHARS = 128


class BoundedHealthServicer(health.aio.HealthServicer):
    """grpc's health servicer with a bound on concurrent Watch streams (and their names)."""

    def __init__(self, max_watchers: int) -> None:
        super().__init__()
        self._max_watchers = max_watchers
        self._num_watchers = 0

    async def Watch(self, request, context) -> None:
        if len(request.service) > MAX_HEALTH_SERVICE_NAME_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"service name longer than {MAX_HEALTH_SERVICE_NAME_CHARS} characters",
            )
        if self._num_watchers >= self._max_watchers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._max_watchers} health watchers are open; use Check, or retry later",
            )
        self._num_watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self._num_watchers -= 1


def _bearer_token(context) -> str:
    """The caller's `authorization` metadata ("Bearer <key>"), "" when absent."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def tenant_cache_salt(authorization: str, cache_salt: str) -> str:
    """The cache salt of a request under --cache-salt-by-api-key: a digest of the caller's
    key (never the key itself, which then lives in no request) then the request's own salt.
    The digest's fixed length keeps the two parts apart: no (key, salt) pair can pose as
    another, and a tenant's own salts still split its cache further."""
    digest = hashlib.sha256(authorization.encode()).hexdigest()
    return f"{digest}:{cache_salt}"


def read_api_keys(path: str) -> list[str]:
    """The bearer tokens of an api_key_file: one per line, blank lines and # comments
    skipped; a file holding one key, as before, is one line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read api_key_file: {exc}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise ConfigError(f"api_key_file {path} is empty")
    return keys


class BearerAuth(grpc.aio.ServerInterceptor):
    """Refuses every RPC but the health Check without `authorization: Bearer <key>` for
    one of the keys (one per tenant)."""

    def __init__(self, api_keys: list[str]) -> None:
        self._expected = [f"Bearer {key}".encode() for key in api_keys]

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")

        self._refusal = grpc.unary_unary_rpc_method_handler(refuse)
        self._stream_refusal = grpc.unary_stream_rpc_method_handler(refuse)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in _OPEN_METHODS:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        token = str(metadata.get("authorization", "")).encode()
        # Every key compared (no early exit), so the time taken tells nothing of which.
        if sum(hmac.compare_digest(token, expected) for expected in self._expected):
            return await continuation(handler_call_details)
        streaming = handler_call_details.method.endswith(("/Generate", "/Chat", "/Watch"))
        return self._stream_refusal if streaming else self._refusal


def build_server(
    config: ServiceConfig, servicer: GenerationServicer
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The grpc.aio server with Generation, health (NOT_SERVING until a worker) and reflection."""
    interceptors = []
    if config.api_key_file:
        interceptors.append(BearerAuth(read_api_keys(config.api_key_file)))
    # Beyond max_concurrent_rpcs (all connections together) running handlers, the next RPC
    # gets RESOURCE_EXHAUSTED: counted by handler, not by grpc's maximum_concurrent_rpcs,
    # whose count a stalled stream keeps for as long as its connection lives (rpc_limit).
    interceptors.append(RpcLimit(config.max_concurrent_rpcs))
    options = [
        ("grpc.max_receive_message_length", config.max_grpc_message_bytes),
        ("grpc.max_send_message_length", config.max_grpc_message_bytes),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.so_reuseport", 0),
        *KEEPALIVE_OPTIONS,
        ("grpc.max_connection_idle_ms", int(config.max_connection_idle_s * 1000)),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    server.add_generic_rpc_handlers((_generation_handler(servicer),))
    health_servicer = BoundedHealthServicer(config.max_health_watchers)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    if config.tls_cert:
        try:
            credentials = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
            )
        except OSError as exc:
            raise ConfigError(f"cannot read the TLS files: {exc}") from None
        port = server.add_secure_port(config.grpc_address, credentials)
    else:
        port = server.add_insecure_port(config.grpc_address)
    if port == 0:
        raise ConfigError(f"cannot listen on {config.grpc_address}")
    return server, health_servicer
