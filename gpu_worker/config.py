"""The worker's configuration: flags > PAGODA_WORKER_* environment > TOML file > defaults.

Built once in `__main__` into a frozen `WorkerConfig`, validated, then passed down.
This is the only worker module that reads the environment (besides the model cache
location in model_loader). Imports no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagoda.common.logs import add_log_flags, log_setting_problems
from pagoda.common.settings import (
    LoadedConfig,
    add_config_flags,
    default_zmq_endpoint,
    insecure_tcp_problem,
    load_flags,
)
from pagoda.gpu_worker.attention import BACKEND_NAMES

ENV_PREFIX = "PAGODA_WORKER_"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8")  # see pagoda.gpu_worker.quantization
LAUNCH_AHEAD = ("auto", "on", "off")  # see pagoda.gpu_worker.engine
MAX_TENSOR_PARALLEL_SIZE = 64  # a sanity bound: one host's GPUs, or a torchrun world
ATTENTION_BACKENDS = BACKEND_NAMES  # pagoda.gpu_worker.attention's package imports no torch


class QuantizationError(ValueError):
    """A quantization this device cannot run; the message says what to use instead.
    (Here, not in quantization.py, so __main__ can catch it without importing torch.)"""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    zmq_endpoint: str
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"  # auto: int8 on CPU (float32), none on CUDA
    attention_backend: str = "auto"  # auto: triton on CUDA, cpu on a CPU, when they load
    block_size: int = 16
    kv_cache_gib: float = 1.0  # pool budget on CPU
    gpu_memory_utilization: float = 0.85  # fraction of the CUDA memory for everything
    max_num_batched_tokens: int = 2048  # the largest step expected (KV sizing on CUDA)
    num_kv_blocks: int | None = None  # overrides both budgets
    max_context_tokens: int | None = None  # None: the model config's position limit
    tensor_parallel_size: int = 1  # ranks sharing the model (pagoda.gpu_worker.tensor_parallel)
    zmq_curve_secret_key: str | None = None  # this worker's CurveZMQ .key_secret file
    zmq_curve_server_key: str | None = None  # the scheduler's public .key file
    zmq_allow_insecure_tcp: bool = False  # a tcp:// endpoint without CurveZMQ keys
    log_level: str = "INFO"
    log_format: str = "text"  # text or json lines (pagoda.common.logs)
    hang_timeout_s: float = 300.0  # a step running longer is taken as hung (step_pulse.py)
    fail_on_token_id: int | None = None  # fault-injection hook for tests
    dummy_step_ms: float = 0.0  # --model dummy: the least wall time of each step's compute
    cuda_graphs: bool = True  # decode steps replay captured graphs (CUDA + triton only)
    piecewise_graphs: bool = True  # with cuda_graphs: other steps replay the dense parts
    fused_ops: bool = True  # fused RMSNorm, SiLU*up and RoPE (CUDA + triton, or CPU + int8)
    launch_ahead: str = "auto"  # step N+1 enqueued before N is read: auto is on CUDA only
    # --model dummy, tests only: the process dies at once on a step feeding this token id.
    dummy_crash_on_token_id: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if "://" not in self.zmq_endpoint:
            problems.append(
                f"--zmq-endpoint {self.zmq_endpoint!r} needs a scheme (ipc:// or tcp://)"
            )
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            problems.append(f"--device must be one of {', '.join(DEVICES)} or cuda:N")
        if self.dtype not in DTYPES:
            problems.append(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            problems.append(f"--quantization must be one of {', '.join(QUANTIZATIONS)}")
        elif self.quantization == "int8" and self.device.startswith("cuda"):
            problems.append("--quantization int8 runs only on the CPU; use none or auto on CUDA")
        elif self.quantization == "int8" and self.dtype in ("bfloat16", "float16"):
            problems.append("--quantization int8 needs float32 weights (--dtype auto or float32)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            problems.append(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        elif self.attention_backend == "triton" and self.device == "cpu":
            problems.append("--attention-backend triton runs only on CUDA")
        elif self.attention_backend == "cpu" and self.device.startswith("cuda"):
            problems.append("--attention-backend cpu runs only on the CPU")
        if self.launch_ahead not in LAUNCH_AHEAD:
            problems.append(f"--launch-ahead must be one of {', '.join(LAUNCH_AHEAD)}")
        elif self.launch_ahead == "on" and self.is_dummy:
            problems.append("--launch-ahead on needs a real model (the dummy computes at once)")
        if not 1 <= self.block_size <= 1024:
            problems.append("--block-size must be between 1 and 1024 tokens")
        if self.kv_cache_gib <= 0:
            problems.append("--kv-cache-gib must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append("--gpu-memory-utilization must be in (0, 1]")
        if self.max_num_batched_tokens < 1:
            problems.append("--max-num-batched-tokens must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            problems.append("--num-kv-blocks must be at least 1")
        if self.max_context_tokens is not None and self.max_context_tokens < 1:
            problems.append("--max-context-tokens must be at least 1")
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            problems.append(
                f"--tensor-parallel-size must be between 1 and {MAX_TENSOR_PARALLEL_SIZE}"
            )
        elif self.tensor_parallel_size > 1 and self.is_dummy:
            problems.append("--tensor-parallel-size needs a real model (the dummy has no weights)")
        if (self.zmq_curve_secret_key is None) != (self.zmq_curve_server_key is None):
            problems.append("--zmq-curve-secret-key and --zmq-curve-server-key go together")
        insecure = insecure_tcp_problem(
            self.zmq_endpoint,
            curve=self.zmq_curve_secret_key is not None,
            allow_insecure_tcp=self.zmq_allow_insecure_tcp,
        )
        if insecure is not None:
            problems.append(insecure)
        if not self.hang_timeout_s >= 0:
            problems.append("--hang-timeout-s must be >= 0")
        if not 0 <= self.dummy_step_ms <= 60_000:
            problems.append("--dummy-step-ms must be between 0 and 60000")
        if self.dummy_crash_on_token_id is not None and not self.is_dummy:
            problems.append("--dummy-crash-on-token-id needs --model dummy")
        problems += log_setting_problems(self.log_level, self.log_format)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def is_dummy(self) -> bool:
        return self.model == "dummy"


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("", "none") else int(text)


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (whose meaning each help text spells out)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def resolves_launch_ahead(setting: str, device: str) -> bool:
    """Whether --launch-ahead `setting` (LAUNCH_AHEAD) launches steps ahead on `device`
    ("cpu", "cuda", "cuda:N"): auto does on CUDA only."""
    return setting == "on" or (setting == "auto" and device.startswith("cuda"))


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.gpu_worker",
        description=(
            "Pagoda worker: loads a causal LM, owns the paged KV pool and executes the "
            "scheduler's step plans over ZeroMQ. Every flag may also be set through the "
            f"environment as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}BLOCK_SIZE=32); flags win."
        ),
        formatter_class=_HelpFormatter,
    )
    add = parser.add_argument
    add(
        "--zmq-endpoint",
        default=default_zmq_endpoint(environ),
        help="scheduler endpoint to connect to (ipc://PATH or tcp://HOST:PORT); "
        "the scheduler binds it, the worker connects; an ipc parent directory is created 0700",
    )
    add(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct), 'dummy' (no weights, deterministic "
        "tokens), a model directory, a .gguf file or a hub id",
    )
    add("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N")
    add(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights and KV dtype; auto is float32 on CPU, bfloat16 on CUDA where the GPU "
        "supports it (else float16)",
    )
    add(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="int8: quantized Linear layers (CPU only): Q4_1 weights (a GGUF's, as the "
        "default model's) kept as 4-bit groups and rebuilt exactly, float32 activations; "
        "other weights int8 per channel, per-token int8 activations (docs/benchmarks.md "
        "'int8 forward'); none: the weights as loaded, exact; auto: int8 on the CPU with "
        "float32 weights, none otherwise",
    )
    add(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="paged attention: reference (gather + SDPA in plain torch, exact), triton (one "
        "kernel per layer, CUDA only), cpu (Pagoda's C kernel, one call per layer, CPU only; "
        "built on first use); auto: triton on CUDA when it imports, cpu on a CPU where it "
        "builds, else reference",
    )
    add("--block-size", type=int, default=16, help="tokens per KV block")
    add("--kv-cache-gib", type=float, default=1.0, help="KV pool size on CPU, GiB")
    add(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="on CUDA, fraction of the device's memory this worker may fill: weights, the "
        "activations of the largest step (measured by a profiling step before the pool exists) "
        "and the KV pool, which gets the rest",
    )
    add(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="on CUDA, tokens in the profiling step that sizes the KV pool: the scheduler's "
        "--max-num-batched-tokens (a larger step could run out of memory)",
    )
    add(
        "--num-kv-blocks",
        type=_optional_int,
        default=None,
        help="exact number of KV blocks (overrides both budgets; default 4096 for --model dummy)",
    )
    add(
        "--max-context-tokens",
        type=_optional_int,
        default=None,
        help="longest sequence announced to the scheduler (default: the model config's "
        "max_position_embeddings / n_positions; 8192 for dummy)",
    )
    add(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks that share the model, sharded by heads and MLP columns over "
        "torch.distributed (gloo on CPU, NCCL on CUDA); rank 0 talks to the scheduler. "
        "Without torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT the worker spawns the "
        "ranks itself on this host; under torchrun it joins as RANK (WORLD_SIZE must match)",
    )
    add(
        "--zmq-curve-secret-key",
        default=None,
        help="this worker's CurveZMQ .key_secret file: encrypts the link to the scheduler, "
        "which must list its public .key (see python -m pagoda.common.curve)",
    )
    add(
        "--zmq-curve-server-key",
        default=None,
        help="the scheduler's CurveZMQ public .key file (with --zmq-curve-secret-key)",
    )
    add(
        "--zmq-allow-insecure-tcp",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="accept a tcp:// endpoint without CurveZMQ keys (plaintext and unauthenticated: "
        "whoever reaches the port can pose as the scheduler); logged as a warning",
    )
    add_log_flags(parser)
    add(
        "--hang-timeout-s",
        type=float,
        default=300.0,
        help="once a step has run half a second the worker sends a heartbeat (and a systemd "
        "watchdog keep-alive) every half second, so a step longer than the scheduler's "
        "--worker-timeout-s is not a lost worker; past this many seconds the step counts as hung and the beats "
        "stop, so the scheduler's timeout and WatchdogSec apply (0: no beats during a step)",
    )
    add(
        "--fail-on-token-id",
        type=_optional_int,
        default=None,
        help="fault-injection hook for tests: any step that feeds this token id fails in the "
        "forward (the worker answers with step_error and keeps serving)",
    )
    add(
        "--dummy-crash-on-token-id",
        type=_optional_int,
        default=None,
        help="with --model dummy, a test's fault injection: the worker process dies at once "
        "(as if it segfaulted) on any step that feeds this token id",
    )
    add(
        "--cuda-graphs",
        type=_bool,
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA with the triton attention backend, capture the forward of decode-only "
        "steps at padded batch sizes 1, 2, 4, 8, 16, 24 .. 256 before saying hello, and "
        "replay them (pagoda.gpu_worker.cuda_graphs); --no-cuda-graphs runs every step eagerly",
    )
    add(
        "--piecewise-graphs",
        type=_bool,
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --cuda-graphs, also capture the dense parts of the forward (all but "
        "attention) at token buckets 16 .. --max-num-batched-tokens, for the steps a decode "
        "graph cannot take, prompt chunks included (pagoda.gpu_worker.piecewise_graphs); "
        "--no-piecewise-graphs runs those steps eagerly",
    )
    add(
        "--fused-ops",
        type=_bool,
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the model's RMSNorm (with its residual add), SiLU*up and RoPE as fused "
        "kernels rounded where the model's own code rounds (pagoda.gpu_worker.fused_model): "
        "Triton's on CUDA with the triton attention backend, Pagoda's C kernels on the CPU "
        "under --quantization int8; --no-fused-ops keeps the model's code",
    )
    add(
        "--launch-ahead",
        default="auto",
        choices=LAUNCH_AHEAD,
        help="enqueue step N+1 on the device before step N's tokens are read back: N+1's "
        "rows feed N's tokens there, so the device runs N+1 while the host answers N "
        "(pagoda.gpu_worker.engine); not under tensor parallelism; auto: on CUDA. On a "
        "CPU the forward runs on the host, so 'on' only delays each result (it waits "
        "for the next plan): for tests of the bookkeeping",
    )
    add(
        "--dummy-step-ms",
        type=float,
        default=0.0,
        help="with --model dummy, a simulated forward: each step's compute takes at least "
        "this many milliseconds of wall time (it sleeps for what the loop did not use)",
    )
    add_config_flags(parser, environ, ENV_PREFIX, example=" (block_size = 32)")
    return parser


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> LoadedConfig:
    """Flags > environment > TOML file > defaults, validated (pagoda.common.settings)."""
    return load_flags(build_parser, WorkerConfig, ENV_PREFIX, argv, environ)


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> WorkerConfig:
    """The validated config alone (see load_config)."""
    return load_config(argv, environ).config


def describe(loaded: LoadedConfig) -> str:
    """One line per setting, `name = value  # source`, as the other services print them."""
    return loaded.describe()
