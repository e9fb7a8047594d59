"""`make gpu-check ARGS=--dry-run` walks the lent GPU machine's steps on this CPU at toy
sizes, so the script that one short lease depends on cannot rot between leases."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# pytest-cuda is left out: those test files run in this suite anyway.
STEPS = (
    "engine make-qwen3 bench-qwen3 bench-worker service kbench tune kernels make-llama bench-llama"
)


@pytest.mark.slow
def test_the_gpu_check_dry_run_passes_every_step(tmp_path, default_model_dir):
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "GPU_CHECK_STEPS": STEPS,
        "GPU_CHECK_DEADLINE_S": "900",
        "PY": sys.executable,
    }
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    ran = re.findall(r"^=== \[([a-z0-9-]+)\] rc=0", summary, re.MULTILINE)
    assert ran == STEPS.split()
    assert not re.search(r"^FAIL", summary, re.MULTILINE)
    for expected in ("PASS [fp32] engine", "PASS service greedy", "TIME decode B=", "TIME kbench"):
        assert expected in summary
