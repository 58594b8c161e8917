#!/usr/bin/env bash
# The test suite split over N pytest processes that share one GPU: the kernels' JIT compiles are
# CPU-bound, so the whole GPU suite takes ≈ 3 minutes on 6 processes where one process needs over 10.
# Installs nothing (scripts/check.sh does); for a machine that already has the package's needs, such as
# the lent GPU machine with its kit.
#   bash scripts/check_parallel.sh N [pytest selection ...]      (default selection: tests/)
# Each part's log goes to ${LOG_DIR:-/tmp/kda_check}/part_*.log; the summary lists every failure.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
N=${1:?usage: check_parallel.sh N [pytest selection ...]}
shift
logs=${LOG_DIR:-/tmp/kda_check}
mkdir -p "$logs"
rm -f "$logs"/ids "$logs"/part_*
PY=${PYTHON:-python3}
"$PY" -m pytest --collect-only -q "${@:-tests/}" | grep '::' > "$logs/ids"
[ -s "$logs/ids" ] || { echo "check_parallel.sh: no tests collected" >&2; exit 1; }
split -n "r/$N" "$logs/ids" "$logs/part_"
for part in "$logs"/part_??; do
  # Test ids may hold spaces (parameter ids): one id per line, passed as one argument each.
  (mapfile -t ids < "$part"; "$PY" -m pytest -q -p no:cacheprovider "${ids[@]}" > "$part.log" 2>&1) &
done
wait
rc=0
for part in "$logs"/part_??; do
  echo "$(basename "$part"): $(tail -n 1 "$part.log")"
  grep -E '^(FAILED|ERROR)' "$part.log" && rc=1
  tail -n 1 "$part.log" | grep -qE '(passed|skipped)' || rc=1
done
exit $rc
