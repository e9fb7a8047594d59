"""Pagoda's Q4_1 x float32 GEMM for the CPU (kernels/q4_1_gemm.c), built on first use.

Q4Linear's fast path on a CPU with AVX2 and FMA: each weight rebuilt in float32 exactly as
the float model holds it (d * q + m), float32 activations, and each output element one
float32 sum over the inputs in their order, so a row's bits never depend on the rest of
its batch or on the number of threads. Against PyTorch's int4 GEMM on this kind of CPU it
keeps activations in float32 instead of bfloat16 and is faster: weights are rebuilt once
per strip of outputs and shared by every row of the call (docs/benchmarks.md, "int8
forward").

The C source is compiled with the machine's C compiler into a cache folder, once per
source and flags (about a second), and loaded with ctypes; the call releases the GIL and
runs on the OpenMP runtime that PyTorch has already loaded. Where there is no compiler,
no AVX2 or the build fails, `load()` gives None (and says why once) and Q4Linear runs on
PyTorch's int4 GEMM instead; GetModelInfo's `numerics` says which.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("pagoda.q4_kernel")

SOURCE = Path(__file__).with_name("kernels") / "q4_1_gemm.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
TILE = 8  # outputs per tile: one AVX2 register of float32
GROUP = 32  # inputs per Q4_1 group
SCHEME = "float32 activations, float32 sums in input order (Pagoda's AVX2 Q4_1 kernel)"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pagoda" / "kernels"


@dataclass(frozen=True, slots=True)
class PackedQ4:
    """A [out, in] Q4_1 weight in the kernel's layout (see the C source): `levels` int32
    [out / 8, in], eight 4-bit levels per word; `scales` and `minimums` float32
    [out / 8, in / 32, 8]."""

    levels: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    out_features: int
    in_features: int


def pack(levels: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> PackedQ4:
    """Q4_1 groups (levels [out, in] in 0..15, scales and minimums [out, in / 32]) in the
    kernel's layout; out a multiple of 8, in of 32."""
    out_features, in_features = levels.shape
    if out_features % TILE or in_features % GROUP:
        raise ValueError(f"a {out_features} x {in_features} weight is not whole tiles")
    tiles = levels.reshape(out_features // TILE, TILE, in_features).to(torch.int64)
    words = torch.zeros(out_features // TILE, in_features, dtype=torch.int64)
    for j in range(TILE):
        words |= tiles[:, j, :] << (4 * j)
    # The same 32 bits as int32 (the top level's high bit lands in the sign).
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()

    def per_tile(values: torch.Tensor) -> torch.Tensor:
        grouped = values.float().reshape(out_features // TILE, TILE, in_features // GROUP)
        return grouped.permute(0, 2, 1).contiguous()

    return PackedQ4(words, per_tile(scales), per_tile(minimums), out_features, in_features)


class Q4Kernel:
    """The loaded library: `matmul(x, packed, bias)` is x W^T + bias, float32."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.q4_1_gemm
        function.restype = ctypes.c_int
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        function.argtypes = [pointer, size, size, size, pointer, pointer, pointer, pointer]
        function.argtypes += [pointer, ctypes.c_int]
        self._gemm = function

    def matmul(
        self, x: torch.Tensor, packed: PackedQ4, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [rows, in] float32 (made contiguous here) -> [rows, out] float32."""
        rows = x.contiguous()
        out = torch.empty(rows.shape[0], packed.out_features)
        if rows.shape[0] == 0:
            return out
        failed = self._gemm(
            rows.data_ptr(),
            rows.shape[0],
            packed.in_features,
            packed.out_features,
            packed.levels.data_ptr(),
            packed.scales.data_ptr(),
            packed.minimums.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the Q4_1 kernel could not allocate its weight strip")
        return out


@functools.cache
def load(cache_dir: Path | None = None) -> Q4Kernel | None:
    """The kernel, built if this source and these flags were never built in `cache_dir`;
    None where it cannot run here (the reason is logged once)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        log.info("Q4_1 kernel: this CPU has no AVX2 (%s); using PyTorch's int4 GEMM", capability)
        return None
    try:
        return Q4Kernel(ctypes.CDLL(str(_build(cache_dir or default_cache_dir()))))
    except (OSError, subprocess.SubprocessError, BuildError) as exc:
        log.warning("Q4_1 kernel unavailable (%s); using PyTorch's int4 GEMM", exc)
        return None


class BuildError(Exception):
    pass


def _build(cache_dir: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise BuildError("no C compiler (cc or gcc) on the PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_dir / f"q4_1_gemm-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: a process that loads it meanwhile
    # sees the whole library or none.
    handle, partial = tempfile.mkstemp(dir=cache_dir, suffix=".so.partial")
    os.close(handle)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", partial],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target
