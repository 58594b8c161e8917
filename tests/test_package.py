"""The package as a user installs it: `import kda_opt` is the runtime alone."""
import subprocess
import sys

HARNESS = ("kda_bench", "matplotlib", "fla", "flash_kda", "pytest")


def test_import_pulls_in_no_harness_module():
    code = ("import sys, kda_opt; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{HARNESS!r})))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [], f"import kda_opt imported {run.stdout.split()}"


def test_pyproject_states_the_fast_paths_tested_versions():
    """pyproject.toml's [tool.kda_opt.tested] is kda_opt/fastpath.TESTED, and each dependency's lower
    bound is its tested version."""
    import pathlib
    import tomllib

    from kda_opt import fastpath
    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert project["tool"]["kda_opt"]["tested"] == fastpath.TESTED
    for name, version in fastpath.TESTED.items():
        assert f"{name}>={version}" in project["project"]["dependencies"]
