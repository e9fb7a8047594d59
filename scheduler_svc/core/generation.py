"""A sampled token reaches its request: append it, apply the stop rules, produce text.

Called once per sampled token from Scheduler.apply: the hot path, so the rules of
stop_rules.py are applied with one call and the common case (no stop string, nothing
held back, a whole character) touches nothing else.
"""

from __future__ import annotations

from pagoda.scheduler_svc.core.request import FinishReason, Request, TokenLogprob
from pagoda.scheduler_svc.core.step_decision import StepOutcome
from pagoda.scheduler_svc.core.stop_rules import stops_allowed, token_verdict

_STOP, _LENGTH = FinishReason.STOP, FinishReason.LENGTH


def accept_token(
    request: Request, token_id: int, eos_token_ids: frozenset[int], max_context_tokens: int
) -> tuple[str, FinishReason | None]:
    """Append `token_id`; return the text the client may see now and why it ends, if it does.

    EOS and stop token ids end it without their text; a stop string ends it with the
    text before the stop string; LENGTH releases every held-back character.
    """
    token_ids = request.token_ids
    token_ids.append(token_id)
    request.last_token_id = token_id
    num_generated = len(token_ids) - request.num_prompt_tokens
    stopping = request.stopping
    verdict = token_verdict(
        token_id, num_generated, len(token_ids), stopping, eos_token_ids, max_context_tokens
    )
    if verdict is _STOP:
        return final_text(request), _STOP  # a stop token's text is not streamed
    detokenizer = request.detokenizer
    text = detokenizer.push(token_id)
    request.whole_texts = detokenizer.whole_texts
    matcher = request.stop_matcher
    if matcher is not None:
        text, stopped = matcher.push(text, stops_allowed(num_generated, stopping))
        if stopped:
            return text, _STOP
    if verdict is _LENGTH:
        return text + final_text(request), _LENGTH
    return text, None


def final_text(request: Request) -> str:
    """Text that waited (a possible stop string's start, a partial character) and is now final.

    A character left incomplete at the end becomes U+FFFD, as tokenizer.decode does.
    """
    held = request.stop_matcher.flush() if request.stop_matcher is not None else ""
    text = held + request.detokenizer.flush()
    request.whole_texts = request.detokenizer.whole_texts
    return text


def token_logprob(outcome: StepOutcome, index: int) -> TokenLogprob:
    """The logprobs of the `index`-th sampled token of `outcome`."""
    top_offsets = outcome.top_offsets
    if len(top_offsets) > index + 1:
        start, end = top_offsets[index], top_offsets[index + 1]
        top_token_ids, top_logprobs = (
            outcome.top_token_ids[start:end],
            outcome.top_logprobs[start:end],
        )
    else:
        top_token_ids, top_logprobs = [], []
    return TokenLogprob(
        token_id=outcome.token_ids[index],
        logprob=outcome.logprobs[index],
        top_token_ids=top_token_ids,
        top_logprobs=top_logprobs,
    )
