"""bench/gpu_check.sh where there is no GPU: its status logic (a failing step makes the script exit
non-zero and name the step; passing and skipped steps do not; ``nvidia-smi`` is a stand-in on PATH),
and its dry run (``GPU_CHECK_DRY_RUN=1``: every step a CPU stub), whose status lines give each step's
time and limit: the limits and the reserve for cases still to come fit the budget, and the budget fits
the device time a session gets (15 minutes: a machine start, a run and one rerun). Every ``-k`` of a
tests/gpu step selects a case."""

import os
import re
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
DEVICE_TIME, MACHINE_START = 900, 120  # a session's device seconds; a start, at the pessimistic end


def run_check(tmp_path, nvidia_smi_status: int = 0, extra: list | None = None, **env):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho fake nvidia-smi\nexit {nvidia_smi_status}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    python = bindir / "python3"  # the summary runs with the interpreter running this test
    if not python.exists():
        python.symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(["bash", SCRIPT, str(tmp_path / "out"), *(extra or [])], env=env, capture_output=True,
                          text=True, timeout=120)


def status(tmp_path) -> list[list[str]]:
    return [line.split() for line in (tmp_path / "out" / "status.txt").read_text().splitlines()]


@pytest.mark.parametrize("code", [0, 3])
def test_gpu_check_exit_status_names_the_failing_step(tmp_path, code):
    proc = run_check(tmp_path, code, GPU_CHECK_ONLY="nvidia-smi")
    rows = status(tmp_path)
    assert ["nvidia-smi", str(code)] == rows[0][:2], rows
    assert ["versions", "skipped", "0", "10"] in rows
    if code:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "FAILED: nvidia-smi (exit 3)" in proc.stderr
        assert "FAILED steps: nvidia-smi (exit 3)" in proc.stdout  # the summary says it too
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "every step passed" in proc.stdout
    assert sorted(os.listdir(tmp_path / "out")) == ["gpu-check.tgz", "measured.jsonl", "status.txt", "summary.txt"]


SETS = {
    "tests": ["nvidia-smi", "versions", "gpu-kernels", "gpu-engine", "gpu-muon", "gpu-several", "gpu-graph",
              "gpu-formats", "gpu-host-sync", "gpu-ranks", "gpu-state-dict"],
    "bench": ["nvidia-smi", "versions", "gpu-torch-sanitizer", "memcheck", "bench-kernels", "bench-step",
              "bench-graph", "bench-optimizers", "demo"],
}


@pytest.mark.parametrize("which", sorted(SETS))
def test_dry_run_fits_the_budget_and_the_device_time(tmp_path, which):
    proc = run_check(tmp_path, GPU_CHECK_DRY_RUN="1", extra=[which])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = status(tmp_path)
    names = [r[0] for r in rows]
    assert names == SETS[which], names
    assert all(len(r) == 4 and r[1] == "0" for r in rows), rows  # step, exit code, seconds, limit
    steps, reserve, total, finish = map(int, re.search(
        r"steps (\d+)s \(reserve (\d+)s included\) of (\d+)s, then (\d+)s", proc.stdout).groups())
    assert steps == sum(int(r[3]) for r in rows) + reserve <= total, (steps, total)
    assert MACHINE_START + 2 * (total + finish) <= DEVICE_TIME, "a run and one rerun must fit the device time"


def test_every_step_is_in_one_set_and_the_default_is_the_tests():
    text = open(SCRIPT).read()
    declared = re.findall(r"^(?:step|gpu) (\S+)", text, re.M) + ["memcheck"]
    tests, bench = set(SETS["tests"][2:]), set(SETS["bench"][2:])
    assert not tests & bench and set(declared) - {"nvidia-smi", "versions"} == tests | bench, declared
    assert 'SET=${2:-tests}' in text


def test_an_unknown_set_is_refused(tmp_path):
    proc = run_check(tmp_path, GPU_CHECK_DRY_RUN="1", extra=["everything"])
    assert proc.returncode == 2 and "unknown set 'everything'" in proc.stderr, proc.stderr


def test_a_budget_the_limits_do_not_fit_is_refused_before_any_step(tmp_path):
    proc = run_check(tmp_path, GPU_CHECK_DRY_RUN="1", TOTAL_BUDGET="200")
    assert proc.returncode == 2 and "over TOTAL_BUDGET=200s: lower a LIMIT" in proc.stderr, proc.stderr
    assert status(tmp_path) == []


def test_the_check_installs_nothing():
    text = open(SCRIPT).read()
    assert "pip" not in text.replace("no pip", ""), "gpu_check.sh must not install into the active environment"


def test_every_gpu_step_selects_its_cases():
    steps = re.findall(r'^gpu (\S+) "([^"]+)"$', open(SCRIPT).read(), re.M)
    assert len(steps) == 10, steps
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    listed = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                             os.path.join(ROOT, "tests", "gpu")], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120).stdout
    cases = re.findall(r"::(test_\w+)", listed)
    assert len(cases) >= 8, listed
    chosen = {}
    for name, k in steps:
        terms = [t.strip() for t in k.split(" or ")]
        chosen[name] = [c for c in cases if any(t in c for t in terms)]
    empty = [name for name, picked in chosen.items() if not picked]
    assert not empty, f"steps selecting no case: {empty}"
    covered = {c for picked in chosen.values() for c in picked}
    assert covered == set(cases), f"tests/gpu cases no step runs: {sorted(set(cases) - covered)}"
