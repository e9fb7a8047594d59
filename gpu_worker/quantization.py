"""Quantized Linear layers for the CPU forward (`--quantization int8`, the CPU default).

On a CPU the decode forward is bound by reading the weights (SmolLM2-135M: 540 MB of
float32 per step). `int8` swaps every Linear layer of the decoder (and GPT-2's Conv1D):
- a layer whose float weights are exactly Q4_1 groups (llama.cpp's 4-bit format: each 32
  inputs of a row are d * q + m, q in 0..15; the default model is its Q4_1 GGUF
  dequantized) becomes a Q4Linear: those groups kept as 4-bit levels and rebuilt exactly
  as float32 weights by Pagoda's AVX2 kernel (cpu_kernels.py), float32 activations and sums;
  where that kernel cannot run, activations rounded to bfloat16 on PyTorch's CPU int4
  GEMM (docs/benchmarks.md "int8 forward" has both paths' fidelity and speed);
- any other becomes an Int8Linear: int8 weights with one symmetric scale per output
  channel, activations quantized per token to symmetric 8 bits (-127..127, absmax / 127),
  int32 accumulation, and SmoothQuant-style input-channel scales calibrated at load on one
  forward of random token ids (data-free; about a second).
Both are batch-invariant by construction (a row's result never depends on the other rows
of the call). Embeddings, norms, attention and the KV pool stay float32. The output head
(`head`, HEAD_MODE by default) is float32, int8, or `rescored`: int8 logits whose top
RESCORED_TOP of each row are then recomputed in float32.

`auto` is int8 on the CPU with float32 weights and none otherwise: the int8 kernels
exist only for the CPU, so an explicit `int8` on CUDA is refused rather than ignored.
`none` is the model exactly as loaded (the exact-parity tests pin it).

Quality and speed on the default model: docs/benchmarks.md, "int8 forward"
(`python -m benchmarks.quantization`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from pagoda.gpu_worker import cpu_kernels
from pagoda.gpu_worker.config import QUANTIZATIONS, QuantizationError

# How the output head runs under int8; docs/benchmarks.md "int8 forward" has the figures.
#   float32:  as loaded (the largest single read of a small model's decode step).
#   int8:     an Int8Linear as the decoder's: faster, but fails the quality check.
#   rescored: int8 logits, then each row's RESCORED_TOP best recomputed in float32.
HEAD_MODES = ("float32", "int8", "rescored")
HEAD_MODE = "rescored"
RESCORED_TOP = 32
# Decoder Linear layers left in float32 under int8, by attribute name.
FLOAT_LAYERS: tuple[str, ...] = ()


def resolve_quantization(requested: str, device: str, dtype: str = "auto") -> str:
    """'auto' -> 'int8' on the CPU with float32 weights, else 'none'; refuses an
    explicit 'int8' anywhere else (`device` is resolved: 'cpu', 'cuda', 'cuda:N')."""
    if requested not in QUANTIZATIONS:
        raise QuantizationError(
            f"unknown quantization {requested!r}: use one of {', '.join(QUANTIZATIONS)}"
        )
    on_cpu = device == "cpu"
    float32 = dtype in ("auto", "float32") if on_cpu else dtype == "float32"
    if requested == "auto":
        return "int8" if on_cpu and float32 else "none"
    if requested == "int8" and not on_cpu:
        raise QuantizationError(
            f"--quantization int8 runs only on the CPU (PyTorch's dynamic int8 Linear has "
            f"no {device} kernel); on {device} use --quantization none or auto"
        )
    if requested == "int8" and not float32:
        raise QuantizationError(
            f"--quantization int8 needs float32 weights, not {dtype} (--dtype auto or float32)"
        )
    return requested


def quantize(model, quantization: str, *, head: str = HEAD_MODE):
    """The model with `quantization` applied in place ('none': untouched); returns it."""
    if quantization == "none":
        return model
    if quantization != "int8":
        raise QuantizationError(f"cannot apply quantization {quantization!r}")
    return quantize_int8(model, head=head)


def quantize_int8(
    model,
    *,
    head: str = HEAD_MODE,
    smooth: bool = True,
    keep_float: tuple[str, ...] = FLOAT_LAYERS,
    q4: bool = True,
):
    """Every Linear of the decoder becomes a Q4Linear when its weight is exactly Q4_1 (and
    `q4`), else an Int8Linear, GPT-2's Conv1D (a Linear stored transposed) too, but those
    named in `keep_float` (by their attribute name, such as "down_proj"), and the output
    head as `head` says (HEAD_MODES). Call it before the engine switches the model to the
    paged attention: `smooth` runs one calibration forward (when an int8 layer is left)."""
    if head not in HEAD_MODES:
        raise ValueError(f"head must be one of {', '.join(HEAD_MODES)}, got {head!r}")
    if next(model.parameters()).device.type != "cpu":
        raise QuantizationError("int8 quantization needs the model on the CPU")
    output = model.get_output_embeddings()
    targets = [
        (parent, name, child, weight)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if (head != "float32" or child is not output)
        and (child is output or name not in keep_float)
        and (weight := _linear_weight(child)) is not None
    ]
    blocks = {
        child: found
        for _, _, child, weight in targets
        if q4
        and child is not output
        and q4_linear_takes(weight.shape[0])
        and (found := q4_1_blocks(weight)) is not None
    }
    kernel_head = None
    if head == "rescored" and any(child is output for _, _, child, _ in targets):
        kernel_head = _kernel_head(_linear_weight(output), output.bias)
    int8_modules = [
        child
        for _, _, child, _ in targets
        if child not in blocks and not (child is output and kernel_head is not None)
    ]
    input_max = _calibrate(model, int8_modules) if smooth and int8_modules else {}
    made: dict = {}
    with warnings.catch_warnings():
        # PyTorch announces the end of its quantized tensors (the weight's packing goes
        # through one); their int8 GEMM is still the fastest CPU path measured here.
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        for parent, name, child, weight in targets:
            if child in blocks:
                layer = Q4Linear(blocks[child], child.bias)
                made[layer] = (blocks[child], child.bias)
                setattr(parent, name, layer)
                continue
            if child is output and kernel_head is not None:
                setattr(parent, name, RescoredHead(kernel_head, weight, child.bias))
                continue
            scales = smoothing_scales(input_max[child], weight) if child in input_max else None
            replacement = Int8Linear(weight, child.bias, scales)
            if child is output and head == "rescored":
                replacement = RescoredHead(replacement, weight, child.bias)
            setattr(parent, name, replacement)
    _fuse_siblings(model, made)
    return model


# Calibration: random token ids, not text. Which input channels of a Linear carry the
# large activations is a property of the weights; random ids found them at least as
# well as a text (default model, per-call 7-bit activations: perplexity +2.1% vs +3.0%).
NUM_CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0
# Per-token 8-bit activations, default model (docs/benchmarks.md): alpha 0.3 gives
# perplexity +0.41% and a mean first greedy divergence of 17.5 of 48 tokens; 0.4:
# +1.33%, 15.5; 0.5: +1.15%, 13.9.
SMOOTHING_ALPHA = 0.3


def _calibrate(model, modules: list) -> dict:
    """Each module's largest |input| per input channel over one random-token forward."""
    text_config = model.config.get_text_config()
    num_tokens = min(
        NUM_CALIBRATION_TOKENS, getattr(text_config, "max_position_embeddings", None) or 2048
    )
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    input_ids = torch.randint(0, text_config.vocab_size, (1, num_tokens), generator=generator)
    input_max: dict = {}

    def record(module, inputs, output) -> None:
        rows = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
        input_max[module] = rows.abs().amax(dim=0).float()

    hooks = [module.register_forward_hook(record) for module in modules]
    try:
        with torch.inference_mode():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return input_max


def smoothing_scales(input_max: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's per-input-channel s = max|x|^a / max|w|^(1-a): the input is divided
    by s and the weight's columns multiplied by it (the same product), so a channel of
    large activations no longer decides every row's quantization step alone."""
    weight_max = weight.abs().amax(dim=0).float().clamp(min=1e-5)
    scales = input_max.clamp(min=1e-5) ** SMOOTHING_ALPHA / weight_max ** (1 - SMOOTHING_ALPHA)
    return scales.clamp(min=1e-5)


def _linear_weight(module) -> torch.Tensor | None:
    """[out, in] weight of a Linear or of GPT-2's Conv1D (stored [in, out]); else None."""
    if isinstance(module, torch.nn.Linear):
        return module.weight.detach()
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.detach().t()
    return None


class Int8Linear(torch.nn.Module):
    """y = x W^T + b with W as int8 (one symmetric scale per output channel, -127..127)
    and x quantized per row (token) to symmetric 8 bits: scale = max|x_row| / 127, the
    full -127..127 range; optionally smoothed first (see smoothing_scales).

    Batch-invariant by construction: a row's grid is its own, the products are summed
    exactly in int32 and dequantized elementwise, so no batch mate, chunking or
    recompute can change a bit of a row's result (tests/worker/test_batch_invariance.py).

    The GEMM is fbgemm's u8 x s8 kernel (torch._int_mm runs the same sums, but 10-60x
    slower on an AVX2 CPU, measured here). It takes unsigned activations and, on AVX2,
    adds pairs of u8 x s8 products in saturating int16, so a full-range input could clip.
    Each row therefore goes in twice, as its positive part and its negated negative part
    (u8 0..127 each, at a fixed scale 1/127 and zero point 0: 2 x 127 x 127 < 2^15, no
    clipping), and y = W x+ - W x-. A decode step reads the weights once for both halves
    (memory-bound: two rows cost about one); a prefill does twice the integer work.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        input_scales: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float()
        self.inverse_input_scales = None
        if input_scales is not None:  # smoothing: x W^T == (x / s) (W s)^T
            weight = weight * input_scales
            self.inverse_input_scales = torch.nn.Parameter(1 / input_scales, False)
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        quantized = torch.quantize_per_channel(
            weight,
            scales.double(),
            torch.zeros(self.out_features, dtype=torch.long),
            axis=0,
            dtype=torch.qint8,
        )
        self._packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        num_rows = rows.shape[0]
        fresh = self.inverse_input_scales is not None
        if fresh:
            rows = rows * self.inverse_input_scales
        row_max = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True)
        row_max.clamp_(min=1e-30)
        unit = rows.div_(row_max) if fresh else rows / row_max  # in [-1, 1]
        # [x+; x-] as [2 * rows, in]: quantized at the fixed scale 1/127 by the kernel.
        halves = torch.mul(unit, _SIGNS).relu_().view(2 * num_rows, self.in_features)
        out = _linear_u8(halves, ACTIVATION_SCALE, 0, self._packed)
        out = torch.sub(out[:num_rows], out[num_rows:]).mul_(row_max)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


# Quantizes its float input at the given scale and zero point (no per-call statistics),
# multiplies in int32 with the packed int8 weight and returns float32.
_linear_u8 = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
ACTIVATION_SCALE = 1 / 127
_SIGNS = torch.tensor([1.0, -1.0]).view(2, 1, 1)
ACTIVATION_SCHEME = "per-token symmetric int8 (absmax / 127), int32 accumulation"


# Q4_1 (llama.cpp's 4-bit format): each group of Q4_GROUP consecutive input weights of an
# output row is d * q + m, q in 0..15, d and m float16.
Q4_GROUP = 32
Q4_LEVELS = 15


@dataclass(frozen=True, slots=True)
class Q4Blocks:
    """A [out, in] weight as Q4_1 groups: levels [out, in] (0..15, int32), and per group
    scales and minimums [out, in / Q4_GROUP] (float32 holding float16 values)."""

    levels: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor


def q4_1_blocks(weight: torch.Tensor) -> Q4Blocks | None:
    """The Q4_1 groups that reproduce `weight` exactly (a GGUF Q4_1 model dequantized to
    float32, as the default model's decoder), or None when no such groups exist: a
    weight it does not hold exactly is left to Int8Linear, never rounded to 4 bits."""
    out_features, in_features = weight.shape
    if in_features % Q4_GROUP or out_features % 8:
        return None
    groups = weight.detach().float().reshape(out_features, -1, Q4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    minimums = low.half().float()
    scales = ((high - low) / Q4_LEVELS).half().float()
    if not torch.isfinite(scales).all() or not torch.equal(minimums, low):
        return None
    levels = ((groups - minimums.unsqueeze(-1)) / scales.clamp(min=1e-30).unsqueeze(-1)).round()
    levels = levels.clamp_(0, Q4_LEVELS)
    if not torch.equal(levels * scales.unsqueeze(-1) + minimums.unsqueeze(-1), groups):
        return None
    return Q4Blocks(levels.reshape(out_features, in_features).int(), scales, minimums)


def round_to_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """`weight` quantized to Q4_1 and dequantized (llama.cpp's rounding: the group's min
    is level 0, its max level 15): a float weight that q4_1_blocks holds exactly. For
    tests and benchmarks that need a Q4_1 model without a GGUF file."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, -1, Q4_GROUP)
    minimums = groups.amin(dim=-1, keepdim=True).half().float()
    scales = ((groups.amax(dim=-1, keepdim=True) - minimums) / Q4_LEVELS).half().float()
    levels = ((groups - minimums) / scales.clamp(min=1e-30)).round().clamp(0, Q4_LEVELS)
    return (levels * scales + minimums).reshape(out_features, in_features)


# On PyTorch's int4 GEMM (a CPU without AVX2 or a C compiler for cpu_kernels).
Q4_ACTIVATION_SCHEME = "bfloat16 activations, float32 accumulation"


def q4_linear_takes(out_features: int) -> bool:
    """Whether a Q4Linear can hold a layer of `out_features` outputs here: Pagoda's kernel
    takes tiles of 8, PyTorch's int4 GEMM (its fallback) only multiples of 16."""
    multiple = cpu_kernels.TILE if cpu_kernels.load() is not None else 16
    return out_features % multiple == 0


class Q4Linear(torch.nn.Module):
    """y = x W^T + b with W held as its exact Q4_1 groups (4-bit levels, a scale and an
    offset per 32 inputs). Batch-invariant either way it runs: each output element is one
    dot product over the input in a fixed order, whatever the number of rows in the call
    (tested with random batch mates from 1 to 600 rows, tests/worker/test_q4_linear.py).

    On Pagoda's kernel (cpu_kernels.py, where this CPU has AVX2 and a C compiler) x stays
    float32 and each weight is the float model's exactly, so a row differs from the float
    product only by the order of its sum. Otherwise on PyTorch's CPU int4 GEMM
    (`_weight_int4pack_mm_for_cpu`): x rounded to bfloat16, each weight rebuilt as
    (q - 8) * scale + zero with zero = m + 8 * scale and both in bfloat16 (Q4_1's weight up
    to bfloat16's rounding of the float16 scale and offset), float32 sums, bfloat16 output.
    """

    def __init__(self, blocks: Q4Blocks, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.levels.shape
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), False)
        self._kernel = cpu_kernels.load()  # q4_1_blocks holds whole tiles of 8 outputs
        if self._kernel is not None:
            self._native = cpu_kernels.pack_q4_1(blocks.levels, blocks.scales, blocks.minimums)
            self.scheme = f"exact weights, {cpu_kernels.Q4_SCHEME}"
            return
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.levels, 1)
        zeros = blocks.minimums + 8 * blocks.scales
        # [in / Q4_GROUP, out, 2]: the kernel's layout of scale and zero.
        self._scales_and_zeros = (
            torch.stack([blocks.scales, zeros], dim=-1).transpose(0, 1).contiguous().bfloat16()
        )
        self.scheme = f"scale and offset in bfloat16, {Q4_ACTIVATION_SCHEME}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            out = self.rows(x.reshape(-1, self.in_features).float())
            return out.view(*x.shape[:-1], self.out_features)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = _int4_mm(rows, self._packed, Q4_GROUP, self._scales_and_zeros).float()
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def packed(self) -> cpu_kernels.PackedQ4 | None:
        """The weight in Pagoda's kernel layout (where it runs_on the kernels), else None."""
        return self._native if self._kernel is not None else None

    def runs_on(self, kernels) -> bool:
        """Whether this layer runs on `kernels` (Pagoda's, as loaded by cpu_kernels)."""
        return kernels is not None and self._kernel is kernels

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward of float32 rows [n, in_features] on Pagoda's kernel (runs_on it), with
        no module call: the direct forward's (direct_forward.py)."""
        return self._kernel.q4_1_matmul(x, self._native, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q4_1"


_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu

# Sibling layers that read the same input, run as one Q4Linear (one bfloat16 conversion and
# one kernel call instead of three or two): transformers' attention calls q, k and v on the
# same hidden states in this order, its MLP gate and then up. A row's output columns are
# the same bits either way (each is its own dot product; tests/worker/test_q4_linear.py).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedQ4Linear(torch.nn.Module):
    """One Q4Linear over the concatenated outputs of sibling layers, called through their
    Q4Slice: the first sibling's call computes all of them for its input, the others take
    their columns when called on that same tensor, else compute afresh (never stale)."""

    def __init__(self, blocks: list[Q4Blocks], biases: list[torch.Tensor | None]) -> None:
        super().__init__()
        joined = Q4Blocks(
            torch.cat([part.levels for part in blocks]),
            torch.cat([part.scales for part in blocks]),
            torch.cat([part.minimums for part in blocks]),
        )
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    torch.zeros(part.levels.shape[0]) if b is None else b.detach().float()
                    for part, b in zip(blocks, biases, strict=True)
                ]
            )
        self.layer = Q4Linear(joined, bias)
        # The last joined call, for the siblings after the first: a plain object, since
        # setting a Module's attribute costs microseconds (13 sets a layer: 390 in a decode
        # step of the default model).
        self._last = _LastCall()

    def columns(self, x: torch.Tensor, first: bool, num_others: int) -> torch.Tensor:
        last = self._last
        if not first and last.pending and x is last.input:
            out = last.output
            last.pending -= 1
            if not last.pending:
                last.input = last.output = None
            return out
        out = self.layer(x)
        if first:
            last.input, last.output, last.pending = x, out, num_others
        return out


@dataclass(slots=True)
class _LastCall:
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    pending: int = 0  # siblings still to take their columns of `output`


class Q4Slice(torch.nn.Module):
    """One sibling of a FusedQ4Linear: its columns [start, end) of the joined output."""

    def __init__(self, fused: FusedQ4Linear, start: int, end: int, first: bool, others: int):
        super().__init__()
        self.fused = fused
        self.start, self.end, self.first, self.others = start, end, first, others
        self.in_features, self.out_features = fused.layer.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.columns(x, self.first, self.others)[..., self.start : self.end]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.end} of a fused q4_1 layer"


def _fuse_siblings(model, made: dict) -> None:
    """Replace each FUSED_GROUPS set of sibling Q4Linear layers (`made`: layer -> its Q4Blocks
    and bias) by Q4Slices of one FusedQ4Linear."""
    for parent in list(model.modules()):
        for names in FUSED_GROUPS:
            layers = [getattr(parent, name, None) for name in names]
            if not all(layer in made for layer in layers):
                continue
            if len({layer.in_features for layer in layers}) != 1:
                continue
            fused = FusedQ4Linear([made[x][0] for x in layers], [made[x][1] for x in layers])
            start = 0
            for index, (name, layer) in enumerate(zip(names, layers, strict=True)):
                end = start + layer.out_features
                others = len(names) - 1 if index == 0 else 0
                setattr(parent, name, Q4Slice(fused, start, end, index == 0, others))
                start = end


class Int8RowsLinear(torch.nn.Module):
    """y = x W^T + b with W rounded per output row to int8 (max |w| / 127) on Pagoda's
    kernels, a row's result never depending on its batch: the rescored head's first pass
    where the kernels run, four times fewer bytes than the float32 head.

    Where the CPU has AVX-512 VNNI, each row of x is rounded to int8 too (max |x| / 127)
    and the products are summed exactly in int32 (`integer`; int8_dot.c, 1.8x faster at
    64 rows); elsewhere x stays float32 (gemm.c). Either pass only ranks: over 1,500 hidden
    states of real text on the default model, float32's top token was at worst 4th by the
    int8 rows (3rd by float32 rows), always well inside the RESCORED_TOP recomputed."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.integer = kernels.int8_dot and self.out_features % cpu_kernels.DOT_OUTPUTS == 0
        if self.integer:
            self._packed = cpu_kernels.pack_int8_dot(weight)
            self._matmul = kernels.int8_dot_matmul
        else:
            self._packed = cpu_kernels.pack_int8(weight)
            self._matmul = kernels.int8_matmul
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        out = self._matmul(rows, self._packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        activations = "int8 rows, int32 sums" if self.integer else "float32 rows"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 weight "
            f"rows, {activations}"
        )


def _kernel_head(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8RowsLinear | None:
    """The rescored head's first pass on Pagoda's kernel, where it runs and takes the shape."""
    kernels = cpu_kernels.load()
    out_features, in_features = weight.shape
    if kernels is None or out_features % cpu_kernels.TILE or in_features % cpu_kernels.GROUP:
        return None
    return Int8RowsLinear(weight, bias, kernels)


class RescoredHead(torch.nn.Module):
    """An output head whose logits come from `int8` (an Int8Linear of `weight`), except
    each row's RESCORED_TOP highest, which are recomputed from the float32 `weight`.

    The int8 head reads a quarter of the float32 one, but its rounding reorders near-tied
    logits, and a greedy chain that takes another token never comes back. Recomputed,
    the likely tokens carry float32 logits: the int8 rounding of the head cannot change
    which of them is largest, only the tail's share of the probability (below the 32nd
    token, small). `weight` is kept as given, so a head tied to the embeddings costs no
    copy.
    """

    def __init__(
        self,
        int8: Int8Linear | Int8RowsLinear,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        num_rescored: int = RESCORED_TOP,
    ) -> None:
        super().__init__()
        self.int8 = int8
        self.out_features, self.in_features = int8.out_features, int8.in_features
        self.weight = weight.detach()  # a plain attribute: no second parameter
        self.bias = None if bias is None else bias.detach()
        self.num_rescored = min(num_rescored, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.int8(x)
        rows = x.reshape(-1, self.in_features).to(self.weight.dtype)
        flat = logits.view(-1, self.out_features)
        top = self._candidates(flat)
        # Elementwise products summed over the features: the same order for every row,
        # whatever the number of rows (a bmm's kernel depends on it).
        exact = (self.weight[top] * rows.unsqueeze(1)).sum(dim=2)
        if self.bias is not None:
            exact += self.bias[top]
        flat.scatter_(1, top, exact.to(flat.dtype))
        return logits

    def _candidates(self, flat: torch.Tensor) -> torch.Tensor:
        """The indices of each row's num_rescored highest int8 logits: by Pagoda's kernel on
        the CPU (ties to the lower index; torch's topk took 1.5 ms at 64 rows of 49,152),
        else torch's."""
        kernels = cpu_kernels.for_rows(flat)
        if kernels is None:
            return flat.topk(self.num_rescored, dim=1, sorted=False).indices
        return kernels.top_k_rows(flat, self.num_rescored)

    def extra_repr(self) -> str:
        return f"int8 logits, the top {self.num_rescored} of each row in float32"


def count_int8_linear(model) -> int:
    return sum(isinstance(m, Int8Linear) for m in model.modules())


def count_q4_linear(model) -> int:
    """Layers that run as Q4_1: Q4Linear, and each sibling of a fused one."""
    modules = list(model.modules())
    return sum(
        int(isinstance(m, (Q4Linear, Q4Slice))) - int(isinstance(m, FusedQ4Linear)) for m in modules
    )
