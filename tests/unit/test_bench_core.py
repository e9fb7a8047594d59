"""The scheduler-core benchmark's workload: a short run, and the Zipf token option."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks import scheduler_core as bench_core
from pagoda.scheduler_svc.tokenizer import TextTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir) -> TextTokenizer:
    return load_tokenizer(default_model_dir)


def test_the_zipf_map_gives_whole_character_tokens_with_a_heavy_head(default_tokenizer):
    token_map = bench_core.zipf_token_map(default_tokenizer)
    assert len(token_map) == default_tokenizer.vocab_size
    texts = default_tokenizer.token_texts()
    assert all(token_id >= 256 and texts[token_id] for token_id in token_map)
    counts = Counter(token_map)
    # Uniform ids would give the thousand commonest about 2% of the draws; Zipf about 2/3.
    assert sum(n for _, n in counts.most_common(1000)) > 0.5 * len(token_map)
    assert bench_core.zipf_token_map(default_tokenizer) == token_map  # seeded


# tuned_gc=False: gc.freeze() would change garbage collection for the rest of the session.
@pytest.mark.parametrize("zipf", [False, True])
def test_a_short_run_holds_the_running_set_and_preempts_under_pressure(default_tokenizer, zipf):
    token_map = bench_core.zipf_token_map(default_tokenizer) if zipf else None
    roomy = bench_core.run(default_tokenizer, 8, False, 20, False, token_map)
    assert roomy.mean_running == 8 and roomy.preemptions_per_step == 0
    pressure = bench_core.run(default_tokenizer, 8, True, 200, False, token_map)
    assert pressure.preemptions_per_step > 0
