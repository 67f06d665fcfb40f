"""The one-screen summary ``bench/gpu_check.sh`` ends with, from what its steps left in OUTDIR:

    python bench/gpu_summary.py OUTDIR [WORKDIR]

(WORKDIR: where the steps' files are, when not in OUTDIR; gpu_check.sh bundles them afterwards)

- every step's status (status.txt: "<step> <exit code or 'skipped'> <seconds> [limit]"), failures named;
- the GPU tests passed / failed / skipped (gpu-*.xml, pytest's JUnit XML, one per gpu_check.sh step);
- the kernels' GB/s as a share of the same run's device copy of the same bytes, at 1M-256M elements
  (bench-kernels.json);
- the bf16 + master AdamW step against torch's fused AdamW with the casts it needs (same file);
- the iteration against DDP + torch's fused AdamW, per model (bench-step.json);
- ``step()`` eager against replayed from a CUDA graph: host time per step and iteration (bench-graph.json).

Exits 1 when a step failed (a non-zero exit code in status.txt), else 0; missing files are reported as
missing, not as failures (their step's status says why).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

KERNEL_SIZES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
FUSED = ["adamw-fp32", "adamw-bf16master", "sgd-fp32", "sgd-bf16master"]
COPY_OF = {"adamw": "copy-28B", "adam": "copy-28B", "sgd": "copy-20B"}


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


def kernel_table(out: Path) -> list[str]:
    rows = {(b["extra_info"].get("provider"), b["extra_info"].get("size")): b
            for b in _benchmarks(out / "bench-kernels.json")
            if "provider" in (b.get("extra_info") or {}) and "GB/s" in b["extra_info"]}
    if not rows:
        return ["kernels: no results (bench-kernels.json missing or empty)"]
    lines = ["kernel GB/s, and as a share of the same run's copy of the same bytes:",
             f"  {'elements':>9}" + "".join(f"{p:>22}" for p in FUSED)]
    for size in KERNEL_SIZES:
        cells = []
        for p in FUSED:
            b, copy = rows.get((p, size)), rows.get((COPY_OF[p.split("-")[0]], size))
            if b is None:
                cells.append(f"{'-':>22}")
                continue
            gbs = b["extra_info"]["GB/s"]
            share = f" {gbs / copy['extra_info']['GB/s']:.0%}" if copy else ""
            cells.append(f"{gbs:>16.0f}{share:>6}")
        lines.append(f"  {size >> 20:>8}M" + "".join(cells))
    lines.append("bf16 + master AdamW step, median ms: fused_zero vs torch fused AdamW + grad/param casts")
    for size in KERNEL_SIZES:
        ours, theirs = rows.get(("adamw-bf16master", size)), rows.get(("torch-fused-adamw-bf16master", size))
        if ours and theirs:
            a, b = ours["stats"]["median"] * 1e3, theirs["stats"]["median"] * 1e3
            lines.append(f"  {size >> 20:>8}M  {a:8.3f} vs {b:8.3f}  (torch / fused_zero {b / a:.2f})")
    return lines


def iteration_table(out: Path) -> list[str]:
    runs = [b for b in _benchmarks(out / "bench-step.json")
            if (b.get("params") or {}).get("measure") == "iteration" and "system" in b["params"]]
    if not runs:
        return ["iteration: no results (bench-step.json missing or empty)"]
    by_model: dict[str, dict[str, float]] = {}
    for b in runs:
        by_model.setdefault(b["params"]["model"], {})[b["params"]["system"]] = b["stats"]["median"] * 1e3
    lines = ["iteration median ms vs DDP + torch fused AdamW (ratio: fused_zero / DDP):"]
    for model, systems in by_model.items():
        base = systems.get("ddp+torch-adamw")
        cells = []
        for system, ms in systems.items():
            if system == "ddp+torch-adamw":
                continue
            ratio = f" ({ms / base:.2f})" if base else ""
            cells.append(f"{system.replace('fused_zero-', 'fz-')} {ms:.2f}{ratio}")
        lines.append(f"  {model}: ddp {base:.2f}; " + "; ".join(cells) if base else f"  {model}: " + "; ".join(cells))
    return lines


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
    for part in (test_counts, kernel_table, iteration_table, graph_table):
        try:  # one unreadable file must not hide the rest of the summary
            out_lines = part(data)
        except Exception as e:
            out_lines = f"{part.__name__}: unreadable ({type(e).__name__}: {e})"
        print(out_lines if isinstance(out_lines, str) else "\n".join(out_lines))
    print(("FAILED steps: " + ", ".join(failed)) if failed else "every step passed")
    print("=" * 100)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        print(f"usage: {sys.argv[0]} OUTDIR [WORKDIR]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else None))
