"""`--model dummy`: a weightless engine that answers every plan at once.

The sampled token is `pagoda.common.dummy_tokens.dummy_next_token(fed token before it, that
token's position, vocab)` (skipping the ending ids until min_new_tokens and the request's
banned ids, and keeping to its allowed ids, as the sampler masks them), the same pure
function the scheduler's in-process fake uses, so a recomputed sequence reproduces its
output, and a row with drafts samples after each of its last d + 1 fed tokens what rows
fed one at a time would. Plans are validated and run by the same Engine.step as the paged
engine's. Imports no torch: the harness for scheduler load tests starts in a blink.

`step_ms` (--dummy-step-ms) simulates a forward: each compute sleeps that long before it
samples (then waiting for masks that follow the plan, as the paged engine does), so the
scheduler's side of a step (plan, encode, transport, apply, masks) can be measured
against a known worker time.
"""

from __future__ import annotations

import logging
import os
import time

from pagoda.common.dummy_tokens import OutsideMask, dummy_banned_token_ids, dummy_next_token
from pagoda.common.step import StepPlan
from pagoda.gpu_worker.engine import Engine, EngineFacts, SampledTokens

log = logging.getLogger("pagoda.worker.dummy")

DUMMY_VOCAB_SIZE = 49152
DUMMY_EOS_TOKEN_IDS = (2,)
DUMMY_MAX_CONTEXT_TOKENS = 8192
DUMMY_NUM_KV_BLOCKS = 4096
# The exit status of a dummy worker that died on purpose (crash_on_token_id).
DUMMY_CRASH_EXIT_CODE = 70


class DummyEngine(Engine):
    def __init__(
        self,
        *,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_context_tokens: int | None = None,
        fail_on_token_id: int | None = None,
        step_ms: float = 0.0,
        crash_on_token_id: int | None = None,
    ) -> None:
        facts = EngineFacts(
            model_id="dummy",
            vocab_size=DUMMY_VOCAB_SIZE,
            eos_token_ids=DUMMY_EOS_TOKEN_IDS,
            max_context_tokens=max_context_tokens or DUMMY_MAX_CONTEXT_TOKENS,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks or DUMMY_NUM_KV_BLOCKS,
            device="none",
            dtype="none",
            batch_invariant=True,  # a token is a function of the one before and its position
        )
        super().__init__(facts, fail_on_token_id=fail_on_token_id)
        self.step_ms = step_ms
        # Tests only: a request that kills its worker (the scheduler must isolate it).
        self.crash_on_token_id = crash_on_token_id

    def compute(self, plan: StepPlan) -> SampledTokens:
        started_s = time.perf_counter()
        crash_id = self.crash_on_token_id
        if crash_id is not None and crash_id in plan.token_ids:
            log.error("fault injected: token %d was fed; the worker dies now", crash_id)
            logging.shutdown()
            os._exit(DUMMY_CRASH_EXIT_CODE)  # no cleanup, no goodbye: as a segfault
        if self.step_ms > 0:
            # A sleep, not a spin: on a shared machine the scheduler keeps its CPU, as it
            # would while a GPU computes.
            time.sleep(self.step_ms / 1e3)
        forward_done_s = time.perf_counter()
        sampled = SampledTokens([])
        rows = self.sampling_rows(plan)
        wants_logprobs = any(seq.sampling.num_logprobs for seq in rows.sequences)
        masks = rows.masks
        offsets, token_ids, starts = plan.token_offsets, plan.token_ids, plan.start_positions
        points = zip(rows.rows, rows.sequences, rows.positions, strict=True)
        for point, (i, seq, sampled_position) in enumerate(points):
            sampling = seq.sampling
            position = sampled_position - 1  # the fed token's before it
            banned = dummy_banned_token_ids(
                position,
                seq.num_prompt_tokens,
                seq.min_new_tokens,
                seq.min_tokens_banned_ids,
            )
            if sampling.banned_token_ids:
                banned = {*banned, *sampling.banned_token_ids}
            if point in masks:
                banned = OutsideMask(masks[point], banned)
            token_id = dummy_next_token(
                token_ids[offsets[i] + position - starts[i]],
                position,
                DUMMY_VOCAB_SIZE,
                banned,
                sampling.allowed_token_ids,
            )
            sampled.token_ids.append(token_id)
            if wants_logprobs:
                # Placeholders: the dummy is certain of its token; alternatives rank below.
                n = sampling.num_logprobs
                sampled.logprobs.append(0.0)
                sampled.top_token_ids.append([(token_id + k) % DUMMY_VOCAB_SIZE for k in range(n)])
                sampled.top_logprobs.append([-float(k) for k in range(n)])
        sampled.forward_ms = (forward_done_s - started_s) * 1e3
        sampled.sample_ms = (time.perf_counter() - forward_done_s) * 1e3
        return sampled
