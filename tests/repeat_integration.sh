#!/bin/bash
# Run the integration tests of `make test`, and the routing-fault swarms of `make test-swarms` (marker
# `repeated`), N times in a row (default 10), keeping every run's whole output, and print a line per
# run and the pass count. Not part of CI: it is how a flaky test is found.
#
#   tests/repeat_integration.sh [N] [output directory]     (make test-repeat)
set -u
runs=${1:-10}
out=${2:-$(mktemp -d /tmp/swarm-repeat-XXXXXX)}
mkdir -p "$out"
cd "$(dirname "$0")/.."
passed=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  # (faulthandler: a test stuck past its timeout, 240 s at most here, leaves every thread's stack in the output)
  timeout 1200 .venv/bin/python -m pytest -q -m "not swarms or repeated" tests/integration --durations=15 \
    -p no:cacheprovider -o faulthandler_timeout=300 > "$out/run$i.out" 2>&1
  rc=$?
  [ $rc -eq 0 ] && passed=$((passed + 1))
  echo "run $i: exit $rc in $(( $(date +%s) - start ))s: $(grep -E '(passed|failed)' "$out/run$i.out" | tail -1)" \
    | tee -a "$out/summary"
done
echo "$passed/$runs runs passed whole; outputs in $out" | tee -a "$out/summary"
[ "$passed" -eq "$runs" ]
