"""The numeric path of the forward: float32 Linear layers made batch-invariant on the CPU,
and the one-line description GetModelInfo and `pagoda info` report.

A float32 GEMM on the CPU (oneDNN/MKL) takes another kernel for a few rows than for many,
so a row's bits depend on how many rows share its call. Where, depends on the CPU:
- on an AMD EPYC: at 1-3, 5-7 and 9-11 rows against any multiple of 4 or 12+ rows;
- on an Intel Xeon with AVX-512 and AMX (2026-11-29): at 1 row, at 2-15 rows, and for
  SmolLM2's down projection (1,536 -> 576) at 57-192 rows too, against 16-56 or 193+ rows,
  whatever the padding to a multiple.
A decode step of one sequence and the same sequence inside a batch or a prefill would then
differ in the last bits, and a greedy chain can part there. So on the CPU every float
Linear left in the model (all of them under `none`, the float layers and a float32 head
under `int8`) multiplies ROWS rows at a time: its input padded with zero rows to a multiple
of ROWS and cut into calls of exactly ROWS rows. Every row then goes through the same
kernel on every CPU, whatever its batch. tests/worker/test_numerics.py holds one layer to
that, tests/worker/test_batch_invariance.py the whole forward, both bit for bit.

On CUDA nothing here applies: cuBLAS may also pick kernels by shape; what holds there is
stated in docs/benchmarks.md ("Batch invariance").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows per GEMM call: one decode row costs a 16-row GEMM, which reads the same weights.
ROWS = 16


class BatchInvariantLinear(torch.nn.Module):
    """`inner` (a Linear, or GPT-2's Conv1D) called ROWS rows at a time, its input padded
    with zero rows to a multiple of ROWS; keeps `inner`'s weights (no copy) and its
    attributes."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        num_rows = rows.shape[0]
        if num_rows in (0, ROWS):
            return self.inner(x)
        padded = F.pad(rows, (0, 0, 0, -num_rows % ROWS))
        out = torch.cat([self.inner(part) for part in padded.split(ROWS)])[:num_rows]
        return out.view(*x.shape[:-1], out.shape[-1])


def _is_float_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or (
        type(module).__name__ == "Conv1D" and hasattr(module, "nf")
    )


def make_batch_invariant(model) -> int:
    """Wrap every float Linear (and Conv1D) of `model` in a BatchInvariantLinear, in place;
    returns how many. Call it after quantization and on the CPU only."""
    wrapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, BatchInvariantLinear):
            continue
        for name, child in list(parent.named_children()):
            if _is_float_linear(child):
                setattr(parent, name, BatchInvariantLinear(child))
                wrapped += 1
    return wrapped


def describe_numerics(model, quantization: str) -> str:
    """The numeric path of `model` (quantized with `quantization`, made batch-invariant
    when on the CPU) in one line, for the hello, GetModelInfo and `pagoda info`."""
    from pagoda.gpu_worker import quantization as int8

    parameter = next(model.parameters())
    dtype = str(parameter.dtype).removeprefix("torch.")
    on_cpu = parameter.device.type == "cpu"
    invariance = (
        "batch-invariant (a row's result never depends on its batch, chunking or recompute)"
        if on_cpu
        else "not batch-invariant on CUDA (cuBLAS and SDPA pick kernels by shape)"
    )
    if quantization != "int8":
        return f"none: {dtype} weights and activations as loaded; {invariance}"

    def named(kind) -> list[str]:
        return sorted(
            {
                name
                for module in model.modules()
                for name, child in module.named_children()
                if isinstance(child, kind) and child is not head and name not in ("int8", "layer")
            }
        )

    head = model.get_output_embeddings()
    head = getattr(head, "inner", head)
    q4_names = sorted({*named(int8.Q4Linear), *named(int8.Q4Slice)})
    int8_names = named(int8.Int8Linear)
    fused = [
        "/".join(group)
        for group in int8.FUSED_GROUPS
        if all(name in named(int8.Q4Slice) for name in group)
    ]
    float_names = [n for n in named(BatchInvariantLinear) if n != "lm_head"]
    if isinstance(head, int8.RescoredHead):
        first = "int8"
        if isinstance(head.int8, int8.Int8RowsLinear):
            first = (
                "int8 weights x int8 activations, int32 sums (Pagoda's VNNI kernel)"
                if head.int8.integer
                else "int8 weights x float32 activations (Pagoda's kernel)"
            )
        head_text = f"{first} logits, each row's top {head.num_rescored} recomputed in float32"
    else:
        head_text = "int8" if isinstance(head, int8.Int8Linear) else "float32"
    q4_schemes = sorted(
        {
            (m.layer if isinstance(m, int8.FusedQ4Linear) else m).scheme
            for m in model.modules()
            if isinstance(m, (int8.Q4Linear, int8.FusedQ4Linear))
        }
    )
    parts = []
    if q4_names:
        parts.append(
            f"{', '.join(q4_names)} as Q4_1 (the weights' exact 4-bit groups of "
            f"{int8.Q4_GROUP}), {'; '.join(q4_schemes)}"
            + (f", {' and '.join(fused)} in one call each" if fused else "")
        )
    if int8_names:
        parts.append(
            f"{', '.join(int8_names)} as int8 (per-output-channel symmetric weights, "
            f"SmoothQuant input scales), activations {int8.ACTIVATION_SCHEME}"
        )
    return (
        f"int8: {'; '.join(parts) or 'no quantized layer'}; float32: embeddings, norms, "
        "attention"
        + (f", {', '.join(float_names)}" if float_names else "")
        + f"; head: {head_text}; {invariance}"
    )
