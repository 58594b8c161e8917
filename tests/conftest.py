"""Shared test helpers: device tiers and the one error measure every test uses."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Without a GPU the Triton kernels run under the interpreter (tier b). It must be set before any
# kernel module is imported, which conftest precedes.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Imported only now, after TRITON_INTERPRET: importing kda_opt defines its Triton kernels.
from kda_opt.reference import rel_err  # noqa: E402,F401  the one error measure of every test



def gpu(test):
    """A test that needs a CUDA GPU: marked `gpu` (`pytest -m gpu` selects these), skipped without one."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(test))


def kernel_device() -> str:
    """Where Triton stage kernels run in this session: the GPU, or the CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
