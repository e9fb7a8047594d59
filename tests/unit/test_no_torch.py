"""The scheduler process never loads torch (nor transformers, which imports it)."""

from __future__ import annotations

import subprocess
import sys

SCHEDULER_CORE_MODULES = [
    "pagoda.scheduler_svc",
    "pagoda.scheduler_svc.core.admission",
    "pagoda.scheduler_svc.core.block_allocator",
    "benchmarks.scheduler_core",
    "pagoda.scheduler_svc.core.config",
    "pagoda.scheduler_svc.detokenizer",
    "pagoda.scheduler_svc.testing",
    "pagoda.scheduler_svc.core.generation",
    "pagoda.scheduler_svc.core.plan_columns",
    "pagoda.scheduler_svc.core.preemption",
    "pagoda.scheduler_svc.core.prefix_cache",
    "pagoda.scheduler_svc.core.request",
    "pagoda.scheduler_svc.core.request_limits",
    "pagoda.scheduler_svc.core.scheduler",
    "pagoda.scheduler_svc.core.sequence_state",
    "pagoda.scheduler_svc.core.step_decision",
    "pagoda.scheduler_svc.core.stats",
    "pagoda.scheduler_svc.core.step_planner",
    "pagoda.scheduler_svc.core.stop_rules",
    "pagoda.scheduler_svc.tokenizer",
    "pagoda.scheduler_svc.core.waiting_queue",
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
