"""Tensor parallelism (pagoda.gpu_worker.tensor_parallel): the launch rules, the shard plan,
and greedy output of two gloo ranks on the CPU equal to one process's, token for token.

The parity tests spawn two processes (one rank each) that load the same tiny model, shard
it and build a paged engine; rank 0 drives the toy scheduler and broadcasts each plan's
wire frames exactly as the worker's server does, rank 1 runs tensor_parallel.follow.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from pagoda.common import wire
from pagoda.gpu_worker import tensor_parallel
from pagoda.gpu_worker.config import parse_config
from pagoda.gpu_worker.kv_pool import KVGeometry
from pagoda.gpu_worker.tensor_parallel import Rendezvous, TensorParallelError
from tests.worker import toy_scheduler
from tests.worker.conftest import NUM_NEW_TOKENS, TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, random_prompts

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_the_flag_comes_from_the_environment_and_is_bounded():
    environ = {"PAGODA_WORKER_TENSOR_PARALLEL_SIZE": "2"}
    assert parse_config(["--model", "m"], environ).tensor_parallel_size == 2
    assert (
        parse_config(["--model", "m", "--tensor-parallel-size", "3"], environ).tensor_parallel_size
        == 3
    )
    with pytest.raises(SystemExit):
        parse_config(["--model", "m", "--tensor-parallel-size", "0"], {})
    with pytest.raises(SystemExit):
        parse_config(["--model", "dummy", "--tensor-parallel-size", "2"], {})


def test_torchrun_variables_make_this_process_a_rank():
    assert tensor_parallel.rendezvous_from_environ({}, 2) is None
    assert tensor_parallel.rendezvous_from_environ(
        {**TORCHRUN, "LOCAL_RANK": "1"}, 2
    ) == Rendezvous(rank=1, world_size=2, local_rank=1)
    with pytest.raises(TensorParallelError, match="LOCAL_RANK"):
        tensor_parallel.rendezvous_from_environ(TORCHRUN, 2)  # incomplete
    with pytest.raises(
        TensorParallelError, match="WORLD_SIZE is 2 but --tensor-parallel-size is 4"
    ):
        tensor_parallel.rendezvous_from_environ({**TORCHRUN, "LOCAL_RANK": "1"}, 4)


def load(model_dir: Path):
    import transformers

    from tests.worker.conftest import diversify

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    diversify(model)  # the same draw as the fixtures' reference (seed 0)
    return model


class FakeGroup:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def test_the_shard_plan_splits_heads_and_mlp_columns(tiny_model_factory):
    model = load(tiny_model_factory("qwen2"))  # 4 heads, 2 KV heads, biased q/k/v
    full_q = model.model.layers[0].self_attn.q_proj
    q_weight, q_bias = full_q.weight.clone(), full_q.bias.clone()
    full_down = model.model.layers[0].mlp.down_proj.weight.clone()
    tensor_parallel.shard_model(model, FakeGroup(rank=1, world_size=2))
    attention = model.model.layers[0].self_attn
    # Column-parallel: rank 1 keeps the second half of the output rows (heads 2 and 3).
    assert torch.equal(attention.q_proj.weight, q_weight[32:])
    assert torch.equal(attention.q_proj.bias, q_bias[32:])
    assert attention.k_proj.out_features == 16  # one KV head of 16
    # Row-parallel: the second half of the input columns, no bias but on rank 0, wrapped.
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, tensor_parallel.RowParallelLinear)
    assert torch.equal(down.linear.weight, full_down[:, 64:])
    assert attention.o_proj.linear.bias is None and attention.o_proj.linear.in_features == 32
    # The embeddings and the head stay whole.
    assert model.get_output_embeddings().weight.shape == (512, 64)
    geometry = KVGeometry.from_model_config(model.config, 4, torch.float32)
    assert (geometry.num_kv_heads, geometry.head_dim) == (1, 16)


def test_models_that_cannot_be_split_are_refused_with_a_reason(tiny_model_factory):
    with pytest.raises(TensorParallelError, match="4 attention heads and 2 KV heads.*\\[1, 2\\]"):
        tensor_parallel.shard_plan(load(tiny_model_factory("llama")), 4)
    with pytest.raises(TensorParallelError, match="no tensor-parallel plan"):
        tensor_parallel.shard_plan(load(tiny_model_factory("gpt2")), 2)


class FakeLeader:
    """What the server sees of tensor_parallel.GroupLeader."""

    def __init__(self) -> None:
        self.plans: list[bytes] = []
        self.num_resets = 0
        self.problem: str | None = None

    def send_plan(self, frames: list[bytes]) -> None:
        self.plans.append(frames)

    def send_reset(self) -> None:
        self.num_resets += 1

    def keepalive(self) -> None:
        pass

    def lost(self) -> str | None:
        return self.problem


def test_the_server_forwards_plans_and_resets_and_exits_when_the_group_is_lost(tmp_path):
    import zmq

    from pagoda.gpu_worker.dummy_engine import DummyEngine
    from pagoda.gpu_worker.server import EXIT_GROUP_LOST, WorkerServer
    from pagoda.protos import step_pb2

    leader = FakeLeader()
    server = WorkerServer(DummyEngine(num_kv_blocks=8), f"ipc://{tmp_path}/w.sock", group=leader)
    server._socket = zmq.Context.instance().socket(zmq.DEALER)  # connected nowhere
    server._socket.setsockopt(zmq.IMMEDIATE, 1)
    try:
        ack = step_pb2.HelloAck(
            accepted=True, protocol_version=wire.PROTOCOL_VERSION, scheduler_incarnation_id="s1"
        )
        assert server._handle(wire.encode(ack)) is None
        assert leader.num_resets == 1  # a new scheduler: every rank forgets
        plan = step_pb2.StepPlan(step_id=7)
        frames = wire.encode(plan)
        assert server._handle(frames) is None
        assert leader.plans == [frames]  # as received
        leader.problem = "rank 1 exited with -9"
        assert server._handle(wire.encode(step_pb2.StepPlan(step_id=8))) == EXIT_GROUP_LOST
    finally:
        server._socket.close(linger=0)


# -- one rank's share of a step (no collectives: a fake group records them) -----------------


class RecordingGroup:
    """What one rank sees of its group: records its broadcasts, hands out `incoming`."""

    def __init__(self, rank: int, incoming: list[tuple[int, bytes]] = ()) -> None:
        self.rank = rank
        self.sent: list[tuple[int, bytes]] = []
        self.incoming = list(incoming)

    def broadcast_message(self, kind: int, payload: bytes = b"") -> None:
        self.sent.append((kind, payload))

    def receive_message(self) -> tuple[int, bytes]:
        return self.incoming.pop(0)


def int64_bytes(token_ids: list[int]) -> bytes:
    return torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()


def generate(engine, prompt: list[int], num_new_tokens: int) -> list[int]:
    scheduler = toy_scheduler.ToyScheduler(
        engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE
    )
    scheduler.add(0, prompt)
    return scheduler.run(num_new_tokens)[0]


def test_joining_the_group_replaces_no_method_of_the_engine(llama_models):
    for rank in (0, 1):
        engine = llama_models.engine()
        tensor_parallel.join_engine(engine, RecordingGroup(rank))
        methods = [name for name in vars(engine) if callable(getattr(type(engine), name, None))]
        assert methods == []


def test_rank_0_broadcasts_its_tokens_and_the_others_record_them(llama_models):
    prompt = random_prompts(1, seed=3)[0]
    group = RecordingGroup(rank=0)
    tokens = generate(tensor_parallel.join_engine(llama_models.engine(), group), prompt, 4)
    assert tokens == llama_models.greedy(prompt, 4)
    assert group.sent == [(tensor_parallel.SAMPLED, int64_bytes([t])) for t in tokens]

    sent_by_rank_0 = [(tensor_parallel.SAMPLED, int64_bytes([7]))] * 4
    follower = tensor_parallel.join_engine(llama_models.engine(), RecordingGroup(1, sent_by_rank_0))
    assert generate(follower, prompt, 4) == [7, 7, 7, 7]


def test_rank_0_tells_the_others_when_its_step_fails(llama_models):
    def broken_model(**kwargs):
        raise RuntimeError("out of memory")

    group = RecordingGroup(rank=0)
    engine = tensor_parallel.join_engine(llama_models.engine(), group)
    engine.model = broken_model
    scheduler = toy_scheduler.ToyScheduler(
        engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE
    )
    scheduler.add(0, [5, 6, 7])
    with pytest.raises(AssertionError, match="out of memory"):  # the toy's check of the result
        scheduler.step(lambda job: False)
    assert group.sent == [(tensor_parallel.SAMPLING_FAILED, b"")]


# -- two ranks --------------------------------------------------------------------------------

PARITY_ARCHITECTURES = ("llama", "qwen2")  # GQA; biased q/k/v (column-sliced biases)
NUM_RUNS = 2  # the second after a reset, reusing the first run's sequence and block ids


def _rank_main(rank: int, model_dirs: list[str], port: int, out_path: str) -> None:
    """One rank of the parity test (runs in a spawned process): per model, rank 0 drives
    the toy scheduler, rank 1 follows until rank 0's STOP."""
    from pagoda.gpu_worker.paged_engine import PagedEngine

    group = tensor_parallel.init_group(Rendezvous(rank, 2, rank, port), "cpu")
    outputs = []
    try:
        for model_dir in model_dirs:
            model = tensor_parallel.shard_model(load(Path(model_dir)), group)
            engine = PagedEngine(
                model, model_id="tiny", num_kv_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE
            )
            assert engine.pool.geometry.num_kv_heads == 1  # of the model's 2
            if rank != 0:
                assert tensor_parallel.follow(engine, group) == tensor_parallel.EXIT_OK
                continue
            leader = tensor_parallel.GroupLeader(group)
            tensor_parallel.join_engine(engine, group)
            outputs.append(_lead(engine, leader))
            leader.shutdown(tensor_parallel.EXIT_OK)  # STOP: rank 1 returns from follow
        if rank == 0:
            Path(out_path).write_text(json.dumps(outputs))
        torch.distributed.barrier()  # both ranks tear the group down together
    finally:
        tensor_parallel.close_group()
    # Done, and the group destroyed: leave without the interpreter's finalization. In 2 of
    # 6 full-suite runs (never in 20 runs alone) rank 1 died of SIGABRT, "terminate called
    # without an active exception", after its work: a gloo thread torn down at exit is
    # suspected. The marker tells such an abort apart from one during the work.
    Path(f"{out_path}.rank{rank}.done").touch()
    tensor_parallel.exit_process(0)


def _lead(engine, leader) -> list[dict]:
    """Rank 0: the toy scheduler's runs, each plan broadcast first (as the server does)."""
    plain_run_plan = toy_scheduler.run_plan

    def run_plan(engine, plan):
        leader.send_plan(wire.encode(plan))
        return plain_run_plan(engine, plan)

    toy_scheduler.run_plan = run_plan  # this process only
    outputs = []
    for run in range(NUM_RUNS):
        if run:  # a new scheduler: every rank forgets
            leader.send_reset()
            engine.reset()
        outputs.append(_scenario(engine, seed=run))
        assert leader.lost() is None
    toy_scheduler.run_plan = plain_run_plan
    return outputs


def _scenario(engine, seed: int) -> dict[int, list[int]]:
    """Staggered, chunked prompts: prefill chunks share steps with decodes."""
    import random

    prompts = random_prompts(5, seed=10 + seed)
    scheduler = toy_scheduler.ToyScheduler(
        engine, num_blocks=TEST_NUM_BLOCKS, block_size=TEST_BLOCK_SIZE, seed=seed
    )
    rng = random.Random(seed)
    for seq_id, prompt in enumerate(prompts):
        chunks = toy_scheduler.split_into(len(prompt), rng.randint(1, 3), rng)
        scheduler.add(seq_id, prompt, chunk_sizes=chunks, admit_at_step=seq_id)
    return scheduler.run(NUM_NEW_TOKENS)


def run_two_ranks(model_dirs: list[Path], tmp_path: Path) -> list[list[dict]]:
    import torch.distributed as dist
    import torch.multiprocessing as multiprocessing

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        # This process hosts the rendezvous store on the loopback socket; both ranks join it.
        store = dist.TCPStore(
            "127.0.0.1", port, 2, True, timeout=timedelta(seconds=120),
            wait_for_workers=False, master_listen_fd=listener.detach(),
        )  # fmt: skip
        out_path = tmp_path / "tokens.json"
        try:
            multiprocessing.spawn(
                _rank_main, args=([str(d) for d in model_dirs], port, str(out_path)), nprocs=2
            )
        except multiprocessing.ProcessExitedException as exc:
            done = sorted(p.name for p in tmp_path.glob("tokens.json.rank*.done"))
            raise AssertionError(f"{exc}; ranks that had finished their work: {done}") from exc
        del store
    return [
        [{int(seq_id): tokens for seq_id, tokens in run.items()} for run in runs]
        for runs in json.loads(out_path.read_text())
    ]


def test_two_ranks_equal_one_process_token_for_token(tiny_model_factory, tmp_path):
    """Greedy, fp32, quantization none. Each run's second half (after a reset) reuses the
    sequence and block ids of the first: a rank that kept the first run's sequences would
    refuse the plans and the ranks' collectives would no longer pair up."""
    from tests.worker.conftest import TinyModels

    model_dirs = [tiny_model_factory(arch) for arch in PARITY_ARCHITECTURES]
    expected = []
    for model_dir in model_dirs:
        models = TinyModels(model_dir, load(model_dir))
        expected.append([_scenario(models.engine(), seed=run) for run in range(NUM_RUNS)])
    assert run_two_ranks(model_dirs, tmp_path) == expected
