"""Prefix-cache isolation by cache salt (issue 14 item 12, security review M2): requests
with different salts never share a cached block, so one tenant's prompt cannot show up
in another's usage.cached_prompt_tokens, time to first token or hit counts."""

from __future__ import annotations

import dataclasses

from pagoda.scheduler_svc.core.kv import ROOT_HASH, cache_root_hash, extend_block_hashes
from pagoda.scheduler_svc.core.request import token_array
from pagoda.scheduler_svc.testing import FakeWorker
from tests.unit.conftest import drive, make_geometry, make_request, make_scheduler

PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks of 4


def salted(request_id: str, cache_salt: str, prompt=PROMPT):
    return dataclasses.replace(make_request(request_id, prompt), cache_salt=cache_salt)


def cached_tokens(scheduler, worker, request, now: float) -> int:
    scheduler.add(request, now)
    return drive(scheduler, worker)[request.request_id].usage.cached_prompt_tokens


def test_the_same_prompt_hits_only_under_the_same_salt():
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    assert cached_tokens(scheduler, worker, salted("a1", "tenant-a"), 0.0) == 0
    assert cached_tokens(scheduler, worker, salted("b1", "tenant-b"), 1.0) == 0
    assert cached_tokens(scheduler, worker, salted("u1", ""), 2.0) == 0  # unsalted: its own
    assert cached_tokens(scheduler, worker, salted("a2", "tenant-a"), 3.0) == 12
    assert cached_tokens(scheduler, worker, salted("b2", "tenant-b"), 4.0) == 12
    assert cached_tokens(scheduler, worker, salted("u2", ""), 5.0) == 12
    stats = scheduler.stats
    assert stats.num_prefix_hit_tokens == 3 * 12


def test_salted_requests_in_one_step_share_no_block():
    """Admitted together (the second would point at the first's blocks in the same
    step without salts): different salts compute their own."""
    geometry = make_geometry(block_size=4)
    scheduler, worker = make_scheduler(geometry), FakeWorker(geometry)
    scheduler.add(salted("a", "tenant-a"), 0.0)
    scheduler.add(salted("b", "tenant-b"), 0.0)
    plan = scheduler.schedule(0.0)
    assert all(not new.cached_token_ids for new in plan.new_sequences)
    a_seq, b_seq = plan.seq_ids
    scheduler.apply(worker.step(plan), 0.0)
    assert set(worker.block_ids_of(a_seq)).isdisjoint(worker.block_ids_of(b_seq))
    streams = drive(scheduler, worker)
    assert streams["a"].token_ids == streams["b"].token_ids  # the same output all the same


def test_a_salt_changes_every_key_of_the_chain():
    tokens = token_array(PROMPT)

    def chain(root: int) -> list[int]:
        block_hashes: list[int] = []
        extend_block_hashes(tokens, block_hashes, 3, 4, root)
        return block_hashes

    assert cache_root_hash("") == ROOT_HASH
    assert cache_root_hash("x") == cache_root_hash("x") != cache_root_hash("y")
    plain, x, y = chain(ROOT_HASH), chain(cache_root_hash("x")), chain(cache_root_hash("y"))
    assert not set(plain) & set(x) and not set(x) & set(y) and not set(plain) & set(y)
