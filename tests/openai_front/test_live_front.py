"""pagoda-openai in front of a real scheduler and dummy worker, driven by the official
`openai` client and by raw HTTP: both endpoints streamed and not, usage, logprobs, n, error
shapes and statuses, and a client that goes away cancelling its gRPC request."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import free_port, stop_process, wait_until
from tests.openai_front.conftest import API_KEY, METADATA, start_front

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three rivers."}]
NUM_TOKENS = 6
# The dummy worker may sample its EOS; the front passes vLLM's ignore_eos extension on.
KEEP_GOING = {"ignore_eos": True}


@pytest.fixture(scope="module")
def sdk(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(sdk) -> str:
    return sdk.models.list().data[0].id


def sse_events(lines) -> list:
    """The JSON events of an SSE body, and "[DONE]" as itself."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_lists_the_served_model(front, sdk):
    models = sdk.models.list().data
    with front.service.channel() as channel:
        info = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(
            generation_pb2.ModelInfoRequest(), metadata=METADATA
        )
    assert [m.id for m in models] == [info.model_id]
    assert sdk.models.retrieve(info.model_id).id == info.model_id


def test_chat_whole_and_streamed_agree_with_usage(sdk, model):
    whole = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=NUM_TOKENS, temperature=0, extra_body=KEEP_GOING
    )
    choice = whole.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == NUM_TOKENS
    assert whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + NUM_TOKENS
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"

    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_completion_tokens=NUM_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=KEEP_GOING,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NUM_TOKENS
    # The same prompt again: its blocks were cached by the first request.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_whole_and_streamed_agree(sdk, model):
    whole = sdk.completions.create(
        model=model,
        prompt="The sea is",
        max_tokens=NUM_TOKENS,
        temperature=0,
        extra_body=KEEP_GOING,
    )
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == NUM_TOKENS
    streamed = list(
        sdk.completions.create(
            model=model,
            prompt="The sea is",
            max_tokens=NUM_TOKENS,
            temperature=0,
            stream=True,
            extra_body=KEEP_GOING,
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in streamed)  # no include_usage: no usage event


def test_stream_ends_with_done(front, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 3, "stream": True, **KEEP_GOING}
    with front.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text.splitlines())
    assert events[-1] == "[DONE]"
    assert all(isinstance(e, dict) for e in events[:-1])


def grpc_text(front, rpc: str, request) -> str:
    with front.service.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        responses = getattr(stub, rpc)(request, timeout=60, metadata=METADATA)
        return "".join(r.text for r in responses)


def test_greedy_text_equals_the_grpc_streams(front, sdk, model):
    stopping = generation_pb2.StoppingCriteria(max_new_tokens=12, ignore_eos=True)
    generated = grpc_text(
        front, "Generate", generation_pb2.GenerateRequest(prompt="Once upon", stopping=stopping)
    )
    completion = sdk.completions.create(
        model=model, prompt="Once upon", max_tokens=12, temperature=0, extra_body=KEEP_GOING
    )
    assert completion.choices[0].text == generated

    chat_request = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(**m) for m in MESSAGES], stopping=stopping
    )
    chatted = grpc_text(front, "Chat", chat_request)
    chat = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0, extra_body=KEEP_GOING
    )
    assert chat.choices[0].message.content == chatted


def test_n_choices_whole_and_streamed(sdk, model):
    whole = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, n=3, seed=11, extra_body=KEEP_GOING
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 3 * 4
    single = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, extra_body=KEEP_GOING
    )
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once

    chunks = list(
        sdk.completions.create(
            model=model,
            prompt=["one", "two"],
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=KEEP_GOING,
        )
    )
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == 4 * 3


def test_logprobs_of_both_endpoints(sdk, model):
    chat = sdk.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=NUM_TOKENS,
        logprobs=True,
        top_logprobs=2,
        extra_body=KEEP_GOING,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == NUM_TOKENS
    # Each token's text, sent by the scheduler (the gRPC logprobs carry it).
    assert all(entry.bytes and not entry.token.startswith("token_id:") for entry in content)
    assert all(len(entry.top_logprobs) == 2 for entry in content)

    completion = sdk.completions.create(
        model=model, prompt="Hi", max_tokens=NUM_TOKENS, logprobs=0, extra_body=KEEP_GOING
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == NUM_TOKENS
    assert logprobs.top_logprobs == [{}] * NUM_TOKENS

    plain = sdk.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, extra_body=KEEP_GOING
    )
    assert plain.choices[0].logprobs is None


def test_tokenize_and_detokenize_as_vllm_serves_them(front, model):
    with front.client() as http:
        tokens = http.post(
            "/tokenize", json={"model": model, "prompt": "Hello world", "return_token_strs": True}
        )
        assert tokens.status_code == 200, tokens.text
        body = tokens.json()
        assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) >= 2
        assert body["max_model_len"] > 0
        text = http.post("/detokenize", json={"model": model, "tokens": body["tokens"]})
        assert text.json() == {"prompt": "Hello world"}
        beyond = http.post("/detokenize", json={"tokens": [10**9]})
        assert beyond.status_code == 400
        assert "beyond the vocabulary" in beyond.json()["error"]["message"]
        assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_errors_have_openai_shape_and_status(front, sdk, model):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=model, messages=MESSAGES, temperature=-1)
    assert "temperature" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found"
    wrong_key = openai.OpenAI(base_url=f"{front.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.chat.completions.create(model=model, messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    with pytest.raises(openai.BadRequestError) as caught:  # the scheduler's own check
        sdk.chat.completions.create(model=model, messages=MESSAGES, logit_bias={"42": 101})
    assert "logit_bias" in caught.value.body["message"]
    assert caught.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as caught:  # named as this endpoint names it
        sdk.chat.completions.create(model=model, messages=MESSAGES, top_logprobs=100, logprobs=True)
    assert caught.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as caught:  # the scheduler compiles it
        sdk.chat.completions.create(
            model=model,
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        )
    # In this endpoint's terms, not the gRPC request's (constraint.json_schema).
    assert caught.value.body["message"].startswith("response_format is invalid")
    assert caught.value.body["param"] == "response_format"
    for unsupported in ({"functions": [{"name": "f"}]}, {"tools": [{"type": "web_search"}]}):
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(model=model, messages=MESSAGES, **unsupported)
        assert caught.value.body["code"] == "unsupported_parameter"

    with front.client() as http:
        # A refused streamed request gets its status before any event, not a 200 stream.
        refused = http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": MESSAGES, "stream": True, "top_p": 5},
        )
        assert refused.status_code == 400
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        bad_json = http.post(
            "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert bad_json.status_code == 400
        assert bad_json.json()["error"]["param"] is None
        assert bad_json.json()["error"]["message"].startswith(
            "the request body is not valid JSON at character 1: "
        )
        not_an_object = http.post("/v1/completions", json=["prompt"])
        assert not_an_object.json()["error"]["message"] == "the request body must be a JSON object"
        missing = http.post("/v1/completions", json={"model": model})
        assert (missing.status_code, missing.json()["error"]["param"]) == (400, "prompt")
        too_big = http.post("/v1/completions", content=b"x" * (9 * 1024 * 1024))
        assert too_big.status_code == 413
        # A chunked body could grow without bound before it is parsed: a length is required.
        chunked = http.post("/v1/completions", content=iter([b'{"prompt": "hi"}']))
        assert chunked.status_code == 411


def wait_idle(front) -> None:
    wait_until(
        lambda: (s := front.stats()).num_running == 0 and s.num_waiting == 0,
        30,
        "the scheduler to hold no request",
    )


def test_a_streaming_client_that_goes_away_cancels_its_request(front, model):
    wait_idle(front)
    # 5000 tokens at DUMMY_STEP_MS a step would run for minutes.
    body = {"model": model, "prompt": "Tell", "max_tokens": 5000, "stream": True, **KEEP_GOING}
    with front.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events = sse_events(line for line, _ in zip(lines, range(6), strict=False))
        assert events
        assert front.stats().num_running == 1
    # The connection is closed: the front cancels the gRPC call, the scheduler frees it.
    wait_idle(front)


def test_a_waiting_whole_response_client_that_goes_away_cancels_its_request(front, model):
    wait_idle(front)
    body = {"model": model, "messages": MESSAGES, "max_tokens": 5000, **KEEP_GOING}
    timeout = httpx.Timeout(60, read=1.0)
    with front.client(timeout=timeout) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body)
    wait_idle(front)


def test_health_follows_the_scheduler(front):
    with front.client(api_key=None) as http:
        assert http.get("/health").status_code == 200


def test_grpc_refusal_maps_to_http_status(front, model):
    """An empty prompt is the scheduler's INVALID_ARGUMENT, passed on as a 400 sentence."""
    with front.client() as http:
        response = http.post("/v1/completions", json={"model": model, "prompt": ""})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_an_unreachable_scheduler_is_503(tmp_path):
    """A front whose target does not answer says so: UNAVAILABLE becomes 503."""
    target = f"127.0.0.1:{free_port()}"
    process, url = start_front(target, tmp_path / "front.log", serving=False)
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/health").status_code == 503
            response = http.get("/v1/models")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "service_unavailable"
    finally:
        stop_process(process)


def test_response_format_on_the_dummy_worker_gives_schema_valid_json(sdk, model):
    """The dummy worker takes the next allowed id of each mask, so the grammar alone makes
    its output JSON: the masks reach a real worker process and end the request."""
    schema = {
        "type": "object",
        "properties": {"river": {"enum": ["Nile", "Rhine", "Amazon"]}, "long": {"type": "boolean"}},
        "required": ["river", "long"],
        "additionalProperties": False,
    }
    reply = sdk.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop"
    value = json.loads(reply.choices[0].message.content)
    assert value["river"] in ("Nile", "Rhine", "Amazon") and isinstance(value["long"], bool)
