#!/usr/bin/env bash
# One prepared check for a machine with one or more NVIDIA GPUs, run from anywhere, in four sets, each of
# them one device call of at most 6.5 minutes:
#
#     bash bench/gpu_check.sh OUTDIR run       # FIRST: bench/gpu_run.py, every figure (into OUTDIR itself)
#     bash bench/gpu_check.sh OUTDIR [tests]   # the GPU tests, part 1: torch's own tolerances measured, then
#                                              # the kernels, the engine and the cases beside them
#     bash bench/gpu_check.sh OUTDIR tests2    # the GPU tests, part 2: shared-GPU ranks, the rank-0 state
#                                              # dict, torch's CUDA sanitizer, compute-sanitizer's memcheck
#     bash bench/gpu_check.sh OUTDIR bench     # what gpu_run.py does not measure: CUDA-graph steps, the twins
#
# The run set is bench/gpu_run.py (python3 bench/gpu_run.py --out OUTDIR does the same without this
# script): the kernels against a copy, the step level, torch's AdamW, world-1 iterations against DDP and
# ZeRO, profiler traces read into numbers, 2+ GPUs where there are; one JSON line per measurement in
# OUTDIR/run.jsonl, its summary in OUTDIR/summary.md (docs/benchmarks.md, "On a GPU machine").
#
# Installs nothing: it runs this checkout from its source tree (PYTHONPATH=the checkout; the package finds
# kernels/ through pyproject.toml's package-dir, fused_zero/checkout.py), under the python3 it finds, which
# must already have torch (CUDA build), triton, pytest and pytest-benchmark (the borrowed machine's image:
# torch 2.11, Triton 3.6; no network there).
# The active environment is left as it was: no pip, no editable install.
#
# Steps, each with its own time limit (LIMIT below, seconds), in this order:
#   gpu-run                      (run set) bench/gpu_run.py, its budget 340 s: it stops itself at 350 s;
#   nvidia-smi, versions         what the machine is (the other sets);
#   gpu-tolerance                (tests) bench/gpu_tolerance.py: torch's own fused-vs-single distance in the
#                                two cases with a measured tolerance, written to GPU_TOLERANCES, which
#                                gpu-kernels' Adam amsgrad bf16 case and gpu-engine's bf16 case read
#                                (max(today's atol, 2 x the distance); today's without the file);
#   gpu-kernels                  tests/gpu's kernel cases;
#   gpu-engine, gpu-muon, gpu-several, gpu-graph, gpu-formats, gpu-host-sync (tests), gpu-ranks,
#   gpu-state-dict (tests2)      the other tests/gpu cases, one pytest each (-k), so a failure or a
#                                timeout names its case; a step whose cases are absent is "skipped";
#   gpu-torch-sanitizer          (tests2) the world-1 engine under torch's CUDA sanitizer;
#   memcheck                     (tests2) compute-sanitizer's memcheck over one small case, where the
#                                machine has compute-sanitizer (else "skipped");
#   bench-graph                  (bench) step() eager against step() replayed from a CUDA graph
#                                (capturable=True): host time per step and iteration time;
#   bench-optimizers             (bench) each torch.optim twin's step against torch's foreach one.
# The kernel and iteration benchmarks and the demo's trace are gpu_run.py's (the run set), measured once.
# The CPU suite is CI's job and is not rerun here.
#
# Budget: a set's limits and its RESERVE (room for GPU cases being added) add up to at most TOTAL_BUDGET
# (360 s), checked before anything runs; FINISH (30 s) more covers the summary and the bundle: 6.5
# minutes at most, so that a machine start (1-2 minutes) and two sets fit the 15 minutes of device time
# a session gets: the run set first, then tests; tests2 and bench in a later session. A step gets what
# is left of TOTAL_BUDGET when that is less than its limit, and is "skipped" when under 5 s are left.
# A step that reaches its limit gets SIGINT (pytest then writes the JUnit XML of the cases it finished,
# gpu_run.py its summary), SIGKILL 10 s later; its status is 124.
#
# Results: OUTDIR/status.txt ("<step> <exit code or skipped> <seconds> <limit>"; 124: the step hit its
# limit), OUTDIR/summary.txt (bench/gpu_summary.py), OUTDIR/measured.jsonl (every comparison with
# torch.optim, measured, and the tolerances the two cases used) and OUTDIR/gpu-check.tgz (every log,
# JUnit XML per step, tolerances.json, benchmark JSON): four files, plus the run set's run.jsonl,
# summary.md and trace, as few as a machine that returns at most 8 from OUTDIR needs. A failing step
# does not stop the next; the script exits 1 naming every failed step.
#
# The Triton cache is one fixed folder outside OUTDIR, kept (TRITON_CACHE_DIR, default
# ~/.cache/fused_zero-gpu-run/triton, gpu_run.py's too): a later set on the same machine finds the
# kernels compiled.
#
# GPU_CHECK_ONLY="step ..." runs only the named steps (the others: "skipped").
# GPU_CHECK_DRY_RUN=1 runs every step as a CPU stub that prints the command it stands for: the status
# lines, the budget check and the summary work where there is no GPU (tests/test_gpu_check.py).
set -u

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 OUTDIR [run|tests|tests2|bench]" >&2
    exit 2
fi
SET=${2:-tests}
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
TOTAL_BUDGET=${TOTAL_BUDGET:-360}
FINISH=30
ONLY=${GPU_CHECK_ONLY:-}
DRY=${GPU_CHECK_DRY_RUN:-}
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.cache/fused_zero-gpu-run/triton}"
export PYTHONUNBUFFERED=1
export GPU_MEASURE="$WORK/measured.jsonl"   # every comparison with torch.optim, measured (tests/gpu)
export GPU_TOLERANCES="$WORK/tolerances.json"  # gpu-tolerance writes it; two tests/gpu cases read it
: > "$GPU_MEASURE"
: > "$OUT/status.txt"
PYTEST=(python3 -m pytest -p no:cacheprovider -q -rs)

# The limits come from complete runs where there are some: the first H200 run (2026-12-04,
# bench/results/2026-12-04-h200-gpu-check: torch 2.11 + Triton 3.6, every step a fresh process on a
# Triton cache the earlier steps filled; run2 ran each case to its end), with 10-20% to spare:
#   from a complete run: versions 6 s (run1), gpu-muon 30, gpu-graph 26, gpu-formats 28, gpu-host-sync 31,
#   gpu-ranks 63 (two cases, four spawned gloo ranks), gpu-state-dict 27 (run2);
#   partly measured: gpu-kernels (run1: 23 s of pytest for its two cases, the torch.optim one stopped at
#   its 5th of 13 runs after 13 s, the exact one complete in 10 s; the rest estimated at 1 s a run),
#   gpu-engine (run2: 28 s to its failure in the 2nd of 13 configurations; the other 11 estimated),
#   gpu-several (run1: 25 s for its first case; the twins' case never ran on a GPU);
#   still guesses: gpu-tolerance (3 s on a CPU, plus the process and CUDA start), gpu-torch-sanitizer and
#   memcheck (both ran out of run1's 15 s, nothing measured), bench-graph and bench-optimizers (never
#   run), gpu-run (gpu_run.py stops itself 5 s before its limit).
declare -A LIMIT=(
    [gpu-run]=355
    [nvidia-smi]=5 [versions]=10
    [gpu-tolerance]=30 [gpu-kernels]=40 [gpu-engine]=50 [gpu-muon]=35 [gpu-several]=45 [gpu-graph]=30
    [gpu-formats]=32 [gpu-host-sync]=35
    [gpu-ranks]=70 [gpu-state-dict]=30 [gpu-torch-sanitizer]=90 [memcheck]=120
    [bench-graph]=60 [bench-optimizers]=30
)
case "$SET" in
    run) ORDER=(gpu-run); RESERVE=0 ;;
    tests) ORDER=(nvidia-smi versions gpu-tolerance gpu-kernels gpu-engine gpu-muon gpu-several gpu-graph
                  gpu-formats gpu-host-sync); RESERVE=30 ;;
    tests2) ORDER=(nvidia-smi versions gpu-ranks gpu-state-dict gpu-torch-sanitizer memcheck); RESERVE=30 ;;
    bench) ORDER=(nvidia-smi versions bench-graph bench-optimizers); RESERVE=0 ;;
    *) echo "gpu_check: unknown set '$SET' (run, tests, tests2 or bench)" >&2; exit 2 ;;
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
        timeout -s INT --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
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

step gpu-run python3 bench/gpu_run.py --out "$OUT" --no-log --budget 340  # its watchdog: 350 s, before the limit
step nvidia-smi nvidia-smi
step versions python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); \
print('triton', triton.__version__)"
step gpu-tolerance python3 bench/gpu_tolerance.py --out "$WORK"
gpu gpu-kernels "kernels"
gpu gpu-engine "engine_world1"
gpu gpu-muon "muon_beside"
# gpu-several also runs torch.optim's twins (test_several_optimizers_torch_optimizers_twins; its limit a guess)
gpu gpu-several "several_optimizers"
gpu gpu-graph "cuda_graph"
gpu gpu-formats "compact_state_formats"
gpu gpu-host-sync "never_syncs_the_host"
gpu gpu-ranks "two_gloo_ranks or nccl_on_two_gpus"
gpu gpu-state-dict "state_dict"
gpu gpu-torch-sanitizer "cuda_sanitizer"
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
step bench-graph "${PYTEST[@]}" bench/test_bench_graph.py --benchmark-json "$WORK/bench-graph.json"
step bench-optimizers "${PYTEST[@]}" bench/test_bench_optimizers.py --benchmark-json "$WORK/bench-optimizers.json"

echo "== total $(($(date +%s) - START))s of ${TOTAL_BUDGET}s"
timeout 20 python3 bench/gpu_summary.py "$OUT" "$WORK" | tee "$OUT/summary.txt"
cp "$GPU_MEASURE" "$OUT/measured.jsonl"
# the bundle: every log, JUnit XML and JSON of WORK (the Triton cache lives outside it, and stays)
tar czf "$OUT/gpu-check.tgz" -C "$WORK" . 2> /dev/null
rm -rf "$WORK"
# the exit status does not depend on the summary script working: read status.txt here
failed=$(awk '$2 != "0" && $2 != "skipped" { printf "%s%s (exit %s)", sep, $1, $2; sep = ", " }' "$OUT/status.txt")
if [ -n "$failed" ]; then
    echo "gpu_check: FAILED: $failed (logs in $OUT/gpu-check.tgz)" >&2
    exit 1
fi
echo "gpu_check: every step passed"
