"""The scheduler process never loads torch (nor transformers, which imports it)."""

from __future__ import annotations

import subprocess
import sys

SCHEDULER_CORE_MODULES = [
    "scheduler_svc",
    "scheduler_svc.admission",
    "scheduler_svc.block_allocator",
    "scheduler_svc.bench_core",
    "scheduler_svc.config",
    "scheduler_svc.detokenizer",
    "scheduler_svc.fake_worker",
    "scheduler_svc.generation",
    "scheduler_svc.plan_columns",
    "scheduler_svc.preemption",
    "scheduler_svc.prefix_cache",
    "scheduler_svc.request",
    "scheduler_svc.request_limits",
    "scheduler_svc.scheduler",
    "scheduler_svc.sequence_state",
    "scheduler_svc.step_decision",
    "scheduler_svc.stats",
    "scheduler_svc.step_planner",
    "scheduler_svc.stop_rules",
    "scheduler_svc.tokenizer",
    "scheduler_svc.waiting_queue",
]

PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
loaded = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(",".join(loaded))
"""


def test_importing_the_scheduler_core_loads_no_torch():
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *SCHEDULER_CORE_MODULES],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"imported: {result.stdout.strip()}"
