"""bench/gpu_check.sh where there is no GPU: its status logic (a failing step makes the script exit
non-zero and name the step; passing and skipped steps do not; ``nvidia-smi`` is a stand-in on PATH),
and its dry run (``GPU_CHECK_DRY_RUN=1``: every step a CPU stub), whose status lines give each step's
time and limit: in every set the limits and the reserve for cases still to come fit the budget, and
the budget fits the device time a session gets (15 minutes: a machine start and two sets, the run set
and the tests). Every ``-k`` of a tests/gpu step selects a case; a real step writes its JUnit XML, and
a step stopped at its limit still does (SIGINT first). The measured tolerances: bench/gpu_tolerance.py
on the CPU writes the file the two tests/gpu cases read, and they keep max(today's, 2 x torch's)."""

import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
import tarfile

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
    "run": ["gpu-run"],
    "tests": ["nvidia-smi", "versions", "gpu-tolerance", "gpu-kernels", "gpu-engine", "gpu-muon", "gpu-several",
              "gpu-graph", "gpu-formats", "gpu-host-sync"],
    "tests2": ["nvidia-smi", "versions", "gpu-ranks", "gpu-state-dict", "gpu-torch-sanitizer", "memcheck"],
    "bench": ["nvidia-smi", "versions", "bench-graph", "bench-optimizers"],
}
COMMON = {"nvidia-smi", "versions"}


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
    assert MACHINE_START + 2 * (total + finish) <= DEVICE_TIME, "two sets (run, then tests) must fit the device time"


def test_every_step_is_in_one_set_and_the_default_is_the_tests():
    text = open(SCRIPT).read()
    declared = re.findall(r"^(?:step|gpu) (\S+)", text, re.M) + ["memcheck"]
    own = [set(names) - COMMON for names in SETS.values()]
    assert sum(map(len, own)) == len(set().union(*own)), "a step in two sets: measured twice"
    assert set(declared) - COMMON == set().union(*own), declared
    assert 'SET=${2:-tests}' in text


def test_the_run_set_is_the_measurement_program_and_it_comes_first():
    text = open(SCRIPT).read()
    assert re.search(r"^step gpu-run python3 bench/gpu_run.py --out \"\$OUT\"", text, re.M)
    usage = [line for line in text.splitlines()[:12] if "bash bench/gpu_check.sh OUTDIR" in line]
    assert "OUTDIR run" in usage[0] and "FIRST" in usage[0], usage
    for retired in ("bench-kernels", "bench-step", "fused_zero.demo.cli demo"):  # gpu_run.py measures these
        assert retired not in text.split("set -u", 1)[1], retired


def test_the_tolerances_are_measured_before_the_cases_that_read_them():
    order = SETS["tests"]
    assert order.index("gpu-tolerance") < order.index("gpu-kernels") < order.index("gpu-engine")
    text = open(SCRIPT).read()
    assert 'export GPU_TOLERANCES="$WORK/tolerances.json"' in text
    assert 'step gpu-tolerance python3 bench/gpu_tolerance.py --out "$WORK"' in text


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


def test_a_real_step_writes_its_junit_into_the_bundle(tmp_path):
    """Not a dry run: gpu-kernels' pytest runs here (its cases skip without CUDA) and its JUnit XML is in
    gpu-check.tgz, as every gpu step's is."""
    proc = run_check(tmp_path, GPU_CHECK_ONLY="gpu-kernels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ["gpu-kernels", "0"] == next(r for r in status(tmp_path) if r[0] == "gpu-kernels")[:2]
    with tarfile.open(tmp_path / "out" / "gpu-check.tgz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
        xml = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("gpu-kernels.xml"))).read()
    assert {"gpu-kernels.xml", "gpu-kernels.log"} <= names, names
    assert b'skipped="2"' in xml, xml[:400]
    assert "GPU tests: 0 passed, 0 failed, 2 skipped" in proc.stdout


def test_a_step_stopped_at_its_limit_still_writes_its_junit(tmp_path):
    """The script stops a step with SIGINT (then SIGKILL): pytest then writes the JUnit XML of the cases
    it finished, where SIGTERM would leave none (the first H200 run's timed-out steps left no XML)."""
    text = open(SCRIPT).read()
    command = re.search(r"^\s+(timeout -s INT --kill-after=\d+) \"\$limit\" \"\$@\"", text, re.M)
    assert command, "gpu_check.sh must stop a step with SIGINT first"
    (tmp_path / "test_slow.py").write_text(
        "import subprocess, sys\n"
        "def test_done():\n    pass\n"
        "def test_stuck():\n    subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])\n")
    xml = tmp_path / "out.xml"
    proc = subprocess.run([*command.group(1).split(), "4", sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-q", str(tmp_path / "test_slow.py"), "--junitxml", str(xml)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert xml.exists() and b'name="test_done"' in xml.read_bytes(), proc.stdout


def _gpu_cases(monkeypatch, path):
    monkeypatch.setenv("GPU_TOLERANCES", str(path))
    monkeypatch.delenv("GPU_MEASURE", raising=False)
    spec = importlib.util.spec_from_file_location("gpu_cases_under_test", os.path.join(ROOT, "tests", "gpu",
                                                                                       "gpu_cases.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_measured_tolerances_are_written_and_read(tmp_path, monkeypatch):
    """bench/gpu_tolerance.py on the CPU writes tolerances.json; the two cases read it: max(today's atol,
    the factor x torch's fused-vs-single distance), never looser than that distance, never tighter than
    today's; without the file, today's."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_tolerance.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, env={**env, "TOLDEV": "cpu"}, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = json.loads((tmp_path / "tolerances.json").read_text())
    assert set(written["cases"]) == {"kernel_adam_amsgrad_bf16", "engine_bf16"}
    cases = _gpu_cases(monkeypatch, tmp_path / "tolerances.json")
    for name, case in written["cases"].items():
        assert case["today"] == cases.MEASURED[name] and case["torch_fused_vs_single"] >= 0
        assert cases.measured_tolerance(name) == case["tolerance"] == max(
            cases.MEASURED[name], cases.TOLERANCE_FACTOR * case["torch_fused_vs_single"])
    far = {"cases": {"kernel_adam_amsgrad_bf16": {"torch_fused_vs_single": 3e-4},
                     "engine_bf16": {"torch_fused_vs_single": 1e-9}}}
    (tmp_path / "far.json").write_text(json.dumps(far))
    cases = _gpu_cases(monkeypatch, tmp_path / "far.json")
    assert cases.measured_tolerance("kernel_adam_amsgrad_bf16") == cases.TOLERANCE_FACTOR * 3e-4
    assert cases.measured_tolerance("engine_bf16") == cases.ENGINE_BF16_ATOL  # never tighter than today's
    cases = _gpu_cases(monkeypatch, tmp_path / "absent.json")
    assert cases.measured_tolerance("kernel_adam_amsgrad_bf16") == cases.KERNEL_ATOL


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
