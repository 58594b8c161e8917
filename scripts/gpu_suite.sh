#!/usr/bin/env bash
# The whole test suite on a GPU, and its record: profiles/gpu_suite_<gpu>.txt (gpu: h200, h100, ...).
#
#   bash scripts/gpu_suite.sh suite       every test but the sanitizer tier, in parallel (-n $JOBS), longest
#                                         first (profiles/gpu_suite_seconds.txt, rewritten from this run)
#   PART=i/n bash scripts/gpu_suite.sh suite   part i of n of it (a part is whole test files; part n is
#                                         every file no run on this tree has covered yet)
#   bash scripts/gpu_suite.sh sanitizer   the sanitizer tier (tests/test_sanitizer.py; minutes)
#
# Run from the project root with the test dependencies importable (on the lent machine: the kit, and
# SGLang's for tests/test_sglang.py; docs/BENCHMARKING.md, "The GPU suite"). Extra arguments go to pytest.
# Each run stops pytest at $LIMIT seconds (SIGINT: what ran is still counted, and the record says
# `interrupted`). scripts/suite_record.py writes the record: for a tree, each test file's counts from the
# last suite run that covered it, the runs, the sanitizer tier's last run; a record of another tree is
# replaced. `failed 0` means every test file ran on this tree and passed: a file no run covered, and a run
# that ended otherwise than with status 0 and no failing test, each count as a failure. The record's lines:
#   tree <commit>  gpu <name>  versions <torch> <triton> <cuda-tile>
#   passed N  failed N  skipped N  suite_seconds S (the runs' sum)  [suite_interrupted yes]
#   suite_run seconds=S status=X failing=N interrupted=yes|no files=<file>,...   (one line each)
#   suite_file <file> passed=N failed=N skipped=N                      (one line each)
#   sanitizer_passed N  sanitizer_failed N  sanitizer_skipped N  sanitizer_seconds S  [sanitizer_interrupted yes]
#   failed_test [suite|sanitizer] <id> (one line each)
# tree: $KDA_TREE where set (a copy of the tree whose .git is not its own, as on the lent machine: the
# caller names its commit), else HEAD, refused if kda_opt/, tests/ or scripts/ differ from it.
# The exit status is pytest's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODE=${1:-}
shift || true
# The sanitizer tier is tests/test_sanitizer.py alone: collecting every module for it would count another
# module's skip at import (tests/test_sglang.py without SGLang) against the tier (tests/conftest.py).
# The suite starts the tests the last whole run found longest (FLA's and SGLang's own calls autotune on a
# fresh machine: minutes each) and hands out one test at a time to whichever worker is free, so that it
# ends on short tests rather than on a long one begun late.
SECONDS_FILE=profiles/gpu_suite_seconds.txt
case "$MODE" in
  suite|sanitizer) ;;
  *) echo "usage: [PART=i/n] bash scripts/gpu_suite.sh suite|sanitizer [pytest arguments]" >&2; exit 2 ;;
esac
LIMIT=${LIMIT:-560}

if [ -n "${KDA_TREE:-}" ]; then
  TREE=$KDA_TREE
elif git rev-parse --git-dir >/dev/null 2>&1; then
  TREE=$(git rev-parse HEAD)
  if [ -n "$(git status --porcelain -- kda_opt tests scripts)" ]; then
    echo "gpu_suite.sh: kda_opt/, tests/ or scripts/ differ from HEAD ($TREE): commit first" >&2
    exit 2
  fi
else
  echo "gpu_suite.sh: no git here: name the commit of this tree in KDA_TREE" >&2
  exit 2
fi

if [ "$MODE" = suite ]; then
  files=$(python3 scripts/suite_record.py files "${PART:-1/1}" "$TREE") || exit 2
  read -ra FILES <<< "$files"
  MARK="not sanitizer"; JOBS=${JOBS:-16}
  ARGS=(--dist load --maxschedchunk 1 --longest-first "$SECONDS_FILE" "${FILES[@]}")
else
  FILES=(tests/test_sanitizer.py)
  MARK="sanitizer"; JOBS=${JOBS:-5}; ARGS=("${FILES[@]}")
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
timeout -s INT -k 30 "$LIMIT" python3 -m pytest -q -m "$MARK" -n "$JOBS" -p no:cacheprovider \
  --junitxml="$work/junit.xml" "${ARGS[@]}" "$@" 2>&1 | tee "$work/log"
status=${PIPESTATUS[0]}
seconds=$(( $(date +%s) - start ))

python3 scripts/suite_record.py write "$MODE" "$TREE" "$seconds" "$status" "$work/junit.xml" "${FILES[@]}"
# On the lent machine: the record, the log and the JUnit XML (each finished test with its seconds: what a
# run stopped at $LIMIT did not reach is the collected tests less these) come back under $OUT.
if [ -n "${OUT:-}" ]; then
  cp profiles/gpu_suite_*.txt "$OUT/"      # the record and, after the suite, its order for the next run
  cp "$work/log" "$OUT/gpu_suite_$MODE.log"
  cp "$work/junit.xml" "$OUT/gpu_suite_$MODE.xml" 2>/dev/null
fi
exit "$status"
