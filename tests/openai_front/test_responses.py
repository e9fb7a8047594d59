"""Chunks -> OpenAI JSON, and the fan-out's cancellation, without processes."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.client.results import Chunk, TokenLogprob, Usage
from pagoda.openai_front import responses
from pagoda.openai_front.errors import FrontError
from pagoda.openai_front.responses import Choice, Header
from pagoda.openai_front.streaming import ClientGone, fan_out, until_disconnected
from pagoda.openai_front.translation import Call

ENTRY = TokenLogprob(token_id=7, logprob=-0.5, top_token_ids=[7, 8], top_logprobs=[-0.5, -1.5])


def call(choice_index: int, prompt_index: int = 0) -> Call:
    return Call(choice_index, prompt_index, "p", None, {})


def last_chunk(text: str, usage: Usage, reason: str = "length") -> Chunk:
    return Chunk("r", text, [1], None, reason, usage, None)


def test_usage_counts_each_prompt_once_and_every_completion():
    choices = []
    for index, prompt_index in [(0, 0), (1, 0), (2, 1)]:
        choice = Choice(call(index, prompt_index))
        choice.add(last_chunk("x", Usage(10 + prompt_index, 3, 4)))
        choices.append(choice)
    assert responses.usage_json(choices) == {
        "prompt_tokens": 21,
        "completion_tokens": 9,
        "total_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_whole_response_orders_choices_by_index():
    header = Header("chatcmpl-1", 5, "m", "chat")
    second, first = Choice(call(1)), Choice(call(0))
    second.add(last_chunk("b", Usage(2, 1, 0)))
    first.add(last_chunk("a", Usage(2, 1, 0), "stop"))
    body = responses.whole_response(header, [second, first], None)
    assert [c["message"]["content"] for c in body["choices"]] == ["a", "b"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["object"] == "chat.completion" and body["usage"]["total_tokens"] == 4


def test_logprobs_keep_the_asked_alternatives():
    chat = responses.logprobs_json("chat", [ENTRY], num_top=1)
    assert chat == {
        "content": [
            {
                "token": "token_id:7",
                "logprob": -0.5,
                "bytes": None,
                "top_logprobs": [{"token": "token_id:7", "logprob": -0.5, "bytes": None}],
            }
        ]
    }
    legacy = responses.logprobs_json("completions", [ENTRY], num_top=0)
    assert legacy["tokens"] == ["token_id:7"] and legacy["token_logprobs"] == [-0.5]
    assert legacy["top_logprobs"] == [{}]


def test_logprobs_name_tokens_by_their_text_when_the_server_sends_it():
    entry = TokenLogprob(
        7, -0.5, [7, 8], [-0.5, -1.5], b" caf\xc3\xa9", [b" caf\xc3\xa9", b"\xe2\x80"]
    )
    (token,) = responses.logprobs_json("chat", [entry], num_top=2)["content"]
    assert (token["token"], token["bytes"]) == (" café", list(b" caf\xc3\xa9"))
    partial = token["top_logprobs"][1]
    assert partial["bytes"] == [0xE2, 0x80] and partial["token"] == "\ufffd"
    legacy = responses.logprobs_json("completions", [entry], num_top=2)
    assert legacy["tokens"] == [" café"] and list(legacy["top_logprobs"][0]) == [" café", "\ufffd"]


def test_a_server_side_cancel_is_a_503():
    with pytest.raises(FrontError) as caught:
        responses.finish_reason("cancelled")
    assert caught.value.status == 503


class FakeStream:
    """An AsyncChunkStream stand-in: `count` chunks a `delay_s` apart, then the end."""

    def __init__(self, count: int, delay_s: float = 0.0) -> None:
        self.count = count
        self.delay_s = delay_s
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        if self.count == 0:
            raise StopAsyncIteration
        await asyncio.sleep(self.delay_s)
        self.count -= 1
        return Chunk("r", "t", [1], None, None, None, None)

    def cancel(self) -> None:
        self.cancelled = True


def test_fan_out_interleaves_all_streams_to_their_end():
    streams = [(call(0), FakeStream(2)), (call(1), FakeStream(3))]

    async def read() -> list[int]:
        return [c.choice_index async for c, _ in fan_out(streams)]

    indexes = asyncio.run(read())
    assert sorted(indexes) == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("num_calls", [1, 3])
def test_a_disconnect_cancels_every_call_of_the_fan_out(num_calls):
    streams = [(call(i), FakeStream(1000, 0.01)) for i in range(num_calls)]

    async def main() -> None:
        disconnect = asyncio.Event()

        async def receive() -> dict:
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def collect() -> int:
            return len([item async for item in fan_out(streams)])

        asyncio.get_running_loop().call_later(0.05, disconnect.set)
        with pytest.raises(ClientGone):
            await until_disconnected(receive, collect())

    asyncio.run(main())
    assert all(stream.cancelled for _, stream in streams)
