#!/usr/bin/env bash
# compute-sanitizer over ropekv on a GPU machine: memcheck over the whole GPU test suite, then
# racecheck, initcheck and synccheck over one call of every kernel (tools/sanitize_calls.py).
# Every tool must report 0 errors (the script exits non-zero otherwise).
#
#   bash tools/sanitize.sh                 # everything
#   bash tools/sanitize.sh memcheck tests/test_hostile.py   # only memcheck, pytest arguments after it
#   bash tools/sanitize.sh calls           # only racecheck, initcheck and synccheck
#   bash tools/sanitize.sh memcheck-shards 12   # memcheck as 12 processes at once (shard i of n:
#                                               # tools/pytest_shard.py), logs in $SHARD_LOGS
#
# CuPy's memory pool is off (every CuPy array is its own cudaMalloc, so an access past its end
# leaves the allocation and is seen) and JAX does not preallocate. PyTorch keeps its caching
# allocator: CUDA graph capture (the ropekv.torch tests) cannot run without it. The suite runs in
# one process: pytest-xdist's workers under the sanitizer never get going.
set -euo pipefail
cd "$(dirname "$0")/.."
# ROPEKV_UNDER_SANITIZER: tests/conftest.py switches off one torch.compile debug assertion that
# fails under compute-sanitizer with or without ropekv (conftest.py says which and why).
export ROPEKV_NO_MEMORY_POOL=1 ROPEKV_UNDER_SANITIZER=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}" PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
what="${1:-all}"
[ $# -gt 0 ] && shift
sanitizer=(compute-sanitizer --error-exitcode 1 --target-processes all --print-limit 20)
if [ "$what" = all ] || [ "$what" = memcheck ]; then
  echo "== memcheck: the GPU test suite"
  "${sanitizer[@]}" --tool memcheck --leak-check no \
    python3 -m pytest -q -m gpu -p no:cacheprovider -p no:xdist -p no:benchmark "$@"
fi
if [ "$what" = memcheck-shards ]; then
  n="${1:-12}"
  logs="${SHARD_LOGS:-/tmp/ropekv-memcheck}"
  mkdir -p "$logs"
  echo "== memcheck: the GPU test suite in $n shards (logs: $logs)"
  pids=()
  for i in $(seq 0 $((n - 1))); do
    SHARD_N=$n SHARD_I=$i PYTHONPATH="$PYTHONPATH:$PWD/tools" \
      "${sanitizer[@]}" --tool memcheck --leak-check no \
      python3 -m pytest -q -m gpu -p no:cacheprovider -p no:xdist -p no:benchmark \
      -p pytest_shard --deselect tests/test_compile.py tests/ >"$logs/memcheck-$i.log" 2>&1 &
    pids+=($!)
  done
  failed=0
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      failed=1
      echo "shard $i failed: $logs/memcheck-$i.log"
    fi
    grep -E "passed|failed|ERROR SUMMARY" "$logs/memcheck-$i.log" | tail -2
  done
  [ "$failed" = 0 ] || exit 1
fi
if [ "$what" = all ] || [ "$what" = calls ]; then
  for tool in racecheck initcheck synccheck; do
    echo "== $tool: one call of every kernel"
    "${sanitizer[@]}" --tool "$tool" python3 tools/sanitize_calls.py "$tool"
  done
fi
echo "sanitizer: 0 errors"
