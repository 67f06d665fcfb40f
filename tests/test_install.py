"""The package as a user gets it: a wheel and an sdist built from a clean copy of the tracked files, the
wheel installed (not editable) into a folder of its own, and ``import fused_zero`` with its kernels
(which live in ``kernels/`` at the top level; pyproject.toml's package-dir installs them as
``fused_zero.kernels``) from the clone's root, which puts the source tree first (fused_zero/checkout.py
reads the same package-dir there), and from elsewhere, which finds the installed copy. Skipped where the
copy or the build cannot be made here (no git, no setuptools backend); builds without the network (no
build isolation, no index)."""

import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = sorted(p.name for p in (ROOT / "kernels").glob("*.py"))


def _run(args, cwd, **kw):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(clone, wheel, sdist): the tracked files copied as git has them, and what setuptools' backend
    builds from them."""
    tmp = tmp_path_factory.mktemp("install")
    clone = tmp / "clone"
    files = _run(["git", "ls-files", "-z"], ROOT)
    if files.returncode != 0 or shutil.which("tar") is None:
        pytest.skip(f"no git checkout to copy: {files.stderr.strip()}")
    clone.mkdir()
    pack = subprocess.run(["tar", "--null", "-T", "-", "-cf", "-"], cwd=ROOT, input=files.stdout.encode(),
                          capture_output=True, check=True)
    subprocess.run(["tar", "-xf", "-"], cwd=clone, input=pack.stdout, check=True)
    out = {kind: _build(kind, clone, tmp) for kind in ("wheel", "sdist")}
    return clone, out["wheel"], out["sdist"]


def _build(kind: str, source: Path, into: Path) -> Path:
    build = f"from setuptools import build_meta as b; print(b.build_{kind}({str(into)!r}))"
    # -P and no PYTHONPATH: no checkout's kernels/ may shadow an installed package named kernels
    # (transformers' dependency, whose entry point setuptools' egg_info loads)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    res = _run([sys.executable, "-P", "-c", build], source, env=env)
    if res.returncode != 0:
        pytest.skip(f"setuptools cannot build the {kind} here: {res.stderr.strip()[-400:]}")
    return into / res.stdout.strip().splitlines()[-1]


def _kernels_in_wheel(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {Path(n).name for n in z.namelist() if n.startswith("fused_zero/kernels/")}


def test_wheel_and_sdist_hold_the_kernels(built, tmp_path):
    """The wheel holds them as fused_zero/kernels; the sdist holds kernels/ and the package-dir that maps
    it, so the wheel pip builds from the sdist holds them too."""
    _, wheel, sdist = built
    assert KERNELS and set(KERNELS) <= _kernels_in_wheel(wheel), f"the wheel has {sorted(_kernels_in_wheel(wheel))}"
    with tarfile.open(sdist) as t:
        in_sdist = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name and m.isfile()}
        t.extractall(tmp_path, filter="data")
    assert {f"kernels/{name}" for name in KERNELS} <= in_sdist, f"the sdist has {sorted(in_sdist)}"
    (unpacked,) = (p for p in tmp_path.iterdir() if p.is_dir())
    from_sdist = _build("wheel", unpacked, tmp_path)
    assert set(KERNELS) <= _kernels_in_wheel(from_sdist), f"its wheel has {sorted(_kernels_in_wheel(from_sdist))}"


def test_import_after_a_non_editable_install(built, tmp_path):
    clone, wheel, _ = built
    target = tmp_path / "site"
    res = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
               tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    # -S: no .pth files, so no editable install of another checkout can answer the import
    path = ":".join([str(target), *site.getsitepackages()])
    probe = "import fused_zero, fused_zero.kernels as k; print(fused_zero.__file__); print(k.__file__)"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd, home in ((clone, clone), (elsewhere, target)):
        res = _run([sys.executable, "-S", "-c", probe], cwd, env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"})
        assert res.returncode == 0, f"import fused_zero in {cwd}: {res.stderr[-2000:]}"
        package, kernels = (Path(line) for line in res.stdout.split())
        assert package.is_relative_to(home) and kernels.is_relative_to(home), (cwd, res.stdout)
