"""The package imported from its source checkout, without an install of that checkout: ``python -m
fused_zero.demo.cli`` from the clone's root (even beside an installed copy: the current folder comes first
on ``sys.path``), ``PYTHONPATH=<clone>``, the test suite's subprocesses and spawned ranks, which run there.

pyproject.toml's ``[tool.setuptools.package-dir]`` maps sub-packages whose sources sit outside
``fused_zero/`` (``fused_zero.kernels`` is the top-level ``kernels/``). A wheel copies them into place and
an editable install's import finder maps them; a bare checkout has neither, so ``mount_package_dirs``
reads the same table and imports each such sub-package from its folder. The mapping is written once, in
pyproject.toml, and the checkout finds the kernels where an install does. The checkout's own folders are
taken before the import system is asked: an editable install of another checkout in site-packages would
answer with that checkout's kernels (in an editable install of this one both agree). In an installed copy
there is no pyproject.toml beside the package, and nothing here runs.

Imports nothing of fused_zero: the package's ``__init__`` calls it before importing anything that needs
the kernels.
"""

import importlib.util
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The folder holding the package: the checkout's root, or site-packages in an install."""


def pyproject() -> dict | None:
    """The checkout's pyproject.toml, parsed, where the package is fused-zero's source tree; else None."""
    path = ROOT / "pyproject.toml"
    if not path.is_file():
        return None
    config = tomllib.loads(path.read_text())
    return config if config.get("project", {}).get("name") == "fused-zero" else None


def mount_package_dirs(package: str) -> None:
    """Import each sub-package of ``package`` (being initialised) that pyproject.toml's
    package-dir maps to a folder of its own, from that folder, as ``<package>.<name>``: its own modules
    then import through its ``__path__`` as in an install. Nothing in an installed copy, nor for a
    sub-package already imported."""
    config = pyproject()
    if config is None:
        return
    folders = config.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    for name, folder in sorted(folders.items()):
        parent, _, child = name.rpartition(".")
        if parent != package or name in sys.modules:
            continue
        where = ROOT / folder
        spec = importlib.util.spec_from_file_location(name, where / "__init__.py",
                                                      submodule_search_locations=[str(where)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        setattr(sys.modules[package], child, module)
