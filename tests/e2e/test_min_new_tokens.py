"""min_new_tokens through real gRPC, scheduler and dummy worker processes (issue 14 item 6):
the worker never samples an ending id before min_new_tokens, so the stream holds no EOS
there and ends on the first one after it."""

from __future__ import annotations

import pytest

from pagoda.common.dummy_tokens import dummy_next_token
from pagoda.gpu_worker.dummy_engine import DUMMY_EOS_TOKEN_IDS, DUMMY_VOCAB_SIZE
from pagoda.protos import generation_pb2
from tests.e2e.conftest import running_service

pytestmark = pytest.mark.slow

(EOS,) = DUMMY_EOS_TOKEN_IDS


def prompt_whose_first_token_is_eos() -> list[int]:
    # dummy_next_token(t, 0, V) = (31 t + 7) mod V: solve for EOS.
    token_id = (EOS - 7) * pow(31, -1, DUMMY_VOCAB_SIZE) % DUMMY_VOCAB_SIZE
    assert dummy_next_token(token_id, 0, DUMMY_VOCAB_SIZE) == EOS
    return [token_id]


def expected(prompt: list[int], min_new_tokens: int, max_new_tokens: int) -> list[int]:
    tokens = list(prompt)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        banned = DUMMY_EOS_TOKEN_IDS if len(generated) < min_new_tokens else ()
        token_id = dummy_next_token(tokens[-1], len(tokens) - 1, DUMMY_VOCAB_SIZE, banned)
        tokens.append(token_id)
        generated.append(token_id)
        if token_id == EOS:
            break
    return generated


def generate(service, prompt: list[int], min_new_tokens: int) -> tuple[list[int], int]:
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
        stopping=generation_pb2.StoppingCriteria(max_new_tokens=8, min_new_tokens=min_new_tokens),
    )
    tokens: list[int] = []
    finish = 0
    with service.channel() as channel:
        for response in service.stub(channel).Generate(request, timeout=60):
            tokens.extend(response.token_ids)
            finish = response.finish_reason
    return tokens, finish


def test_the_worker_masks_eos_until_min_new_tokens(tmp_path):
    prompt = prompt_whose_first_token_is_eos()
    with running_service(tmp_path, model="dummy") as service:
        assert generate(service, prompt, 0) == ([EOS], generation_pb2.STOP)
        tokens, finish = generate(service, prompt, 3)
        assert EOS not in tokens[:3]
        assert tokens == expected(prompt, 3, 8)
        assert finish == (generation_pb2.STOP if tokens[-1] == EOS else generation_pb2.LENGTH)
