"""N-gram speculation (--speculative-tokens) on real processes: drafted rows through the
scheduler, the socket and the worker give exactly the tokens of decoding one at a time,
on the dummy worker (where prompts are built so that drafts are right) and on a tiny
real model (greedy against transformers' generate(); seeded sampling with logprobs
against the same service without speculation)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.protos import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import running_service
from tests.e2e.test_dummy_service import VOCAB_SIZE, dummy_continuation
from tests.e2e.test_generation import EXACT
from tests.e2e.test_overlap_service import streamed
from tests.e2e.test_tensor_parallel import generate, tiny_model  # noqa: F401

pytestmark = pytest.mark.slow

DRAFTS = ["--speculative-tokens", "4"]


def echoing_prompt(index: int, length: int = 40, num_echoed: int = 6) -> list[int]:
    """A prompt whose last two tokens also open it, followed there by exactly the tokens
    the dummy worker generates after the prompt (a function of the last token and its
    position only): speculation drafts them, and the worker agrees."""
    head = [100 + index, 200 + index]
    echoed, last = [], head[-1]
    for position in range(length - 1, length - 1 + num_echoed):
        last = dummy_next_token(last, position, VOCAB_SIZE)
        echoed.append(last)
    filler = [1000 + 10 * index + k for k in range(length - 2 * len(head) - len(echoed))]
    return [*head, *echoed, *filler, *head]


def test_dummy_worker_streams_drafted_tokens_exactly(tmp_path):
    prompts = [echoing_prompt(index) for index in range(6)]
    requests = [
        generation_pb2.GenerateRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
            stopping=generation_pb2.StoppingCriteria(
                max_new_tokens=10 + index,
                ignore_eos=True,
                # One stops on a token that a draft brings, inside a run of kept samples.
                stop_token_ids=[dummy_continuation(prompt, 4)[2]] if index == 3 else [],
            ),
        )  # fmt: skip
        for index, prompt in enumerate(prompts)
    ]
    with running_service(
        tmp_path, model="dummy", scheduler_args=[*DRAFTS, "--speculative-ngram-min", "2"]
    ) as service:
        results = asyncio.run(streamed(service.address, requests))
        stats = service.stats()
    for index, (request, (tokens, finish)) in enumerate(zip(requests, results, strict=True)):
        expected = dummy_continuation(
            list(request.prompt_token_ids.ids), request.stopping.max_new_tokens
        )
        if index == 3:
            assert (tokens, finish) == (expected[:3], generation_pb2.STOP)
        else:
            assert (tokens, finish) == (expected, generation_pb2.LENGTH)
    # How many are fed depends on the step's price (six decoders at once) and on arrivals
    # (none while a request waits); some are, and kept.
    assert stats.num_draft_tokens >= stats.num_accepted_draft_tokens > 0
    assert stats.num_kv_blocks_used == 0 and stats.num_running == 0


# A tiny random model repeats itself soon: drafts come from its own output too.
REPEATING_PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41, 42], [7, 300, 7, 300]]
NUM_TOKENS = 40


# Penalties per prompt: the worker counts the drafts before each sample point.
PENALTIES = [{}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.4, "frequency_penalty": 0.3}]


async def sampled(address: str, seed: int) -> list[tuple[list[int], list[float]]]:
    async def one(stub, prompt, penalties):
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
            sampling=generation_pb2.SamplingParams(
                temperature=0.8, top_k=20, seed=seed, **penalties
            ),
            stopping=generation_pb2.StoppingCriteria(max_new_tokens=NUM_TOKENS, ignore_eos=True),
            logprobs=3,
        )
        tokens, logprobs = [], []
        async for response in stub.Generate(request, timeout=300):
            tokens.extend(response.token_ids)
            logprobs.extend(entry.logprob for entry in response.logprobs)
        return tokens, logprobs

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(
            *(
                one(stub, prompt, penalties)
                for prompt, penalties in zip(REPEATING_PROMPTS, PENALTIES, strict=True)
            )
        )


def test_tiny_model_gives_the_same_tokens_and_logprobs_with_drafts(tmp_path, tiny_model):  # noqa: F811
    directory, model = tiny_model
    expected = [generate(model, ids, NUM_TOKENS) for ids in REPEATING_PROMPTS]
    runs = {}
    for name, flags in (("plain", []), ("drafted", DRAFTS)):
        log_dir = tmp_path / name
        log_dir.mkdir()
        with running_service(
            log_dir,
            model=str(directory),
            worker_args=[*EXACT, "--device", "cpu"],
            scheduler_args=flags,
        ) as service:
            greedy = asyncio.run(
                streamed(
                    service.address,
                    [
                        generation_pb2.GenerateRequest(
                            prompt_token_ids=generation_pb2.TokenIds(ids=ids),
                            stopping=generation_pb2.StoppingCriteria(
                                max_new_tokens=NUM_TOKENS, ignore_eos=True
                            ),
                        )
                        for ids in REPEATING_PROMPTS
                    ],
                )
            )
            assert [tokens for tokens, _ in greedy] == expected, name
            runs[name] = asyncio.run(sampled(service.address, seed=11))
            stats = service.stats()
        if name == "drafted":
            assert stats.num_accepted_draft_tokens > 0
    assert runs["drafted"] == runs["plain"]


# Constraints whose outputs repeat, so that drafts come from the request's own tokens.
CONSTRAINTS = [
    generation_pb2.Constraint(
        json_schema='{"type": "array", "items": {"type": "boolean"}, "maxItems": 40}'
    ),
    generation_pb2.Constraint(regex="(ab|ba|abc)+"),
    generation_pb2.Constraint(json_object=True),
]
CONSTRAINED_PROMPTS = ["The quick", "Paris is", "brown fox"]


CONSTRAINED_REQUESTS = [
    generation_pb2.GenerateRequest(
        prompt=prompt,
        sampling=sampling,
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=NUM_TOKENS),
        constraint=constraint,
        logprobs=2,
    )
    for constraint in CONSTRAINTS
    for prompt in CONSTRAINED_PROMPTS
    for sampling in (
        generation_pb2.SamplingParams(),
        generation_pb2.SamplingParams(temperature=1.0, seed=5),
    )
]


def constrained_runs(
    address: str, requests: list[generation_pb2.GenerateRequest]
) -> list[tuple[list[int], list[float], int]]:
    """(tokens, logprobs, finish) of each of `requests` (constraint x prompt x greedy or
    seeded), sent at once."""

    async def one(stub, request):
        tokens, logprobs, finish = [], [], None
        async for response in stub.Generate(request, timeout=300):
            tokens.extend(response.token_ids)
            logprobs.extend(entry.logprob for entry in response.logprobs)
            finish = response.finish_reason
        return tokens, logprobs, finish

    async def run_all():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(*(one(stub, request) for request in requests))

    return asyncio.run(run_all())


def test_constrained_requests_give_the_same_tokens_with_drafts(tmp_path, tiny_model_factory):
    """A constrained row with drafts gets a mask per sample point (protocol 7): greedy and
    seeded, JSON schema, regex and JSON object, all at once and one at a time, the tokens
    and logprobs are those of the same service without drafts, and drafts were kept. (At
    once, 18 decoders may make every draft cost more than it is likely to save, and the
    service rightly drafts nothing; alone, a draft is cheap.)"""
    runs, stats = {}, {}
    for name, count in (("plain", "0"), ("drafted", "4")):
        log_dir = tmp_path / name
        log_dir.mkdir()
        with running_service(
            log_dir,
            model=str(tiny_model_factory("llama")),
            scheduler_args=["--speculative-tokens", count, "--no-overlap-steps"],
        ) as service:
            together = constrained_runs(service.address, CONSTRAINED_REQUESTS)
            alone = [
                constrained_runs(service.address, [request])[0]
                for request in CONSTRAINED_REQUESTS[::3]
            ]
            runs[name] = together, alone
            stats[name] = service.stats()
    assert stats["plain"].num_draft_tokens == 0
    assert stats["drafted"].num_accepted_draft_tokens > 0
    assert runs["drafted"] == runs["plain"]
    assert any(finish == generation_pb2.STOP for _, _, finish in runs["plain"][0])
