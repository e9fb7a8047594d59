"""Pagoda's CPU kernels (gpu_worker/kernels/*.c), built on first use and called with ctypes.

All float32 on AVX2 + FMA (the GEMMs and the attention in 512-bit registers where the CPU
has AVX-512, with the same bits) but for the head's int32 pass on AVX-512 VNNI, all
batch-invariant by construction (a row's bits never depend on the rest of its call, on the
number of threads, or on the vector width):
- `q4_1_matmul`: y = x W^T + b with W held as Q4_1 groups, each weight rebuilt exactly as
  the float model holds it (d * q + m) and each output one float32 sum over the inputs in
  their order: Q4Linear's fast path (quantization.py);
- `int8_matmul`: the same over int8 weights with one scale per output row, and
  `int8_dot_matmul` (int8_dot.c, where the CPU has AVX-512 VNNI): those int8 weights
  against each row of x rounded to int8, summed exactly in int32: the rescored output
  head's first pass (quantization.py, RescoredHead);
- `paged_attention`: one call per layer over the whole step, reading keys and values
  through the block table in place (the `cpu` attention backend, attention/cpu.py);
- `rms_norm` (with its residual add), `silu_and_mul` and `rotary_in_place`: a decoder
  layer's dense ops between its GEMMs, one call each over the step, rounded where HF's
  code rounds (elementwise.c), patched in by fused_model.py under `int8`.

The sources are compiled together by the machine's C compiler into a cache folder, once
per sources and flags (about two seconds), and loaded with ctypes; each call releases the
GIL and runs on the OpenMP runtime that PyTorch has already loaded. Where there is no
compiler, no AVX2 or the build fails, `load()` gives None and says why once; the callers
then keep PyTorch's ops (Q4Linear its int4 GEMM, attention the reference backend), and
GetModelInfo says which ran.
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

log = logging.getLogger("pagoda.cpu_kernels")

KERNELS_DIR = Path(__file__).with_name("kernels")
SOURCES = tuple(
    KERNELS_DIR / name
    for name in (
        "gemm.c",
        "int8_dot.c",
        "paged_attention.c",
        "elementwise.c",
        "select.c",
        "decoder.c",
    )
)
HEADERS = (KERNELS_DIR / "simd.h",)
# No contraction: each product and sum in the sources rounds where it is written (an
# FMA appears only where an intrinsic asks for one).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
TILE = 8  # outputs per tile of the Q4_1 kernel: one AVX2 register of float32
DOT_OUTPUTS = 64  # outputs per work item of int8_dot.c: four registers of int32
GROUP = 32  # inputs per Q4_1 group
Q4_SCHEME = "float32 activations, float32 sums in input order (Pagoda's Q4_1 kernel)"


def default_cache_dir() -> Path:
    """Beside the converted models (model_loader.cache_root): $XDG_CACHE_HOME/pagoda/kernels,
    which the systemd unit points at its CacheDirectory."""
    from pagoda.gpu_worker.model_loader import cache_root

    return cache_root().parent / "kernels"


@dataclass(frozen=True, slots=True)
class PackedQ4:
    """A [out, in] Q4_1 weight in the kernel's layout (see gemm.c): `levels` int32
    [ceil(out / 16), in, 2], eight 4-bit levels per word, the tiles of 8 outputs in pairs;
    `scales` and `minimums` float16 (Q4_1's d and m, which q4_1_blocks finds float16
    exactly) [out / 8, in / 32, 8]."""

    levels: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    out_features: int
    in_features: int


def pack_q4_1(levels: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> PackedQ4:
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
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    # Tiles in pairs, input by input: [tiles / 2, in, 2] (a last odd tile beside zeros),
    # so the AVX-512 loops read a pair's two words at an input in one load.
    if words.shape[0] % 2:
        words = torch.cat([words, torch.zeros_like(words[:1])])
    words = words.view(-1, 2, in_features).transpose(1, 2).contiguous()

    def per_tile(values: torch.Tensor) -> torch.Tensor:
        # float16, as Q4_1 holds them: a quarter less to read a step than float32, and
        # the kernel widens each exactly.
        half = values.half()
        if not torch.equal(half.float(), values.float()):
            raise ValueError("Q4_1 scales and minimums must be float16 values")
        grouped = half.reshape(out_features // TILE, TILE, in_features // GROUP)
        return grouped.permute(0, 2, 1).contiguous()

    return PackedQ4(words, per_tile(scales), per_tile(minimums), out_features, in_features)


@dataclass(frozen=True, slots=True)
class PackedInt8:
    """A [out, in] weight as int8 with one symmetric scale per output row, in the kernel's
    layout (see gemm.c): `levels` int8 [out / 8, in, 8], `scales` float32 [out]."""

    levels: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int


def pack_int8(weight: torch.Tensor) -> PackedInt8:
    """`weight` [out, in] (out a multiple of 8, in of 32) rounded per row to int8 at
    max |w| / 127."""
    out_features, in_features = weight.shape
    if out_features % TILE or in_features % GROUP:
        raise ValueError(f"a {out_features} x {in_features} weight is not whole tiles")
    levels, scales = _int8_rows(weight)
    tiles = levels.reshape(out_features // TILE, TILE, in_features).transpose(1, 2)
    return PackedInt8(tiles.contiguous(), scales, out_features, in_features)


@dataclass(frozen=True, slots=True)
class PackedInt8Dot:
    """A [out, in] weight as int8 with one symmetric scale per output row, in int8_dot.c's
    layout: `levels` int8 [out / 16, in / 4, 16, 4], `offsets` int32 [out] (128 times each
    row's sum of levels), `scales` float32 [out]."""

    levels: torch.Tensor
    offsets: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int


def pack_int8_dot(weight: torch.Tensor) -> PackedInt8Dot:
    """`weight` [out, in] (out a multiple of 64, in of 8 and below 65,536, where the int32
    sums cannot overflow) rounded per row to int8 at max |w| / 127, as pack_int8 rounds it."""
    out_features, in_features = weight.shape
    if out_features % DOT_OUTPUTS or in_features % 8 or in_features >= 65536:
        raise ValueError(f"a {out_features} x {in_features} weight is not whole tiles")
    levels, scales = _int8_rows(weight)
    offsets = levels.to(torch.int32).sum(dim=1, dtype=torch.int32) * 128
    quads = levels.reshape(out_features // 16, 16, in_features // 4, 4).transpose(1, 2)
    return PackedInt8Dot(quads.contiguous(), offsets, scales, out_features, in_features)


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `weight` rounded to int8 at max |w| / 127: levels [out, in], scales [out]."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    levels = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return levels, scales.contiguous()


_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64


# decoder.c's structs, field for field.
class Q4Weight(ctypes.Structure):
    _fields_ = [
        ("levels", _POINTER),
        ("scales", _POINTER),
        ("mins", _POINTER),
        ("bias", _POINTER),
        ("k", _SIZE),
        ("n", _SIZE),
    ]

    @classmethod
    def of(cls, packed: PackedQ4, bias: torch.Tensor | None) -> Q4Weight:
        return cls(
            packed.levels.data_ptr(),
            packed.scales.data_ptr(),
            packed.minimums.data_ptr(),
            None if bias is None else bias.data_ptr(),
            packed.in_features,
            packed.out_features,
        )


class DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _POINTER),
        ("post_norm", _POINTER),
        ("q_norm", _POINTER),
        ("k_norm", _POINTER),
        ("input_eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
        ("q_eps", ctypes.c_float),
        ("k_eps", ctypes.c_float),
        ("qkv", Q4Weight),
        ("o_proj", Q4Weight),
        ("gate_up", Q4Weight),
        ("down", Q4Weight),
        ("cos_sin", _POINTER),
        ("scale", ctypes.c_float),
        ("sliding_window", _SIZE),
        ("key_cache", _POINTER),
        ("value_cache", _POINTER),
    ]


class DecoderShape(ctypes.Structure):
    _fields_ = [
        (name, _SIZE)
        for name in (
            "hidden",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
            "block_size",
        )
    ]


class DecoderStep(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _SIZE),
        ("num_seqs", _SIZE),
        ("max_context_len", _SIZE),
        ("table_width", _SIZE),
        ("positions", _POINTER),
        ("slots", _POINTER),
        ("block_table", _POINTER),
        ("query_start_loc", _POINTER),
        ("context_lens", _POINTER),
    ]


class CpuKernels:
    """The loaded library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        gemm = library.q4_1_gemm
        gemm.restype = ctypes.c_int
        gemm.argtypes = [_POINTER, _SIZE, _SIZE, _SIZE] + [_POINTER] * 5 + [ctypes.c_int]
        int8_gemm = library.int8_gemm
        int8_gemm.restype = ctypes.c_int
        int8_gemm.argtypes = [_POINTER, _SIZE, _SIZE, _SIZE] + [_POINTER] * 4 + [ctypes.c_int]
        self._int8_gemm = int8_gemm
        int8_dot = library.int8_dot_gemm
        int8_dot.restype = ctypes.c_int
        int8_dot.argtypes = [_POINTER, _SIZE, _SIZE, _SIZE] + [_POINTER] * 5 + [ctypes.c_int]
        self._int8_dot = int8_dot
        # Whether int8_dot_matmul runs here (AVX-512 VNNI).
        self.int8_dot = bool(library.int8_dot_available())
        self._wide_vectors = library.wide_vectors
        self._wide_vectors.restype = ctypes.c_int
        self._wide_vectors.argtypes = [ctypes.c_int]
        attention = library.paged_attention
        attention.restype = ctypes.c_int
        attention.argtypes = (
            [_POINTER] * 4 + [_SIZE] + [_POINTER] * 2 + [_SIZE] * 6 + [ctypes.c_float] * 2
        ) + [_SIZE, _POINTER, ctypes.c_int]
        self._gemm, self._attention = gemm, attention
        self._argmax_rows = library.argmax_rows
        self._argmax_rows.restype = None
        self._argmax_rows.argtypes = [_POINTER, _SIZE, _SIZE, _POINTER, ctypes.c_int]
        self._top_k_rows = library.top_k_rows
        self._top_k_rows.restype = None
        self._top_k_rows.argtypes = [_POINTER, _SIZE, _SIZE, _SIZE, _POINTER, ctypes.c_int]
        self._write_kv = library.write_kv
        self._write_kv.restype = None
        self._write_kv.argtypes = (
            [_POINTER] * 2 + [_SIZE] * 2 + [_POINTER] + [_SIZE] * 2 + [_POINTER] * 2
        )
        self._rms_norm = library.rms_norm
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [_POINTER] * 5 + [_SIZE, _SIZE, ctypes.c_float, ctypes.c_int]
        self._silu_and_mul = library.silu_and_mul
        self._silu_and_mul.restype = None
        self._silu_and_mul.argtypes = [_POINTER, _POINTER, _SIZE, _SIZE, ctypes.c_int]
        self._rotary = library.rotary
        self._rotary.restype = None
        heads = [_POINTER, _SIZE, _SIZE, _SIZE]  # a tensor, its token and head strides, heads
        self._rotary.argtypes = heads * 2 + [_POINTER] * 2 + [_SIZE, _SIZE, ctypes.c_int]
        self._decoder_layers = library.decoder_layers
        self._decoder_layers.restype = ctypes.c_int
        self._decoder_layers.argtypes = [
            _POINTER,
            _SIZE,
            _POINTER,
            _POINTER,
            _POINTER,
            ctypes.c_int,
        ]

    def avx512(self, on: bool | None = None) -> bool:
        """Whether the kernels run their AVX-512 paths (the GEMMs' and the attention's
        loops): on wherever the CPU has AVX-512 (F, VL, DQ) unless turned off here (`on`:
        False keeps the AVX2 paths, True turns them back on where the CPU has them; None
        asks). Same bits either way."""
        return bool(self._wide_vectors(-1 if on is None else int(on)))

    def q4_1_matmul(
        self, x: torch.Tensor, packed: PackedQ4, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [rows, in] float32 (made contiguous here) -> [rows, out] float32."""
        weights = (packed.levels, packed.scales, packed.minimums)
        return self._matmul(self._gemm, x, packed, weights, bias)

    def int8_matmul(
        self, x: torch.Tensor, packed: PackedInt8, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [rows, in] float32 (made contiguous here) -> [rows, out] float32: each row's
        float32 sum over the inputs in order of x times the int8 level, times the row's
        scale."""
        return self._matmul(self._int8_gemm, x, packed, (packed.levels, packed.scales), bias)

    def int8_dot_matmul(
        self, x: torch.Tensor, packed: PackedInt8Dot, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [rows, in] float32 (made contiguous here) -> [rows, out] float32: each row of x
        rounded to int8 at max |x| / 127 (to nearest, ties to even), its int32 sums against
        the levels, times the row's step and the output's scale (int8_dot.c). Only where
        `self.int8_dot`."""
        weights = (packed.levels, packed.offsets, packed.scales)
        return self._matmul(self._int8_dot, x, packed, weights, bias)

    @staticmethod
    def _matmul(
        function,
        x: torch.Tensor,
        packed: PackedQ4 | PackedInt8 | PackedInt8Dot,
        weights: tuple[torch.Tensor, ...],
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """One of the GEMMs' entry points: (x, rows, in, out, *weights, bias, y, threads)."""
        rows = x.contiguous()
        out = torch.empty(rows.shape[0], packed.out_features)
        if rows.shape[0] == 0:
            return out
        failed = function(
            rows.data_ptr(),
            rows.shape[0],
            packed.in_features,
            packed.out_features,
            *(weight.data_ptr() for weight in weights),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("a CPU GEMM kernel could not allocate its buffers")
        return out

    # The dense ops between a decoder layer's GEMMs, with fused_ops.py's signatures so that
    # fused_model.py patches either in (elementwise.c says how each one rounds). They take
    # float32 with widths in whole vectors of 8; fused_model.cpu_fusable checks the model.

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """weight * RMSNorm(x) over the last dimension; with `residual`: (that of
        x + residual, x + residual)."""
        x = _dense(x)
        out = torch.empty(x.shape)
        residual_out = None
        if residual is not None:
            residual, residual_out = _dense(residual), torch.empty(x.shape)
        num_cols = x.shape[-1]
        self._rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            None if residual_out is None else residual_out.data_ptr(),
            x.numel() // num_cols,
            num_cols,
            eps,
            torch.get_num_threads(),
        )
        return out if residual_out is None else (out, residual_out)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for gate_up [..., 2 * n] (gate the first half) -> [..., n]."""
        gate_up = _dense(gate_up)
        width = gate_up.shape[-1]
        out = torch.empty(*gate_up.shape[:-1], width // 2)
        self._silu_and_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            gate_up.numel() // width,
            width // 2,
            torch.get_num_threads(),
        )
        return out

    def rotary_in_place(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> None:
        """RoPE on query [T, heads, head_dim] and key [T, kv_heads, head_dim] in place (unit
        stride along head_dim), token t at positions[t] (< cos_sin's rows)."""
        if query.stride(-1) != 1 or key.stride(-1) != 1:
            raise ValueError("rotary_in_place needs a unit stride along head_dim")
        positions = positions.to(torch.int64).contiguous()
        self._rotary(
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            query.shape[1],
            key.data_ptr(),
            key.stride(0),
            key.stride(1),
            key.shape[1],
            positions.data_ptr(),
            cos_sin.data_ptr(),
            query.shape[0],
            query.shape[2],
            torch.get_num_threads(),
        )

    # Selections over rows of logits (select.c): float32 [rows, cols], contiguous.

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) for x [rows, cols] (the first largest; the first NaN
        where a row has one) -> int64 [rows]."""
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        if rows and cols:
            self._argmax_rows(x.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads())
        return out

    def top_k_rows(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """The indices [rows, k] of each row's k largest (1 <= k <= cols), ties to the lower
        index, in no particular order."""
        rows, cols = x.shape
        if not 1 <= k <= cols:
            raise ValueError(f"k = {k} of {cols} values")
        out = torch.empty(rows, k, dtype=torch.int64)
        if rows:
            self._top_k_rows(x.data_ptr(), rows, cols, k, out.data_ptr(), torch.get_num_threads())
        return out

    def decoder_layers(
        self,
        layers: ctypes.Array,  # of DecoderLayer
        shape: DecoderShape,
        step: DecoderStep,
        hidden: torch.Tensor,  # [T, shape.hidden] float32, contiguous: updated in place
    ) -> None:
        """Every layer of a Llama or Qwen3 decoder over one step (decoder.c; the direct
        forward's)."""
        failed = self._decoder_layers(
            ctypes.addressof(layers),
            len(layers),
            ctypes.addressof(shape),
            ctypes.addressof(step),
            hidden.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the decoder kernel could not allocate its buffers")

    def write_kv(
        self,
        key: torch.Tensor,  # [T, kv_heads, d] float32, each row's kv_heads * d contiguous
        value: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [T]
        key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, d] float32, contiguous
        value_cache: torch.Tensor,
    ) -> None:
        """Row t of key and value into slot slot_mapping[t] of the caches (a copy)."""
        rows = key.shape[0]
        if rows == 0:
            return
        slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
        self._write_kv(
            key.data_ptr(),
            value.data_ptr(),
            key.stride(0),
            value.stride(0),
            slots.data_ptr(),
            rows,
            key_cache[0, 0].numel(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
        )

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, heads, d] float32
        key_cache: torch.Tensor,  # [blocks, block_size, kv_heads, d] float32, contiguous
        value_cache: torch.Tensor,
        block_table: torch.Tensor,  # int32 [seqs, W]
        query_start_loc: torch.Tensor,  # int32 [seqs + 1]
        context_lens: torch.Tensor,  # int32 [seqs]
        max_context_len: int,
        scale: float,
        softcap: float | None,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Every row's attention over its sequence's cached keys (attention/backend.py's
        semantics) -> [T, heads, d] float32."""
        query = query.contiguous()
        block_table = block_table.contiguous()
        num_tokens, num_heads, head_dim = query.shape
        out = torch.empty_like(query)
        if num_tokens == 0:
            return out
        failed = self._attention(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_table.data_ptr(),
            block_table.shape[1],
            query_start_loc.data_ptr(),
            context_lens.data_ptr(),
            context_lens.shape[0],
            num_heads,
            key_cache.shape[2],
            head_dim,
            key_cache.shape[1],
            max_context_len,
            scale,
            softcap or 0.0,
            sliding_window or 0,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the attention kernel could not allocate its scores")
        return out


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous float32 (itself when it is: the model's activations are)."""
    if x.dtype is not torch.float32:
        x = x.float()
    return x if x.is_contiguous() else x.contiguous()


def for_rows(x: torch.Tensor) -> CpuKernels | None:
    """The kernels where they take `x` as rows of logits (select.c's: float32 on the CPU,
    contiguous), else None (the caller runs torch's op)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    return load()


@functools.cache
def load(cache_dir: Path | None = None) -> CpuKernels | None:
    """The kernels, built if these sources and flags were never built in `cache_dir`;
    None where they cannot run here (the reason is logged once)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        log.info("CPU kernels: this CPU has no AVX2 (%s); using PyTorch's ops", capability)
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_build(cache_dir or default_cache_dir()))))
    except (OSError, subprocess.SubprocessError, BuildError) as exc:
        log.warning("Pagoda's CPU kernels are unavailable (%s); using PyTorch's ops", exc)
        return None


class BuildError(Exception):
    pass


def _build(cache_dir: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise BuildError("no C compiler (cc or gcc) on the PATH")
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    target = cache_dir / f"pagoda_cpu_kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: a process that loads it meanwhile
    # sees the whole library or none.
    handle, partial = tempfile.mkstemp(dir=cache_dir, suffix=".so.partial")
    os.close(handle)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-lm", "-o", partial],
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
