"""N-gram speculation: drafts read from a request's own tokens, checked by the model.

Output that repeats its input (a summary quoting its text, code edited in place, a table
copied, JSON echoed) is predictable from the tokens already there: when the last few
tokens occurred before, the ones that followed them then are a good guess for the next
ones (prompt lookup decoding). The planner feeds such guesses, the drafts, behind a
decoding request's last token (StepPlan.draft_counts); the worker samples after each of
them as it would sample after each real token, and `num_kept` keeps the samples while
they equal the drafts, then one more. A step then gives 1 to d + 1 tokens for a cost
close to one, on the CPU where a decode step's cost is mostly reading the weights.

No token changes. The worker's logits of a row do not depend on its batch mates or its
chunking (docs/benchmarks.md, "Batch invariance"), and a seeded draw is a function of
(seed, position), so the sample after an accepted draft is the one decoding would have
drawn there. An unseeded one is a fresh draw from the same distribution. What is kept
is therefore exactly what decoding one token at a time gives, token and logprob; the
drafts decide only how many of them one step computes.

A draft is not free: the worker computes it whether it is kept or not. Each one is fed
only when its chance of being kept pays for it (`num_worth_drafting`): the i-th draft of
a request is kept with about its acceptance rate to the i-th power (each needs the ones
before it kept), and it must beat the draft's price, the step's tokens per millisecond
times a draft's milliseconds (`draft_price`, from the step budget's learned cost model).
One request alone on a CPU pays little for drafts; eight in a step pay eight times more
per draft, so only well-predicted output drafts there. A request whose drafts are not
worth their price pauses (2, 4, ... MAX_PAUSE_STEPS steps, doubling while they keep
failing), then tries again from a clean record.

Pure functions over token arrays (`token_array`, 64-bit items): the search is
bytes.rfind over the array's bytes, so a long context costs a memcpy and a C search,
not a Python loop.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from pagoda.scheduler_svc.core.request import Request
from pagoda.scheduler_svc.core.step_budget import StepCostModel

_ITEM_BYTES = array("q").itemsize

# A request's record of drafts kept and tried fades by this much per step it drafts in, so
# that its rate follows its output as it changes.
RECORD_DECAY = 0.9
# The longest pause of a request whose drafts were not worth their price (it doubles from 2
# while they keep failing): one step of tries in so many costs about 1% of its steps.
MAX_PAUSE_STEPS = 64
# Until the cost model has seen this many steps, a draft is priced from the CPU's
# measured shape (benchmarks.worker_step, default model, 2-core Zen 5: a lone decode step
# 4.4 ms, about 0.6 ms more per token fed, 0.8 ms per decoding sequence): a draft costs
# DRAFT_COST of a lone decode step, each decoding request DECODER_COST more.
MIN_COST_OBSERVATIONS = 8
DRAFT_COST = 0.15
DECODER_COST = 0.2


def propose(token_ids: array, ngram_min: int, ngram_max: int, max_drafts: int) -> list[int]:
    """Up to `max_drafts` tokens that followed the latest earlier occurrence of the
    longest n-gram (n from `ngram_max` down to `ngram_min`) that ends `token_ids`; []
    when none occurred before or `max_drafts` is 0."""
    num_tokens = len(token_ids)
    if max_drafts <= 0 or num_tokens <= ngram_min:
        return []
    data = token_ids.tobytes()
    # An occurrence must end before the last token, so that a token follows it.
    search_end = len(data) - _ITEM_BYTES
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        needle = data[-n * _ITEM_BYTES :]
        end = search_end
        while True:
            found = data.rfind(needle, 0, end)
            if found < 0:
                break
            if found % _ITEM_BYTES == 0:  # a match across item boundaries is no match
                first = found // _ITEM_BYTES + n
                return token_ids[first : first + max_drafts].tolist()
            end = found + len(needle) - 1
    return []


def acceptance(num_kept_drafts: float, num_tried_drafts: float) -> float:
    """A request's chance that its next draft is kept, from its faded record (a prior of
    half a draft kept in one tried: a new request drafts, and four failures in a row bring
    a lone request on a CPU below the price of a draft)."""
    return (num_kept_drafts + 0.5) / (num_tried_drafts + 1.0)


def num_worth_drafting(rate: float, price: float, limit: int) -> int:
    """How many drafts to feed: those whose chance of being kept (`rate` to the i-th
    power for the i-th) is above `price`, at most `limit`."""
    count, chance = 0, rate
    while count < limit and chance > price:
        count += 1
        chance *= rate
    return count


def draft_price(model: StepCostModel | None, num_decoders: int, num_context_tokens: int) -> float:
    """The chance of being kept that a draft needs to pay for itself in a step decoding
    `num_decoders` requests over `num_context_tokens`: the step's tokens per ms times a
    draft's ms (a token fed more, and attended), from `model` once it has measured
    enough, else from DRAFT_COST and DECODER_COST."""
    if model is not None and model.num_observations >= MIN_COST_OBSERVATIONS:
        step_ms = model.predict_ms(0, num_decoders, num_context_tokens)
        draft_ms = model.prefill_ms_per_token + model.context_ms_per_token
        if step_ms > 0:
            return num_decoders * draft_ms / step_ms
    return num_decoders * DRAFT_COST / (1.0 + DECODER_COST * num_decoders)


def pause_drafts(request: Request, step_id: int) -> None:
    """`request`'s drafts are not worth their price at step `step_id`: none for a pause
    twice as long as its last one (2 steps first, MAX_PAUSE_STEPS at most), then a clean
    record (its output may have changed, or the batch that priced them)."""
    pause = min(MAX_PAUSE_STEPS, 2 * request.draft_pause_steps or 2)
    request.draft_pause_steps = pause
    request.drafts_resume_step = step_id + pause
    request.num_kept_drafts = request.num_tried_drafts = 0.0


def record_drafts(request: Request, num_drafts: int, num_kept_drafts: int) -> None:
    """`num_kept_drafts` of the request's `num_drafts` drafts were kept: its record fades
    and takes them (tried: those kept, and the one after them unless all were); a kept
    one ends its pauses' doubling."""
    request.num_kept_drafts = RECORD_DECAY * request.num_kept_drafts + num_kept_drafts
    request.num_tried_drafts = RECORD_DECAY * request.num_tried_drafts + min(
        num_kept_drafts + 1, num_drafts
    )
    if num_kept_drafts:
        request.draft_pause_steps = 0


def num_kept(drafts: Sequence[int], samples: Sequence[int]) -> int:
    """How many of `samples` (one per draft, and one after the last) a request keeps: the
    samples while each equals the draft it was drawn in place of, then one more."""
    kept = 0
    for draft, sample in zip(drafts, samples, strict=False):
        if draft != sample:
            break
        kept += 1
    return kept + 1
