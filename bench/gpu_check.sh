#!/usr/bin/env bash
# One prepared check for a machine with one or more NVIDIA GPUs, run from anywhere:
#
#     bash bench/gpu_check.sh OUTDIR
#
# Needs a python3 that already has torch (CUDA build), triton, pytest and pytest-benchmark; works with
# the Triton it finds (3.6 on the borrowed machine's image, 3.9 in CI), nothing is reinstalled. Installs
# this checkout editable without touching dependencies, then runs, in this order:
#   gpu-tests      tests/gpu (the kernels, the engine, gloo ranks sharing a GPU, NCCL, the sanitizer);
#   bench-kernels  the update kernels, a device copy and torch's AdamW at 1M, 16M, 64M and 256M elements;
#   bench-step     one iteration of the demo GPT, fused_zero in each overlap mode against DDP + fused AdamW;
#   demo           the demo on one NCCL rank, with a torch.profiler trace (no nsys needed).
# The CPU suite is CI's job (tests/, 2 cores) and is not rerun here.
# Every step logs to OUTDIR/<step>.log and appends "<step> <exit code> <seconds>" to OUTDIR/status.txt
# (124: it hit its time limit); a failing step does not stop the next one. The script ends with a
# one-screen summary (bench/gpu_summary.py) and exits 1 when any step failed, naming it.
# Each step has its own time limit and the whole stays under TOTAL_BUDGET seconds (420: under 8 minutes
# with the summary and the kill grace): a step gets what is left when that is less than its own limit,
# and is skipped (status "skipped") when under 10 seconds are left.
# GPU_CHECK_ONLY="step ..." runs only the named steps (the others: "skipped"), e.g. for a dry run of the
# status logic where there is no GPU: GPU_CHECK_ONLY=nvidia-smi bash bench/gpu_check.sh /tmp/x
set -u

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
cd "$(dirname "$0")/.."
TOTAL_BUDGET=${TOTAL_BUDGET:-420}
ONLY=${GPU_CHECK_ONLY:-}
START=$(date +%s)
: > "$OUT/status.txt"

# `pytest`, not `python -m pytest`: the latter puts the source tree first on sys.path, and its fused_zero/
# lacks the kernels subpackage that the installed package maps in from kernels/. -P does the same for
# python3 -m (Python >= 3.11) where the console scripts are not on PATH.
if command -v pytest > /dev/null; then PYTEST=(pytest); else PYTEST=(python3 -P -m pytest); fi
if command -v fused-zero > /dev/null; then FZ=(fused-zero); else FZ=(python3 -P -m fused_zero.demo.cli); fi

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
        echo "$name skipped 0" >> "$OUT/status.txt"
        return
    fi
    local left=$((TOTAL_BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 10 ]; then
        echo "$name skipped 0" >> "$OUT/status.txt"
        echo "== $name: skipped, ${left}s of the budget left"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name (limit ${limit}s)"
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $(($(date +%s) - t0))" >> "$OUT/status.txt"
    echo "   exit $rc, $(($(date +%s) - t0))s, log $OUT/$name.log"
}

step install 60 python3 -m pip install --no-deps --no-build-isolation -e .
step nvidia-smi 20 nvidia-smi
step versions 30 python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); \
print('triton', triton.__version__)"
export GPU_MEASURE="$OUT/measured.jsonl"   # every comparison with torch.optim, measured (tests/gpu)
: > "$GPU_MEASURE"
step gpu-tests 200 "${PYTEST[@]}" -q -rs tests/gpu -p no:cacheprovider --junitxml "$OUT/gpu-tests.xml"
step bench-kernels 100 "${PYTEST[@]}" -q bench/test_bench_kernels.py -p no:cacheprovider \
    -k "1M or 16M or 64M or 256M" --benchmark-json "$OUT/bench-kernels.json"
step bench-step 90 "${PYTEST[@]}" -q bench/test_bench_step.py -p no:cacheprovider \
    -k "test_step and iteration" --benchmark-json "$OUT/bench-step.json"
step demo 40 "${FZ[@]}" demo --world-size 1 --steps 20 --profile "$OUT/trace"

echo "== total $(($(date +%s) - START))s"
timeout 30 python3 bench/gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
# the exit status does not depend on the summary script working: read status.txt here
failed=$(awk '$2 != "0" && $2 != "skipped" { printf "%s%s (exit %s)", sep, $1, $2; sep = ", " }' "$OUT/status.txt")
if [ -n "$failed" ]; then
    echo "gpu_check: FAILED: $failed (logs in $OUT)" >&2
    exit 1
fi
echo "gpu_check: every step passed"
