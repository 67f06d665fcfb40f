#!/usr/bin/env bash
# one-off: each tests/gpu case under its own limit, in order of importance, within DEADLINE seconds
cd "$(dirname "$0")"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc GPU_MEASURE=$OUT/measured.jsonl
START=$(date +%s); DEADLINE=395
run() { local name=$1 k=$2 limit=$3
  local left=$((DEADLINE - ($(date +%s) - START)))
  [ $left -lt 10 ] && { echo "$name skipped" >> $OUT/status.txt; return; }
  [ $left -lt $limit ] && limit=$left
  local t0=$(date +%s)
  timeout -k 5 $limit python3 -m pytest -p no:cacheprovider -q -rs tests/gpu -k "$k" > $OUT/$name.log 2>&1
  echo "$name $? $(($(date +%s) - t0)) $limit" | tee -a $OUT/status.txt
}
run ranks "two_gloo_ranks" 80
run hostsync "never_syncs_the_host" 60
run engine "engine_world1" 60
run muon "muon_beside" 40
run graph "cuda_graph" 40
run statedict "state_dict" 60
run formats "compact_state_formats" 60
run exact "kernels_equal" 50
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
