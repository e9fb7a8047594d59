"""The HTTP routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses,
vLLM's /tokenize and /detokenize, and /health.

Each request is translated (translation.py), sent as gRPC calls with the caller's bearer
key (upstream.py) and answered in OpenAI's shapes, whole (responses.py) or as server-sent
events (stream_events.py, written by streaming.py); the Responses API has its own
translation and shapes (responses_api/). A streamed response begins only once every call
has produced its first chunk, so a request the scheduler refuses gets its HTTP status,
not a 200 stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pagoda.client.errors import PagodaError
from pagoda.client.results import Chunk
from pagoda.openai_front import responses, stream_events
from pagoda.openai_front.body_limit import BodyLimit
from pagoda.openai_front.config import FrontConfig
from pagoda.openai_front.errors import (
    FrontError,
    from_pagoda,
    in_endpoint_terms,
    invalid,
    model_not_found,
    param_for,
)
from pagoda.openai_front.responses import Choice, Header
from pagoda.openai_front.responses_api.events import ResponseEvents
from pagoda.openai_front.responses_api.output import ResponseHead, echoed_settings, whole_response
from pagoda.openai_front.responses_api.schema import ResponsesRequest
from pagoda.openai_front.responses_api.translation import plan_response
from pagoda.openai_front.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Endpoint,
    TokenizeRequest,
)
from pagoda.openai_front.streaming import (
    DONE_EVENT,
    ClientGone,
    Events,
    error_event,
    fan_out,
    replay,
    sse,
    until_disconnected,
)
from pagoda.openai_front.translation import Call, Plan, plan_chat, plan_completion
from pagoda.openai_front.upstream import Upstream, call_metadata

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before the answer; never read
# Path -> the endpoint family whose body names a refused field (errors.param_for).
_ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
}


def request_metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata of an HTTP request: its bearer key and its traceparent."""
    headers = request.headers
    return call_metadata(headers.get("authorization"), headers.get("traceparent"))


def build_app(config: FrontConfig, upstream: Upstream) -> Any:
    """The ASGI application: FastAPI behind the body-size guard."""
    started_s = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        upstream.open()
        try:
            yield
        finally:
            await upstream.close()

    app = FastAPI(
        title="Pagoda OpenAI-compatible API",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    _install_error_handlers(app)

    async def served_model(requested: str | None, metadata: tuple) -> str:
        info = await upstream.model_info(metadata)
        if requested is None or requested == info.model_id:
            return info.model_id
        # The scheduler may have restarted with another model since the cached answer.
        info = await upstream.model_info(metadata, fresh=True)
        if requested == info.model_id:
            return info.model_id
        if not info.worker_connected:
            # Before its first worker the scheduler knows no model id: not a 404; the call
            # itself gets the scheduler's answer (UNAVAILABLE, or it waits for a worker).
            return requested
        raise model_not_found(requested)

    @app.get("/health")
    async def health() -> Response:
        if await upstream.serving():
            return JSONResponse({"status": "serving", "target": upstream.target})
        error = FrontError(
            503,
            f"the scheduler at {upstream.target} is not serving",
            "server_error",
            code="service_unavailable",
        )
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        metadata = request_metadata(request)
        info = await upstream.model_info(metadata, fresh=True)
        return {"object": "list", "data": [_model_card(info, started_s)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        metadata = request_metadata(request)
        info = await upstream.model_info(metadata, fresh=True)
        if model_id != info.model_id:
            raise model_not_found(model_id)
        return _model_card(info, started_s)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        """vLLM's extension: a prompt's token ids, as the scheduler's Tokenize gives them."""
        metadata = request_metadata(request)
        await served_model(body.model, metadata)
        reply = await upstream.tokenize(body.prompt, body.add_special_tokens, metadata)
        info = await upstream.model_info(metadata)
        return {
            "count": len(reply.token_ids),
            "max_model_len": info.max_context_tokens,
            "tokens": list(reply.token_ids),
            "token_strs": list(reply.tokens) if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        """vLLM's extension: token ids back to text (special tokens kept)."""
        metadata = request_metadata(request)
        await served_model(body.model, metadata)
        reply = await upstream.detokenize(body.tokens, metadata)
        return {"prompt": reply.text}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return await serve(request, body, "completions", request_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await serve(request, body, "chat", request_id)

    async def serve(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        endpoint: Endpoint,
        request_id: str,
    ) -> Response:
        metadata = request_metadata(request)
        if isinstance(body, ChatCompletionRequest):
            plan = plan_chat(body, request_id, config.max_n)
        else:
            plan = plan_completion(body, request_id, config.max_n)
        model = await served_model(body.model, metadata)
        header = Header(request_id, int(time.time()), model, endpoint)
        events = start(plan, metadata)
        if not body.stream:
            choices = await until_disconnected(request.receive, _collect(events, plan))
            return JSONResponse(responses.whole_response(header, choices, plan.num_top_logprobs))
        first = await until_disconnected(request.receive, _first_chunks(events, plan))
        return _event_source(_event_stream(header, plan, first, events))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        response_id = f"resp_{uuid.uuid4().hex}"
        metadata = request_metadata(request)
        plan = plan_response(body, response_id)
        model = await served_model(body.model, metadata)
        head = ResponseHead(response_id, int(time.time()), model, echoed_settings(body))
        events = start(plan, metadata)
        if not body.stream:
            (choice,) = await until_disconnected(request.receive, _collect(events, plan))
            return JSONResponse(whole_response(head, choice))
        first = await until_disconnected(request.receive, _first_chunks(events, plan))
        return _event_source(_response_event_stream(head, first, events))

    def start(plan: Plan, metadata: tuple) -> Events:
        """The plan's gRPC calls, started, read as one (closing it cancels them all)."""
        streams = []
        try:
            for call in plan.calls:
                streams.append((call, upstream.stream(call, metadata)))
        except BaseException:
            for _, stream in streams:
                stream.cancel()
            raise
        return fan_out(streams)

    return BodyLimit(app, config.max_body_bytes)


def _event_source(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _model_card(info: Any, created_s: int) -> dict[str, Any]:
    return {
        "id": info.model_id,
        "object": "model",
        "created": created_s,
        "owned_by": "pagoda",
        "max_model_len": info.max_context_tokens,
    }


def _choices(plan: Plan) -> dict[int, Choice]:
    """Each choice of the plan by its index (a call of n serves n of them)."""
    return {
        index: Choice(call, index - call.choice_index)
        for call in plan.calls
        for index in call.choice_indices
    }


async def _collect(events: Events, plan: Plan) -> list[Choice]:
    choices = _choices(plan)
    async with aclosing(events):
        async for call, chunk in events:
            choices[call.choice_index + chunk.index].add(chunk)
    return list(choices.values())


async def _first_chunks(events: Events, plan: Plan) -> list[tuple[Call, Chunk]]:
    """Read until every call has sent a chunk (a refused call raises its error here)."""
    waiting = {call.choice_index for call in plan.calls}  # a call is refused whole
    first: list[tuple[Call, Chunk]] = []
    while waiting:
        try:
            call, chunk = await anext(events)
        except StopAsyncIteration:
            break
        first.append((call, chunk))
        waiting.discard(call.choice_index)
    return first


async def _event_stream(
    header: Header, plan: Plan, first: list[tuple[Call, Chunk]], events: Events
) -> AsyncIterator[str]:
    choices = _choices(plan)
    started: set[int] = set()
    async with aclosing(events):
        try:
            async for call, chunk in replay(first, events):
                index = call.choice_index + chunk.index
                if header.endpoint == "chat" and index not in started:
                    started.add(index)
                    yield sse(stream_events.role_event(header, index, plan.include_usage))
                choice = choices[index]
                choice.add(chunk)
                for event in stream_events.chunk_events(
                    header,
                    call,
                    chunk,
                    plan.num_top_logprobs,
                    plan.include_usage,
                    len(choice.call_offsets),
                ):
                    yield sse(event)
            if plan.include_usage:
                yield sse(stream_events.usage_event(header, choices.values()))
        except FrontError as error:
            yield error_event(error)
        yield DONE_EVENT


async def _response_event_stream(
    head: ResponseHead, first: list[tuple[Call, Chunk]], events: Events
) -> AsyncIterator[str]:
    """The Responses API's stream: typed events, no [DONE]."""
    stream = ResponseEvents(head)
    async with aclosing(events):
        try:
            for event in stream.opening():
                yield event
            async for _, chunk in replay(first, events):
                for event in stream.chunk(chunk):
                    yield event
        except FrontError as error:
            yield stream.error(error)


def _install_error_handlers(app: FastAPI) -> None:
    def reply(error: FrontError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    def named(error: FrontError, request: Request) -> FrontError:
        """A scheduler's refusal in the terms of the endpoint called: `param` named for
        the field it refused, the fields its sentence names spelled as the body does."""
        if error.refused_field is not None:
            endpoint = _ENDPOINTS.get(request.url.path)
            if error.param is None:
                error.param = param_for(error.refused_field, endpoint)
            error.message = in_endpoint_terms(error.message, endpoint)
        return error

    @app.exception_handler(FrontError)
    async def front_error(request: Request, error: FrontError) -> JSONResponse:
        return reply(named(error, request))

    @app.exception_handler(PagodaError)
    async def pagoda_error(request: Request, error: PagodaError) -> JSONResponse:
        return reply(named(from_pagoda(error), request))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, error: RequestValidationError) -> JSONResponse:
        problem = error.errors()[0] if error.errors() else {}
        kind = problem.get("type")
        if kind == "json_invalid":  # its location is a character offset, not a field
            reason = problem.get("ctx", {}).get("error", "")
            where = f" at character {problem['loc'][-1]}" if len(problem["loc"]) > 1 else ""
            return reply(
                invalid(f"the request body is not valid JSON{where}: {reason}".rstrip(": "))
            )
        location = [str(part) for part in problem.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        message = problem.get("msg", "the request body is not valid")
        if kind == "model_attributes_type":
            message = "the request body must be a JSON object"
        where = f"{param}: " if param else ""
        return reply(invalid(f"{where}{message}", param))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return reply(FrontError(error.status_code, str(error.detail), kind))
