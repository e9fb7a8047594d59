"""Write a sitecustomize.py that maps the repository's folders onto `pagoda.*`.

    PAGODA_REPO=/path/to/repo python3 scripts/pagoda_paths.py DIR   # then PYTHONPATH=DIR

For a Python that cannot install the project (the lent GPU machine: its torch and
transformers are not the pinned ones and it has no package index). The mapping is
pyproject's package-dir; any sitecustomize already on the path still runs after it.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

TEMPLATE = """import importlib.machinery, importlib.util, os, sys
_FOLDERS = {folders!r}


class _PagodaFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        folder = _FOLDERS.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])


sys.meta_path.insert(0, _PagodaFinder)
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
"""


def main() -> None:
    repo = Path(os.environ.get("PAGODA_REPO", Path(__file__).resolve().parent.parent))
    setuptools = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"pagoda": str(repo / "pagoda")}
    for package, folder in setuptools.get("package-dir", {}).items():
        if package:  # "" is a root mapping, not a package
            folders[package] = str(repo / folder)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "sitecustomize.py").write_text(TEMPLATE.format(folders=folders))


if __name__ == "__main__":
    main()
