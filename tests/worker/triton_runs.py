"""Where a Triton kernel test file runs its kernels: natively on CUDA, else in Triton's
interpreter on CPU tensors.

The interpreter needs TRITON_INTERPRET=1 before triton is first imported (its own library
functions are decorated then), and torch._dynamo imports triton as soon as anything loads
it. So on a CPU machine such a file's kernel tests skip in the suite's process, and one
test of the file (`run_under_interpreter`) runs the file again in a child pytest with
TRITON_INTERPRET=1 set from the start; `TRITON_INTERPRET=1 pytest FILE` runs them
directly.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = "cuda" if ON_CUDA else "cpu"
RUN_HERE = ON_CUDA or INTERPRETED  # the kernels can run in this process
REPO_ROOT = Path(__file__).resolve().parents[2]


def kernel_module(name: str, child_test: str) -> ModuleType:
    """The module of kernels `name`, imported when they can run in this process; else the
    calling test skips (`child_test` runs it in the interpreter's child process)."""
    if not RUN_HERE:
        pytest.skip(f"no CUDA: {child_test} runs this in a child process")
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module(name)
    if INTERPRETED and not isinstance(triton.language.zeros, InterpretedFunction):
        pytest.fail("TRITON_INTERPRET=1 was set after triton was imported")
    return module


def run_under_interpreter(test_file: str, min_passed: int) -> None:
    """Run `test_file` in a child pytest with TRITON_INTERPRET=1 (but its tests named
    compile_for_cuda, which need no interpreter) and require `min_passed` passes."""
    relative = str(Path(test_file).resolve().relative_to(REPO_ROOT))
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", relative]
        + ["-k", "not compile_for_cuda"],
        cwd=REPO_ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert completed.returncode == 0, completed.stdout[-8000:] + completed.stderr[-2000:]
    passed = re.search(r"(\d+) passed", completed.stdout)
    assert passed and int(passed.group(1)) >= min_passed, completed.stdout[-2000:]


def compile_ahead(script: str) -> None:
    """Run `script`, which compiles kernels ahead of time for a GPU target and prints
    "compiled", in a child process without TRITON_INTERPRET (the interpreter checks no
    PTX; a compile needs the real compiler)."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, "-c", script],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert completed.stdout.strip() == "compiled"
