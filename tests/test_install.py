"""The package as a user gets it: a wheel and an sdist built from a clean copy of the tracked files, the
wheel installed (not editable) into a folder of its own, and ``import fused_zero`` (with its kernels,
which live in ``kernels/`` at the top level and reach the package through the ``fused_zero/kernels``
link) from the clone's root, which puts the source tree first, and from elsewhere, which finds the
installed copy. Skipped where the copy or the build cannot be made here (no git, no setuptools
backend); builds without the network (no build isolation, no index)."""

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
    """(clone, wheel, sdist): the tracked files copied as git has them (the link kept a link), and what
    setuptools' backend builds from them."""
    tmp = tmp_path_factory.mktemp("install")
    clone = tmp / "clone"
    files = _run(["git", "ls-files", "-z"], ROOT)
    if files.returncode != 0 or shutil.which("tar") is None:
        pytest.skip(f"no git checkout to copy: {files.stderr.strip()}")
    clone.mkdir()
    pack = subprocess.run(["tar", "--null", "-T", "-", "-cf", "-"], cwd=ROOT, input=files.stdout.encode(),
                          capture_output=True, check=True)
    subprocess.run(["tar", "-xf", "-"], cwd=clone, input=pack.stdout, check=True)
    out = {}
    for kind in ("wheel", "sdist"):
        build = f"from setuptools import build_meta as b; print(b.build_{kind}({str(tmp)!r}))"
        # -P: the clone's kernels/ must not shadow an installed package named kernels (transformers' dependency)
        res = _run([sys.executable, "-P", "-c", build], clone)
        if res.returncode != 0:
            pytest.skip(f"setuptools cannot build the {kind} here: {res.stderr.strip()[-400:]}")
        out[kind] = tmp / res.stdout.strip().splitlines()[-1]
    return clone, out["wheel"], out["sdist"]


def test_wheel_and_sdist_hold_the_kernels(built):
    _, wheel, sdist = built
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {Path(n).name for n in z.namelist() if n.startswith("fused_zero/kernels/")}
    with tarfile.open(sdist) as t:
        members = {m.name.split("/", 1)[1]: m for m in t.getmembers() if "/" in m.name}
    in_sdist = {Path(n).name for n, m in members.items() if n.startswith("fused_zero/kernels/") and m.isfile()}
    assert KERNELS and set(KERNELS) <= in_wheel, f"the wheel's fused_zero/kernels has {sorted(in_wheel)}"
    assert set(KERNELS) <= in_sdist, f"the sdist's fused_zero/kernels has {sorted(in_sdist)}"


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
