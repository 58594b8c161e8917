"""Shared test helpers: device tiers and the one error measure every test uses."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Without a GPU the Triton kernels run under the interpreter (tier b). It must be set before any
# kernel module is imported, which conftest precedes.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (SPEC §5); NaN anywhere gives inf so it never passes."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def kernel_device() -> str:
    """Where Triton stage kernels run in this session: the GPU, or the CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
