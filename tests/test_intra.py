"""Stage 2 (intra-chunk Aqk, Akk) against the reference stage, under the interpreter or on the GPU."""
import pytest
import torch

from kda_opt import reference as ref
from kda_opt.intra import intra_chunk
from tests.conftest import gpu, kernel_device, rel_err
from tests.stage_inputs import stage_inputs


def run(B, T, H, HV, K, gate, dtype, device, scale=0.125):
    x = stage_inputs(B, T, H, K, HV=HV, gate=gate, dtype=dtype, device=device, seed=T)
    Aqk, Akk = intra_chunk(x["q"], x["k"], x["gcum"], x["beta"], scale, safe_gate=gate == "safe")
    rAqk, rAkk = ref.intra_chunk(x["q"], x["k"], x["gamma"], x["beta"], scale)
    assert Aqk.dtype == dtype and Akk.dtype == torch.float32
    return Aqk, Akk, rAqk, rAkk


@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("B,T,H,HV", [(1, 1, 1, 1), (2, 63, 1, 2), (1, 64, 2, 2), (1, 65, 1, 1), (1, 130, 2, 4)])
def test_intra_fp32(B, T, H, HV, gate):
    Aqk, Akk, rAqk, rAkk = run(B, T, H, HV, 64, gate, torch.float32, kernel_device())
    # Γ rounded to fp32 (|Γ| up to a few hundred) bounds the agreement near 1e-5.
    assert rel_err(Aqk, rAqk) < 1e-4
    assert rel_err(Akk, rAkk) < 1e-4 or rAkk.abs().max() == 0
    # Structure: zero on/above the diagonal (Akk) and above it (Aqk), zero past a tail chunk.
    C, rows = 64, torch.arange(T) % 64
    upper = torch.arange(C)[None, :] > rows[:, None]
    diag = torch.arange(C)[None, :] == rows[:, None]
    per_head = lambda x: x.permute(0, 2, 1, 3).cpu()
    assert (per_head(Akk)[:, :, upper | diag] == 0).all() and (per_head(Aqk)[:, :, upper] == 0).all()


@gpu
@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [63, 1000])
@pytest.mark.parametrize("K", [64, 128])
def test_intra_gpu(T, K, dtype, gate):
    Aqk, Akk, rAqk, rAkk = run(2, T, 2, 4, K, gate, dtype, "cuda")
    assert rel_err(Aqk, rAqk) < 5e-3 and rel_err(Akk, rAkk) < 1e-4
