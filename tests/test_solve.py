"""Stage 3 (Tm = (I + Akk)⁻¹ Diag(β)) against the reference stage, under the interpreter or on the GPU."""
import pytest
import torch

from kda_opt import reference as ref
from kda_opt.solve import solve
from tests.conftest import gpu, kernel_device, rel_err
from tests.stage_inputs import stage_inputs


def run(T, HV, gate, out_dtype, device):
    x = stage_inputs(2, T, 1, 64, HV=HV, gate=gate, device=device, seed=T)
    _, rAkk = ref.intra_chunk(x["q"], x["k"], x["gamma"], x["beta"], 1.0)
    Tm = solve(rAkk.float().to(device), x["beta"], out_dtype)
    assert Tm.dtype == out_dtype and Tm.shape == rAkk.shape
    return Tm, ref.solve(rAkk, x["beta"])


@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("T", [1, 17, 63, 64, 65, 130])
def test_solve_fp32(T, gate):
    Tm, rTm = run(T, 2, gate, torch.float32, kernel_device())
    assert rel_err(Tm, rTm) < 1e-5


@gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [65, 4096])
def test_solve_gpu(T, out_dtype):
    Tm, rTm = run(T, 4, "safe", out_dtype, "cuda")
    assert rel_err(Tm, rTm) < (5e-3 if out_dtype == torch.bfloat16 else 1e-5)
