"""kda_forward end to end on the GPU: the whole forward against the float64 recurrence beside FLA's
own error (docs/DESIGN.md, Accuracy), and against FLA chunk_kda directly. (Validation: tests/test_plan.py.)"""
import itertools

import pytest
import torch

from inputs import GATE_MODES, PER_TOKEN, ill_conditioned_inputs, random_inputs
from kda_opt import kda_forward, reference
from kda_opt.forward import RUN_TENSORS, run
from kda_opt.plan import Tuning
from kda_opt.reference import ERROR_FLOOR, error_bound, reference_forward
from tests.conftest import gpu, rel_err
from tests.stage_inputs import plan_of



def run_tuned(args, tuning, launch=None):
    """kda_forward's call with other launch knobs: the plan made with `tuning`, then run."""
    plan = plan_of(**args, tuning=tuning)
    return run(plan, **{n: args.get(n) for n in RUN_TENSORS}, **({"launch": launch} if launch else {}))


def fla_chunk_kda():
    return pytest.importorskip("fla.ops.kda").chunk_kda


def bound(ours_fn, fla_fn):
    """Our error and the bound it must meet (kda_opt.reference.error_bound); FLA is only run when
    ours exceeds the floor, below which the bound is the floor whatever FLA's error."""
    ours = ours_fn()
    return ours, (ERROR_FLOOR if ours <= ERROR_FLOOR else error_bound(fla_fn()))


# ---- GPU: the whole forward against the float64 recurrence ----

SHAPES = list(itertools.product([1, 3], [1, 63, 64, 65, 1000], [1, 4], [64, 128]))  # B, T, H, K


@gpu
@pytest.mark.parametrize("B,T,H,K", SHAPES)
@pytest.mark.parametrize("gate", list(GATE_MODES))
@pytest.mark.parametrize("with_state", [False, True])
def test_forward_vs_recurrence(B, T, H, K, gate, with_state):
    args = random_inputs(B, T, H, K, gate=gate, seed=B * 7 + T + H + K, initial_state=with_state)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    assert o.dtype == args["v"].dtype and s.dtype == torch.float32
    fla = lambda: fla_chunk_kda()(**args)
    err_o, bound_o = bound(lambda: rel_err(o, ref_o), lambda: rel_err(fla()[0], ref_o))
    err_s, bound_s = bound(lambda: rel_err(s, ref_s), lambda: rel_err(fla()[1], ref_s))
    assert err_o <= bound_o, f"o error {err_o:.2e}"
    assert err_s <= bound_s, f"state error {err_s:.2e}"


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("HV", [4, 8])
def test_forward_dtypes_and_gva(dtype, HV):
    args = random_inputs(2, 200, 4, 128, HV=HV, dtype=dtype, initial_state=True, seed=HV)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    assert o.dtype == dtype
    assert rel_err(o, ref_o) <= ERROR_FLOOR and rel_err(s, ref_s) <= ERROR_FLOOR


@gpu
@pytest.mark.parametrize("gate", list(GATE_MODES))
def test_forward_matches_fla_and_is_as_accurate(gate):
    """Close to FLA chunk_kda on the same inputs, and at least as accurate as FLA against the float64
    recurrence (the project's bar, tighter than the 2× bound), for o and the final state."""
    args = random_inputs(2, 1000, 4, 128, gate=gate, initial_state=True, seed=3)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    o_fla, s_fla = fla_chunk_kda()(**args)
    assert rel_err(o, o_fla) < 1e-2 and rel_err(s, s_fla) < 1e-2
    assert rel_err(o, ref_o) <= rel_err(o_fla, ref_o), "o less accurate than FLA's"
    assert rel_err(s, ref_s) <= rel_err(s_fla, ref_s), "state less accurate than FLA's"


@gpu
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_gate_parameters_in_a_model_dtype(gate):
    """A bf16 model's A_log and dt_bias, passed as they are: the same call, bit for bit, as their
    values in fp32 (stage 1 reads them as fp32; nothing is converted before the launches)."""
    args = random_inputs(1, 300, 4, 128, gate=gate, initial_state=True, seed=4, l2norm=True)
    half = {n: args[n].bfloat16() for n in ("A_log", "dt_bias")}
    o, s = kda_forward(**{**args, **half})
    o_f, s_f = kda_forward(**{**args, **{n: x.float() for n, x in half.items()}})
    assert torch.equal(o, o_f) and torch.equal(s, s_f)


@gpu
def test_no_final_state_and_default_scale():
    args = random_inputs(1, 100, 2, 64, output_final_state=False)
    o, s = kda_forward(**args)
    assert s is None
    o2, _ = kda_forward(**args, scale=64 ** -0.5)
    assert torch.equal(o, o2)
    o3, _ = kda_forward(**args, scale=0.5)
    assert rel_err(o3, reference_forward(**args, scale=0.5)[0]) <= ERROR_FLOOR


# ---- GPU: serving features (packed sequences, continuation, l2norm, GVA, K ≠ V) ----

def pack(args, lens):
    """args' per-token tensors cut into sequences of `lens` (B = 1) — the arguments of each one run
    alone, its initial state the matching row of args' initial_state."""
    bounds = torch.tensor([0, *lens]).cumsum(0).tolist()
    skip = ("cu_seqlens", "cu_seqlens_cpu", "initial_state")
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        one = {name: (x[:, a:b] if name in PER_TOKEN else x) for name, x in args.items() if name not in skip}
        if "initial_state" in args:
            one["initial_state"] = args["initial_state"][n:n + 1]
        yield a, b, one


def assert_each_alone(args, lens, o, s):
    """o and the final states s of a packed call are what each sequence gives run alone through
    kda_forward, packed on its own so that it takes the same path (a sequence of one token: the
    decode kernel; any other: the same chunks, rounding apart the same numbers)."""
    for n, (a, b, one) in enumerate(pack(args, lens)):
        o1, s1 = kda_forward(**one, cu_seqlens=torch.tensor([0, b - a], device=o.device))
        assert rel_err(o[:, a:b], o1) < 2e-3 and rel_err(s[n:n + 1], s1) < 1e-4, n


PACKED_LENS = [[1, 63, 64, 65, 333, 7], [1000], [130, 1, 64, 4000]]


@gpu
@pytest.mark.parametrize("lens", PACKED_LENS)
@pytest.mark.parametrize("gate", list(GATE_MODES))
@pytest.mark.parametrize("H,HV", [(4, 4), (2, 4)])
def test_forward_packed(lens, gate, H, HV):
    """cu_seqlens: against the float64 recurrence sequence by sequence (kda_opt.reference.error_bound), and against
    each sequence run alone through kda_forward (the same chunks: rounding apart, the same numbers)."""
    args = random_inputs(1, sum(lens), H, 128, HV=HV, gate=gate, seqlens=lens, initial_state=True,
                         seed=len(lens) + HV)
    o, s = kda_forward(**args)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    fla = lambda: fla_chunk_kda()(**args)
    err_o, bound_o = bound(lambda: rel_err(o, ref_o), lambda: rel_err(fla()[0], ref_o))
    err_s, bound_s = bound(lambda: rel_err(s, ref_s), lambda: rel_err(fla()[1], ref_s))
    assert err_o <= bound_o and err_s <= bound_s, (err_o, err_s)
    assert_each_alone(args, lens, o, s)


@gpu
def test_forward_packed_many_sequences_and_empty_ones():
    """Thousands of sequences, some empty (their final state is their initial state)."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 20, (3000,), generator=gen).tolist()
    lens[:3] = [0, 300, 0]
    args = random_inputs(1, sum(lens), 2, 64, seqlens=lens, initial_state=True, seed=1)
    o, s = kda_forward(**args)
    ref_o, ref_s = reference_forward(**args)
    assert rel_err(o, ref_o) <= ERROR_FLOOR and rel_err(s, ref_s) <= ERROR_FLOOR
    assert torch.equal(s[0], args["initial_state"][0]) and torch.equal(s[2], args["initial_state"][2])


@gpu
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_forward_packed_matches_fla_and_is_as_accurate(gate):
    lens = [1, 63, 64, 65, 333, 474]
    args = random_inputs(1, sum(lens), 4, 128, gate=gate, seqlens=lens, initial_state=True, seed=2)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    o_fla, s_fla = fla_chunk_kda()(**args)
    assert rel_err(o, o_fla) < 1e-2 and rel_err(s, s_fla) < 1e-2
    assert rel_err(o, ref_o) <= rel_err(o_fla, ref_o) and rel_err(s, ref_s) <= rel_err(s_fla, ref_s)


def cut(args, t):
    """args split at token t: (first part, second part without its initial state)."""
    first = {n: (x[:, :t] if n in PER_TOKEN else x) for n, x in args.items()}
    second = {n: (x[:, t:] if n in PER_TOKEN else x) for n, x in args.items() if n != "initial_state"}
    return first, second


@gpu
@pytest.mark.parametrize("t", [1, 63, 64, 65, 333, 517, 999])
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_forward_continuation(t, gate):
    """Chunked prefill: a sequence cut at token t, the first part's final state starting the second,
    gives the whole run's output and final state, within the engine's error bound."""
    args = random_inputs(2, 1000, 4, 128, gate=gate, initial_state=True, seed=t)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    first, second = cut(args, t)
    o1, s1 = kda_forward(**first)
    o2, s2 = kda_forward(**second, initial_state=s1)
    o12 = torch.cat([o1, o2], dim=1)
    assert rel_err(o12, ref_o) <= ERROR_FLOOR and rel_err(s2, ref_s) <= ERROR_FLOOR
    assert rel_err(o12, o) < ERROR_FLOOR and rel_err(s2, s) < ERROR_FLOOR


@gpu
def test_forward_batch_stride_past_int32():
    """B = 1 inputs whose batch stride is 2^31 or more (as in one sequence of a million tokens, or a
    slice of one): the same numbers as contiguous ones (the kernels never multiply that stride)."""
    args = random_inputs(1, 200, 2, 128, initial_state=True)
    far = {}
    for n in ("q", "k", "v", "beta"):
        x = args[n]
        far[n] = torch.empty_strided(x.shape, (2 ** 31 + 64 * x.stride(1), *x.stride()[1:]), dtype=x.dtype,
                                     device=x.device).copy_(x)
        assert far[n].stride(0) > 2 ** 31
    o, s = kda_forward(**args)
    o_far, s_far = kda_forward(**{**args, **far})
    assert torch.equal(o, o_far) and torch.equal(s, s_far)


@gpu
def test_forward_continuation_packed():
    """The same through cu_seqlens: every sequence's first part packed in one call, the second parts
    in another, started from the first call's final states."""
    lens, cuts = [1000, 130, 65, 700], [333, 64, 1, 699]
    args = random_inputs(1, sum(lens), 2, 128, HV=4, seqlens=lens, initial_state=True, seed=4)
    o, s = kda_forward(**args)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    parts = [cut(one, c) for (_, _, one), c in zip(pack(args, lens), cuts)]
    lens1, lens2 = cuts, [n - c for n, c in zip(lens, cuts)]

    def packed_call(ones, lens_, h0):
        cu = torch.tensor([0, *lens_]).cumsum(0).to(torch.int32)
        joined = {n: (torch.cat([x[n] for x in ones], dim=1) if n in PER_TOKEN else x)
                  for n, x in ones[0].items() if n != "initial_state"}
        return kda_forward(**joined, initial_state=h0, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)

    o1, s1 = packed_call([p[0] for p in parts], lens1, args["initial_state"])
    o2, s2 = packed_call([p[1] for p in parts], lens2, s1)
    bounds1 = torch.tensor([0, *lens1]).cumsum(0).tolist()
    bounds2 = torch.tensor([0, *lens2]).cumsum(0).tolist()
    o12 = torch.cat([torch.cat([o1[:, bounds1[n]:bounds1[n + 1]], o2[:, bounds2[n]:bounds2[n + 1]]], dim=1)
                     for n in range(len(lens))], dim=1)
    assert rel_err(o12, ref_o) <= ERROR_FLOOR and rel_err(s2, ref_s) <= ERROR_FLOOR
    assert rel_err(o12, o) < ERROR_FLOOR and rel_err(s2, s) < ERROR_FLOOR


@gpu
@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("seqlens", [None, [1, 63, 64, 65, 333, 474]])
def test_forward_l2norm_in_kernel(gate, seqlens):
    """use_qk_l2norm_in_kernel: the float64 recurrence on normalised q, k within the accuracy bound; as
    accurate as FLA's own in-kernel l2norm; and close to normalising before the call."""
    T = 1000
    args = random_inputs(1, T, 4, 128, HV=8, gate=gate, l2norm=True, seqlens=seqlens, initial_state=True, seed=6)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    o_fla, s_fla = fla_chunk_kda()(**args)
    assert rel_err(o, ref_o) <= error_bound(rel_err(o_fla, ref_o))
    assert rel_err(o, ref_o) <= rel_err(o_fla, ref_o) and rel_err(s, ref_s) <= rel_err(s_fla, ref_s)
    normed = {n: reference.l2norm(args[n]).to(args[n].dtype) for n in ("q", "k")}
    o_pre, s_pre = kda_forward(**{**args, **normed, "use_qk_l2norm_in_kernel": False})
    assert rel_err(o, o_pre) < 1e-2 and rel_err(s, s_pre) < 1e-2


@gpu
@pytest.mark.parametrize("K,V", [(128, 64), (64, 128)])
def test_forward_key_and_value_dims_differ(K, V):
    args = random_inputs(2, 200, 2, K, V=V, HV=4, initial_state=True, seed=K)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    assert o.shape == args["v"].shape and s.shape == (2, 4, K, V)
    assert rel_err(o, ref_o) <= ERROR_FLOOR and rel_err(s, ref_s) <= ERROR_FLOOR


# ---- GPU: FlashKDA's call (issue 10): beta as logits, negative eigenvalues, V-first states ----

@gpu
@pytest.mark.parametrize("neg_eigval", [False, True])
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_forward_beta_logits(neg_eigval, gate):
    """use_beta_sigmoid_in_kernel (and allow_neg_eigval, β in (0, 2)) against the float64
    recurrence and FLA on the same logits: as accurate as FLA."""
    args = random_inputs(2, 1000, 4, 128, gate=gate, initial_state=True, seed=21)
    args.update(beta=(4 * args["beta"] - 2), use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    o_fla, s_fla = fla_chunk_kda()(**args)
    assert rel_err(o, ref_o) <= rel_err(o_fla, ref_o) and rel_err(s, ref_s) <= rel_err(s_fla, ref_s)


@gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqlens", [None, [1, 63, 64, 65, 333, 474]])
def test_forward_state_v_first(state_dtype, seqlens):
    """state_v_first: initial and final states [N, HV, V, K], the initial one in fp32 or bf16; the
    same numbers as the K-first layout, transposed. K ≠ V, so a wrong layout cannot pass."""
    B = 1 if seqlens else 2
    args = random_inputs(B, 1000, 2, 128, V=64, HV=4, initial_state=True, seqlens=seqlens, seed=22)
    args["initial_state"] = args["initial_state"].to(state_dtype)
    # Stage 4 for every sequence: the decode kernel that takes a packed call's one-token sequences
    # reduces in another order per layout (tests/test_decode.py checks each layout against float64).
    tuning = Tuning(route_decodes=False)
    o, s = run_tuned(args, tuning)
    h0_t = args["initial_state"].transpose(-1, -2).contiguous()
    o_t, s_t = run_tuned({**args, "initial_state": h0_t, "state_v_first": True}, tuning)
    assert s_t.shape == (s.shape[0], 4, 64, 128) and s_t.dtype == torch.float32
    assert torch.equal(o_t, o) and torch.equal(s_t.transpose(-1, -2), s)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o_v, s_v = kda_forward(**{**args, "initial_state": h0_t}, state_v_first=True)   # the default call
    for out, state in (o, s), kda_forward(**args), (o_v, s_v.transpose(-1, -2)):
        assert rel_err(out, ref_o) <= ERROR_FLOOR and rel_err(state, ref_s) <= ERROR_FLOOR


@gpu
@pytest.mark.parametrize("call", [dict(), dict(gate="softplus", initial_state=True),
                                  dict(l2norm=True, beta_logits=True, state_v_first=True, initial_state=True)])
def test_forward_time_segments(call):
    """A lone sequence cut into time segments (stages 1–3 of the next on a side stream while stage 4
    runs this one; forced at a small shape with 128-token segments): one pass's numbers bit for bit
    (the state handed on is stage 4's fp32 state), a tail chunk in the last segment."""
    args = random_inputs(1, 1000, 2, 128, seed=41, **call)
    o, s = kda_forward(**args)
    assert plan_of(**args).segments == ((0, 1000),)
    tuning = Tuning(segment_tokens=128)
    launches = []
    record = lambda name, launcher, *a, **kw: launches.append(name) or launcher(*a, **kw)
    o_seg, s_seg = run_tuned(args, tuning, launch=record)
    segments = len(plan_of(**args, tuning=tuning).segments)
    assert segments > 1 and launches == ["gate", "intra", "wuso"] * segments
    assert torch.equal(o_seg, o) and torch.equal(s_seg, s)


@gpu
@pytest.mark.parametrize("segment_tokens", [None, 128])
def test_forward_captures_in_a_cuda_graph(segment_tokens):
    """kda_forward in a CUDA graph (it never waits on the device and allocates through torch): new
    inputs copied into the captured ones and one replay give the eager call's numbers, bit for bit.
    FlashKDA's call at a small shape, where launches are the cost; and cut
    into time segments, whose side stream the capture must fork and join."""
    forward = kda_forward if segment_tokens is None else lambda **a: run_tuned(a, Tuning(segment_tokens=segment_tokens))
    call = dict(l2norm=True, beta_logits=True, state_v_first=True, initial_state=True)
    static = random_inputs(1, 300, 2, 128, seed=31, **call)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward(**static)                      # JIT compiles and autotuning stay out of the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = forward(**static)
    new = random_inputs(1, 300, 2, 128, seed=32, **call)
    for name, x in new.items():
        if isinstance(x, torch.Tensor):
            static[name].copy_(x)
    graph.replay()
    o_eager, s_eager = forward(**new)
    assert torch.equal(o, o_eager) and torch.equal(s, s_eager)


@gpu
@pytest.mark.parametrize("lens", PACKED_LENS[::2])
def test_forward_packed_flashkda_configuration(lens):
    """FlashKDA's call on packed sequences (stage 2 hands β's residual and the q/k norms to stage 4 per token):
    within the accuracy floor of the float64 recurrence, and each sequence run alone gives the same numbers."""
    args = random_inputs(1, sum(lens), 4, 128, seqlens=lens, initial_state=True, l2norm=True, beta_logits=True,
                         state_v_first=True, seed=24)
    o, s = kda_forward(**args)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    assert rel_err(o, ref_o) <= ERROR_FLOOR and rel_err(s, ref_s) <= ERROR_FLOOR
    assert_each_alone(args, lens, o, s)


@gpu
def test_forward_flashkda_configuration_matches_fla():
    """FlashKDA's whole configuration at once (K = V = 128, safe gate, q/k l2norm and beta sigmoid in
    kernel, V-first states) against FLA given the same arguments, and as accurate."""
    args = random_inputs(1, 1000, 4, 128, l2norm=True, initial_state=True, seed=23)
    args.update(beta=4 * args["beta"] - 2, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                initial_state=args["initial_state"].transpose(-1, -2).contiguous())
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    o_fla, s_fla = fla_chunk_kda()(**args)
    assert rel_err(o, o_fla) < 1e-2 and rel_err(s, s_fla) < 1e-2
    assert rel_err(o, ref_o) <= rel_err(o_fla, ref_o) and rel_err(s, ref_s) <= rel_err(s_fla, ref_s)


@gpu
@pytest.mark.parametrize("gate", list(GATE_MODES))
@pytest.mark.parametrize("neg_eigval", [False, True])
@pytest.mark.parametrize("seqlens", [None, (300, 64, 1, 500, 135)])
def test_forward_ill_conditioned_chunks(gate, neg_eigval, seqlens):
    """Near-collinear keys in every chunk and β at its top (near 1; near 2 with allow_neg_eigval):
    o and the final state at most FLA's own error against the float64 recurrence (docs/DESIGN.md, Accuracy), and
    finite."""
    T = sum(seqlens) if seqlens else 1000
    args = ill_conditioned_inputs(1, T, 4, 128, gate=gate, neg_eigval=neg_eigval, seed=5, seqlens=seqlens)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    fla_o, fla_s = fla_chunk_kda()(**args)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    ours, fla = (rel_err(o, ref_o), rel_err(s, ref_s)), (rel_err(fla_o, ref_o), rel_err(fla_s, ref_s))
    assert ours[0] <= fla[0] and ours[1] <= fla[1], (ours, fla)


FP32_CALLS = {
    "safe": lambda: random_inputs(2, 1000, 4, 128, dtype=torch.float32, initial_state=True, seed=3),
    "softplus": lambda: random_inputs(2, 1000, 4, 128, gate="softplus", dtype=torch.float32, initial_state=True,
                                      seed=3),
    "packed, FlashKDA's options": lambda: random_inputs(1, 1000, 4, 128, seqlens=[130, 1, 600, 269], l2norm=True,
                                                        beta_logits=True, dtype=torch.float32, initial_state=True),
    "ill-conditioned safe": lambda: ill_conditioned_inputs(1, 640, 4, 128, gate="safe", seed=5, dtype=torch.float32),
    "ill-conditioned softplus": lambda: ill_conditioned_inputs(1, 640, 4, 128, gate="softplus", seed=5,
                                                               dtype=torch.float32),
}


@gpu
@pytest.mark.parametrize("call", list(FP32_CALLS))
def test_fp32_as_accurate_as_fla(call):
    """fp32 q, k, v (stage 4's products in tf32): o and the final state at most FLA's own fp32 error
    against the float64 recurrence, ill-conditioned chunks included (16-bit products would not be)."""
    args = FP32_CALLS[call]()
    ref_o, ref_s = reference_forward(**args, method="chunked")
    o, s = kda_forward(**args)
    fla_o, fla_s = fla_chunk_kda()(**args)
    ours, fla = (rel_err(o, ref_o), rel_err(s, ref_s)), (rel_err(fla_o, ref_o), rel_err(fla_s, ref_s))
    assert o.dtype == torch.float32 and ours[0] <= fla[0] and ours[1] <= fla[1], (ours, fla)


# ---- GPU: the plan's compiled kernels (kda_opt/launch) ----

@gpu
@pytest.mark.parametrize("call", ["default", "flashkda packed", "time segments"])
def test_compiled_launches_match_the_jit(call):
    """After a plan's first call its Triton kernels launch through their compiled handles: every
    Triton kernel of the call is in the table, and the numbers are the JIT's bit for bit (time
    segments: one gate and one intra handle serve segments of different lengths)."""
    from kda_opt import gate, intra, recurrence, seqs
    tuning = Tuning(segment_tokens=128) if call == "time segments" else Tuning()
    args = {"default": lambda: random_inputs(1, 1000, 4, 128, initial_state=True),
            "flashkda packed": lambda: random_inputs(1, 777, 4, 128, seqlens=[1, 63, 64, 65, 584], l2norm=True,
                                                     beta_logits=True, state_v_first=True, initial_state=True),
            "time segments": lambda: random_inputs(1, 1000, 2, 128, gate="softplus", initial_state=True)}[call]()
    plan = plan_of(**args, tuning=tuning)
    tensors = {n: args.get(n) for n in RUN_TENSORS}
    o_jit, s_jit = run(plan, **tensors)
    kernels = {}
    run(plan, **tensors, kernels=kernels)
    expected = {gate.gate_cumsum_kernel, intra.intra_chunk_kernel}
    if plan.packed:
        expected |= {seqs.chunk_offsets_kernel, seqs.chunk_indices_kernel, recurrence.decode_kernel}
    assert set(kernels) == expected
    o, s = run(plan, **tensors, kernels=kernels)
    assert torch.equal(o, o_jit) and torch.equal(s, s_jit)
    assert len(plan.segments) == (6 if call == "time segments" else 1)
