"""The GPU suite's record, profiles/gpu_suite_<gpu>.txt, and its order, profiles/gpu_suite_seconds.txt
(scripts/gpu_suite.sh calls this; docs/BENCHMARKING.md, "The GPU suite").

The suite may run in parts (PART=i/n): each run covers some test files, and the record of one tree keeps,
for each test file, the counts of the last run that covered it. Its totals are over the files; a test file
no run covered, and a run that ended with a status other than 0 but no failing test (interrupted, an error
of the run itself), each count as one failure, so `failed 0` means every test file ran and passed.

    python3 scripts/suite_record.py files PART TREE      the test files of part PART (i/n) of the suite
    python3 scripts/suite_record.py write MODE TREE SECONDS STATUS JUNIT [FILE ...]   record one run

Part i < n is the i-th of n bins of the test files, filled longest first by their seconds in the order file;
part n is every test file no run on this tree has covered yet (on a record of another tree, bin n), so the
parts of one tree cover the suite whatever the order file said between them.
"""
import os
import pathlib
import re
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECONDS_FILE = "profiles/gpu_suite_seconds.txt"
INTERRUPTED = (2, 124, 130, 137)     # pytest's own interrupt, timeout's, SIGINT's and SIGKILL's statuses
COUNTS = ("passed", "failed", "skipped")
ORDER = ["tree", "gpu", "versions", *COUNTS, "suite_seconds", "suite_interrupted", "suite_run", "suite_file",
         *(f"sanitizer_{k}" for k in COUNTS), "sanitizer_seconds", "sanitizer_interrupted", "failed_test"]


def test_files(root=ROOT) -> list[str]:
    """Every test file of the suite (the sanitizer tier's file too: its tests not so marked run here)."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py"))


def read(path) -> list[tuple[str, str]]:
    """A record's `key value` lines, in order."""
    if not os.path.exists(path):
        return []
    return [tuple(line.split(" ", 1)) for line in open(path).read().splitlines() if " " in line]


def fields(value: str) -> dict[str, str]:
    """`a=1 b=x` into {a: 1, b: x}."""
    return dict(item.split("=", 1) for item in value.split())


def bins(files, seconds_lines, n) -> list[list[str]]:
    """The test files in n bins of about equal seconds (the order file's per-file sums), longest first."""
    weight = dict.fromkeys(files, 0.0)
    for s, test_id in seconds_lines:
        name = test_id.split("::")[0]
        if name in weight and s != "-":
            weight[name] += float(s)
    parts = [[] for _ in range(n)]
    load = [0.0] * n
    for name in sorted(files, key=lambda f: (-weight[f], f)):
        i = load.index(min(load))
        parts[i].append(name)
        load[i] += weight[name]
    return [sorted(p) for p in parts]


def covered(record, tree) -> set[str]:
    """The test files some suite run on `tree` covered, from its record."""
    if dict(record).get("tree") != tree:
        return set()
    return {v.split()[0] for k, v in record if k == "suite_file"}


def part_files(part: str, files, seconds_lines, record, tree) -> list[str]:
    i, n = (int(x) for x in part.split("/"))
    if not 1 <= i <= n:
        raise ValueError(f"PART={part}: want i/n with 1 <= i <= n")
    done = covered(record, tree)
    if i == n and done:
        return [f for f in files if f not in done]
    return bins(files, seconds_lines, n)[i - 1]


def results(junit, files) -> tuple[dict[str, dict[str, int]], list[str], dict[str, float]]:
    """Per test file its counts, the failing test ids, and each test's seconds, from a JUnit XML."""
    counts = {f: dict.fromkeys(COUNTS, 0) for f in files}
    failing, seconds = [], {}
    if not os.path.exists(junit):
        return counts, failing, seconds
    for case in ET.parse(junit).iter("testcase"):
        outcome = {child.tag for child in case} & {"failure", "error", "skipped"}
        classname, name = case.get("classname") or "", case.get("name")
        if name is None and not outcome:     # an entry of xdist's that names no test
            continue
        parts = classname.split(".") if classname else (name or "").split(".")
        cut = next((i for i in range(len(parts), 0, -1) if "/".join(parts[:i]) + ".py" in counts), None)
        if cut is None:                      # a failure no test file owns: kept for the run
            test_id, owner = f"{classname}::{name}", None
        else:
            owner = "/".join(parts[:cut]) + ".py"
            test_id = "::".join([owner, *parts[cut:], name] if classname else [owner, "(collecting)"])
        seconds[test_id] = float(case.get("time") or 0)
        kind = "failed" if outcome & {"failure", "error"} else "skipped" if outcome else "passed"
        if owner is not None:
            counts[owner][kind] += 1
        if kind == "failed":
            failing.append(test_id)
    return counts, failing, seconds


def read_run(junit, files, status) -> tuple:
    """One run's (counts per file, failing test ids, each test's seconds, whether it was stopped: an
    interrupt's exit status, or no JUnit XML)."""
    return (*results(junit, files), status in INTERRUPTED or not os.path.exists(junit))


def merge_suite(record, tree, run_files, counts, failing, seconds_taken, status, interrupted, all_files):
    """The suite's lines of a record of `tree` after a run over run_files: the files it covered take its
    counts, earlier runs keep the files it did not cover. A run whose status is not 0 though no test of it
    failed (stopped, an error of the run itself) stays a failure while it keeps a file."""
    same = dict(record).get("tree") == tree
    old = record if same else []
    files = {v.split()[0]: fields(v.split(" ", 1)[1]) for k, v in old if k == "suite_file"}
    runs = []
    for k, v in old:
        if k == "suite_run":
            run = fields(v)
            left = [f for f in run["files"].split(",") if f not in run_files]
            if left:
                runs.append({**run, "files": ",".join(left)})
    tests = [v.removeprefix("[suite] ") for k, v in old
             if k == "failed_test" and v.startswith("[suite] ") and "::" in v]
    tests = [t for t in tests if t.split("::")[0] not in run_files] + failing
    files.update({f: {k: str(n) for k, n in counts[f].items()} for f in run_files})
    runs.append({"seconds": str(seconds_taken), "status": str(status), "failing": str(len(failing)),
                 "interrupted": "yes" if interrupted else "no", "files": ",".join(run_files)})

    failed_tests = list(tests)
    for run in runs:
        if run["status"] != "0" and run["failing"] == "0":
            failed_tests.append(f"(the run over {run['files']}: pytest exit status {run['status']})")
    failed_tests += [f"{f} (no run on this tree)" for f in all_files if f not in files]
    lines = [("passed", str(sum(int(c["passed"]) for c in files.values()))),
             ("failed", str(len(failed_tests))),
             ("skipped", str(sum(int(c["skipped"]) for c in files.values()))),
             ("suite_seconds", str(sum(int(r["seconds"]) for r in runs)))]
    if any(r["interrupted"] == "yes" for r in runs):
        lines.append(("suite_interrupted", "yes"))
    lines += [("suite_run", " ".join(f"{k}={v}" for k, v in r.items())) for r in runs]
    lines += [("suite_file", f"{f} " + " ".join(f"{k}={c[k]}" for k in COUNTS)) for f, c in sorted(files.items())]
    lines += [("failed_test", f"[suite] {t}") for t in failed_tests]
    return lines


def merge_sanitizer(counts, failing, seconds_taken, status, interrupted):
    """The sanitizer tier's lines after its run (one run, the whole tier)."""
    total = {k: sum(c[k] for c in counts.values()) for k in COUNTS}
    failing = list(failing)
    if status != 0 and not failing:
        failing.append(f"(the run itself: pytest exit status {status})")
    total["failed"] = max(total["failed"], len(failing))
    lines = [(f"sanitizer_{k}", str(n)) for k, n in total.items()] + [("sanitizer_seconds", str(seconds_taken))]
    if interrupted:
        lines.append(("sanitizer_interrupted", "yes"))
    return lines + [("failed_test", f"[sanitizer] {t}") for t in failing]


def record_after(record, mode, tree, gpu, versions, run_files, run, seconds_taken, status, all_files):
    """The whole record after one run of `mode` (read_run's): this run's lines, the other mode's kept
    where the record is of the same tree, else marked not run (-)."""
    counts, failing, _, interrupted = run
    same = dict(record).get("tree") == tree
    if mode == "suite":
        own = merge_suite(record, tree, run_files, counts, failing, seconds_taken, status, interrupted, all_files)
        other = ([(k, v) for k, v in record if k.startswith("sanitizer_") or v.startswith("[sanitizer] ")]
                 if same else [])
        other = other or [(f"sanitizer_{k}", "-") for k in COUNTS] + [("sanitizer_seconds", "-")]
    else:
        own = merge_sanitizer(counts, failing, seconds_taken, status, interrupted)
        other = ([(k, v) for k, v in record if k in (*COUNTS, "suite_seconds", "suite_interrupted", "suite_run",
                                                      "suite_file") or v.startswith("[suite] ")]
                 if same else [])
        other = other or [(k, "-") for k in COUNTS] + [("suite_seconds", "-")]
    lines = [("tree", tree), ("gpu", gpu), ("versions", versions)] + own + other
    return sorted(lines, key=lambda kv: ORDER.index(kv[0]))


def order_after(seconds_lines, run_files, seconds, interrupted):
    """The order file's lines after a suite run: its files' tests of 2 s or more take this run's seconds;
    after an interrupted run the listed tests it did not reach stay, first, as they may be the long ones."""
    kept = [(s, t) for s, t in seconds_lines if t.split("::")[0] not in run_files
            or interrupted and t not in seconds]
    timed = [(f"{s:.1f}", t) for t, s in seconds.items() if s >= 2]
    return sorted(kept + timed, key=lambda st: (st[0] != "-", -float(st[0]) if st[0] != "-" else 0))


def record_path(gpu: str) -> str:
    short = (re.search(r"[A-Z]\d{3}", gpu) or re.search(r".*", gpu)).group(0).lower().replace(" ", "_")
    return f"profiles/gpu_suite_{short}.txt"


def seconds_file() -> tuple[list[str], list[tuple[str, str]]]:
    """The order file's comment lines and its `<seconds> <test id>` lines."""
    lines = open(SECONDS_FILE).read().splitlines()
    return ([l for l in lines if l.startswith("#")],
            [tuple(l.split(" ", 1)) for l in lines if l.strip() and not l.startswith("#")])


def main(argv):
    import torch
    os.chdir(ROOT)
    gpu = torch.cuda.get_device_name()
    path = record_path(gpu)
    header, order = seconds_file()
    if argv[0] == "files":
        part, tree = argv[1:3]
        chosen = part_files(part, test_files(), order, read(path), tree)
        if not chosen:
            sys.exit(f"suite_record.py: PART={part}: every test file has a run on {tree} ({path})")
        print(" ".join(chosen))
        return
    import triton
    try:
        from importlib.metadata import version
        tile = version("cuda-tile")
    except Exception:
        tile = "-"
    mode, tree, seconds_taken, status, junit, *run_files = argv[1:]
    run_files = run_files or test_files()
    status = int(status)
    run = read_run(junit, run_files, status)
    record = record_after(read(path), mode, tree, gpu, f"{torch.__version__} {triton.__version__} {tile}",
                          run_files, run, int(seconds_taken), status, test_files())
    open(path, "w").write("".join(f"{k} {v}\n" for k, v in record))
    if mode == "suite":
        lines = order_after(order, run_files, run[2], run[3])
        open(SECONDS_FILE, "w").write("\n".join(header + [f"{s} {t}" for s, t in lines]) + "\n")
    print(f"suite_record.py: {path}")
    print(open(path).read(), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
