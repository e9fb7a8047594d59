"""n > 1 end to end (issue 28 item 4): a scheduler, a tiny random-weight model on a real
worker, and the gRPC API. One call's samples stream tagged with their index, share the
prompt's KV blocks (their cached_prompt_tokens show it), and give what n = 1 gives; seeded
samples are distinct and the same on a rerun; cancelling the call frees every block."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from pagoda.client import Client
from pagoda.protos import generation_pb2 as pb
from tests.e2e.conftest import running_service, wait_until

pytestmark = pytest.mark.slow

PROMPT_IDS = [(7 * index) % 500 + 10 for index in range(45)]
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=[[], ["--no-prefix-caching"]], ids=["cache", "no-cache"])
def service(request, tiny_model_factory, tmp_path_factory):
    with running_service(
        tmp_path_factory.mktemp("samples"),
        model=str(tiny_model_factory("llama")),
        scheduler_args=["--max-n", "4", *request.param],
    ) as running:
        yield running


def generate(service, n: int, sampling: pb.SamplingParams | None = None, **stopping):
    stopping.setdefault("max_new_tokens", MAX_NEW_TOKENS)
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT_IDS),
        sampling=sampling or pb.SamplingParams(),
        stopping=pb.StoppingCriteria(ignore_eos=True, **stopping),
        n=n,
        request_id="call",
    )
    with service.channel() as channel:
        return list(service.stub(channel).Generate(request, timeout=300))


def by_index(responses) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for response in responses:
        tokens.setdefault(response.index, []).extend(response.token_ids)
    return tokens


def test_greedy_samples_equal_one_sample_and_share_the_prompt(service):
    with service.channel() as channel:
        block_size = service.stub(channel).GetModelInfo(pb.ModelInfoRequest()).block_size
    (single,) = by_index(generate(service, 1)).values()
    responses = generate(service, 4)
    assert {r.request_id for r in responses} == {"call"}
    assert by_index(responses) == {index: single for index in range(4)}
    finals = [r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(r.index for r in finals) == [0, 1, 2, 3]
    assert all(r.finish_reason == pb.LENGTH for r in finals)
    # The siblings hit the prompt's full blocks that sample 0 computed.
    shared = (len(PROMPT_IDS) - 1) // block_size * block_size
    cached = sorted(r.usage.cached_prompt_tokens for r in finals if r.index > 0)
    assert cached == [shared] * 3 and shared > 0
    # The last message carries the call's usage: the prompt once, completions summed.
    assert [r.HasField("total_usage") for r in responses].count(True) == 1
    total = responses[-1].total_usage
    assert (total.prompt_tokens, total.completion_tokens) == (len(PROMPT_IDS), 4 * MAX_NEW_TOKENS)


def test_seeded_samples_are_distinct_and_reproducible(service):
    sampling = pb.SamplingParams(temperature=1.0, seed=7)
    first = by_index(generate(service, 3, sampling))
    assert len(first) == 3 and len({tuple(tokens) for tokens in first.values()}) == 3
    assert by_index(generate(service, 3, sampling)) == first
    # Sample i draws with seed + i: sample 1 of seed 7 is sample 0 of seed 8.
    (seed_8,) = by_index(generate(service, 1, pb.SamplingParams(temperature=1.0, seed=8))).values()
    assert first[1] == seed_8


def test_n_above_max_n_is_invalid_argument(service):
    with pytest.raises(grpc.RpcError) as caught:
        generate(service, 5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 4 (the server's --max-n)" in caught.value.details()


def test_cancelling_the_call_frees_every_sample(service):
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT_IDS),
        stopping=pb.StoppingCriteria(max_new_tokens=200, ignore_eos=True),
        n=4,
    )
    with service.channel() as channel:
        stub = service.stub(channel)
        call = stub.Generate(request, timeout=300)
        seen = set()
        for response in call:
            seen.add(response.index)
            if len(seen) == 4:
                break
        call.cancel()

        def freed() -> bool:
            stats = stub.GetServerStats(pb.ServerStatsRequest())
            return (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)

        wait_until(freed, 30, "every sample's blocks freed")


def test_the_client_and_the_cli_give_n_samples(service):
    with Client(service.address) as client:
        samples = client.complete_samples(PROMPT_IDS, n=3, max_new_tokens=4, ignore_eos=True)
    assert [sample.index for sample in samples] == [0, 1, 2]
    assert all(
        len(sample.token_ids) == 4 and sample.finish_reason == "length" for sample in samples
    )
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.client", "--target", service.address, "generate",
         "--raw", "--n", "3", "--max-new-tokens", "4", "--ignore-eos", "Once upon a time"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("--- sample")]
    assert headers == ["--- sample 0 ---", "--- sample 1 ---", "--- sample 2 ---"]
