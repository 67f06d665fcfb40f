"""The torch and Triton releases fused_zero is tested on, and what an import says outside them.

fused_zero is Python and Triton: no compiled extension is tied to torch's ABI. So pyproject.toml sets
lower bounds only (``torch>=2.11``, ``triton>=3.6``): installing fused_zero never replaces a torch or
Triton a user already has, and a new torch release needs no new fused_zero to install beside it (an
upper bound made pip plan a multi-GB downgrade of the user's torch, and held back torch's own Triton
pin). CI runs the oldest supported pair and the newest release (``.ci/run``); docs/install.md says what
each release changed that touches fused_zero. At import:

- torch or Triton older than ``OLDEST`` (installed with ``--no-deps`` beside an older image): ImportError
  naming the version to install;
- newer than ``NEWEST``: an ``UntestedVersionWarning`` naming the tested range, once per process (silence
  it with ``warnings.filterwarnings("ignore", category=fused_zero.versions.UntestedVersionWarning)``).
  ``NEWEST`` moves with each torch release CI runs.
"""

from __future__ import annotations

import re
import warnings

OLDEST = {"torch": (2, 11), "triton": (3, 6)}
NEWEST = {"torch": (2, 15), "triton": (3, 9)}


class UntestedVersionWarning(UserWarning):
    """torch or Triton is newer than the newest release fused_zero's CI runs."""


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: ``"2.15.0+cu132"`` -> (2, 15), ``"3.10.0.dev1"`` -> (3, 10)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def _named(pair: tuple[int, int]) -> str:
    return f"{pair[0]}.{pair[1]}"


def check(versions: dict[str, str]) -> None:
    """Raise or warn for each of ``versions`` ({"torch": torch.__version__, ...}) outside the tested range."""
    for name, version in versions.items():
        have = release(version)
        if have < OLDEST[name]:
            raise ImportError(
                f"fused_zero needs {name} >= {_named(OLDEST[name])}; this environment has {name} {version}. "
                f"Install a newer {name} (tested: {_tested()})")
        if have > NEWEST[name]:
            warnings.warn(
                f"fused_zero is tested on {_tested()}; this environment has {name} {version}, newer than "
                f"the newest tested. It is expected to work (fused_zero is Python and Triton, with no "
                f"compiled extension tied to torch); report what differs", UntestedVersionWarning, stacklevel=3)


def _tested() -> str:
    return (f"torch {_named(OLDEST['torch'])} to {_named(NEWEST['torch'])} with Triton "
            f"{_named(OLDEST['triton'])} to {_named(NEWEST['triton'])}")


def check_installed() -> None:
    """``check`` on the torch and Triton this process imports."""
    import torch
    import triton

    check({"torch": torch.__version__, "triton": triton.__version__})
