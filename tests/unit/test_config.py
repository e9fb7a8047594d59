from __future__ import annotations

import pytest

from pagoda.scheduler_svc.core.config import ConfigError, SchedulerConfig


def test_the_defaults_are_valid():
    SchedulerConfig().validate()


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
        ({"max_active_requests": -3}, "max_active_requests must be >= 1, got -3"),
        ({"prefill_max_tokens": 0}, "prefill_max_tokens must be >= 1 (or unset for no cap), got 0"),
        ({"prefill_max_batch_size": 0}, "prefill_max_batch_size must be >= 1"),
        ({"max_decode_batch_size": 0}, "max_decode_batch_size must be >= 1"),
        ({"admission_lookahead": 0}, "admission_lookahead must be >= 1, got 0"),
        ({"force_fifo_every": -1}, "force_fifo_every must be >= 0 (0 or unset: never), got -1"),
        ({"max_waiting_requests": 0}, "max_waiting_requests must be >= 1, got 0"),
        (
            {"admission_policy": "lifo"},
            "admission_policy must be one of fifo, pack, prefix, deadline, priority, got 'lifo'",
        ),
        ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens must be an integer, got 2.5"),
        ({"chunked_prefill": "yes"}, "chunked_prefill must be true or false, got 'yes'"),
        ({"speculative_tokens": -1}, "speculative_tokens must be >= 0 (0: off), got -1"),
        (
            {"speculative_ngram_min": 3, "speculative_ngram_max": 2},
            "speculative_ngram_max must be >= 3, got 2",
        ),
        (
            {"speculative_tokens": 17, "speculative_max_batch": 8},
            "speculative_tokens x speculative_max_batch must be <= 128 (the logits rows "
            "drafts may add to a step), got 17 x 8",
        ),
    ],
)
def test_a_knob_out_of_range_is_named_in_one_sentence(knobs, message):
    with pytest.raises(ConfigError) as raised:
        SchedulerConfig(**knobs).validate()
    assert str(raised.value).startswith(message)
