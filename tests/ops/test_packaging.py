"""A wheel built from the repository holds every package: the worker's engine and the
scheduler import from the unpacked wheel alone, not from this checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")
# The modules a `pip install .` must be able to run: the worker's engine (it imports the
# attention backends, a subpackage) and both services' entry points.
MODULES = (
    "pagoda.gpu_worker.paged_engine",
    "pagoda.gpu_worker.__main__",
    "pagoda.scheduler_svc.__main__",
    "pagoda.scheduler_svc.core.scheduler",
    "pagoda.client.cli",
)


def source_folders() -> list[str]:
    """The folders the import name `pagoda` is mapped onto (pyproject's package-dir)."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    package_dir = config["tool"]["setuptools"]["package-dir"]
    return sorted({"pagoda", *package_dir.values()})


def build_wheel(out: Path) -> Path:
    """Build the wheel from a copy of the sources (the checkout gets no build/ or egg-info)."""
    source = out / "source"
    source.mkdir()
    for name in BUILD_FILES:
        if (REPO_ROOT / name).exists():
            shutil.copy2(REPO_ROOT / name, source / name)
    for folder in source_folders():
        shutil.copytree(
            REPO_ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    wheels = out / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--wheel-dir", str(wheels), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = wheels.glob("pagoda-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_imports_the_engine_and_the_scheduler_alone(tmp_path):
    wheel = build_wheel(tmp_path)
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    # -I -S: neither the checkout (cwd, PYTHONPATH) nor the venv's editable finder (a .pth
    # that site would run) is on the path; the dependencies come from site-packages, added
    # as plain folders so no .pth runs.
    site_packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    script = (
        "import importlib, sys\n"
        f"sys.path[:0] = [{str(unpacked)!r}]\n"
        f"sys.path += {site_packages!r}\n"
        f"for name in {MODULES!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(unpacked)!r}), module.__file__\n"
        "print('imported', len(sys.modules))\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imported" in result.stdout
    # The CPU kernels' sources, which the worker compiles on first use: every one it
    # compiles, and nothing else.
    from pagoda.gpu_worker import cpu_kernels

    kernels = unpacked / "pagoda" / "gpu_worker" / "kernels"
    compiled = {p.name for p in cpu_kernels.SOURCES + cpu_kernels.HEADERS}
    assert {p.name for p in kernels.glob("*.[ch]")} == compiled
    assert {"gemm.c", "decoder.c", "simd.h"} <= compiled
