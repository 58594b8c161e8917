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
