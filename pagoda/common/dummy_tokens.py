"""The deterministic tokens of the weightless `--model dummy` worker."""

from __future__ import annotations


def dummy_next_token(last_token_id: int, last_position: int, vocab_size: int) -> int:
    """The token the weightless `--model dummy` worker samples after a fed token.

    A pure function of the sequence's last token and its position, so the in-process
    fake worker of the scheduler tests and the real dummy worker agree, and a
    preempted sequence recomputes to the same output.
    """
    return (last_token_id * 31 + last_position * 17 + 7) % vocab_size
