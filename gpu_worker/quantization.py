"""Int8 weights for the CPU forward: dynamic int8 Linear layers.

On a CPU the decode forward is bound by reading the weights (SmolLM2-135M: 540 MB of
float32 per step). `int8` swaps every Linear layer of the decoder for PyTorch's dynamic
int8 Linear (fbgemm): weights stored as int8 with one scale per output channel,
activations quantized per call, int32 accumulation. Embeddings, norms, attention math
and the KV pool stay float32, and so does the output head (see QUANTIZED_LM_HEAD).

`auto` is int8 on the CPU and none on CUDA: the dynamic int8 kernels exist only for
the CPU, so `int8` on CUDA is refused rather than silently ignored. `none` is the
model exactly as loaded (the exact-parity tests pin it).

Quality and speed on the default model: docs/benchmarks.md, "int8 forward"
(`python -m benchmarks.quantization`).
"""

from __future__ import annotations

import warnings

import torch
from pagoda.gpu_worker.config import QUANTIZATIONS

# The output head stays float32: see docs/benchmarks.md "int8 forward" for the measurement.
QUANTIZED_LM_HEAD = False


class QuantizationError(ValueError):
    """A quantization this device cannot run; the message says what to use instead."""


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


def quantize(model, quantization: str, *, lm_head: bool = QUANTIZED_LM_HEAD):
    """The model with `quantization` applied in place ('none': untouched); returns it."""
    if quantization == "none":
        return model
    if quantization != "int8":
        raise QuantizationError(f"cannot apply quantization {quantization!r}")
    return quantize_int8(model, lm_head=lm_head)


def quantize_int8(model, *, lm_head: bool = QUANTIZED_LM_HEAD):
    """Every Linear of the decoder (and the head when `lm_head`) becomes an Int8Linear.
    GPT-2's Conv1D (a Linear stored transposed) is converted too."""
    if next(model.parameters()).device.type != "cpu":
        raise QuantizationError("int8 quantization needs the model on the CPU")
    head = model.get_output_embeddings()
    with warnings.catch_warnings():
        # PyTorch announces the end of its quantized tensors (the weight's packing goes
        # through one); their int8 GEMM is still the fastest CPU path measured here.
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if child is head and not lm_head:
                    continue
                weight = _linear_weight(child)
                if weight is not None:
                    setattr(parent, name, Int8Linear(weight, child.bias))
    return model


def _linear_weight(module) -> torch.Tensor | None:
    """[out, in] weight of a Linear or of GPT-2's Conv1D (stored [in, out]); else None."""
    if isinstance(module, torch.nn.Linear):
        return module.weight.detach()
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.detach().t()
    return None


class Int8Linear(torch.nn.Module):
    """y = x W^T + b with W as int8 (one scale per output channel) and x quantized
    per call to 7-bit unsigned integers by fbgemm's dynamic int8 GEMM.

    fbgemm picks one activation scale for the whole [rows, in] input: a prefill
    chunk's largest activation would coarsen every other row (perplexity +167% on
    the default model). Each row is therefore divided by its own max |x| first and
    the output multiplied back (exact algebra, the bias added after): per-token
    activation scales from the same kernel, and a row's result hardly depends on
    the other rows of the step.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.float()
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
        row_max = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
        # reduce_range: 7-bit activations, so no int16 saturation in AVX2's kernel.
        out = torch.ops.quantized.linear_dynamic(rows / row_max, self._packed, True)
        out.mul_(row_max)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def count_int8_linear(model) -> int:
    return sum(isinstance(m, Int8Linear) for m in model.modules())
