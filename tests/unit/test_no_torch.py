"""The scheduler process never loads torch (nor transformers, which imports it), and its
scheduling core loads no I/O at all."""

from __future__ import annotations

import subprocess
import sys

# The step schema both processes share; the core imports it, so it is as pure as the core.
SHARED_PURE_MODULES = ["pagoda.common.step"]

SCHEDULER_CORE_MODULES = [
    *SHARED_PURE_MODULES,
    "pagoda.scheduler_svc",
    "pagoda.scheduler_svc.core",
    "pagoda.scheduler_svc.core.admission",
    "pagoda.scheduler_svc.core.config",
    "pagoda.scheduler_svc.core.isolation",
    "pagoda.scheduler_svc.core.kv",
    "pagoda.scheduler_svc.core.outputs",
    "pagoda.scheduler_svc.core.planner",
    "pagoda.scheduler_svc.core.request",
    "pagoda.scheduler_svc.core.scheduler",
    "pagoda.scheduler_svc.core.waiting_queue",
    "pagoda.scheduler_svc.detokenizer",
    "pagoda.scheduler_svc.grammars",
    "pagoda.scheduler_svc.output_processor",
    "pagoda.scheduler_svc.testing",
    "pagoda.scheduler_svc.tokenizer",
    "benchmarks.scheduler_core",
]

PROBE = """
import importlib, sys
for name in sys.argv[2:]:
    importlib.import_module(name)
forbidden = sys.argv[1].split(",")
print(",".join(sorted(m for m in forbidden if m in sys.modules)))
"""


def loaded(modules: list[str], forbidden: list[str]) -> str:
    """Which of `forbidden` a fresh interpreter has loaded after importing `modules`."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(forbidden), *modules],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_importing_the_scheduler_core_loads_no_torch():
    assert loaded(SCHEDULER_CORE_MODULES, ["torch", "transformers"]) == ""


def test_the_scheduling_core_loads_no_io():
    """The core is pure: no gRPC, ZeroMQ, asyncio, protobuf or torch behind any module."""
    core = [
        name
        for name in SCHEDULER_CORE_MODULES
        if name.startswith("pagoda.scheduler_svc.core") or name in SHARED_PURE_MODULES
    ]
    forbidden = ["grpc", "zmq", "asyncio", "google.protobuf", "torch", "llguidance"]
    assert loaded(core, forbidden) == ""
