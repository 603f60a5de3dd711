#!/usr/bin/env bash
# The GPU test suite as N pytest processes at once (every N-th test to each: tools/pytest_shard.py),
# so that it fits a machine whose commands are limited to 10 minutes (an H200 host's 16 cores: 16
# shards, about 6 minutes). Logs in LOGS (default gpu-logs/); prints each shard's last line, the
# failures and the totals; exits non-zero when a shard failed or did not finish.
#
#   bash tools/gpu_suite.sh [N] [pytest arguments...]      # N defaults to 8
#   SHARD_TIMEOUT=430 LOGS=/tmp/logs bash tools/gpu_suite.sh 16
set -uo pipefail
cd "$(dirname "$0")/.."
n="${1:-8}"
[ $# -gt 0 ] && shift
logs="${LOGS:-gpu-logs}"
mkdir -p "$logs"
export PYTHONPATH="$PWD/tools:$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$SECONDS
for ((i = 0; i < n; i++)); do
  SHARD_N=$n SHARD_I=$i timeout "${SHARD_TIMEOUT:-0}" python3 -m pytest tests -m gpu -q \
    -p no:xdist -p no:cacheprovider -p pytest_shard -rs "$@" > "$logs/gpu$i.log" 2>&1 &
done
rc=0
for job in $(jobs -p); do wait "$job" || rc=1; done
for ((i = 0; i < n; i++)); do echo "shard $i: $(tail -n 1 "$logs/gpu$i.log")"; done
grep -h -E '^(FAILED|ERROR) ' "$logs"/gpu*.log || true
python3 - "$logs" "$n" <<'PY'
import pathlib, re, sys
totals = {}
for i in range(int(sys.argv[2])):
    lines = (pathlib.Path(sys.argv[1]) / f"gpu{i}.log").read_text().strip().splitlines()
    for count, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1] if lines else ""):
        totals[kind] = totals.get(kind, 0) + int(count)
print("total:", ", ".join(f"{v} {k}" for k, v in totals.items()) or "nothing ran")
PY
echo "wall: $((SECONDS - start)) s"
exit $rc
