"""Paged-attention backends behind one interface (pagoda.gpu_worker.attention.backend).

`create_backend(name, device, block_size)` picks one: "reference" (gather + SDPA in plain
torch, the definition), "triton" (pagoda.gpu_worker.attention.triton_paged, class
TritonBackend: one kernel launch per layer, CUDA, any block size), "cpu"
(pagoda.gpu_worker.attention.cpu: one call of Pagoda's C kernel per layer, the CPU), or
"auto" (triton on CUDA when it imports and takes the block size; cpu on a CPU where
Pagoda's kernels build; else reference). Importing this package imports no torch.
"""

from __future__ import annotations

import importlib
import logging

BACKEND_NAMES = ("auto", "reference", "triton", "cpu")
# name -> (module, class); imported only when chosen, so a missing triton costs nothing.
_BACKENDS = {
    "reference": ("pagoda.gpu_worker.attention.reference", "ReferenceBackend"),
    "triton": ("pagoda.gpu_worker.attention.triton_paged", "TritonBackend"),
    "cpu": ("pagoda.gpu_worker.attention.cpu", "CpuBackend"),
}

log = logging.getLogger("pagoda.worker.attention")


class BackendUnavailableError(RuntimeError):
    """The named backend cannot run here; the message says why."""


def create_backend(name: str, device_type: str, block_size: int = 16):
    """An AttentionBackend instance for `name` on a device of type `device_type` ("cpu",
    "cuda") with KV blocks of `block_size` tokens."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        if device_type == "cuda":
            try:
                return _instantiate("triton", block_size)
            except BackendUnavailableError as exc:
                log.warning("%s; using the reference attention backend", exc)
        elif device_type == "cpu":
            backend = _instantiate("cpu", block_size)
            if backend.uses_kernel:  # else cpu_kernels said why
                return backend
        return _instantiate("reference", block_size)
    if name == "triton" and device_type != "cuda":
        raise BackendUnavailableError("the triton attention backend runs only on CUDA")
    if name == "cpu" and device_type != "cpu":
        raise BackendUnavailableError("the cpu attention backend runs only on the CPU")
    return _instantiate(name, block_size)


def triton_block_size_problem(block_size: int) -> str | None:
    """Why the triton backend cannot use blocks of `block_size` tokens, or None. Its key
    tile is independent of the block size (triton_paged.py), so every size the worker's
    configuration allows works; kept as the one place such a limit would be stated."""
    if block_size < 1:
        return f"the triton attention backend needs a positive block size, not {block_size}"
    return None


def _instantiate(name: str, block_size: int):
    if name == "triton" and (problem := triton_block_size_problem(block_size)) is not None:
        raise BackendUnavailableError(problem)
    module_name, class_name = _BACKENDS[name]
    try:
        backend_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(
            f"the {name} attention backend is unavailable: {exc}"
        ) from exc
    return backend_class()
