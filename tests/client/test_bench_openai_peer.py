"""The OpenAI peer of `make bench` without a server: `--peer openai...` parsing, the request
body, and how stream events become the chunks `summarize` reads (token counts per event)."""

from __future__ import annotations

import pytest

from benchmarks.openai_peer import (
    EventCounter,
    OpenAIPeer,
    OpenAIPeerError,
    completions_body,
    parse_peer,
)
from benchmarks.scenarios import ALL_PEERS, PEER_LLAMA, PEER_LLAMA_OPENAI
from benchmarks.suite import main, openai_peers, parse_args, selected_peers
from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_report import RequestResult


def test_peer_flags_name_a_label_and_a_url():
    args = parse_args(
        ["--peer", "openai=http://127.0.0.1:8000/v1/",
         "--peer", "openai:vllm=https://gpu.example:8000", "--peer", "llama-server"]
    )  # fmt: skip
    assert openai_peers(args) == [
        OpenAIPeer("openai", "http://127.0.0.1:8000"),
        OpenAIPeer("openai:vllm", "https://gpu.example:8000"),
    ]
    assert selected_peers(args) == (PEER_LLAMA,)
    only_servers = parse_args(["--peer", "openai:front=http://h:1"])
    assert selected_peers(only_servers) == () and len(openai_peers(only_servers)) == 1
    assert openai_peers(parse_args(["--no-peers", "--peer", "openai=http://h:1"])) == []
    assert openai_peers(parse_args([])) == [] and selected_peers(parse_args([])) == ALL_PEERS


def test_llama_server_through_v1_only_when_named():
    assert PEER_LLAMA_OPENAI not in selected_peers(parse_args([]))
    args = parse_args(["--peer", "llama-server-openai", "--peer", "llama-server"])
    assert selected_peers(args) == (PEER_LLAMA, PEER_LLAMA_OPENAI)


@pytest.mark.parametrize("value", ["openai", "openai:x", "vllm=http://h:1", "openai=h:1"])
def test_bad_peer_values_are_usage_errors(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--peer", value])
    assert "--peer" in capsys.readouterr().err
    with pytest.raises(ValueError):
        parse_peer(value)


def test_two_servers_with_one_label_are_refused(capsys):
    assert main(["--list", "--peer", "openai=http://a:1", "--peer", "openai=http://b:1"]) == 2
    assert "share a label" in capsys.readouterr().err


def test_list_names_the_openai_peer(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "openai[:LABEL]=URL" in out and "llama-server-openai" in out


def test_body_asks_what_the_load_generator_asks():
    config = BenchConfig(max_new_tokens=9, ignore_eos=True)
    body = completions_body([1, 2], config, 3, "m")
    assert body == {
        "prompt": [1, 2], "max_tokens": 9, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True, "model": "m",
        "ignore_eos": True,
    }  # fmt: skip
    sampled = completions_body([1], BenchConfig(temperature=0.5, seed=10), 3, None)
    assert sampled["seed"] == 13 and "model" not in sampled and "ignore_eos" not in sampled


def event(text="", token_ids=None, finish_reason=None, usage=None, choices=True):
    choice = {"index": 0, "text": text, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"choices": [choice] if choices else [], "usage": usage}


def test_token_ids_count_each_event_exactly():
    counter = EventCounter(RequestResult(index=0, send_s=0.0), num_prompt_tokens=4)
    counter.on_event(event("ab", [7, 8]), 0.5)
    counter.on_event(event("", []), 0.6)  # nothing new: no chunk
    counter.on_event(event("c", [9], finish_reason="length"), 0.7)
    usage = {"prompt_tokens": 4, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
    counter.on_event(event(usage=usage, choices=False), 0.8)
    counter.finish(0.9)
    result = counter.result
    assert (result.chunk_times_s, result.chunk_num_tokens) == ([0.5, 0.7], [2, 1])
    assert result.ok and result.finish_reason == "length" and result.end_s == 0.9
    assert (result.usage.completion_tokens, result.usage.cached_prompt_tokens) == (3, 2)


def test_without_token_ids_each_text_event_is_one_token_and_usage_settles_the_rest():
    counter = EventCounter(RequestResult(index=0, send_s=0.0), num_prompt_tokens=4)
    for k, text in enumerate(["a", "", "b", "c"]):
        counter.on_event(event(text), 0.1 * (k + 1))
    counter.on_event(event("", finish_reason="stop"), 0.5)
    counter.on_event(event(usage={"prompt_tokens": 4, "completion_tokens": 5}, choices=False), 0.6)
    counter.finish(0.6)
    assert counter.result.chunk_num_tokens == [1, 1, 3]
    assert counter.result.usage.completion_tokens == 5


def test_a_server_without_usage_still_gets_its_counts():
    counter = EventCounter(RequestResult(index=0, send_s=0.0), num_prompt_tokens=6)
    counter.on_event(event("a", finish_reason="length"), 0.1)
    counter.finish(0.2)
    assert (counter.result.usage.prompt_tokens, counter.result.usage.completion_tokens) == (6, 1)


def test_error_events_and_broken_streams_fail_the_request():
    counter = EventCounter(RequestResult(index=0, send_s=0.0), num_prompt_tokens=1)
    with pytest.raises(OpenAIPeerError, match="overloaded"):
        counter.on_event({"error": {"message": "overloaded"}}, 0.1)
    counter.on_event(event("a"), 0.2)
    with pytest.raises(OpenAIPeerError, match="finish_reason"):
        counter.finish(0.3)
