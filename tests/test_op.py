"""torch.ops.kda_opt.forward (kda_opt/op): its fake implementation's shapes under FakeTensorMode
(CPU), and on the GPU kda_forward under torch.compile(fullgraph=True) against the eager call."""
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kda_opt  # noqa: F401  registers the op
from inputs import random_inputs
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


def traced_op_calls(fn, *args):
    """The kda_opt ops the graph of fn(*args) compiled whole (fullgraph) calls, each as (op, its
    arguments by name): traced only (CPU tensors; the fake implementations give the shapes), never run."""
    graphs = []

    class Traced(Exception):
        pass

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*_):
            raise Traced
        return run
    with pytest.raises(Traced):
        torch.compile(fn, fullgraph=True, backend=backend)(*args)
    (gm,) = graphs
    return [(str(n.target), dict(n.kwargs)) for n in gm.graph.nodes
            if n.op == "call_function" and "kda_opt" in str(n.target)]


def test_compiled_calls_are_one_op_by_keyword():
    """Under torch.compile kda_forward and kda_decode are one op call each, every argument passed by
    name (but kda_forward's host copies): no argument list is kept in order by hand."""
    q, k, v, g = (torch.randn(1, 64, 2, 64) for _ in range(4))
    beta, h0 = torch.rand(1, 64, 2), torch.zeros(1, 2, 64, 64)
    forward_calls = traced_op_calls(
        lambda q, h0: kda_forward(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens_cpu=None), q, h0)
    (op, named), = forward_calls
    assert op == "kda_opt.forward" and set(named) == set(DEFAULTS) | {"q", "k", "v", "g", "beta"}
    assert named["use_qk_l2norm_in_kernel"] is True and named["output_final_state"] is True
    (op, named), = traced_op_calls(lambda q: kda_opt.kda_decode(q, k, v, g, beta, use_gate_in_kernel=False,
                                                                state_v_first=True), q)
    assert op == "kda_opt.decode" and set(named) == set(DECODE_DEFAULTS) | {"q", "k", "v", "g", "beta"}
    assert named["state_v_first"] is True


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


# ---- torch.ops.kda_opt.decode (kda_decode) ----

def decode_call(device, dtype=torch.bfloat16, N=4, T=1, H=2, K=128, pool=True, out=False):
    """kda_decode's keywords: N requests of T tokens, a V-first pool of 2N + 8 rows at shuffled slots."""
    t = lambda *shape, dt=dtype: torch.randn(*shape, device=device, dtype=dt)
    a = dict(q=t(N, T, H, K), k=t(N, T, H, K), v=t(N, T, H, K), g=t(N, T, H, K), beta=t(N, T, H),
             A_log=t(H, dt=torch.float32), dt_bias=t(H * K, dt=torch.float32), use_qk_l2norm_in_kernel=True,
             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True)
    if pool:
        a.update(initial_state=t(2 * N + 8, H, K, K, dt=torch.float32), inplace_final_state=True,
                 ssm_state_indices=torch.randperm(2 * N + 8, device=device)[:N])
    else:
        a.update(initial_state=t(N, H, K, K, dt=torch.float32), output_final_state=True)
    if out:
        a["out"] = torch.empty_like(a["v"])
    return a


DECODE_DEFAULTS = {n: p.default for n, p in inspect.signature(kda_opt.kda_decode).parameters.items()
                   if p.default is not inspect.Parameter.empty}


@cuda_build
@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("out", [False, True])
def test_decode_fake_shapes(pool, out):
    """o like v (empty where `out` takes it), the new final states or an empty tensor (in place)."""
    with FakeTensorMode():
        a = decode_call("cuda", pool=pool, out=out)
        op = torch.ops.kda_opt.decode_in_place if pool or out else torch.ops.kda_opt.decode
        o, final = op(**{**DECODE_DEFAULTS, **a})
    assert o.shape == ((0,) if out else (4, 1, 2, 128))
    assert final.shape == ((0,) if pool else (4, 2, 128, 128)) and final.dtype == torch.float32


@gpu
@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("out", [False, True])
def test_decode_compiled_equals_eager(pool, out):
    """A decode step compiled whole (fullgraph), over a pool or dense states, into `out` or not: the
    eager call's o and states bit for bit. Over a pool without `out` is the step a server compiles
    (the in-place op then hands no `out`)."""
    torch.manual_seed(0)
    a = decode_call("cuda", pool=pool, out=out)
    eager = {**a, "initial_state": a["initial_state"].clone()}
    if out:
        eager["out"] = torch.empty_like(a["v"])
    o, s = kda_opt.kda_decode(**eager)
    oc, sc = torch.compile(lambda x: kda_opt.kda_decode(**x), fullgraph=True)(a)
    assert torch.equal(oc, o) and torch.equal(sc, s)
    assert torch.equal(a["initial_state"], eager["initial_state"])
    assert not out or torch.equal(a["out"], o)


def test_in_place_ops_take_every_argument():
    """The ops that write their arguments have no defaults (kda_opt/op._op: torch 2.11 finds a written
    argument by its position among those the dispatcher hands, which leave out trailing defaults);
    the others keep kda_forward's and kda_decode's."""
    ops = torch.ops.kda_opt
    for op in (ops.forward_in_place, ops.decode_in_place):
        assert not any(a.has_default_value() for a in op.default._schema.arguments), op
    for op in (ops.forward, ops.decode):
        assert any(a.has_default_value() for a in op.default._schema.arguments), op


@gpu
def test_decode_graph_replay_on_new_data_equals_eager():
    """A decode step captured in a CUDA graph (out given: the eager call allocates nothing), replayed
    after new tokens and a new pool are copied into its buffers, gives the eager call's o and pool."""
    torch.manual_seed(0)
    a = decode_call("cuda", N=64, H=4, out=True)
    warm = {**a, "initial_state": a["initial_state"].clone()}
    kda_opt.kda_decode(**warm)                                      # plan and compile first
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    kda_opt.kda_decode(**warm)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda_opt.kda_decode(**a)
    fresh = decode_call("cuda", N=64, H=4, out=True)
    expected_o, expected_pool = kda_opt.kda_decode(**{**fresh, "ssm_state_indices": a["ssm_state_indices"],
                                                      "initial_state": fresh["initial_state"].clone()})
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"):
        a[name].copy_(fresh[name])
    graph.replay()
    assert torch.equal(a["out"], expected_o) and torch.equal(a["initial_state"], expected_pool)
