"""Tensor parallelism: N ranks share one model over torch.distributed, rank 0 serves.

`--tensor-parallel-size N` (N > 1) makes this worker a group of N ranks. Without
torchrun's variables the worker spawns ranks 1..N-1 itself on this host (spawn start
method; the rendezvous store and gloo bind 127.0.0.1 only) and is rank 0; under torchrun
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK set) each process joins as its
RANK. Backend: gloo on the CPU, NCCL on CUDA (rank r uses cuda:LOCAL_RANK).

Sharding (`shard_model`) follows the model's own transformers tp plan
(config.base_model_tp_plan): a "colwise" Linear keeps its rank's share of the output
features (so q/k/v keep whole heads, the MLP's gate/up whole columns), a "rowwise" one its
share of the input features, and its partial products are summed over the group
(`RowParallelLinear`, one all_reduce). The attention modules need no change: their
reshapes infer the head count from the tensors, and so does the paged attention. The
embeddings and the output head stay replicated: an embedding is a lookup (nothing to split
but memory), a vocabulary-parallel head would need a gather of the logits to rank 0 before
every sampling, and on the models served here (SmolLM2: tied embedding/head, 28 M of 135 M
parameters) the copies cost little. The KV pool of each rank holds its kv_heads / N heads
(kv_pool.KVGeometry reads TENSOR_PARALLEL_ATTRIBUTE off the sharded config), and the
number of blocks the hello announces is the minimum over ranks.

Rank 0 alone talks to the scheduler (pagoda.gpu_worker.server). Before it steps a plan it
broadcasts the plan's wire frames (pagoda.common.wire: its kind byte and protobuf bytes)
as a [kind, length] int64 tensor, then the bytes as a uint8 tensor (never pickle), and
every rank runs the same engine step. Only rank 0 samples; it broadcasts the sampled
token ids, which the other ranks' sequence tables record as their own (join_engine). A
reset (a new scheduler) and a stop travel the same way, and an idle rank 0 broadcasts a
keepalive so no collective waits past the group timeout. A rank that dies
(or a collective that fails) takes the group down: rank 0 exits EXIT_GROUP_LOST, which
the scheduler sees as a lost worker and systemd restarts.

Reduction order: a row-parallel layer's output is (x_0 W_0^T) + (x_1 W_1^T) + ... summed by
the collective, where one rank computes x W^T with its own accumulation order; the two
differ by float32 rounding (about 1e-7 relative per layer). Every rank receives the same
sum (gloo and NCCL reduce each element once and broadcast it), so the ranks never diverge
from each other; against N = 1 the logits differ in the last bits, and greedy output is
the same token unless the two best logits of some step are within that rounding (never
seen on the test models; bfloat16 makes such ties likelier).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn, Protocol

import torch
import torch.distributed as dist

from pagoda.common import step_codec, wire
from pagoda.common.logs import configure_logging
from pagoda.common.step import StepPlan
from pagoda.gpu_worker.config import WorkerConfig
from pagoda.gpu_worker.engine import SampledTokens, one_line
from pagoda.gpu_worker.kv_pool import TENSOR_PARALLEL_ATTRIBUTE
from pagoda.gpu_worker.server import EXIT_GROUP_LOST, EXIT_OK, EXIT_REFUSED

if TYPE_CHECKING:
    from pagoda.gpu_worker.paged_engine import PagedEngine

log = logging.getLogger("pagoda.worker.tensor_parallel")

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
COLUMN_STYLES = frozenset({"colwise"})
ROW_STYLES = frozenset({"rowwise"})
# Left as loaded: a per-head norm (Qwen3's q_norm/k_norm) works on any share of heads.
REPLICATED_STYLES = frozenset({"replicated_with_grad_allreduce"})
# Bounds a collective that waits on a hung (not dead: a dead peer's socket closes at once)
# rank; model loading happens before the first one, hence generous.
GROUP_TIMEOUT_S = 1800
KEEPALIVE_INTERVAL_S = 5.0
CHILD_JOIN_TIMEOUT_S = 30.0


class ForwardAndSample(Protocol):
    """PagedEngine.forward_and_sample: the forward, then the sampling when `samples`."""

    def __call__(self, plan: StepPlan, *, samples: bool) -> SampledTokens: ...


# What rank 0 broadcasts, the header's first element.
KEEPALIVE, PLAN, RESET, STOP = 0, 1, 2, 3
# Within a step: rank 0's sampled token ids (int64 bytes), or word that its sampling failed.
SAMPLED, SAMPLING_FAILED = 4, 5


class TensorParallelError(ValueError):
    """A model or a launch that cannot be split as asked; the message says why."""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    # Self-spawned: rank 0 listens on 127.0.0.1:port; torchrun: None (env:// rendezvous).
    port: int | None = None


def rendezvous_from_environ(environ: Mapping[str, str], tensor_parallel_size: int):
    """This process's place under torchrun, or None when torchrun did not start it."""
    present = [name for name in TORCHRUN_VARIABLES if name in environ]
    if not present:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
    if missing:
        raise TensorParallelError(
            f"torchrun variables are set ({', '.join(present)}) but {', '.join(missing)} "
            "are missing"
        )
    try:
        rank, world_size, local_rank = (
            int(environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        )
    except ValueError:
        raise TensorParallelError("RANK, WORLD_SIZE and LOCAL_RANK must be integers") from None
    if world_size == 1 and tensor_parallel_size == 1:
        return None
    if world_size != tensor_parallel_size:
        raise TensorParallelError(
            f"torchrun's WORLD_SIZE is {world_size} but --tensor-parallel-size is "
            f"{tensor_parallel_size}: set them equal (every rank of the world shares the model)"
        )
    if not 0 <= rank < world_size:
        raise TensorParallelError(f"RANK {rank} is outside WORLD_SIZE {world_size}")
    return Rendezvous(rank, world_size, local_rank)


# -- the group ------------------------------------------------------------------------------


class Group:
    """This process's rank in the initialized process group, and whether the group broke."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device  # where collective tensors live (NCCL needs them on the GPU)
        self.lost: str | None = None  # why the group is unusable, once it is

    def _collective(self, operation, *args, **kwargs) -> None:
        if self.lost is not None:  # a broken group may hang rather than fail again
            raise RuntimeError(f"the tensor-parallel group is lost: {self.lost}")
        try:
            operation(*args, **kwargs)
        except Exception as exc:  # gloo and NCCL raise RuntimeError subclasses
            self.lost = self.lost or one_line(exc)
            raise

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._collective(dist.all_reduce, tensor)

    def min_over_ranks(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._collective(dist.all_reduce, tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def broadcast_message(self, kind: int, payload: bytes = b"") -> None:
        """Rank 0: one message to every rank."""
        header = torch.tensor([kind, len(payload)], dtype=torch.int64, device=self.device)
        self._collective(dist.broadcast, header, src=0)
        if payload:
            body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            self._collective(dist.broadcast, body, src=0)

    def receive_message(self) -> tuple[int, bytes]:
        """Ranks 1..N-1: the next message rank 0 broadcasts."""
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        self._collective(dist.broadcast, header, src=0)
        kind, length = (int(v) for v in header.tolist())
        if not length:
            return kind, b""
        body = torch.empty(length, dtype=torch.uint8, device=self.device)
        self._collective(dist.broadcast, body, src=0)
        return kind, body.cpu().numpy().tobytes()


_group: Group | None = None  # set by init_group, for the hooks in model_loader and paged_engine


def active_group() -> Group | None:
    return _group


def init_group(rendezvous: Rendezvous, device: str, listener: socket.socket | None = None):
    """Join the process group (gloo on the CPU, NCCL on CUDA); the module's active group."""
    global _group
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if rendezvous.port is None:  # torchrun: MASTER_ADDR/MASTER_PORT in the environment
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
            timeout=timeout,
        )
    else:
        # The store's server runs where `listener` is: a socket bound to 127.0.0.1 before
        # the spawn (TCPStore alone would listen on every interface); the rest connect.
        store = dist.TCPStore(
            "127.0.0.1",
            rendezvous.port,
            rendezvous.world_size,
            listener is not None,
            timeout=timeout,
            master_listen_fd=listener.detach()
            if listener is not None
            else None,  # the store owns it now
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
            timeout=timeout,
        )
    _group = Group(rendezvous.rank, rendezvous.world_size, torch.device(device))
    return _group


def close_group(destroy: bool = True) -> None:
    """Forget the active group; `destroy` it too unless it is broken (a destroy can then
    hang on, or abort in, the connections to the ranks that went away)."""
    global _group
    _group = None
    if destroy and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def exit_process(exit_code: int) -> NoReturn:
    """End a rank's process with `exit_code`, without the interpreter's finalization: gloo's
    threads torn down there can abort the process ("terminate called without an active
    exception", SIGABRT), which replaced EXIT_GROUP_LOST (restartable) by a signal once in
    about 15 full-suite runs of the dead-rank test, and killed finished ranks of the
    parity test."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


# -- sharding -------------------------------------------------------------------------------


class RowParallelLinear(torch.nn.Module):
    """A Linear that holds this rank's share of the input features: its partial product
    is summed over the group. The bias lives on rank 0 only, so it is added once.
    (A wrapper, not a hook: int8 quantization swaps the inner Linear and keeps this.)"""

    def __init__(self, linear: torch.nn.Module, group: Group) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output = self.linear(hidden)
        self.group.all_reduce_sum(output)
        return output


@dataclass(frozen=True, slots=True)
class ShardPlan:
    column: list[str]  # module names under the base model
    row: list[str]


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def shard_plan(model, world_size: int) -> ShardPlan:
    """Which Linear layers are column- and row-parallel; TensorParallelError when the model
    cannot be split `world_size` ways."""
    text = model.config.get_text_config()
    tp_plan = getattr(text, "base_model_tp_plan", None) or {}
    if not tp_plan:
        raise TensorParallelError(
            f"{type(model).__name__} has no tensor-parallel plan in its transformers config "
            "(base_model_tp_plan); use --tensor-parallel-size 1"
        )
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    if num_heads % world_size or num_kv_heads % world_size:
        raise TensorParallelError(
            f"the model has {num_heads} attention heads and {num_kv_heads} KV heads; "
            f"--tensor-parallel-size {world_size} must divide both (q/k/v are split by whole "
            f"heads): use one of {[n for n in range(1, num_kv_heads + 1) if _divides(n, text)]}"
        )
    patterns = [(_pattern(key), key, style) for key, style in tp_plan.items()]
    column: list[str] = []
    row: list[str] = []
    for name, module in model.base_model.named_modules():
        matched = [(key, style) for pattern, key, style in patterns if pattern.fullmatch(name)]
        if not matched:
            continue
        key, style = matched[0]
        if style in REPLICATED_STYLES:
            continue
        if style not in COLUMN_STYLES | ROW_STYLES:
            raise TensorParallelError(
                f"{name}: tp style {style!r} ({key}) is not supported here (only colwise, "
                "rowwise and replicated); use --tensor-parallel-size 1"
            )
        if not isinstance(module, torch.nn.Linear):
            raise TensorParallelError(
                f"{name}: {style} names a {type(module).__name__}, not a Linear"
            )
        features = module.out_features if style in COLUMN_STYLES else module.in_features
        if features % world_size:
            raise TensorParallelError(f"{name}: {features} features do not split {world_size} ways")
        (column if style in COLUMN_STYLES else row).append(name)
    if not column or not row:
        raise TensorParallelError(
            f"the tp plan of {type(model).__name__} matched no column/row Linear pair"
        )
    return ShardPlan(column, row)


def _divides(n: int, text) -> bool:
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    return num_heads % n == 0 and num_kv_heads % n == 0


def _share(size: int, rank: int, world_size: int) -> slice:
    step = size // world_size
    return slice(rank * step, (rank + 1) * step)


def shard_model(model, group: Group):
    """Keep this rank's share of every column- and row-parallel Linear, in place (call it
    before quantization, so an int8 layer holds only its shard); returns the model."""
    plan = shard_plan(model, group.world_size)
    base = model.base_model
    modules = dict(base.named_modules())
    with torch.no_grad():
        for name in plan.column:
            linear = modules[name]
            rows = _share(linear.out_features, group.rank, group.world_size)
            linear.weight = torch.nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
            if linear.bias is not None:
                linear.bias = torch.nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
            linear.out_features = rows.stop - rows.start
        for name in plan.row:
            linear = modules[name]
            columns = _share(linear.in_features, group.rank, group.world_size)
            linear.weight = torch.nn.Parameter(
                linear.weight[:, columns].clone(), requires_grad=False
            )
            if linear.bias is not None and group.rank != 0:
                linear.bias = None
            linear.in_features = columns.stop - columns.start
            parent_name, _, child_name = name.rpartition(".")
            parent = base.get_submodule(parent_name) if parent_name else base
            setattr(parent, child_name, RowParallelLinear(linear, group))
    setattr(model.config.get_text_config(), TENSOR_PARALLEL_ATTRIBUTE, group.world_size)
    log.info(
        "rank %d/%d: %d column- and %d row-parallel Linear layers sharded",
        group.rank,
        group.world_size,
        len(plan.column),
        len(plan.row),
    )
    return model


def shard_if_grouped(model):
    """The hook in model_loader.load_model: shard when a group is active."""
    group = active_group()
    return model if group is None else shard_model(model, group)


def agree_num_kv_blocks(num_blocks: int) -> int:
    """The hook in paged_engine.load_engine: the fewest blocks any rank can hold (a block id
    the scheduler hands out must exist on every rank)."""
    group = active_group()
    return num_blocks if group is None else group.min_over_ranks(num_blocks)


# -- rank 0: the scheduler's side -----------------------------------------------------------


class GroupLeader:
    """What pagoda.gpu_worker.server calls on rank 0 (duck-typed there: the server imports
    no torch): forward plans and resets, keep the group alive, report its loss."""

    def __init__(self, group: Group, children=None) -> None:
        self.group = group
        self._children = children  # torch.multiprocessing ProcessContext, when self-spawned
        self._last_sent_s = time.monotonic()

    def _broadcast(self, kind: int, payload: bytes = b"") -> None:
        if self.group.lost is None:
            with contextlib.suppress(Exception):  # recorded in group.lost; lost() reports it
                self.group.broadcast_message(kind, payload)
        self._last_sent_s = time.monotonic()

    def send_plan(self, frames: list[bytes]) -> None:
        """`frames`: the plan as received (wire.encode's kind byte and protobuf bytes)."""
        self._broadcast(PLAN, b"".join(frames))

    def send_reset(self) -> None:
        self._broadcast(RESET)

    def keepalive(self) -> None:
        if time.monotonic() - self._last_sent_s >= KEEPALIVE_INTERVAL_S:
            self._broadcast(KEEPALIVE)

    def lost(self) -> str | None:
        """Why the group can no longer serve, or None."""
        if self.group.lost is not None:
            return self.group.lost
        for rank, process in enumerate(self._processes(), start=1):
            if process.exitcode is not None:
                self.group.lost = f"rank {rank} exited with {process.exitcode}"
        return self.group.lost

    def _processes(self) -> list:
        return [] if self._children is None else list(self._children.processes)

    def shutdown(self, exit_code: int) -> None:
        """Stop the other ranks: a STOP message when the group still works, then the
        self-spawned processes are joined (and terminated past the timeout)."""
        if exit_code == EXIT_OK and self.lost() is None:
            self._broadcast(STOP)
        deadline_s = time.monotonic() + (CHILD_JOIN_TIMEOUT_S if exit_code == EXIT_OK else 0)
        for process in self._processes():
            process.join(max(0.0, deadline_s - time.monotonic()))
            if process.exitcode is None:
                process.kill()  # they ignore SIGTERM (see _spawned_rank)
                process.join(CHILD_JOIN_TIMEOUT_S)


# -- ranks 1..N-1 ---------------------------------------------------------------------------


class GroupSampling:
    """A rank's share of every step (PagedEngine.group_sampling): every rank runs the
    forward, only rank 0 samples, and it broadcasts the sampled token ids, which the other
    ranks take as theirs; every rank's sequence table thus records the same tokens (a later
    plan may feed them as placeholders)."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def compute(self, plan: StepPlan, forward_and_sample: ForwardAndSample) -> SampledTokens:
        if self.group.rank == 0:
            return self._sample_and_share(plan, forward_and_sample)
        return self._take_rank_0s(plan, forward_and_sample)

    def _sample_and_share(
        self, plan: StepPlan, forward_and_sample: ForwardAndSample
    ) -> SampledTokens:
        samples = any(plan.sample)
        try:
            sampled = forward_and_sample(plan, samples=True)
        except Exception:
            if samples:  # the others wait for this step's tokens: tell them there are none
                self.group.broadcast_message(SAMPLING_FAILED)
            raise
        if samples:
            tokens = torch.tensor(sampled.token_ids, dtype=torch.int64)
            self.group.broadcast_message(SAMPLED, tokens.numpy().tobytes())
        return sampled

    def _take_rank_0s(self, plan: StepPlan, forward_and_sample: ForwardAndSample) -> SampledTokens:
        sampled = forward_and_sample(plan, samples=False)
        if any(plan.sample):
            kind, payload = self.group.receive_message()
            if kind != SAMPLED:
                raise RuntimeError("rank 0 sampled nothing in this step")
            sampled.token_ids = torch.frombuffer(bytearray(payload), dtype=torch.int64).tolist()
        return sampled


def join_engine(engine: PagedEngine, group: Group) -> PagedEngine:
    """Make `engine` this rank's part of the group's steps (see GroupSampling); returns it."""
    engine.group_sampling = GroupSampling(group)
    return engine


def follow(engine: PagedEngine, group: Group) -> int:
    """Run every plan rank 0 broadcasts (see join_engine) until STOP (EXIT_OK) or the
    group breaks (EXIT_GROUP_LOST)."""
    join_engine(engine, group)
    while True:
        try:
            kind, payload = group.receive_message()
        except Exception as exc:
            log.error("rank %d: lost rank 0: %s", group.rank, one_line(exc))
            return EXIT_GROUP_LOST
        if kind == PLAN:
            # The frames rank 0 received (and wire checked there): kind byte, then the body.
            plan = step_codec.decode_plan(wire.decode([payload[:1], payload[1:]]))
            try:
                engine.step(plan)
            except Exception as exc:  # the same backstop as the server's
                log.error("step %d: engine crashed: %s", plan.step_id, one_line(exc))
                engine.table.forget(plan.named_seq_ids())
            if group.lost is not None:
                log.error(
                    "rank %d: the group broke in step %d: %s", group.rank, plan.step_id, group.lost
                )
                return EXIT_GROUP_LOST
        elif kind == RESET:
            engine.reset()
        elif kind == STOP:
            return EXIT_OK


# -- launching ------------------------------------------------------------------------------


def rank_device(requested: str, local_rank: int) -> str:
    """The device of a rank: cuda:LOCAL_RANK when the request means CUDA, else cpu."""
    from pagoda.gpu_worker.paged_engine import pick_device

    device = pick_device(requested)
    if device == "cpu":
        return device
    if device != "cuda":
        raise TensorParallelError(
            f"--device {requested} names one GPU; with --tensor-parallel-size use --device "
            "cuda (or auto): rank r runs on cuda:LOCAL_RANK"
        )
    return f"cuda:{local_rank}"


def _die_with_parent() -> None:
    """A self-spawned rank must not outlive rank 0 (Linux: PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _spawned_rank(index: int, config: WorkerConfig, port: int, world_size: int) -> None:
    """Entry point of a self-spawned rank (index 0 is rank 1); exits with its code."""
    _die_with_parent()
    # Ctrl-C and systemd's SIGTERM reach the whole process group: rank 0 decides, and
    # sends STOP (or dies, and PDEATHSIG follows).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = index + 1
    configure_logging(config.log_level, config.log_format, service="worker", rank=rank)
    exit_process(_run_rank(config, Rendezvous(rank, world_size, rank, port), None))


def _run_rank(
    config: WorkerConfig,
    rendezvous: Rendezvous,
    curve_client,
    listener: socket.socket | None = None,
    children=None,
) -> int:
    from pagoda.gpu_worker.config import QuantizationError
    from pagoda.gpu_worker.model_loader import ModelNotFoundError
    from pagoda.gpu_worker.paged_engine import load_engine
    from pagoda.gpu_worker.server import WorkerServer

    device = rank_device(config.device, rendezvous.local_rank)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N ranks of one host share its cores: each rank's default (every core) makes idle
        # OpenMP threads spin against the other ranks, and every all_reduce then waits for
        # the rank that was descheduled.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // rendezvous.world_size))
    group = init_group(rendezvous, device, listener)
    leader = GroupLeader(group, children) if rendezvous.rank == 0 else None
    exit_code = EXIT_GROUP_LOST
    try:
        try:
            engine = load_engine(replace(config, device=device))
        except (ModelNotFoundError, QuantizationError, TensorParallelError) as exc:
            log.error("rank %d cannot load the model: %s", rendezvous.rank, exc)
            exit_code = EXIT_REFUSED
            return exit_code
        except Exception as exc:
            if group.lost is None:
                raise
            log.error("rank %d: the group broke while loading: %s", rendezvous.rank, exc)
            return exit_code
        if leader is None:
            exit_code = follow(engine, group)
            return exit_code
        join_engine(engine, group)
        exit_code = WorkerServer(
            engine,
            config.zmq_endpoint,
            curve_client,
            group=leader,
            hang_timeout_s=config.hang_timeout_s,
        ).run()
        return exit_code
    finally:
        if leader is not None:
            leader.shutdown(exit_code)
        close_group(destroy=group.lost is None and exit_code != EXIT_GROUP_LOST)


def run(config: WorkerConfig, curve_client=None, environ: Mapping[str, str] | None = None):
    """`python -m pagoda.gpu_worker --tensor-parallel-size N`: this process's rank, serving
    (rank 0) or following; returns the exit code."""
    environ = os.environ if environ is None else environ
    try:
        rendezvous = rendezvous_from_environ(environ, config.tensor_parallel_size)
    except TensorParallelError as exc:
        log.error("%s", exc)
        return EXIT_REFUSED
    if rendezvous is not None:  # torchrun started every rank
        if rendezvous.rank != 0:
            configure_logging(
                config.log_level, config.log_format, service="worker", rank=rendezvous.rank
            )
        return _run_rank(config, rendezvous, curve_client if rendezvous.rank == 0 else None)
    import torch.multiprocessing as multiprocessing

    world_size = config.tensor_parallel_size
    # Children inherit these: the gloo and NCCL connections stay on the loopback interface.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        children = multiprocessing.start_processes(
            _spawned_rank,
            args=(config, port, world_size),
            nprocs=world_size - 1,
            join=False,
            start_method="spawn",
        )
        log.info(
            "tensor parallel: rank 0 of %d; ranks 1..%d are processes %s",
            world_size,
            world_size - 1,
            [p.pid for p in children.processes],
        )
        rendezvous = Rendezvous(0, world_size, 0, port)
        return _run_rank(config, rendezvous, curve_client, listener, children)
