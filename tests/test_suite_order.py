"""The GPU suite's order (tests/conftest.py, --longest-first, as scripts/gpu_suite.sh runs it): the tests
the file lists first, in its order, the rest after them in collection order."""
import pathlib
import subprocess
import sys

import suite_record

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


FILES = ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py"]


def junit(path, cases):
    """A JUnit XML of (module, test, outcome) cases, outcome one of passed, failure, skipped."""
    body = "".join(f'<testcase classname="{m}" name="{t}" time="3.0">'
                   + ("" if o == "passed" else f"<{o}/>") + "</testcase>" for m, t, o in cases)
    path.write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")
    return str(path)


def run(record, tree, files, cases, tmp_path, status=0, mode="suite"):
    done = suite_record.read_run(junit(tmp_path / "j.xml", cases), files, status)
    return suite_record.record_after(record, mode, tree, "NVIDIA H200", "v", files, done, 100, status, FILES)


def values(record, key):
    return [v for k, v in record if k == key]


def test_parts_of_one_tree_make_one_record(tmp_path):
    first = run([], "t1", FILES[:2], [("tests.test_a", "x", "passed"), ("tests.test_b", "y", "skipped")], tmp_path)
    assert values(first, "failed") == ["1"] and values(first, "failed_test") == [
        "[suite] tests/test_c.py (no run on this tree)"]
    both = run(first, "t1", FILES[2:], [("tests.test_c", "z", "passed"), ("tests.test_c", "w", "passed")], tmp_path)
    assert [values(both, k) for k in ("passed", "failed", "skipped", "suite_seconds")] == [["3"], ["0"], ["1"], ["200"]]
    assert len(values(both, "suite_run")) == 2 and not values(both, "failed_test")
    # the sanitizer tier's run keeps the suite's lines of its tree, and a run on another tree starts afresh
    sanitized = run(both, "t1", ["tests/test_a.py"], [("tests.test_a", "s", "passed")], tmp_path, mode="sanitizer")
    assert values(sanitized, "failed") == ["0"] and values(sanitized, "sanitizer_passed") == ["1"]
    other = run(sanitized, "t2", FILES[:2], [("tests.test_a", "x", "passed")], tmp_path)
    assert values(other, "failed") == ["1"] and values(other, "sanitizer_passed") == ["-"]


def test_a_file_run_again_takes_the_new_counts(tmp_path):
    bad = run([], "t1", FILES, [("tests.test_a", "x", "failure"), ("tests.test_b", "y", "passed"),
                                ("tests.test_c", "z", "passed")], tmp_path, status=1)
    assert values(bad, "failed") == ["1"] and values(bad, "failed_test") == ["[suite] tests/test_a.py::x"]
    mended = run(bad, "t1", FILES[:1], [("tests.test_a", "x", "passed")], tmp_path)
    assert values(mended, "failed") == ["0"] and values(mended, "passed") == ["3"]
    # a run stopped by its timeout with no failing test is a failure of its files until they run again
    stopped = run(mended, "t1", FILES[1:], [("tests.test_b", "y", "passed")], tmp_path, status=124)
    assert values(stopped, "failed") == ["1"] and values(stopped, "suite_interrupted") == ["yes"]
    assert run(stopped, "t1", FILES[1:], [("tests.test_b", "y", "passed"), ("tests.test_c", "z", "passed")],
               tmp_path)[3:6] == [("passed", "3"), ("failed", "0"), ("skipped", "0")]


def test_the_last_part_is_what_no_run_covered(tmp_path):
    order = [("50.0", "tests/test_a.py::x"), ("40.0", "tests/test_b.py::y"), ("20.0", "tests/test_c.py::z"),
             ("-", "tests/test_c.py::w")]
    assert suite_record.bins(FILES, order, 2) == [["tests/test_a.py"], ["tests/test_b.py", "tests/test_c.py"]]
    first = run([], "t1", ["tests/test_a.py"], [("tests.test_a", "x", "passed")], tmp_path)
    # the order file changed between the parts: the last part still takes every file not yet covered
    changed = [("10.0", "tests/test_a.py::x"), ("40.0", "tests/test_b.py::y"), ("45.0", "tests/test_c.py::z")]
    assert suite_record.bins(FILES, changed, 2)[1] == ["tests/test_a.py", "tests/test_b.py"]
    assert suite_record.part_files("2/2", FILES, changed, first, "t1") == FILES[1:]
    assert suite_record.part_files("2/2", FILES, order, first, "t2") == FILES[1:]
    assert suite_record.part_files("1/1", FILES, order, [], "t1") == FILES
    # the order file after a part: its files' tests retimed, the others' kept
    assert suite_record.order_after(order, ["tests/test_c.py"], {"tests/test_c.py::w": 7.0}, False) == [
        ("50.0", "tests/test_a.py::x"), ("40.0", "tests/test_b.py::y"), ("7.0", "tests/test_c.py::w")]
