"""Which worker hellos the scheduler refuses, each with a sentence for both logs."""

from __future__ import annotations

import pytest

from pagoda.common import wire
from pagoda.scheduler_svc.worker_link import hello_problem
from tests.unit.conftest import make_hello


def test_a_complete_hello_is_accepted():
    assert hello_problem(make_hello()) is None


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [
        ({"protocol_version": wire.PROTOCOL_VERSION + 1}, "is not supported; this scheduler"),
        ({"protocol_version": 0}, "protocol version 0"),
        ({"incarnation_id": ""}, "no incarnation id"),
        ({"vocab_size": 0}, "vocab_size is 0"),
        ({"block_size": 0}, "block_size is 0"),
        ({"num_kv_blocks": 0}, "num_kv_blocks is 0"),
        ({"max_context_tokens": 0}, "max_context_tokens is 0"),
        ({"eos_token_ids": [100]}, "eos_token_ids fall outside its vocabulary"),
    ],
)
def test_incomplete_or_foreign_hellos_are_refused(fields, phrase):
    assert phrase in hello_problem(make_hello(**fields))
