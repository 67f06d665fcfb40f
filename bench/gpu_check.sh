#!/usr/bin/env bash
# One prepared check for a machine with one or more NVIDIA GPUs, run from anywhere:
#
#     bash bench/gpu_check.sh OUTDIR
#
# Needs a python3 that already has torch (CUDA build), triton, pytest and pytest-benchmark (matplotlib
# for the report's plots). Installs this checkout editable without touching dependencies, then runs the
# test suite, the kernel and step benchmarks, the demo on one NCCL rank (plain and with a profiler
# trace) and bench/report.py. Every step logs to OUTDIR/<step>.log and appends "<step> <exit code>
# <seconds>" to OUTDIR/status.txt; a failing step does not stop the next one (124 = hit its timeout).
# Each step has its own time limit and the whole script stays under TOTAL_BUDGET seconds (450, under 8
# minutes with the kill grace): a step gets what is left (less 20 s kept for the report) when that is
# less than its own limit, and is skipped (status "skipped") when under 10 seconds are left.
# Not run on the machine it was written on (no GPU there): the CPU results are in bench/results/.
set -u

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
cd "$(dirname "$0")/.."
TOTAL_BUDGET=${TOTAL_BUDGET:-450}
RESERVE=20  # seconds kept back for the report until it runs
START=$(date +%s)
: > "$OUT/status.txt"

# `pytest`, not `python -m pytest`: the latter puts the source tree first on sys.path, and its fused_zero/
# lacks the kernels subpackage that the installed package maps in from kernels/. -P does the same for
# python3 -m (Python >= 3.11) where the console scripts are not on PATH.
if command -v pytest > /dev/null; then PYTEST=(pytest); else PYTEST=(python3 -P -m pytest); fi
if command -v fused-zero > /dev/null; then FZ=(fused-zero); else FZ=(python3 -P -m fused_zero.cli); fi

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local left=$((TOTAL_BUDGET - RESERVE - ($(date +%s) - START)))
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
# the test suite uses gloo ranks and the Triton interpreter on CPU tensors even here
step tests 150 "${PYTEST[@]}" -q tests -p no:cacheprovider
step bench-kernels 150 "${PYTEST[@]}" -q bench/test_bench_kernels.py -p no:cacheprovider \
    --benchmark-json "$OUT/bench-kernels.json"
step bench-step 120 "${PYTEST[@]}" -q bench/test_bench_step.py -p no:cacheprovider \
    --benchmark-json "$OUT/bench-step.json"
step demo 60 "${FZ[@]}" demo --world-size 1 --steps 50
step demo-profile 60 "${FZ[@]}" demo --world-size 1 --steps 8 --profile "$OUT/trace"

reports=()
for f in "$OUT/bench-kernels.json" "$OUT/bench-step.json"; do
    [ -s "$f" ] && reports+=("$f")
done
RESERVE=0
if [ ${#reports[@]} -gt 0 ]; then
    step report 60 python3 bench/report.py "${reports[@]}" --out "$OUT/report"
else
    echo "report skipped-no-json 0" >> "$OUT/status.txt"
fi

echo "== total $(($(date +%s) - START))s; status:"
cat "$OUT/status.txt"
