"""Shared test helpers: device tiers and the one error measure every test uses."""
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Without a GPU the Triton kernels run under the interpreter (tier b). It must be set before any
# kernel module is imported, which conftest precedes.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Imported only now, after TRITON_INTERPRET: importing kda_opt defines its Triton kernels.
from kda_opt.reference import rel_err  # noqa: E402,F401  the one error measure of every test
import triton  # noqa: E402

# triton.next_power_of_2 as Triton defines it, kept before any test imports SGLang, whose import replaces
# it with a plain function (sglang.srt.utils.common) that Triton 3.6 refuses inside a kernel, where
# vLLM's kernels call it (tests/test_vllm.py puts it back around each of its tests).
TRITON_NEXT_POWER_OF_2 = triton.next_power_of_2



NO_GPU = "needs a CUDA GPU"
NO_TWO_GPUS = "needs two CUDA GPUs"
NO_CUDA_BUILD = "needs torch built with CUDA (a CPU-only build makes no CUDA tensors, fake ones included)"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_env() -> dict:
    """The environment of a subprocess that compiles kernels for sm_90 without a GPU: this one's
    without TRITON_INTERPRET (which Triton applies to every compile in a process that has it), the
    project root and scripts/ on PYTHONPATH."""
    env = {n: x for n, x in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (ROOT, os.path.join(ROOT, "scripts"), env.get("PYTHONPATH"))))
    return env


def gpu(test):
    """A test that needs a CUDA GPU: marked `gpu` (`pytest -m gpu` selects these), skipped without one."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU)(test))


def two_gpus(test):
    """A test that needs two CUDA GPUs of one host (NCCL): marked `gpu`, skipped with fewer."""
    return pytest.mark.gpu(pytest.mark.skipif(torch.cuda.device_count() < 2, reason=NO_TWO_GPUS)(test))


def cuda_build(test):
    """A test that needs CUDA tensors but no GPU (fake ones, under FakeTensorMode): skipped on a
    CPU-only build of torch."""
    return pytest.mark.skipif(not torch.backends.cuda.is_built(), reason=NO_CUDA_BUILD)(test)


def pytest_sessionfinish(session, exitstatus):
    """A skip for any other reason, or for one of these where it does not hold (a GPU present, two
    GPUs, a CUDA build), fails the run: a missing test dependency (an importorskip) or tool would otherwise pass
    as green while the tests it guards never ran."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    reasons = {report.longrepr[2] for report in reporter.stats.get("skipped", [])
               if isinstance(report.longrepr, tuple)}
    holds = tuple(r for r, here in ((NO_GPU, not HAS_CUDA), (NO_TWO_GPUS, torch.cuda.device_count() < 2),
                                    (NO_CUDA_BUILD, not torch.backends.cuda.is_built())) if here)
    unexpected = sorted(r for r in reasons if not r.endswith(holds))
    if unexpected:
        reporter.write_line("\nskipped for a reason other than a missing GPU or CUDA build (a failure here): "
                            + "; ".join(unexpected), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser):
    parser.addoption("--longest-first", metavar="PATH", default=None,
                     help="run first the tests PATH lists (lines `<seconds> <test id>`, in their order; "
                          "scripts/gpu_suite.sh writes profiles/gpu_suite_seconds.txt), the rest after them")


def pytest_collection_modifyitems(config, items):
    """--longest-first: the listed tests first, in the file's order, the rest after them in collection
    order. Under xdist's load scheduler one test at a time (--maxschedchunk 1), a run started longest
    first ends with short tests, not with a long one begun late."""
    path = config.getoption("--longest-first")
    if path is None:
        return
    listed = [line.split(" ", 1)[1] for line in open(path).read().splitlines()
              if line.strip() and not line.startswith("#")]
    rank = {test_id: i for i, test_id in enumerate(listed)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))


def kernel_device() -> str:
    """Where Triton stage kernels run in this session: the GPU, or the CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


# Whether the Triton kernels run under the interpreter here, whose tl.dot multiplies fp32 operands in
# fp32 whatever input_precision says: a bound that holds only there is a bound of the interpreter's.
INTERPRETED = not HAS_CUDA


@pytest.fixture(autouse=True)
def fla_stays_fla():
    """FLA's chunk_kda is FLA's own in every test: kda_opt registered with it (kda_opt.use_in_fla,
    in a test or a docs example) is removed after the test, as FLA has no way to unregister."""
    yield
    backends = sys.modules.get("fla.backends")
    for registry in getattr(backends, "_function_registries", {}).values():
        registry._backends.pop("kda_opt", None)
