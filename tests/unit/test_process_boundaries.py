"""The two processes share only pagoda.common (and the protos): neither imports the other.

The scheduler may run the worker's model resolution, but only as a subprocess; the worker
never needs the scheduler's code. Every module of each package is imported in a fresh
interpreter, so a new module is covered without being listed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
names = [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
for name in names:
    importlib.import_module(name)
forbidden = sys.argv[2:]
loaded = sorted(
    m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden)
)
print(json.dumps({"modules": names, "loaded": loaded}))
"""


def import_everything(package: str, forbidden: list[str]) -> tuple[list[str], list[str]]:
    """(the modules of `package`, the forbidden modules importing all of them loaded)."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, package, *forbidden],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["modules"], report["loaded"]


@pytest.mark.parametrize(
    ("package", "forbidden", "some_module"),
    [
        ("pagoda.gpu_worker", ["pagoda.scheduler_svc"], "pagoda.gpu_worker.server"),
        (
            "pagoda.scheduler_svc",
            ["pagoda.gpu_worker", "torch", "transformers"],
            "pagoda.scheduler_svc.core.scheduler",
        ),
    ],
)
def test_a_process_imports_nothing_of_the_other(package, forbidden, some_module):
    modules, loaded = import_everything(package, forbidden)
    assert some_module in modules  # the walk found the package's modules
    assert loaded == [], f"importing every {package} module loaded {loaded}"
