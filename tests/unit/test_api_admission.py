"""The servicer's admission, in process: a full queue refuses before any tokenizer time, big
inputs are tokenized and chat-rendered off the event loop, a Tokenize text is bounded by the
context before it is encoded (security review M1)."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import grpc
import pytest

from pagoda.protos import generation_pb2 as pb
from pagoda.scheduler_svc.api import OFF_LOOP_MIN_CHARS, GenerationServicer
from pagoda.scheduler_svc.chat_validation import validate_chat
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.refusals import Refused
from pagoda.scheduler_svc.settings import ServiceConfig
from pagoda.scheduler_svc.tools import ToolFormat
from pagoda.scheduler_svc.validation import validate_generate
from pagoda.scheduler_svc.worker_link import WorkerInfo
from tests.unit.conftest import make_hello

MAX_CONTEXT_TOKENS = 512


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class Context:
    """grpc.aio's servicer context, as far as the servicer uses it."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.aborted: Aborted | None = None
        self.remaining_s: float | None = None  # the call's deadline (None: none)

    async def abort(self, code, details):
        # grpc.aio keeps the exception on the RPC's state, as this does: its traceback's
        # frames hold the context, so the two make a reference cycle.
        self.aborted = Aborted(code, details)
        raise self.aborted

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def invocation_metadata(self):
        return ()

    def time_remaining(self) -> float | None:
        return self.remaining_s

    def set_details(self, details: str) -> None:
        self.details = details


class CountingTokenizer:
    """Records on which thread each encode and render ran."""

    vocab_size = 100
    eos_token_ids = frozenset({2})
    chat_template = "?"
    known_roles = frozenset({"user", "assistant", "system"})
    model_max_length = None
    tool_format = ToolFormat.GENERIC
    special_texts = ()
    added_tokens = ()
    thinks = False

    def __init__(self) -> None:
        self.encode_threads: list[str] = []
        self.render_threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encode_threads.append(threading.current_thread().name)
        return [5] * max(1, min(len(text) // 64, 100))

    def id_to_piece(self, token_id: int) -> str:
        return "x"

    def decoded_bytes(self, token_id: int) -> bytes:
        return b"x"

    def encode_chat(self, rendered: str, contents: list[str]) -> list[int]:
        return self.encode(rendered, add_special_tokens=False)

    def render_chat(self, messages, tools=None, variables=None) -> str:
        self.render_threads.append(threading.current_thread().name)
        return "".join(message["content"] for message in messages)


class FakeLoop:
    def __init__(self, num_waiting: int) -> None:
        hello = make_hello(max_context_tokens=MAX_CONTEXT_TOKENS, vocab_size=100)
        self.worker = WorkerInfo(identity=b"w", hello=hello)
        self.draining = False
        self.stats = SimpleNamespace(num_waiting=num_waiting)


def servicer(num_waiting: int = 0) -> tuple[GenerationServicer, CountingTokenizer, FakeLoop]:
    tokenizer = CountingTokenizer()
    loop = FakeLoop(num_waiting)
    config = ServiceConfig()
    return GenerationServicer(loop, Metrics(), tokenizer, config, "m"), tokenizer, loop


def test_a_full_queue_refuses_before_any_tokenizer_time():
    config = ServiceConfig()
    service, tokenizer, _ = servicer(num_waiting=config.scheduler.max_waiting_requests)

    async def scenario():
        with pytest.raises(Refused) as generate:
            await service._admit(
                validate_generate, pb.GenerateRequest(prompt="hi " * 900), Context()
            )
        with pytest.raises(Refused) as chat:
            request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hello")])
            await service._admit(validate_chat, request, Context())
        return generate.value.code, chat.value.code

    codes = asyncio.run(scenario())
    assert codes == (grpc.StatusCode.RESOURCE_EXHAUSTED,) * 2
    assert tokenizer.encode_threads == [] and tokenizer.render_threads == []


def test_big_inputs_are_tokenized_and_rendered_off_the_event_loop():
    service, tokenizer, _ = servicer()
    small = "a" * OFF_LOOP_MIN_CHARS
    big = "a" * (OFF_LOOP_MIN_CHARS + 1)

    async def scenario():
        for text in (small, big):
            valid = await service._admit(
                validate_generate, pb.GenerateRequest(prompt=text), Context()
            )
            assert valid.prompt_token_ids
        request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=big)])
        await service._admit(validate_chat, request, Context())
        # Tools (and past calls) are rendered too: a big schema counts like a big message.
        tool = pb.Tool(name="f", parameters=json.dumps({"description": small}))
        request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")], tools=[tool])
        await service._admit(validate_chat, request, Context())
        await service.Tokenize(pb.TokenizeRequest(text=small), Context())
        await service.Tokenize(pb.TokenizeRequest(text=big), Context())
        return threading.current_thread().name

    loop_thread = asyncio.run(scenario())
    on_loop = [name == loop_thread for name in tokenizer.encode_threads]
    assert on_loop == [True, False, False, False, True, False]
    assert tokenizer.render_threads[0].startswith("pagoda-tokenize")
    assert tokenizer.render_threads[1].startswith("pagoda-tokenize")


def test_tokenize_text_is_bounded_by_the_context_before_encoding():
    service, tokenizer, _ = servicer()
    text = "a" * 4_000_000

    async def scenario():
        context = Context()
        assert await service.Tokenize(pb.TokenizeRequest(text=text), context) is None
        return context

    refused = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "far beyond the context of 512 tokens" in refused.details
    assert tokenizer.encode_threads == []


@pytest.mark.parametrize("status_refused", [False, True])
def test_a_stream_whose_writes_stall_is_ended_and_its_request_released(status_refused):
    """A client that stops reading blocks the write (flow control); past
    stream_write_timeout_s the stream ends with DEADLINE_EXCEEDED and the slot is released.
    When grpc refuses to queue the status behind the pending write (ExecuteBatchError, an
    InternalError), the handler ends as cancelled: nothing for grpc.aio to log with a
    traceback, once per stalled stream (security review N7)."""
    import dataclasses

    from pagoda.scheduler_svc.core import RequestOutput
    from pagoda.scheduler_svc.output_streams import OutputSlot

    class StalledContext(Context):
        async def write(self, message):
            await asyncio.Event().wait()  # the client never takes it

        async def abort(self, code, details):
            if status_refused:
                raise grpc.aio.InternalError("GRPC_CALL_ERROR_TOO_MANY_OPERATIONS")
            await super().abort(code, details)

    class ServingLoop(FakeLoop):
        def __init__(self) -> None:
            super().__init__(num_waiting=0)
            self.released: list[OutputSlot] = []

        def submit(self, valid):
            slot = OutputSlot(valid.request_id)
            slot.publish(RequestOutput(valid.request_id, "a", [5], None))
            return slot

        def release(self, slot):
            self.released.append(slot)

    loop = ServingLoop()
    config = dataclasses.replace(ServiceConfig(), stream_write_timeout_s=0.05)
    service = GenerationServicer(loop, Metrics(), CountingTokenizer(), config, "m")

    async def scenario():
        ending = Aborted if not status_refused else asyncio.CancelledError
        with pytest.raises(ending) as ended:
            await service.Generate(pb.GenerateRequest(prompt="hi"), StalledContext())
        return ended.value

    ended = asyncio.run(scenario())
    if not status_refused:
        assert ended.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(loop.released) == 1


def test_tokenize_refuses_more_tokens_than_the_context_before_building_pieces():
    """Within the character bound, a text may still encode to more tokens than the context:
    refused before any piece is built (security review N6)."""

    class OneTokenPerChar(CountingTokenizer):
        def __init__(self) -> None:
            super().__init__()
            self.num_pieces = 0

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [5] * len(text)

        def id_to_piece(self, token_id: int) -> str:
            self.num_pieces += 1
            return "x"

    tokenizer = OneTokenPerChar()
    service = GenerationServicer(FakeLoop(0), Metrics(), tokenizer, ServiceConfig(), "m")

    async def scenario():
        refused, allowed = Context(), Context()
        too_many = pb.TokenizeRequest(text="a" * (MAX_CONTEXT_TOKENS + 1))
        assert await service.Tokenize(too_many, refused) is None
        reply = await service.Tokenize(pb.TokenizeRequest(text="a" * MAX_CONTEXT_TOKENS), allowed)
        return refused, allowed, reply

    refused, allowed, reply = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{MAX_CONTEXT_TOKENS + 1} tokens" in refused.details
    assert allowed.code is None and len(reply.tokens) == MAX_CONTEXT_TOKENS
    assert tokenizer.num_pieces == MAX_CONTEXT_TOKENS  # none for the refused text


def test_refusals_echo_only_the_start_of_the_input():
    """A 3 MB role came back whole in the details, past the client's metadata limit
    (security review N11)."""
    service, _, _ = servicer()
    role = "r" * 3_000_000

    async def scenario():
        context = Context()
        request = pb.ChatRequest(messages=[pb.ChatMessage(role=role, content="hi")])
        await service.Chat(request, context)
        return context

    refused = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].role 'rrrr" in refused.details
    assert "(3000000 characters)" in refused.details
    assert len(refused.details) < 300


def test_a_write_grpc_refuses_ends_the_handler_as_cancelled():
    """A write into a call whose connection closed raises ExecuteBatchError (an
    InternalError); grpc.aio logged each with a traceback (security review N7)."""
    from pagoda.scheduler_svc.core import RequestOutput
    from pagoda.scheduler_svc.output_streams import OutputSlot

    class ClosedContext(Context):
        async def write(self, message):
            raise grpc.aio.InternalError("Failed execute_batch")

    class ServingLoop(FakeLoop):
        def __init__(self) -> None:
            super().__init__(num_waiting=0)
            self.released: list[OutputSlot] = []

        def submit(self, valid):
            slot = OutputSlot(valid.request_id)
            slot.publish(RequestOutput(valid.request_id, "a", [5], None))
            return slot

        def release(self, slot):
            self.released.append(slot)

    loop = ServingLoop()
    service = GenerationServicer(loop, Metrics(), CountingTokenizer(), ServiceConfig(), "m")

    async def scenario():
        with pytest.raises(asyncio.CancelledError):
            await service.Generate(pb.GenerateRequest(prompt="hi"), ClosedContext())

    asyncio.run(scenario())
    assert len(loop.released) == 1


def test_a_tenant_over_its_tokens_per_minute_is_refused_naming_the_limit():
    import dataclasses

    from pagoda.scheduler_svc.tenants import Tenant

    service, _, loop = servicer()
    config = dataclasses.replace(ServiceConfig(), tenant_tokens_per_minute=100)
    service = GenerationServicer(loop, Metrics(), CountingTokenizer(), config, "m")
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[5] * 30), stopping=pb.StoppingCriteria(max_new_tokens=30)
    )

    async def scenario():
        return await service._admit(validate_generate, request, Context())

    valid = asyncio.run(scenario())
    service._check_tokens_per_minute(Tenant("a"), valid)  # 60 of its 100
    with pytest.raises(Refused) as refused:
        service._check_tokens_per_minute(Tenant("a"), valid)
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant a is over its 100 tokens per minute (tenant_tokens_per_minute)" in str(
        refused.value
    )
    service._check_tokens_per_minute(Tenant("b"), valid)  # b has a bucket of its own


def test_tokenize_past_its_bound_is_refused_while_generate_is_served():
    """Tokenize's long texts run on a thread of their own with a bound on the calls queued
    or running: past it a call is refused RESOURCE_EXHAUSTED naming the setting, and a
    Generate's validation, on its own threads, is served while the Tokenize queue is full
    (security review N6)."""
    import dataclasses

    from pagoda.scheduler_svc.core import FinishReason, RequestOutput
    from pagoda.scheduler_svc.output_streams import OutputSlot

    class BlockingTokenizeTexts(CountingTokenizer):
        """Encoding a text that starts with "T" waits until `release` is set."""

        def __init__(self) -> None:
            super().__init__()
            self.release = threading.Event()

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            if text.startswith("T"):
                self.release.wait()
            return super().encode(text, add_special_tokens)

    class WritingContext(Context):
        def __init__(self) -> None:
            super().__init__()
            self.written: list[pb.GenerateResponse] = []

        async def write(self, message):
            self.written.append(message)

    class ServingLoop(FakeLoop):
        def submit(self, valid):
            slot = OutputSlot(valid.request_id)
            slot.publish(RequestOutput(valid.request_id, "a", [5], None, FinishReason.LENGTH))
            return slot

        def release(self, slot):
            pass

    tokenizer = BlockingTokenizeTexts()
    config = dataclasses.replace(ServiceConfig(), max_tokenize_calls=2)
    service = GenerationServicer(ServingLoop(0), Metrics(), tokenizer, config, "m")
    long_text = "T" * (OFF_LOOP_MIN_CHARS + 1)

    async def scenario():
        held = [
            asyncio.create_task(service.Tokenize(pb.TokenizeRequest(text=long_text), Context()))
            for _ in range(2)
        ]
        while service._tokenize_rpcs.num_calls < 2:  # each task reaches its thread hop
            await asyncio.sleep(0)
        refused = Context()
        assert await service.Tokenize(pb.TokenizeRequest(text=long_text), refused) is None
        short = await service.Tokenize(pb.TokenizeRequest(text="hi"), Context())
        # T-less, so its encode does not wait; long, so it is validated off the loop.
        prompt = "a" * (OFF_LOOP_MIN_CHARS + 1)
        served = WritingContext()
        await asyncio.wait_for(service.Generate(pb.GenerateRequest(prompt=prompt), served), 60)
        held_done_before_release = [task.done() for task in held]
        tokenizer.release.set()
        replies = await asyncio.gather(*held)
        again = await service.Tokenize(pb.TokenizeRequest(text=long_text), Context())
        return refused, short, served, held_done_before_release, replies, again

    try:
        refused, short, served, held_done, replies, again = asyncio.run(scenario())
    finally:
        tokenizer.release.set()  # never leave a thread waiting
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        "2 Tokenize or Detokenize calls" in refused.details
        and "max_tokenize_calls" in refused.details
    )
    # A short text never waits behind them: it is encoded on the loop.
    assert short is not None and list(short.token_ids) == [5]
    assert served.code is None and served.written[-1].finish_reason == pb.LENGTH
    assert held_done == [False, False]
    assert all(len(reply.token_ids) > 0 for reply in replies)
    assert again is not None and service._tokenize_rpcs.num_calls == 0


@pytest.mark.parametrize("remaining_s", [None, 7.5])
def test_the_caller_s_deadline_reaches_the_core(remaining_s):
    """The call's time remaining becomes the request's time limit (the deadline policy
    orders by it); a call without a deadline has none."""
    from pagoda.scheduler_svc.core import FinishReason, RequestOutput, Timings, Usage
    from pagoda.scheduler_svc.output_streams import OutputSlot

    class ServingLoop(FakeLoop):
        def __init__(self) -> None:
            super().__init__(num_waiting=0)
            self.submitted = []

        def submit(self, valid):
            self.submitted.append(valid)
            slot = OutputSlot(valid.request_id)
            slot.publish(
                RequestOutput(
                    valid.request_id, "a", [5], None, FinishReason.LENGTH,
                    usage=Usage(1, 1, 0, 0), timings=Timings(0.0, 1.0, 1.0),
                )
            )  # fmt: skip
            return slot

        def release(self, slot):
            pass

    class DeadlineContext(Context):
        def peer(self) -> str:
            return "peer"

        async def write(self, message) -> None:
            pass

    loop = ServingLoop()
    service = GenerationServicer(loop, Metrics(), CountingTokenizer(), ServiceConfig(), "m")
    context = DeadlineContext()
    context.remaining_s = remaining_s
    asyncio.run(service.Generate(pb.GenerateRequest(prompt="hi"), context))
    assert [valid.time_limit_s for valid in loop.submitted] == [remaining_s]
