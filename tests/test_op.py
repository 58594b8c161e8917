"""torch.ops.kda_opt.forward (kda_opt/op): its fake implementation's shapes under FakeTensorMode
(CPU), and on the GPU kda_forward under torch.compile(fullgraph=True) against the eager call."""
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kda_opt  # noqa: F401  registers the op
from kda_bench.inputs import random_inputs
from kda_opt import kda_forward
from tests.conftest import cuda_build, gpu


# kda_forward's defaults: the op takes every argument but the host copies.
DEFAULTS = {n: p.default for n, p in inspect.signature(kda_forward).parameters.items()
            if p.default is not inspect.Parameter.empty and not n.endswith("_cpu")}


def op_call(**a):
    return torch.ops.kda_opt.forward(**{**DEFAULTS, **a})


@cuda_build
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("state", ["none", "k-first", "v-first", "deprecated name"])
def test_fake_shapes(packed, state):
    """o like v (dense), the final state [N, HV, K, V] fp32 ([N, HV, V, K] V-first), or empty when not asked."""
    B, T, H, HV, K, V = (1, 300, 2, 4, 128, 64) if packed else (3, 300, 2, 4, 128, 64)
    N = 5 if packed else B
    with FakeTensorMode():
        t = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, device="cuda", dtype=dtype)
        a = dict(q=t(B, T, H, K), k=t(B, T, H, K), v=t(B, T, HV, V).transpose(1, 2).contiguous().transpose(1, 2),
                 g=t(B, T, HV, K), beta=t(B, T, HV), output_final_state=state != "none",
                 state_v_first=state == "v-first", transpose_state_layout=True if state == "deprecated name" else None)
        if packed:
            a["cu_seqlens"] = t(N + 1, dtype=torch.int32)
        o, final = op_call(**a)
    assert o.shape == (B, T, HV, V) and o.dtype == torch.bfloat16 and o.is_contiguous()
    expected = {"none": (0,), "k-first": (N, HV, K, V)}.get(state, (N, HV, V, K))
    assert final.shape == expected and final.dtype == torch.float32


CALLS = {
    "default": dict(initial_state=True),
    "softplus packed": dict(gate="softplus", initial_state=True, seqlens=[1, 63, 300, 0, 136]),
    "flashkda": dict(l2norm=True, beta_logits=True, state_v_first=True, initial_state=True),
    "no final state": dict(output_final_state=False),
}


@gpu
@pytest.mark.parametrize("name", list(CALLS))
def test_compiled_equals_eager(name):
    """kda_forward inside a function compiled whole (fullgraph: no graph break) gives the eager
    call's o and final state bit for bit."""
    call = CALLS[name]
    T = sum(call["seqlens"]) if "seqlens" in call else 500
    args = random_inputs(1, T, 2, 128, seed=3, **call)
    step = lambda a: kda_forward(**a)
    o, s = step(args)
    oc, sc = torch.compile(step, fullgraph=True)(args)
    assert torch.equal(oc, o)
    assert sc is None if s is None else torch.equal(sc, s)


@gpu
def test_opcheck():
    """torch.library.opcheck: the schema, the fake implementation against the real one, and dispatch."""
    a = random_inputs(1, 200, 2, 64, initial_state=True, seqlens=[50, 150])
    a.pop("cu_seqlens_cpu")
    torch.library.opcheck(torch.ops.kda_opt.forward.default, (), {**DEFAULTS, **a})
