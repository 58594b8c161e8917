"""The sanitizer tier (`pytest -m sanitizer`, GPU; run it whenever a kernel or launcher changes):
compute-sanitizer's memcheck, racecheck, synccheck and initcheck, each over one small call of every
launch path (tests/sanitizer_calls.py), with every tensor an allocation of its own
(PYTORCH_NO_CUDA_MEMORY_CACHING); zero errors each, but for racecheck's reports of one instruction
whose threads write the same bytes (benign). initcheck does not see stage 4's TMA stores (ARGUMENTS);
that every element a call returns is written is shown by the same calls on memory poisoned with NaN
(test_every_element_returned_is_written)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SANITIZER = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
# memcheck: every global access inside an allocation (leaks are the caching allocator's business);
# racecheck: shared-memory hazards; synccheck: barriers; initcheck: no read of memory never written.
TOOLS = {"memcheck": ["--leak-check", "no"], "racecheck": [], "synccheck": [], "initcheck": []}
# initcheck does not see TMA stores (UTMASTG in the SASS; a reproducer in docs/BENCHMARKING.md), by which
# stage 4 writes o, the final states and checkpoints, and so takes every later read of them (the
# merge of parallel segments, the next time segment's stage 4) for a read of memory never written.
# Under it those buffers are zeroed before each stage-4 launch (sanitizer_calls.py
# --zero-stage4-buffers): every other read is checked, and that stage 4 writes every element of them
# is test_every_element_returned_is_written's.
ARGUMENTS = {"initcheck": ["--zero-stage4-buffers"]}


def calls(sanitizer=(), arguments=(), **env):
    """tests/sanitizer_calls.py with its `arguments`, under the `sanitizer` command if one is given:
    its exit status and output."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, (
        ROOT, os.path.join(ROOT, "scripts"), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([*sanitizer, sys.executable, os.path.join(ROOT, "tests", "sanitizer_calls.py"), *arguments],
                          capture_output=True, text=True, env=env, timeout=1800)
    return done.returncode, done.stdout + done.stderr


# API errors are not reported: cuda-bindings (kda_opt/launch's replays of cuTile launches) asks the
# driver for every entry point it binds at its first call, and the driver answers "invalid argument"
# for those it lacks. A launch or a driver call of the package that fails raises in Python, which
# fails the calls.
API_ERRORS = ("--report-api-errors", "no")


def sanitize(tool):
    """compute-sanitizer --tool `tool` over every call of tests/sanitizer_calls.py."""
    if not os.access(SANITIZER, os.X_OK):
        pytest.fail(f"the sanitizer tier needs compute-sanitizer (not on PATH nor at {SANITIZER})")
    return calls((SANITIZER, "--tool", tool, *TOOLS[tool], *API_ERRORS, "--error-exitcode", "99"),
                 ARGUMENTS.get(tool, ()), PYTORCH_NO_CUDA_MEMORY_CACHING="1")


@gpu
@pytest.mark.sanitizer
@pytest.mark.parametrize("tool", [t for t in TOOLS if t != "racecheck"])
def test_every_launch_path_is_clean(tool):
    status, report = sanitize(tool)
    assert status == 0 and "ERROR SUMMARY: 0 errors" in report and "calls done" in report, report[-6000:]


# A racecheck hazard, as it reports one: the two accesses, each with its kind, PC and source line.
HAZARD = re.compile(r"Race reported between (\w+) access at (\S+) in ([\w.]+):(\d+)\s*\n=+\s+and (\w+) access at "
                    r"(\S+) in ([\w.]+):(\d+)")
ROW_VECTOR_LOAD = re.compile(r"\b(RSTD|RB)\.get_raw_memory\(\)\.load_offset\(")


def benign(hazard) -> bool:
    """A hazard racecheck reports that is none: both accesses writes by the same instruction of
    kda_opt/wuso.py, at a row vector's load by element offsets (the q/k norms or β's residual of a
    packed chunk). cuTile compiles that [64, 1] load to cp.async copies (LDGSTS) in which thread t
    copies element t mod 64 from global row0 + (t mod 64) into shared word t mod 64, so the threads
    t + 64·j write the same bytes to the same word (sm_90 SASS from tileiras 13.5: docs/DESIGN.md,
    "Memory safety")."""
    kind1, pc1, file1, line1, kind2, pc2, file2, line2 = hazard
    if (kind1, kind2) != ("Write", "Write") or (pc1, file1, line1) != (pc2, file2, line2) or file1 != "wuso.py":
        return False
    with open(os.path.join(ROOT, "kda_opt", "wuso.py")) as f:
        return bool(ROW_VECTOR_LOAD.search(f.readlines()[int(line1) - 1]))


@gpu
@pytest.mark.sanitizer
def test_racecheck_finds_only_the_row_vectors_replicated_copies():
    """racecheck over every launch path: no hazard but the benign one (benign); the tool's count of
    hazards is the count of those, so none is left unread."""
    _, report = sanitize("racecheck")
    hazards = HAZARD.findall(report)
    counted = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed", report)
    assert "calls done" in report and counted and int(counted[1]) == len(hazards), report[-6000:]
    assert all(benign(h) for h in hazards), [h for h in hazards if not benign(h)]


@gpu
@pytest.mark.sanitizer
def test_every_element_returned_is_written():
    """The calls on an allocator whose memory is all NaN: every element of o and of the final states
    they return is finite, so each was written."""
    status, report = calls(arguments=("--poisoned",))
    assert status == 0 and "calls done" in report, report[-6000:]
