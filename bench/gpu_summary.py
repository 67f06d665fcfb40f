"""The one-screen summary ``bench/gpu_check.sh`` ends with, from what its steps left in OUTDIR:

    python bench/gpu_summary.py OUTDIR [WORKDIR]

(WORKDIR: where the steps' files are, when not in OUTDIR; gpu_check.sh bundles them afterwards)

- every step's status (status.txt: "<step> <exit code or 'skipped'> <seconds> [limit]"), failures named;
- the GPU tests passed / failed / skipped (gpu-*.xml, pytest's JUnit XML, one per gpu_check.sh step; a
  step stopped at its limit still leaves the cases it finished);
- the tolerances the two measured cases used (tolerances.json, bench/gpu_tolerance.py);
- bench/gpu_run.py's run (OUTDIR/run.jsonl, the run set): complete or not, its measurements, skips and
  errors, and where its summary is (OUTDIR/summary.md: the kernels, the iterations, the traces);
- ``step()`` eager against replayed from a CUDA graph: host time per step and iteration (bench-graph.json).

Exits 1 when a step failed (a non-zero exit code in status.txt), else 0; missing files are reported as
missing, not as failures (their step's status says why).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read_status(out: Path) -> list[tuple[str, str, str]]:
    path = out / "status.txt"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            rows.append((parts[0], parts[1], parts[2] if len(parts) > 2 else "?"))
    return rows


def failed_steps(rows) -> list[str]:
    return [f"{name} (exit {code})" for name, code, _ in rows if code not in ("0", "skipped")]


def test_counts(out: Path) -> str:
    paths = sorted(out.glob("gpu-*.xml"))
    if not paths:
        return "GPU tests: no report (no gpu-*.xml)"
    suites = []
    for path in paths:
        root = ET.parse(path).getroot()
        suites += [root] if root.tag == "testsuite" else list(root)
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    names = [c.get("name") for s in suites for c in s.iter("testcase")
             if c.find("failure") is not None or c.find("error") is not None]
    skips = sorted({(c.find("skipped").get("message") or "").strip()[:90] for s in suites
                    for c in s.iter("testcase") if c.find("skipped") is not None})
    line = f"GPU tests: {total - failed - skipped} passed, {failed} failed, {skipped} skipped"
    if names:
        line += "\n  failed: " + ", ".join(names)
    for reason in skips:
        line += f"\n  skipped: {reason}"
    return line


def _benchmarks(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return json.loads(path.read_text()).get("benchmarks", [])


def tolerance_lines(out: Path) -> list[str]:
    path = out / "tolerances.json"
    if not path.exists():
        return ["tolerances: not measured (no tolerances.json): the two cases kept today's"]
    data = json.loads(path.read_text())
    lines = [f"tolerances ({data.get('rule')}, factor {data.get('factor')}, {data.get('device')}):"]
    for name, case in data.get("cases", {}).items():
        lines.append(f"  {name}: torch fused vs single {case['torch_fused_vs_single']:.3g} "
                     f"(foreach {case['torch_foreach_vs_single']:.3g}); today {case['today']:.3g} -> "
                     f"{case['tolerance']:.3g}")
    return lines


def program_lines(out: Path) -> list[str]:
    """bench/gpu_run.py's lines (the run set writes them to OUTDIR itself), in a few words."""
    path = out / "run.jsonl"
    if not path.exists():
        return []
    kinds: dict[str, int] = {}
    bad = 0
    for raw in path.read_text().splitlines():
        try:
            kind = json.loads(raw).get("kind")
        except json.JSONDecodeError:
            bad += 1
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    state = "complete" if kinds.get("end") else "stopped" if kinds.get("abort") else "incomplete (killed?)"
    measured = sum(n for k, n in kinds.items() if k not in ("env", "section", "skip", "error", "abort", "end"))
    return [f"gpu_run: {state}, {measured} measurements, {kinds.get('skip', 0)} skipped, {kinds.get('error', 0)} "
            f"errors{f', {bad} torn lines' if bad else ''}; the tables: summary.md (python3 bench/gpu_run.py "
            f"--summarize run.jsonl renders them again)"]


def graph_table(out: Path) -> list[str]:
    runs = [b for b in _benchmarks(out / "bench-graph.json") if "system" in (b.get("extra_info") or {})]
    if not runs:
        return ["graph: no results (bench-graph.json missing or empty)"]
    lines = ["step() host us and iteration ms, median (ratio to fused_zero-step, eager):"]
    for b in runs:
        i = b["extra_info"]
        graph = f", captures {i['captures']} replays {i['replays']}" if i.get("captures") is not None else ""
        lines.append(f"  {i['model']} {i['system']}: host {i['host_step_us_median']:.0f} us "
                     f"({i['host_step_vs_eager']:.2f}), iteration {i['iteration_ms_median']:.2f} ms "
                     f"({i['iteration_vs_eager']:.2f}){graph}")
    return lines


def main(out: Path, work: Path | None = None) -> int:
    rows = read_status(out)
    data = work if work is not None else out
    failed = failed_steps(rows)
    print("=" * 100)
    print("steps: " + " | ".join(f"{n} {'ok' if c == '0' else c} {s}s" for n, c, s in rows))
    steps = {name for name, _, _ in rows}
    parts = [(test_counts, data, any(n.startswith("gpu-") and n not in ("gpu-run", "gpu-tolerance") for n in steps)),
             (tolerance_lines, data, "gpu-tolerance" in steps), (program_lines, out, True),
             (graph_table, data, "bench-graph" in steps)]
    for part, where, this_set in parts:  # the parts of the set that ran (every part without a status)
        if rows and not this_set:
            continue
        try:  # one unreadable file must not hide the rest of the summary
            out_lines = part(where)
        except Exception as e:
            out_lines = f"{part.__name__}: unreadable ({type(e).__name__}: {e})"
        if out_lines:
            print(out_lines if isinstance(out_lines, str) else "\n".join(out_lines))
    print(("FAILED steps: " + ", ".join(failed)) if failed else "every step passed")
    print("=" * 100)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        print(f"usage: {sys.argv[0]} OUTDIR [WORKDIR]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else None))
