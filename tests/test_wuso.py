"""Stage 4, the cuTile W/U/S/O kernel: compiled to sm_90 cubins without a GPU (tier c), and on the
GPU against the reference state pass fed the same Tm, Aqk and Γ (tier d)."""
import io
import math

import pytest
import torch

import cuda.tile as ct
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint, export_kernel
from kda_opt import reference as ref
from kda_opt.wuso import launch_config, wuso, wuso_kernel
from tests.conftest import gpu, rel_err
from tests.stage_inputs import stage_inputs

CT_DTYPES = {torch.bfloat16: ct.bfloat16, torch.float16: ct.float16, torch.float32: ct.float32}


def array(dtype):
    return ArrayConstraint(CT_DTYPES[dtype], 4, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=False, stride_constant=(None, None, None, 1), base_addr_divisible_by=16)


def cubin(dtype, H, HV, K, V, has_state, store_state):
    """The kernel as the launcher specialises it (launch_config's constants), compiled for sm_90."""
    q, v = torch.empty(1, 64, H, K, device="meta"), torch.empty(1, 64, HV, V, device="meta")
    _, consts = launch_config(q, v, 64, has_state, store_state)
    f32 = torch.float32
    params = [array(dtype), array(dtype), array(dtype), array(f32), array(dtype), array(dtype), array(f32),
              array(dtype), array(f32), ScalarConstraint(ct.float32), ScalarConstraint(ct.int32),
              ScalarConstraint(ct.int32), *consts[2:]]
    buf = io.BytesIO()
    export_kernel(wuso_kernel, [KernelSignature(params, CallingConvention.cutile_python_v2())], buf,
                  gpu_code="sm_90", output_format="cubin")
    return buf.getvalue()


@pytest.mark.parametrize("dtype,K,has_state,store_state", [
    (torch.bfloat16, 128, True, True), (torch.bfloat16, 64, False, True),
    (torch.float16, 128, False, False), (torch.float32, 128, True, False)])
def test_exports_sm90_cubin(dtype, K, has_state, store_state):
    binary = cubin(dtype, 2, 4, K, K, has_state, store_state)
    assert binary[:4] == b"\x7fELF" and len(binary) > 10_000
    assert b"wuso_kernel" in binary


def reference_case(B, T, H, HV, K, gate, dtype, with_state, seed=0):
    x = stage_inputs(B, T, H, K, HV=HV, gate=gate, dtype=dtype, device="cuda", seed=seed)
    scale = K ** -0.5
    Aqk, Akk = ref.intra_chunk(x["q"], x["k"], x["gamma"], x["beta"], scale)
    Tm = ref.solve(Akk, x["beta"])
    W, U = ref.wu(Tm, x["k"], x["v"], x["gamma"])
    h0 = torch.randn(B, HV, K, K, device="cuda") if with_state else None
    ref_o, ref_s = ref.state_pass(x["q"], x["k"], W, U, Aqk, x["gamma"], scale, h0)
    args = (x["q"], x["k"], x["v"], x["gcum"], Tm.to(dtype), Aqk.to(dtype), scale, h0, True)
    return args, ref_o, ref_s


@gpu
@pytest.mark.parametrize("B,T,H,HV", [(1, 1, 1, 1), (3, 63, 1, 2), (1, 64, 4, 4), (1, 65, 2, 4), (3, 1000, 4, 4)])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("with_state", [False, True])
def test_wuso_gpu(B, T, H, HV, K, with_state):
    args, ref_o, ref_s = reference_case(B, T, H, HV, K, "safe", torch.bfloat16, with_state, seed=T + K)
    o, s = wuso(*args)
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-2


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_wuso_gpu_dtypes(dtype):
    args, ref_o, ref_s = reference_case(2, 200, 2, 2, 128, "softplus", dtype, True)
    o, s = wuso(*args)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-2
