"""A deterministic, in-process pagoda.v1.Generation server for client tests.

It speaks the real protocol on a real gRPC server (127.0.0.1, an ephemeral port), with the
standard health service, but generates canned text:

- any prompt: `max_new_tokens` tokens (DEFAULT_NEW_TOKENS when unset), one per message, token i
  is id 1000 + i and text " t<i>", `token_delay_s` apart; finish LENGTH with usage and timings.
  A prompt seen before reports all but one of its tokens as cached.
- Chat: the answer is "(<n> messages) you said: <last content>", one word per message.
  With a tool_choice naming a function, it calls that function instead: FAKE_CALL_TOKENS
  messages of tokens without text (held back, as a call's are), then the last one carries
  the call (id FAKE_CALL_ID, arguments FAKE_CALL_ARGUMENTS) and finish TOOL_CALLS.
  With stream_tool_calls, those messages carry the call in FAKE_CALL_PIECES (tool_call_deltas:
  the first with the id and name); a max_new_tokens below FAKE_CALL_TOKENS cuts the call
  there, and the last message carries the arguments written so far, finish LENGTH.
  A servicer made with `thinks=True` (ModelInfo.thinks) first thinks FAKE_THOUGHT, one word
  of reasoning_text per message; the message of its last word carries the first word of
  the answer too. chat_template_kwargs {"enable_thinking": false} turns the thinking off.
- magic prompts (for Chat, the last message's content):
  - "echo": one message whose text is the request in protobuf text format; finish STOP.
  - "error:<CODE>": fails at once with that grpc.StatusCode name (e.g. "error:UNAVAILABLE").
  - "error-after:<CODE>": one message, then the failure.
  - "hang": one message, then waits until the client cancels (at most HANG_LIMIT_S).

Every request is recorded (`servicer.requests`); cancellations are observable with
`servicer.wait_cancelled(request_id, timeout_s)`. Run it alone with
`python -m tests.client.fake_server --port 50051`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from google.protobuf import text_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagoda.protos import generation_pb2 as pb
from pagoda.protos import generation_pb2_grpc

DEFAULT_NEW_TOKENS = 4
MAX_NEW_TOKENS = 1000
HANG_LIMIT_S = 30.0
FIRST_TOKEN_ID = 1000
FAKE_CALL_ID = "call_" + "0123456789ab" * 2
FAKE_CALL_ARGUMENTS = '{"city": "Paris"}'
FAKE_CALL_TOKENS = 3
# The arguments' text each of the call's token messages adds, when the call streams.
FAKE_CALL_PIECES = ("", '{"city": ', '"Paris"}')
FAKE_THOUGHT = "Hm, a greeting."
# The tool the fake call calls, as an OpenAI client declares it.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    },
}
# OpenAI's tool_choice forms and the pagoda.v1 ToolChoice each becomes (oneof field, value).
TOOL_CHOICES = [
    ("auto", "mode", pb.TOOL_CHOICE_AUTO),
    ("none", "mode", pb.TOOL_CHOICE_NONE),
    ("required", "mode", pb.TOOL_CHOICE_REQUIRED),
    ({"type": "function", "function": {"name": "get_weather"}}, "function_name", "get_weather"),
]

MODEL_INFO = pb.ModelInfo(
    model_id="fake-model",
    max_context_tokens=2048,
    vocab_size=4096,
    block_size=16,
    num_kv_blocks=128,
    num_kv_tokens=2048,
    eos_token_ids=[2],
    device="cpu",
    dtype="float32",
    quantization="int8",
    worker_connected=True,
)


@dataclass(slots=True)
class RecordedCall:
    method: str
    request: object
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class FakeCalls:
    """The fake chat's calls: whole on the last message, and when they stream, the pieces
    each token message carries (one tuple per message)."""

    whole: tuple[pb.ToolCall, ...] = ()
    pieces: tuple[tuple[pb.ToolCallDelta, ...], ...] = ()
    finish_reason: int = pb.TOOL_CALLS

    def on_message(self, index: int) -> tuple[pb.ToolCallDelta, ...]:
        return self.pieces[index] if 0 <= index < len(self.pieces) else ()


NO_CALLS = FakeCalls()


@dataclass(slots=True)
class FakeCounters:
    num_running: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    num_generated_tokens: int = 0
    seen_prompts: set[str] = field(default_factory=set)


class FakeGenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Canned Generation behaviour; thread-safe (the gRPC server runs handlers in a pool)."""

    def __init__(
        self,
        *,
        token_delay_s: float = 0.0,
        api_key: str | None = None,
        preemptions_per_request: int = 0,
        has_chat_template: bool = False,
        thinks: bool = False,
    ) -> None:
        self.token_delay_s = token_delay_s
        self.has_chat_template = has_chat_template
        self.thinks = thinks
        self.api_key = api_key
        self.preemptions_per_request = preemptions_per_request
        self.requests: list[RecordedCall] = []
        self.cancelled_ids: set[str] = set()
        self.counters = FakeCounters()
        self._lock = threading.Condition()
        self._ids = itertools.count()

    def wait_cancelled(self, request_id: str, timeout_s: float) -> bool:
        """True once the server has seen the client cancel `request_id`."""
        with self._lock:
            return self._lock.wait_for(lambda: request_id in self.cancelled_ids, timeout_s)

    def last_request(self, method: str) -> object:
        with self._lock:
            return [call.request for call in self.requests if call.method == method][-1]

    # -- RPCs -----------------------------------------------------------------------------

    def Generate(self, request, context):
        self._admit("Generate", request, context)
        kind = request.WhichOneof("input")
        if kind == "prompt":
            prompt, num_prompt_tokens = request.prompt, len(request.prompt.split())
        elif kind == "prompt_token_ids":
            prompt, num_prompt_tokens = "", len(request.prompt_token_ids.ids)
        else:
            prompt, num_prompt_tokens = "", 0
        if num_prompt_tokens == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "The prompt must not be empty.")
        pieces = [f" t{i}" for i in range(self._num_new_tokens(request, context))]
        yield from self._stream(request, context, prompt, num_prompt_tokens, pieces)

    def Chat(self, request, context):
        self._admit("Chat", request, context)
        if not request.messages:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "At least one message is needed.")
        last = request.messages[-1].content
        rendered = "\n".join(f"{m.role}: {m.content}" for m in request.messages)
        words = f"({len(request.messages)} messages) you said: {last}".split(" ")
        pieces = _words(words)
        pieces = pieces[: self._num_new_tokens(request, context, default=len(pieces))]
        thought = []
        kwargs = json.loads(request.chat_template_kwargs or "{}")
        if self.thinks and kwargs.get("enable_thinking", True):
            thought = _words(FAKE_THOUGHT.split(" "))
        num_thinking_tokens = max(len(thought) - 1, 0)
        calls = NO_CALLS
        if request.tool_choice.function_name:
            calls = _fake_call(request, num_thinking_tokens)
            pieces = [""] * (len(calls.pieces) or FAKE_CALL_TOKENS)
        if thought:
            # The thinking counts toward max_new_tokens too.
            pieces = [""] * num_thinking_tokens + pieces
            pieces = pieces[: request.stopping.max_new_tokens or None]
        yield from self._stream(
            request, context, last, len(rendered.split()), pieces, calls, thought
        )

    def Tokenize(self, request, context):
        self._admit("Tokenize", request, context)
        token_ids = [1] if request.add_special_tokens else []
        token_ids += list(request.text.encode())
        tokens = (["<s>"] if request.add_special_tokens else []) + list(request.text)
        return pb.TokenizeResponse(token_ids=token_ids, tokens=tokens)

    def Detokenize(self, request, context):
        """The inverse of Tokenize here: ids are bytes; 1 is the special <s>."""
        self._admit("Detokenize", request, context)
        special = "" if request.skip_special_tokens else "<s>"
        text = "".join(special if i == 1 else chr(i) for i in request.token_ids)
        return pb.DetokenizeResponse(text=text)

    def GetModelInfo(self, request, context):
        self._admit("GetModelInfo", request, context)
        info = pb.ModelInfo()
        info.CopyFrom(MODEL_INFO)
        info.has_chat_template = self.has_chat_template
        info.thinks = self.thinks
        return info

    def GetServerStats(self, request, context):
        self._admit("GetServerStats", request, context)
        with self._lock:
            c = self.counters
            return pb.ServerStats(
                num_waiting=0,
                num_running=c.num_running,
                num_kv_blocks_used=c.num_running,
                num_kv_blocks_total=MODEL_INFO.num_kv_blocks,
                prefix_cache_hit_rate=0.25,
                num_preemptions=c.num_preemptions,
                num_steps=c.num_steps,
                worker_connected=True,
                num_kv_blocks_cached=3,
                num_requests_finished=c.num_requests_finished,
                num_generated_tokens=c.num_generated_tokens,
                worker_incarnation_id="fake-incarnation",
                draining=False,
                workers=[pb.WorkerStats(incarnation_id="fake-incarnation", num_steps=c.num_steps)],
            )

    # -- helpers --------------------------------------------------------------------------

    def _admit(self, method: str, request, context) -> None:
        metadata = {key: value for key, value in context.invocation_metadata()}
        with self._lock:
            self.requests.append(RecordedCall(method, request, metadata))
        if self.api_key is not None and metadata.get("authorization") != f"Bearer {self.api_key}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "The API key is missing or wrong.")

    def _num_new_tokens(self, request, context, default: int = DEFAULT_NEW_TOKENS) -> int:
        wanted = request.stopping.max_new_tokens
        if wanted > MAX_NEW_TOKENS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_new_tokens {wanted} is over the fake model's limit of {MAX_NEW_TOKENS}.",
            )
        return wanted or default

    def _stream(self, request, context, *answer):
        """Answer `request` (`answer`: _respond's prompt, num_prompt_tokens, pieces and
        optional calls and thought), recording a cancellation by the client."""
        request_id = request.request_id or f"fake-{next(self._ids)}"
        # The handler's own endings set `handled`; any other end of the RPC is the client's
        # cancellation (or deadline). Registered before anything is sent, since a callback
        # added after the RPC ended never runs.
        handled, ended = threading.Event(), threading.Event()

        def on_rpc_end() -> None:
            ended.set()
            if not handled.is_set():
                self._record_cancelled(request_id)

        if not context.add_callback(on_rpc_end):
            on_rpc_end()
        try:
            yield from self._respond(request, request_id, context, ended, *answer)
        finally:
            handled.set()

    def _respond(
        self,
        request,
        request_id,
        context,
        ended,
        prompt: str,
        num_prompt_tokens: int,
        pieces: list[str],
        calls: FakeCalls = NO_CALLS,
        thought=(),
    ):
        arrival = time.perf_counter()
        if prompt.startswith("error:"):
            self._abort_with(context, prompt.removeprefix("error:"))
        if prompt == "echo":
            pieces = [text_format.MessageToString(request, as_one_line=True)]
        elif prompt.startswith("error-after:") or prompt == "hang":
            pieces = pieces[:1]
        with self._lock:
            cached = num_prompt_tokens - 1 if prompt and prompt in self.counters.seen_prompts else 0
            self.counters.seen_prompts.add(prompt)
            self.counters.num_running += 1
            self.counters.num_preemptions += self.preemptions_per_request
        first_token_ms = 0.0
        try:
            for index, piece in enumerate(pieces):
                if index and self.token_delay_s:
                    time.sleep(self.token_delay_s)
                if not context.is_active():
                    return
                with self._lock:
                    self.counters.num_steps += 1
                    self.counters.num_generated_tokens += 1
                if index == 0:
                    first_token_ms = (time.perf_counter() - arrival) * 1000
                reasoning = thought[index] if index < len(thought) else ""
                message = self._token_message(request, request_id, index, piece, reasoning)
                message.tool_call_deltas.extend(calls.on_message(index - max(len(thought) - 1, 0)))
                yield message
            if prompt.startswith("error-after:"):
                self._abort_with(context, prompt.removeprefix("error-after:"))
            if prompt == "hang":
                # The handler has not returned, so only the client can end the RPC now.
                ended.wait(HANG_LIMIT_S)
                return
            finish_reason = pb.STOP if prompt == "echo" else pb.LENGTH
            yield pb.GenerateResponse(
                request_id=request_id,
                finish_reason=calls.finish_reason if calls.whole else finish_reason,
                tool_calls=calls.whole,
                usage=pb.Usage(
                    prompt_tokens=num_prompt_tokens,
                    completion_tokens=len(pieces),
                    cached_prompt_tokens=cached,
                    # The token that holds the answer's first word is none of the thinking's.
                    reasoning_tokens=min(max(len(thought) - 1, 0), len(pieces)),
                ),
                timings=pb.Timings(
                    queued_ms=0.5,
                    first_token_ms=first_token_ms,
                    total_ms=(time.perf_counter() - arrival) * 1000,
                ),
            )
        finally:
            with self._lock:
                self.counters.num_running -= 1
                self.counters.num_requests_finished += 1

    def _token_message(self, request, request_id: str, index: int, piece: str, reasoning: str):
        token_id = FIRST_TOKEN_ID + index
        message = pb.GenerateResponse(
            request_id=request_id, text=piece, reasoning_text=reasoning, token_ids=[token_id]
        )
        if request.logprobs:
            message.logprobs.add(
                token_id=token_id,
                logprob=-0.25,
                top_token_ids=[token_id + k for k in range(request.logprobs)],
                top_logprobs=[-0.25 - k for k in range(request.logprobs)],
            )
        return message

    def _record_cancelled(self, request_id: str) -> None:
        with self._lock:
            self.cancelled_ids.add(request_id)
            self._lock.notify_all()

    @staticmethod
    def _abort_with(context, code_name: str) -> None:
        code = getattr(grpc.StatusCode, code_name, grpc.StatusCode.UNKNOWN)
        context.abort(code, f"The fake server was asked to fail with {code_name}.")


def _fake_call(request: pb.ChatRequest, num_thinking_tokens: int) -> FakeCalls:
    """The call of the function tool_choice names: whole, or with stream_tool_calls in
    FAKE_CALL_PIECES, cut where max_new_tokens (the thinking's tokens counted) runs out."""
    name = request.tool_choice.function_name
    if not request.stream_tool_calls:
        return FakeCalls((pb.ToolCall(id=FAKE_CALL_ID, name=name, arguments=FAKE_CALL_ARGUMENTS),))
    budget = max(request.stopping.max_new_tokens - num_thinking_tokens, 0)
    written = FAKE_CALL_PIECES[: budget if request.stopping.max_new_tokens else None]
    if not written:
        return NO_CALLS
    pieces = [(pb.ToolCallDelta(index=0, id=FAKE_CALL_ID, name=name, arguments=written[0]),)]
    pieces += [(pb.ToolCallDelta(index=0, arguments=text),) for text in written[1:]]
    call = pb.ToolCall(id=FAKE_CALL_ID, name=name, arguments="".join(written))
    cut = len(written) < len(FAKE_CALL_PIECES)
    return FakeCalls((call,), tuple(pieces), pb.LENGTH if cut else pb.TOOL_CALLS)


def _words(words: list[str]) -> list[str]:
    """One message's text per word, the space before each word but the first."""
    return [words[0]] + [f" {word}" for word in words[1:]]


class FakeServer:
    """A started gRPC server around a FakeGenerationServicer; `target` is "127.0.0.1:<port>"."""

    def __init__(self, servicer: FakeGenerationServicer | None = None, port: int = 0) -> None:
        self.servicer = servicer or FakeGenerationServicer()
        self.health = health.HealthServicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self.target = f"127.0.0.1:{self.port}"
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING
        if not serving:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", "pagoda.v1.Generation"):
            self.health.set(service, status)

    def start(self) -> FakeServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait()

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the fake pagoda.v1.Generation.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-delay-ms", type=float, default=5.0)
    args = parser.parse_args()
    servicer = FakeGenerationServicer(token_delay_s=args.token_delay_ms / 1000)
    with FakeServer(servicer, port=args.port) as server:
        print(f"fake pagoda server on {server.target}", flush=True)
        try:
            server._server.wait_for_termination()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
