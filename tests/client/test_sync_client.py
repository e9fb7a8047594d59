"""The blocking Client against the fake server."""

from __future__ import annotations

import threading

import pytest

from pagoda.client import Chunk, Client, Completion
from pagoda.client.errors import DeadlineExceededError, InvalidArgumentError, UnauthenticatedError
from tests.client.conftest import TEST_API_KEY
from tests.client.fake_server import MODEL_INFO


def test_generate_streams_chunks_in_order(fake_server):
    with Client(fake_server.target) as client:
        chunks = list(client.generate("one two three", max_new_tokens=3, logprobs=2))
    assert all(isinstance(chunk, Chunk) for chunk in chunks)
    assert [chunk.text for chunk in chunks] == [" t0", " t1", " t2", ""]
    assert [chunk.token_ids for chunk in chunks[:3]] == [[1000], [1001], [1002]]
    assert [chunk.is_last for chunk in chunks] == [False, False, False, True]
    assert chunks[0].logprobs[0].top_token_ids == [1000, 1001]
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 3)
    assert last.timings.total_ms >= last.timings.first_token_ms >= 0


def test_generate_sends_every_option(fake_server):
    with Client(fake_server.target) as client:
        text = client.complete(
            "echo", temperature=0.5, top_k=7, seed=11, stop=["END"], ignore_eos=True, priority=2
        ).text
    request = fake_server.servicer.last_request("Generate")
    assert request.sampling.top_k == 7 and request.sampling.seed == 11
    assert list(request.stopping.stop) == ["END"] and request.priority == 2
    # The fake echoes the request it received, so the text shows the wire form too.
    assert "top_k: 7" in text and 'stop: "END"' in text and "ignore_eos: true" in text


def test_complete_joins_the_stream(fake_server):
    with Client(fake_server.target) as client:
        completion = client.complete([5, 6, 7, 8], max_new_tokens=5, request_id="joined")
    assert isinstance(completion, Completion)
    assert completion.text == " t0 t1 t2 t3 t4"
    assert completion.token_ids == [1000, 1001, 1002, 1003, 1004]
    assert (completion.request_id, completion.finish_reason) == ("joined", "length")
    assert completion.usage.prompt_tokens == 4 and completion.timings is not None


def test_chat_sends_the_conversation(fake_server):
    messages = [{"role": "system", "content": "Be brief."}, ("user", "Hello there")]
    with Client(fake_server.target) as client:
        text = "".join(chunk.text for chunk in client.chat(messages, max_new_tokens=50))
    assert text == "(2 messages) you said: Hello there"
    request = fake_server.servicer.last_request("Chat")
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "Hello there"),
    ]
    assert request.stopping.max_new_tokens == 50


def test_tokenize_info_and_stats(fake_server):
    with Client(fake_server.target) as client:
        assert client.tokenize("hi") == [104, 105]
        assert client.tokenize("hi", add_special_tokens=True) == [1, 104, 105]
        info = client.model_info()
        stats = client.server_stats()
    assert (info.model_id, info.block_size, info.eos_token_ids) == ("fake-model", 16, [2])
    assert info.num_kv_tokens == MODEL_INFO.num_kv_tokens and info.worker_connected
    assert stats.num_kv_blocks_total == 128 and stats.worker_incarnation_id == "fake-incarnation"
    assert stats.num_requests_finished >= 0 and stats.prefix_cache_hit_rate == 0.25


def test_breaking_out_of_generate_cancels_the_rpc(fake_server):
    with Client(fake_server.target) as client:
        for chunk in client.generate("hang", request_id="sync-break"):
            assert chunk.text == " t0"
            break
        assert fake_server.servicer.wait_cancelled("sync-break", timeout_s=10)


def test_close_and_with_block_cancel_the_rpc(fake_server):
    with Client(fake_server.target) as client:
        stream = client.chat([("user", "hang")], request_id="sync-close")
        next(stream)
        stream.close()
        assert fake_server.servicer.wait_cancelled("sync-close", timeout_s=10)
        assert list(stream) == []
        with client.generate("hang", request_id="sync-with") as stream:
            next(stream)
        assert fake_server.servicer.wait_cancelled("sync-with", timeout_s=10)


def test_cancel_from_another_thread_ends_the_stream(fake_server):
    with Client(fake_server.target) as client:
        stream = client.generate("hang", request_id="sync-thread")
        next(stream)
        threading.Timer(0.05, stream.cancel).start()
        assert list(stream) == []
        assert fake_server.servicer.wait_cancelled("sync-thread", timeout_s=10)


def test_timeout_s_is_the_stream_deadline(fake_server):
    with Client(fake_server.target, timeout_s=0.3) as client, pytest.raises(DeadlineExceededError):
        list(client.generate("hang", request_id="sync-deadline"))


def test_invalid_options_fail_before_sending(fake_server):
    with Client(fake_server.target) as client, pytest.raises(InvalidArgumentError):
        client.generate("x", max_new_tokens=-2)


def test_bearer_key_is_sent(auth_server):
    with Client(auth_server.target, api_key=TEST_API_KEY) as client:
        assert client.complete("hi", max_new_tokens=1).text == " t0"
        assert client.model_info().model_id == "fake-model"
    metadata = auth_server.servicer.requests[-1].metadata
    assert metadata["authorization"] == f"Bearer {TEST_API_KEY}"
    with Client(auth_server.target, api_key="wrong") as client, pytest.raises(UnauthenticatedError):
        client.complete("hi")
    with Client(auth_server.target) as client, pytest.raises(UnauthenticatedError):
        client.tokenize("hi")


def test_wait_ready_returns_when_serving(fake_server):
    with Client(fake_server.target) as client:
        client.wait_ready(timeout_s=5)


def test_wait_ready_times_out_while_not_serving(make_server):
    server = make_server()
    server.set_serving(False)
    with Client(server.target) as client:
        with pytest.raises(DeadlineExceededError, match="NOT_SERVING"):
            client.wait_ready(timeout_s=0.3)
        threading.Timer(0.2, server.set_serving, args=(True,)).start()
        client.wait_ready(timeout_s=10)


def test_wait_ready_times_out_without_a_server():
    with Client("127.0.0.1:1") as client, pytest.raises(DeadlineExceededError):
        client.wait_ready(timeout_s=0.3)
