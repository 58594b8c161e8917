"""Stage 3 (Tm = (I + Akk)⁻¹ Diag(β)) against the reference stage, under the interpreter or on the GPU.

Akk comes from the reference stage 2 on keys that share a common direction, so its entries are large
(up to ≈ 0.9) and the inverse is far from I − Akk; the reference solve gets the same fp32 Akk."""
import pytest
import torch
import torch.nn.functional as F

from kda_opt import reference as ref
from kda_opt.solve import solve
from tests.conftest import gpu, kernel_device, rel_err

C = 64


def chunk_system(B, T, HV, gate, device, seed):
    """Akk [B, T, HV, 64] fp32 and β [B, T, HV]: slow decay (a ≥ −0.2) or softplus (down to ≈ −50)."""
    gen = torch.Generator().manual_seed(seed)
    k = F.normalize(torch.randn(64, generator=gen) + 0.3 * torch.randn(B, T, 1, 64, generator=gen), dim=-1)
    beta = torch.rand(B, T, HV, generator=gen)
    x = torch.randn(B, T, HV, 64, generator=gen, dtype=torch.float64)
    a = -0.2 * torch.sigmoid(x) if gate == "slow" else -4 * F.softplus(3 * x)
    _, Akk = ref.intra_chunk(k, k, ref.chunk_cumsum(a), beta, 1.0)
    return Akk.float().to(device), beta.to(device)


def run(B, T, HV, gate, out_dtype, device, seed=0):
    Akk, beta = chunk_system(B, T, HV, gate, device, seed)
    Tm = solve(Akk, beta, out_dtype)
    assert Tm.dtype == out_dtype and Tm.shape == Akk.shape
    return Tm, ref.solve(Akk, beta), Akk, beta


def assert_structure(Tm, beta, T):
    """Exact zeros above the diagonal and past a tail chunk's end; β on the diagonal (exactly in
    fp32; within one unit of the last place in 16 bits, which the interpreter truncates to)."""
    rows = torch.arange(T) % C
    cols = torch.arange(C)
    tail = (torch.arange(T) >= T // C * C)[:, None] & (cols[None, :] >= T % C)
    per_token = lambda A: A.permute(0, 2, 1, 3).cpu()       # [B, HV, T, C]
    assert (per_token(Tm)[:, :, (cols[None, :] > rows[:, None]) | tail] == 0).all()
    diag = per_token(Tm)[:, :, cols[None, :] == rows[:, None]].float()
    beta = beta.float().permute(0, 2, 1).cpu()
    assert ((diag - beta).abs() <= torch.finfo(Tm.dtype).eps * beta).all()


@pytest.mark.parametrize("gate", ["slow", "softplus"])
@pytest.mark.parametrize("B,T,HV", [(1, 1, 1), (2, 17, 2), (1, 63, 2), (2, 64, 1), (1, 65, 2), (2, 130, 2)])
def test_solve_fp32(B, T, HV, gate):
    Tm, rTm, _, beta = run(B, T, HV, gate, torch.float32, kernel_device(), seed=T)
    assert rel_err(Tm, rTm) < 1e-6
    assert_structure(Tm, beta, T)


def test_solve_bf16_out_and_upper_triangle_ignored():
    """A bf16 Tm is the fp32 one rounded; entries of Akk on and above the diagonal are never read."""
    Akk, beta = chunk_system(2, 130, 2, "slow", kernel_device(), seed=1)
    upper = (torch.arange(C)[None, :] >= (torch.arange(130) % C)[:, None]).to(Akk.device)
    Tm = solve(Akk.masked_fill(upper[None, :, None, :], float("nan")), beta, torch.bfloat16)
    rTm = ref.solve(Akk, beta)
    assert rel_err(Tm, rTm) < 5e-3          # bf16 storage alone: ≈ 3e-3
    assert_structure(Tm, beta, 130)


@gpu
@pytest.mark.parametrize("gate", ["slow", "softplus"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [65, 1000])
def test_solve_gpu(T, out_dtype, gate):
    Tm, rTm, _, beta = run(2, T, 4, gate, out_dtype, "cuda", seed=T)
    # 16-bit Tm: storage rounding dominates (bf16 ≈ 3e-3, fp16 ≈ 4e-4); fp32: three tf32 passes.
    bound = {torch.bfloat16: 5e-3, torch.float16: 1e-3, torch.float32: 1e-5}[out_dtype]
    assert rel_err(Tm, rTm) < bound
    assert_structure(Tm, beta, T)
