"""The deterministic tokens of the weightless `--model dummy` worker."""

from __future__ import annotations

from collections.abc import Collection


def dummy_next_token(
    last_token_id: int,
    last_position: int,
    vocab_size: int,
    banned_token_ids: Collection[int] = (),
    allowed_token_ids: Collection[int] = (),
) -> int:
    """The token the weightless `--model dummy` worker samples after a fed token.

    A pure function of the sequence's last token and its position, so the in-process
    fake worker of the scheduler tests and the real dummy worker agree, and a
    preempted sequence recomputes to the same output. `banned_token_ids` are masked
    out (min_new_tokens not reached, see dummy_banned_token_ids): the next id up that
    is not banned is taken instead, as a real model's next best would be. Given
    `allowed_token_ids` (the request's own list), the next of those up that is not banned.
    """
    token_id = (last_token_id * 31 + last_position * 17 + 7) % vocab_size
    if allowed_token_ids:  # rare: a list comprehension per token costs the fake worker
        candidates = [t for t in allowed_token_ids if t not in banned_token_ids]
        if candidates:
            return min(candidates, key=lambda t: (t - token_id) % vocab_size)
    for _ in range(vocab_size):
        if token_id not in banned_token_ids:
            return token_id
        token_id = (token_id + 1) % vocab_size
    return token_id  # everything banned: nothing better to do than the unmasked pick


def dummy_banned_token_ids(
    last_position: int,
    num_prompt_tokens: int,
    min_new_tokens: int,
    min_tokens_banned_ids: Collection[int],
) -> Collection[int]:
    """The ids masked for the token sampled after `last_position`: the request's ending
    ids while fewer than min_new_tokens tokens were generated, else none."""
    if last_position + 1 - num_prompt_tokens < min_new_tokens:
        return min_tokens_banned_ids
    return ()


class OutsideMask:
    """The ids a structured-output bitmask does not allow (little-endian 32-bit words,
    step.proto's StepPlan.allowed_token_bitmask row), plus `banned`, as a collection for
    dummy_next_token: the dummy then takes the next allowed id up, as a masked model would."""

    __slots__ = ("mask", "banned")

    def __init__(self, mask: bytes, banned: Collection[int] = ()) -> None:
        self.mask = mask
        self.banned = banned

    def __contains__(self, token_id: object) -> bool:
        assert isinstance(token_id, int)
        byte = token_id // 8
        allowed = byte < len(self.mask) and self.mask[byte] >> (token_id % 8) & 1
        return not allowed or token_id in self.banned
