"""Package discovery for the one import name `pagoda`, mapped onto several folders.

setuptools' own discovery (`packages.find`) names a package after its folder, so it cannot
find `pagoda.gpu_worker.attention` in gpu_worker/attention/. This finds the packages under
each folder of pyproject's package-dir and prefixes them; everything else is in pyproject.
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def mapped_packages(package_dir: dict[str, str]) -> list[str]:
    packages = []
    for name, folder in package_dir.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(str(ROOT / folder))]
    # A folder nested in another mapped folder (none today) would be found twice.
    return sorted(set(packages))


PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
setup(packages=mapped_packages(PACKAGE_DIR))
