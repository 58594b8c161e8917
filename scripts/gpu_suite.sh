#!/usr/bin/env bash
# The whole test suite on a GPU, and its record: profiles/gpu_suite_<gpu>.txt (gpu: h200, h100, ...).
#
#   bash scripts/gpu_suite.sh suite       every test but the sanitizer tier, in parallel (-n $JOBS), longest
#                                         first (profiles/gpu_suite_seconds.txt, rewritten from this run)
#   bash scripts/gpu_suite.sh sanitizer   the sanitizer tier (tests/test_sanitizer.py; minutes)
#
# Run from the project root with the test dependencies importable (on the lent machine: the kit, and
# SGLang's for tests/test_sglang.py; docs/BENCHMARKING.md, "The GPU suite"). Extra arguments go to pytest.
# Each mode stops pytest at $LIMIT seconds (SIGINT: what ran is still counted, and the record says
# `interrupted`), and rewrites its own lines of the record; the other mode's lines are kept where the
# record is of the same tree, else marked not run (-). The record's lines:
#   tree <commit>  gpu <name>  versions <torch> <triton> <cuda-tile>
#   passed N  failed N  skipped N  suite_seconds S  [suite_interrupted yes]
#   sanitizer_passed N  sanitizer_failed N  sanitizer_seconds S  [sanitizer_interrupted yes]
#   failed_test <id> (one line each, either mode)
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
  suite) MARK="not sanitizer"; JOBS=${JOBS:-16}
         ARGS=(--dist load --maxschedchunk 1 --longest-first "$SECONDS_FILE" tests) ;;
  sanitizer) MARK="sanitizer"; JOBS=${JOBS:-5}; ARGS=(tests/test_sanitizer.py) ;;
  *) echo "usage: bash scripts/gpu_suite.sh suite|sanitizer [pytest arguments]" >&2; exit 2 ;;
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

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
timeout -s INT -k 30 "$LIMIT" python3 -m pytest -q -m "$MARK" -n "$JOBS" -p no:cacheprovider \
  --junitxml="$work/junit.xml" "${ARGS[@]}" "$@" 2>&1 | tee "$work/log"
status=${PIPESTATUS[0]}
seconds=$(( $(date +%s) - start ))

MODE=$MODE TREE=$TREE SECONDS_TAKEN=$seconds STATUS=$status JUNIT="$work/junit.xml" SECONDS_FILE=$SECONDS_FILE \
  python3 - <<'PY'
import os
import re
import xml.etree.ElementTree as ET

import torch
import triton

mode, tree = os.environ["MODE"], os.environ["TREE"]
name = torch.cuda.get_device_name()
gpu = (re.search(r"[A-Z]\d{3}", name) or re.search(r".*", name)).group(0).lower().replace(" ", "_")
path = f"profiles/gpu_suite_{gpu}.txt"
try:
    from importlib.metadata import version
    tile = version("cuda-tile")
except Exception:
    tile = "-"

counts = {"passed": 0, "failed": 0, "skipped": 0}
failed = []
seconds = {}
if os.path.exists(os.environ["JUNIT"]):
    for case in ET.parse(os.environ["JUNIT"]).iter("testcase"):
        outcome = {child.tag for child in case} & {"failure", "error", "skipped"}
        if case.get("name") is None and not outcome:     # an entry of xdist's that names no test
            continue
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        seconds[test_id] = float(case.get("time") or 0)
        if outcome & {"failure", "error"}:
            counts["failed"] += 1
            failed.append(test_id)
        elif outcome:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
# A status but 0 with no failed test (interrupted, an error of the run itself, a skip the suite
# counts as a failure: tests/conftest.py) is a failure of the run.
status = int(os.environ["STATUS"])
interrupted = status in (2, 124, 130, 137) or not os.path.exists(os.environ["JUNIT"])
if status != 0 and not failed:
    counts["failed"] += 1
    failed.append(f"(the run itself: pytest exit status {status})")

prefix = "" if mode == "suite" else "sanitizer_"
own = {f"{prefix}{k}" for k in counts} | {f"{mode}_seconds", f"{mode}_interrupted"}
kept = []
if os.path.exists(path):
    lines = [line.split(" ", 1) for line in open(path).read().splitlines() if line.strip()]
    if dict(line for line in lines if len(line) == 2).get("tree") == tree:
        kept = [(k, v) for k, v in lines if k not in own and k not in ("tree", "gpu", "versions", "failed_test")
                or k == "failed_test" and v.startswith(f"[{'suite' if prefix else 'sanitizer'}]")]
other = "sanitizer" if mode == "suite" else "suite"
other_prefix = "sanitizer_" if mode == "suite" else ""
if not kept:
    kept = [(f"{other_prefix}{k}", "-") for k in counts] + [(f"{other}_seconds", "-")]
record = [("tree", tree), ("gpu", name), ("versions", f"{torch.__version__} {triton.__version__} {tile}")]
record += [(f"{prefix}{k}", str(n)) for k, n in counts.items()] + [(f"{mode}_seconds", os.environ["SECONDS_TAKEN"])]
if interrupted:
    record.append((f"{mode}_interrupted", "yes"))
record += [("failed_test", f"[{mode}] {t}") for t in failed]
order = ["tree", "gpu", "versions", "passed", "failed", "skipped", "suite_seconds", "suite_interrupted",
         "sanitizer_passed", "sanitizer_failed", "sanitizer_skipped", "sanitizer_seconds", "sanitizer_interrupted",
         "failed_test"]
lines = sorted(record + kept, key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
open(path, "w").write("".join(f"{k} {v}\n" for k, v in lines))

# The suite's order for the next run: this run's tests of 2 s or more, longest first; after an interrupted
# run, the listed tests it did not reach stay first, as they may be the long ones.
if mode == "suite":
    seconds_file = os.environ["SECONDS_FILE"]
    old = [line.split(" ", 1) for line in open(seconds_file).read().splitlines() if line.strip()]
    header = [" ".join(line) for line in old if line[0] == "#"]
    unreached = [f"{s} {t}" for s, t in old if s != "#" and t not in seconds] if interrupted else []
    timed = [f"{s:.1f} {t}" for t, s in sorted(seconds.items(), key=lambda ts: -ts[1]) if s >= 2]
    open(seconds_file, "w").write("\n".join(header + unreached + timed) + "\n")
print(f"gpu_suite.sh: {path}")
print(open(path).read(), end="")
PY
# On the lent machine: the record, the log and the JUnit XML (each finished test with its seconds: what a
# run stopped at $LIMIT did not reach is the collected tests less these) come back under $OUT.
if [ -n "${OUT:-}" ]; then
  cp profiles/gpu_suite_*.txt "$OUT/"      # the record and, after the suite, its order for the next run
  cp "$work/log" "$OUT/gpu_suite_$MODE.log"
  cp "$work/junit.xml" "$OUT/gpu_suite_$MODE.xml" 2>/dev/null
fi
exit "$status"
