"""The piecewise graphs' bookkeeping on the CPU: the padded forward through the cut and
the eager attention between pieces (run_eager: what a replay computes, without the
capture), and the capture's cuts and replay order with stand-in graphs. The capture
and replay themselves need CUDA (`make gpu-check` compares replayed logits with eager
ones)."""

from __future__ import annotations

import pytest

from tests.worker.conftest import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts
from tests.worker.toy_scheduler import ToyScheduler
from tests.worker.triton_runs import ON_CUDA

BUCKETS = (16, 32, 64, 128)


def test_token_buckets_double_to_256_then_step_by_256():
    from pagoda.gpu_worker.piecewise_graphs import token_buckets

    assert token_buckets(2048) == (16, 32, 64, 128, 256, *range(512, 2049, 256))
    assert token_buckets(100) == (16, 32, 64, 128)
    assert token_buckets(16) == (16,)
    assert token_buckets(1) == (16,)
    assert token_buckets(300) == (16, 32, 64, 128, 256, 512)


def test_only_llama_and_qwen3_are_cut(tiny_models):
    """Their logits are the LM head over the base model's last hidden states, nothing more."""
    from pagoda.gpu_worker.piecewise_graphs import refusal

    model_type = tiny_models.reference.config.model_type
    refused = refusal(tiny_models.reference)
    if model_type == "llama":
        assert refused is None
    else:
        assert f"model type {model_type}" in refused


def piecewise_engine(models, steps: list[int]):
    """An engine whose every packed step runs the padded piecewise forward eagerly;
    `steps` collects each one's token count."""
    from pagoda.gpu_worker.piecewise_graphs import PiecewiseGraphs

    engine = models.engine()
    graphs = PiecewiseGraphs(engine, BUCKETS)

    def fits(batch):
        steps.append(batch.num_tokens)
        return graphs.bucket_for(batch.num_tokens) is not None

    graphs.fits = fits
    graphs.run = graphs.run_eager  # no capture on a CPU
    engine.piecewise_graphs = graphs
    return engine


def chunked_run(engine, prompts, num_new_tokens=10):
    """Prompts in chunks, admitted over the first steps: steps mix prompt chunks with
    decode rows and rows that do not sample."""
    from tests.worker.toy_scheduler import greedy

    sampling = greedy()
    sampling.num_logprobs = 3
    scheduler = ToyScheduler(engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE)
    for seq_id, prompt in enumerate(prompts):
        scheduler.add(seq_id, prompt, sampling=sampling, chunk_sizes=[5, 11], admit_at_step=seq_id)
    tokens = scheduler.run(num_new_tokens)
    logprobs = [(list(r.logprobs), list(r.top_logprobs)) for r in scheduler.results]
    return tokens, logprobs, scheduler


def test_padded_pieces_give_the_eager_engines_tokens_and_logprobs(llama_models):
    prompts = random_prompts(5, seed=51, max_len=60)
    plain_tokens, plain_logprobs, _ = chunked_run(llama_models.engine(), prompts)
    steps: list[int] = []
    engine = piecewise_engine(llama_models, steps)
    tokens, logprobs, scheduler = chunked_run(engine, prompts)
    assert tokens == plain_tokens
    # Padded rows change no real row, to the bit: on the CPU every float layer multiplies 16
    # rows per call (numerics.py), so a row's bits do not depend on the padding's count.
    assert logprobs == plain_logprobs
    assert tokens == {i: llama_models.greedy(p, 10) for i, p in enumerate(prompts)}
    padded = [n for n in steps if n not in BUCKETS]
    assert len(padded) > len(prompts)  # mixed steps of odd sizes ran padded
    # Padded rows reached neither attention nor the pool: every block no sequence got is
    # still zero (a padded row would have written its stale position's slot).
    key_cache, value_cache = engine.pool.layer_blocks(0)
    unused = scheduler.free_blocks
    assert unused and not key_cache[unused].any() and not value_cache[unused].any()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pieces_of_the_fused_int8_path_give_its_bits(family):
    """The CPU's fast path cut in pieces (Q4 GEMMs, fused norms and RoPE, the cpu
    attention backend): a padded step's rows are the unpadded step's to the bit."""
    import copy

    from pagoda.gpu_worker import cpu_kernels
    from pagoda.gpu_worker.paged_engine import PagedEngine
    from tests.worker.fused_models import tiny_model

    if cpu_kernels.load() is None:
        pytest.skip("Pagoda's CPU kernels cannot be built or run here")
    model = tiny_model(family)

    class Models:
        def engine(self):
            return PagedEngine(
                copy.deepcopy(model),
                model_id=family,
                num_kv_blocks=TEST_NUM_BLOCKS,
                block_size=TEST_BLOCK_SIZE,
                quantization="int8",
                attention_backend="cpu",
            )

    prompts = random_prompts(4, seed=53, max_len=50)
    plain = chunked_run(Models().engine(), prompts)[:2]
    steps: list[int] = []
    engine = piecewise_engine(Models(), steps)
    assert "Pagoda's float32 kernels" in engine.facts.numerics  # the fused ops are in
    assert chunked_run(engine, prompts)[:2] == plain
    assert any(n not in BUCKETS for n in steps)


def test_a_step_past_the_largest_bucket_runs_the_plain_forward(llama_models):
    steps: list[int] = []
    engine = piecewise_engine(llama_models, steps)
    prompt = random_prompts(1, seed=52, min_len=150, max_len=150)[0]
    scheduler = ToyScheduler(engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE)
    scheduler.add(0, prompt)
    assert scheduler.run(4)[0] == llama_models.greedy(prompt, 4)
    assert steps[0] == 150 and engine.piecewise_graphs.bucket_for(150) is None


class StandInGraph:
    """Records what capture and replay do with it, in one shared log."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.number = sum(1 for entry in log if entry[0] == "begin")

    def capture_begin(self, pool=None):
        self.log.append(("begin", self.number))

    def capture_end(self):
        self.log.append(("end", self.number))

    def replay(self):
        self.log.append(("replay", self.number))


def stand_in_cuda(monkeypatch, log: list) -> None:
    """torch.cuda's graph and stream classes replaced by StandInGraph and no-ops, so that a
    capture's calls run eagerly on the CPU."""
    import contextlib

    import torch

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: StandInGraph(log))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_capture_cuts_at_every_layer_and_replay_attends_between_pieces(llama_models, monkeypatch):
    """With stand-in graphs (the capture's calls run eagerly on the CPU): L + 1 pieces,
    begun and ended in turn, one cut per attention layer on that layer's cache; a replay
    runs piece i, then layer i's attention over the step's real rows, then piece i + 1."""
    import torch

    from pagoda.gpu_worker.piecewise_graphs import PiecewiseGraphs

    log: list = []
    stand_in_cuda(monkeypatch, log)
    engine = llama_models.engine()
    graphs = PiecewiseGraphs(engine, (16, 32))
    graphs.capture(budget_s=60.0)
    num_layers = llama_models.reference.config.num_hidden_layers
    assert graphs.captured_buckets == (16, 32)
    assert len(graphs.layers) == num_layers
    assert [layer.key_cache for layer in graphs.layers] == [
        engine.pool.layer_blocks(i)[0] for i in range(num_layers)
    ]
    pieces = num_layers + 1
    # Largest bucket first; each piece begun, then ended before the next begins.
    assert log == [(kind, n) for n in range(2 * pieces) for kind in ("begin", "end")]
    del log[:]
    monkeypatch.setattr(graphs, "attend", lambda i, n, metadata: log.append(("attend", i, n)))
    monkeypatch.setattr(graphs, "_logits", lambda hidden, batch: hidden)
    batch = type("Batch", (), {})()
    batch.num_tokens, batch.attention = 20, None
    batch.input_ids = batch.position_ids = torch.zeros(1, 20, dtype=torch.long)
    assert graphs.fits(batch)
    graphs.run(batch)  # bucket 32: the first bucket captured, graphs 0 .. L
    between = [[("replay", i), ("attend", i, 20)] for i in range(num_layers)]
    assert log == [entry for pair in between for entry in pair] + [("replay", num_layers)]


def test_a_failure_inside_a_capture_ends_the_open_piece(llama_models, monkeypatch):
    """The error goes up (load_engine then runs without the pieces), but the stream is not
    left capturing: the piece open when it failed is ended, as torch.cuda.graph does."""
    from pagoda.gpu_worker.piecewise_graphs import PiecewiseGraphs

    log: list = []
    stand_in_cuda(monkeypatch, log)
    graphs = PiecewiseGraphs(llama_models.engine(), (16,))
    cut = graphs._at_cut
    calls = []

    def fails_in_the_capture(*args):
        calls.append(len(log))
        if len(calls) > 2 * len(graphs.layers) + 1:  # after two warm-ups, the second cut
            raise RuntimeError("operation not permitted when stream is capturing")
        return cut(*args)

    monkeypatch.setattr(graphs, "_at_cut", fails_in_the_capture)
    with pytest.raises(RuntimeError, match="not permitted"):
        graphs.capture(budget_s=60.0)
    assert log == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1)]
    assert not graphs.captured_buckets and not graphs._cut.pieces


@pytest.mark.skipif(not ON_CUDA, reason="capture and replay need CUDA")
def test_replayed_pieces_give_the_eager_engines_tokens_on_cuda(llama_models):
    """The real capture (decode graphs and pieces, triton backend) against the same engine
    run eagerly: the chunked, staggered workload's tokens and logprobs."""
    import copy

    from pagoda.gpu_worker.paged_engine import PagedEngine

    def cuda_engine(graphs: bool):
        engine = PagedEngine(
            copy.deepcopy(llama_models.reference).cuda(),
            model_id="tiny",
            num_kv_blocks=TEST_NUM_BLOCKS,
            block_size=TEST_BLOCK_SIZE,
            attention_backend="triton",
            cuda_graphs=graphs,
            piecewise_tokens=128,
        )
        if graphs:
            engine.decode_graphs.capture()
            engine.piecewise_graphs.capture(60.0)
            assert engine.piecewise_graphs.captured_buckets == BUCKETS
        return engine

    prompts = random_prompts(5, seed=54, max_len=60)
    eager_tokens, eager_logprobs, _ = chunked_run(cuda_engine(False), prompts)
    graphed = cuda_engine(True)
    replays: list[int] = []
    run = graphed.piecewise_graphs.run
    graphed.piecewise_graphs.run = lambda batch: replays.append(batch.num_tokens) or run(batch)
    tokens, logprobs, _ = chunked_run(graphed, prompts)
    assert tokens == eager_tokens
    for got, expected in zip(logprobs, eager_logprobs, strict=True):
        assert got[0] == pytest.approx(expected[0], abs=1e-3)
    assert any(n not in BUCKETS for n in replays)
