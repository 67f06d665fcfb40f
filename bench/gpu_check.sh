#!/usr/bin/env bash
# One prepared check for a machine with one or more NVIDIA GPUs, run from anywhere, in two sets:
#
#     bash bench/gpu_check.sh OUTDIR [tests]   # the GPU tests: every tests/gpu case
#     bash bench/gpu_check.sh OUTDIR bench     # torch's CUDA sanitizer, memcheck, the benchmarks, the demo
#
# Installs nothing: it runs this checkout from its source tree (PYTHONPATH=the checkout; fused_zero/kernels
# is a link to kernels/), under the python3 it finds, which must already have torch (CUDA build), triton,
# pytest and pytest-benchmark (the borrowed machine's image: torch 2.11, Triton 3.6; no network there).
# The active environment is left as it was: no pip, no editable install.
#
# Steps, each with its own time limit (LIMIT below, seconds), in this order:
#   nvidia-smi, versions         what the machine is (both sets);
#   gpu-kernels                  tests/gpu's kernel cases (pays the cold Triton cache: TRITON_CACHE_DIR
#                                is one folder for every step, so later steps reuse what it compiled);
#   gpu-engine, gpu-muon, gpu-several, gpu-graph, gpu-formats, gpu-host-sync, gpu-ranks, gpu-state-dict
#                                the other tests/gpu cases, one pytest each (-k), so a failure or a
#                                timeout names its case; a step whose cases are absent is "skipped";
#   gpu-torch-sanitizer          (bench set) the world-1 engine under torch's CUDA sanitizer;
#   memcheck                     compute-sanitizer's memcheck over one small case, where the machine has
#                                compute-sanitizer (else "skipped");
#   bench-kernels, bench-step    the update kernels at 1M-256M elements; one demo-GPT iteration per
#                                overlap mode against DDP + fused AdamW;
#   bench-graph                  step() eager against step() replayed from a CUDA graph (capturable=True):
#                                host time per step and iteration time, demo GPT and 500 small parameters;
#   bench-optimizers             each torch.optim twin's step against torch's foreach one (an estimate: 30 s);
#   demo                         the demo on one NCCL rank, with a torch.profiler trace (no nsys needed).
# The CPU suite is CI's job and is not rerun here.
#
# Budget: a set's limits and RESERVE (room for GPU cases being added) add up to at most TOTAL_BUDGET
# (360 s), checked before anything runs; FINISH (30 s) more covers the summary and the bundle: 6.5
# minutes at most, so that a first run after a machine start (1-2 minutes) and one rerun fit the 15
# minutes of device time a session gets. Both sets do not fit one session: on a cold Triton cache the
# GPU tests alone take about 5.5 minutes (the first H200 run). A step gets what is left of TOTAL_BUDGET
# when that is less than its limit, and is "skipped" when under 5 s are left.
#
# Results: OUTDIR/status.txt ("<step> <exit code or skipped> <seconds> <limit>"; 124: the step hit its
# limit), OUTDIR/summary.txt (bench/gpu_summary.py), OUTDIR/measured.jsonl (every comparison with
# torch.optim, measured) and OUTDIR/gpu-check.tgz (every log, JUnit XML, benchmark JSON and the trace):
# four files, as few as a machine that returns at most 8 from OUTDIR needs. A failing step does not stop
# the next; the script exits 1 naming every failed step.
#
# GPU_CHECK_ONLY="step ..." runs only the named steps (the others: "skipped").
# GPU_CHECK_DRY_RUN=1 runs every step as a CPU stub that prints the command it stands for: the status
# lines, the budget check and the summary work where there is no GPU (tests/test_gpu_check.py).
set -u

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 OUTDIR [tests|bench]" >&2
    exit 2
fi
SET=${2:-tests}
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
TOTAL_BUDGET=${TOTAL_BUDGET:-360}
FINISH=30
RESERVE=0
ONLY=${GPU_CHECK_ONLY:-}
DRY=${GPU_CHECK_DRY_RUN:-}
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$WORK/triton-cache}"
export PYTHONUNBUFFERED=1
export GPU_MEASURE="$WORK/measured.jsonl"   # every comparison with torch.optim, measured (tests/gpu)
: > "$GPU_MEASURE"
: > "$OUT/status.txt"
PYTEST=(python3 -m pytest -p no:cacheprovider -q -rs)

# Each set's limits come from the first H200 run (2026-12-04, bench/results/2026-12-04-h200-gpu-check:
# torch 2.11 + Triton 3.6, every step a fresh process on a Triton cache the earlier steps filled), with
# 10-20% to spare: versions 6 s, gpu-kernels 27 s (to its first failure), gpu-engine 28 (likewise),
# gpu-muon 30, gpu-several 25, gpu-graph 26, gpu-formats 28, gpu-host-sync 31, gpu-ranks 63 (two cases, four
# spawned gloo ranks), gpu-state-dict 27. The bench set's limits are estimates until a run of it: its steps
# all ran out of their old 10-25 s (bench-kernels had done 40 of its cases in 20 s).
declare -A LIMIT=(
    [nvidia-smi]=5 [versions]=10
    [gpu-kernels]=40 [gpu-engine]=45 [gpu-muon]=32 [gpu-several]=40 [gpu-graph]=28 [gpu-formats]=30
    [gpu-host-sync]=35 [gpu-ranks]=65 [gpu-state-dict]=30
    [gpu-torch-sanitizer]=35 [memcheck]=40 [bench-kernels]=90 [bench-step]=60 [bench-graph]=60 [bench-optimizers]=30 [demo]=30
)
case "$SET" in
    tests) ORDER=(nvidia-smi versions gpu-kernels gpu-engine gpu-muon gpu-several gpu-graph gpu-formats
                  gpu-host-sync gpu-ranks gpu-state-dict) ;;
    bench) ORDER=(nvidia-smi versions gpu-torch-sanitizer memcheck bench-kernels bench-step bench-graph
                  bench-optimizers demo) ;;
    *) echo "gpu_check: unknown set '$SET' (tests or bench)" >&2; exit 2 ;;
esac

sum=$RESERVE
for name in "${ORDER[@]}"; do sum=$((sum + LIMIT[$name])); done
echo "== set $SET, budget: steps ${sum}s (reserve ${RESERVE}s included) of ${TOTAL_BUDGET}s, then ${FINISH}s for the summary"
if [ "$sum" -gt "$TOTAL_BUDGET" ]; then
    echo "gpu_check: the step limits add up to ${sum}s, over TOTAL_BUDGET=${TOTAL_BUDGET}s: lower a LIMIT" >&2
    exit 2
fi
START=$(date +%s)

step() {  # step NAME COMMAND...: runs it under LIMIT[NAME]; exit 5 (pytest: no case selected) is "skipped"
    local name=$1 limit=${LIMIT[$1]}
    shift
    [[ " ${ORDER[*]} " == *" $name "* ]] || return 0  # a step of the other set
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
        echo "$name skipped 0 $limit" >> "$OUT/status.txt"
        return
    fi
    local left=$((TOTAL_BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 5 ]; then
        echo "$name skipped 0 $limit" >> "$OUT/status.txt"
        echo "== $name: skipped, ${left}s of the budget left"
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name (limit ${limit}s)"
    local t0=$(date +%s)
    if [ -n "$DRY" ]; then
        echo "dry run: $*" > "$WORK/$name.log"
        rc=0
    else
        timeout --kill-after=5 "$limit" "$@" > "$WORK/$name.log" 2>&1
        rc=$?
    fi
    local took=$(($(date +%s) - t0)) status=$rc
    [ "$rc" -eq 5 ] && status=skipped  # none of the step's cases exist (yet)
    echo "$name $status $took $limit" >> "$OUT/status.txt"
    echo "   $status, ${took}s of ${limit}s, log $name.log in gpu-check.tgz"
}

gpu() {  # gpu STEP PYTEST_K: the tests/gpu cases matching PYTEST_K
    step "$1" "${PYTEST[@]}" tests/gpu -k "$2" --junitxml "$WORK/$1.xml"
}

step nvidia-smi nvidia-smi
step versions python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); \
print('triton', triton.__version__)"
gpu gpu-kernels "kernels"
gpu gpu-engine "engine_world1"
gpu gpu-muon "muon_beside"
# gpu-several also runs torch.optim's twins (test_several_optimizers_torch_optimizers_twins; its limit a guess)
gpu gpu-several "several_optimizers"
gpu gpu-graph "cuda_graph"
gpu gpu-formats "compact_state_formats"
gpu gpu-host-sync "never_syncs_the_host"
gpu gpu-ranks "two_gloo_ranks or nccl_on_two_gpus"
gpu gpu-torch-sanitizer "cuda_sanitizer"
gpu gpu-state-dict "state_dict"
if [[ " ${ORDER[*]} " != *" memcheck "* ]]; then
    :  # a step of the other set
elif [ -n "$DRY" ] || command -v compute-sanitizer > /dev/null; then
    # one small case (GPU_CHECK_MEMCHECK_CASE, a case_ of gpu_cases.py), its kernels compiled already (the
    # cache above); "skipped" where the case is absent (5) or cannot run on this machine (77)
    export MEMCHECK_CASE=${GPU_CHECK_MEMCHECK_CASE:-rank0_state_dict}
    step memcheck bash -c 'grep -q "^def case_${MEMCHECK_CASE}(" tests/gpu/gpu_cases.py || exit 5
        compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/gpu/gpu_cases.py "$MEMCHECK_CASE"
        rc=$?; [ $rc -eq 77 ] && exit 5; exit $rc'
else
    echo "memcheck skipped 0 ${LIMIT[memcheck]}" >> "$OUT/status.txt"
    echo "== memcheck: skipped, no compute-sanitizer on this machine"
fi
step bench-kernels "${PYTEST[@]}" bench/test_bench_kernels.py -k "1M or 16M or 64M or 256M" \
    --benchmark-max-time=0.2 --benchmark-json "$WORK/bench-kernels.json"
step bench-step "${PYTEST[@]}" bench/test_bench_step.py -k "test_step and iteration" \
    --benchmark-max-time=0.5 --benchmark-json "$WORK/bench-step.json"
step bench-graph "${PYTEST[@]}" bench/test_bench_graph.py --benchmark-json "$WORK/bench-graph.json"
step bench-optimizers "${PYTEST[@]}" bench/test_bench_optimizers.py --benchmark-json "$WORK/bench-optimizers.json"
step demo python3 -m fused_zero.demo.cli demo --world-size 1 --steps 10 --profile "$WORK/trace"

echo "== total $(($(date +%s) - START))s of ${TOTAL_BUDGET}s"
timeout 20 python3 bench/gpu_summary.py "$OUT" "$WORK" | tee "$OUT/summary.txt"
cp "$GPU_MEASURE" "$OUT/measured.jsonl"
# the bundle: everything but the Triton cache; the trace only while the bundle stays under 15 MiB
tar czf "$OUT/gpu-check.tgz" -C "$WORK" --exclude triton-cache . 2> /dev/null
if [ "$(stat -c %s "$OUT/gpu-check.tgz")" -gt $((15 << 20)) ]; then
    tar czf "$OUT/gpu-check.tgz" -C "$WORK" --exclude triton-cache --exclude trace . 2> /dev/null
    echo "gpu_check: the trace left out of gpu-check.tgz (over 15 MiB with it)"
fi
rm -rf "$WORK"
# the exit status does not depend on the summary script working: read status.txt here
failed=$(awk '$2 != "0" && $2 != "skipped" { printf "%s%s (exit %s)", sep, $1, $2; sep = ", " }' "$OUT/status.txt")
if [ -n "$failed" ]; then
    echo "gpu_check: FAILED: $failed (logs in $OUT/gpu-check.tgz)" >&2
    exit 1
fi
echo "gpu_check: every step passed"
