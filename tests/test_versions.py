"""The version policy (fused_zero/versions.py, docs/install.md): lower bounds only in pyproject.toml, the
same oldest pair CI runs, an ImportError below it and a warning naming the tested range above the newest
release CI runs; docs/install.md and .ci/run name the same versions."""

import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from fused_zero import versions

ROOT = Path(__file__).resolve().parent.parent


def _requirements() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.match(r"[A-Za-z0-9_-]+", d).group(0): d for d in deps}


def test_pyproject_sets_lower_bounds_only_at_the_oldest_tested_pair():
    reqs = _requirements()
    for name in ("torch", "triton"):
        oldest = ".".join(map(str, versions.OLDEST[name]))
        assert reqs[name] == f"{name}>={oldest}", (reqs[name], "no upper bound: docs/install.md, Version policy")


def test_ci_runs_the_oldest_and_the_newest_pair():
    text = (ROOT / ".ci" / "run").read_text()
    pairs = re.findall(r"^compat (\d+\.\d+)\.\d+ (\d+\.\d+)\.\d+$", text, re.M)
    named = [tuple(versions.release(v) for v in pair) for pair in pairs]
    assert (versions.OLDEST["torch"], versions.OLDEST["triton"]) in named, pairs
    assert (versions.NEWEST["torch"], versions.NEWEST["triton"]) in named, pairs


def test_install_md_names_the_tested_range():
    text = (ROOT / "docs" / "install.md").read_text()
    for name in ("torch", "triton"):
        for pair in (versions.OLDEST[name], versions.NEWEST[name]):
            assert f"{name.capitalize() if name == 'triton' else name} {pair[0]}.{pair[1]}" in text, (name, pair)


@pytest.mark.parametrize("version, expected", [("2.15.0+cu132", (2, 15)), ("2.13.0+cpu", (2, 13)),
                                               ("3.10.0.dev20261201", (3, 10)), ("2.11", (2, 11))])
def test_release(version, expected):
    assert versions.release(version) == expected


def test_inside_the_range_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check({"torch": "2.11.0", "triton": "3.6.0"})
        versions.check({"torch": "2.15.0+cu132", "triton": "3.9.0"})


def test_newer_than_the_newest_warns_naming_the_tested_range():
    with pytest.warns(versions.UntestedVersionWarning, match=r"tested on torch 2\.11 to 2\.15 .*torch 2\.16\.0"):
        versions.check({"torch": "2.16.0", "triton": "3.9.0"})
    with pytest.warns(versions.UntestedVersionWarning, match=r"triton 3\.10\.0"):
        versions.check({"torch": "2.15.0", "triton": "3.10.0"})


def test_older_than_the_oldest_is_an_import_error_naming_the_fix():
    with pytest.raises(ImportError, match=r"needs torch >= 2\.11; this environment has torch 2\.10\.1"):
        versions.check({"torch": "2.10.1", "triton": "3.6.0"})


def test_the_import_checks_the_torch_it_finds():
    """``import fused_zero`` under a torch that says it is 2.16: one warning, the import goes on."""
    code = ("import warnings, torch; warnings.simplefilter('always'); torch.__version__ = '2.16.0'\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import fused_zero\n"
            "print([type(w.message).__name__ for w in seen if 'torch 2.16.0' in str(w.message)], "
            "fused_zero.AdamW.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "['UntestedVersionWarning'] AdamW" in out.stdout, out.stdout + out.stderr
