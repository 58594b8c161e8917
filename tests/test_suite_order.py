"""The GPU suite's order (tests/conftest.py, --longest-first, as scripts/gpu_suite.sh runs it): the tests
the file lists first, in its order, the rest after them in collection order."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def collected(*args):
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_listed_tests_first_in_the_files_order(tmp_path):
    plain = collected("tests/test_seqs.py")
    first = [plain[5], plain[2]]
    listed = tmp_path / "seconds.txt"
    listed.write_text(f"# a comment\n9.5 {first[0]}\n- {first[1]}\n3.0 tests/test_seqs.py::test_since_removed\n")
    assert collected("--longest-first", str(listed), "tests/test_seqs.py") == first + [t for t in plain
                                                                                       if t not in first]
