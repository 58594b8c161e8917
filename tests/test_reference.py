"""Tier (a): the float64 reference — chunked form == recurrence, and agreement with FLA's naive code."""
import math

import pytest
import torch

from kda_opt import reference as ref
from tests.conftest import rel_err

GATE_MODES = ["sigmoid", "sigmoid_no_A", "softplus", "preactivated"]


def make_inputs(B, T, H, K, V, gate_mode, HV=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    HV = HV or H
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = randn(B, T, H, K), randn(B, T, H, K)
    # Unit-norm keys keep the delta rule contractive, as in the models that use it.
    k = k / k.norm(dim=-1, keepdim=True)
    v, g = randn(B, T, HV, V), randn(B, T, HV, K)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    A_log, dt_bias = randn(HV) * 0.5, randn(HV * K) * 0.5
    if gate_mode == "sigmoid":
        a = ref.activate_gate(g, A_log, dt_bias, lower_bound=-5.0)
    elif gate_mode == "sigmoid_no_A":
        a = ref.activate_gate(g, None, dt_bias, lower_bound=-5.0)
    elif gate_mode == "softplus":
        a = ref.activate_gate(g, A_log, dt_bias)
    else:
        a = -torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64)
    return q, k, v, a, beta


def test_gate_activation_formulas():
    g = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    A_log, dt_bias = torch.randn(3, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    x = g + dt_bias.view(3, 4)
    rate = A_log.exp().view(3, 1)
    torch.testing.assert_close(ref.activate_gate(g, A_log, dt_bias, -5.0), -5.0 / (1 + (-rate * x).exp()))
    torch.testing.assert_close(ref.activate_gate(g, None, dt_bias, -3.0), -3.0 / (1 + (-x).exp()))
    torch.testing.assert_close(ref.activate_gate(g, A_log, dt_bias), -rate * torch.log1p(x.exp()))
    with pytest.raises(ValueError):
        ref.activate_gate(g)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("gate_mode", GATE_MODES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(T, gate_mode, with_state):
    B, H, K, V = 2, 2, 16, 8
    q, k, v, a, beta = make_inputs(B, T, H, K, V, gate_mode, HV=2 * H, seed=T)
    h0 = torch.randn(B, 2 * H, K, V, dtype=torch.float64) if with_state else None
    o_rec, s_rec = ref.recurrent_kda(q, k, v, a, beta, initial_state=h0)
    o_chk, s_chk = ref.chunked_kda(q, k, v, a, beta, initial_state=h0)
    assert rel_err(o_chk, o_rec) < 1e-10
    assert rel_err(s_chk, s_rec) < 1e-10


def test_recurrence_by_hand():
    """One token, one head, K = V = 1: o = scale · q · β k v, state = β k v (from S0 = 0)."""
    q, k, v, beta, a = torch.tensor([2.0, 0.5, 3.0, 0.25, -0.7], dtype=torch.float64)
    view = lambda x: x.view(1, 1, 1, 1)
    o, S = ref.recurrent_kda(view(q), view(k), view(v), view(a), beta.view(1, 1, 1), scale=1.0)
    assert math.isclose(S.item(), 0.25 * 0.5 * 3.0)
    assert math.isclose(o.item(), 2.0 * 0.25 * 0.5 * 3.0)
    # With a state, decay applies first and the delta rule writes only the error.
    o, S = ref.recurrent_kda(view(q), view(k), view(v), view(a), beta.view(1, 1, 1),
                             scale=1.0, initial_state=torch.full((1, 1, 1, 1), 4.0, dtype=torch.float64))
    s_dec = 4.0 * math.exp(-0.7)
    assert math.isclose(S.item(), s_dec + 0.25 * 0.5 * (3.0 - 0.5 * s_dec))


def test_stage_shapes_and_structure():
    T, C = 70, 64
    q, k, v, a, beta = make_inputs(1, T, 2, 16, 8, "sigmoid")
    gamma = ref.chunk_cumsum(a, C)
    assert torch.allclose(gamma[:, C - 1], a[:, :C].sum(1)) and torch.allclose(gamma[:, C], a[:, C])
    Aqk, Akk = ref.intra_chunk(q, k, gamma, beta, 0.25, C)
    Tm = ref.solve(Akk, beta, C)
    assert Aqk.shape == Akk.shape == Tm.shape == (1, T, 2, C)
    rows = torch.arange(T) % C
    cols = torch.arange(C)
    upper = cols[None, :] > rows[:, None]
    diag = cols[None, :] == rows[:, None]
    per_head = lambda x: x.permute(0, 2, 1, 3)  # [B, HV, T, C]: the mask then indexes (T, C)
    assert (per_head(Akk)[:, :, upper | diag] == 0).all()
    assert (per_head(Aqk)[:, :, upper] == 0).all() and (per_head(Tm)[:, :, upper] == 0).all()
    assert (per_head(Aqk)[:, :, diag] != 0).all()
    # Tail chunk holds 6 tokens: columns 6.. are padding and must be zero.
    assert (Akk[:, C:, :, 6:] == 0).all() and (Tm[:, C:, :, 6:] == 0).all()
    # (I + Akk) Tm = Diag(β) on every chunk.
    for n0, n1 in [(0, C), (C, T)]:
        L = n1 - n0
        lhs = (torch.eye(L, dtype=torch.float64) + Akk[0, n0:n1, :, :L].movedim(1, 0)) @ Tm[0, n0:n1, :, :L].movedim(1, 0)
        torch.testing.assert_close(lhs, torch.diag_embed(beta[0, n0:n1].T))


@pytest.mark.parametrize("T", [1, 65])
def test_agrees_with_fla_naive(T):
    naive = pytest.importorskip("fla.ops.kda.naive")
    B, H, K, V = 2, 2, 16, 8
    q, k, v, a, beta = make_inputs(B, T, H, K, V, "softplus", HV=2 * H, seed=1)
    h0 = torch.randn(B, 2 * H, K, V, dtype=torch.float64)
    o, S = ref.recurrent_kda(q, k, v, a, beta, scale=0.3, initial_state=h0)
    # FLA's naive recurrence computes in float32: agreement to float32 rounding.
    o_fla, S_fla = naive.naive_recurrent_kda(q, k, v, a, beta, scale=0.3, initial_state=h0,
                                             output_final_state=True)
    assert rel_err(o_fla, o) < 1e-5
    assert rel_err(S_fla, S) < 1e-5


def test_reference_forward_methods_agree():
    from inputs import random_inputs
    args = random_inputs(2, 70, 2, 16, HV=4, gate="softplus", dtype=torch.float32, device="cpu", initial_state=True)
    o_r, s_r = ref.reference_forward(**args)
    o_c, s_c = ref.reference_forward(**args, method="chunked")
    assert rel_err(o_c, o_r) < 1e-10 and rel_err(s_c, s_r) < 1e-10


def test_packed_sequences_equal_a_batch():
    """cu_seqlens over N sequences of one length gives what a batch of N gives: o, and each state."""
    from inputs import random_inputs
    batch = random_inputs(3, 70, 2, 16, HV=4, gate="softplus", dtype=torch.float32, device="cpu", initial_state=True)
    flat = lambda x: x.reshape(1, -1, *x.shape[2:])
    cu = torch.tensor([0, 70, 140, 210])
    packed = {**batch, **{n: flat(batch[n]) for n in ("q", "k", "v", "g", "beta")}, "cu_seqlens": cu}
    for method in ("recurrent", "chunked"):
        o_b, s_b = ref.reference_forward(**batch, method=method)
        o_p, s_p = ref.reference_forward(**packed, method=method)
        assert rel_err(o_p, flat(o_b)) < 1e-12 and rel_err(s_p, s_b) < 1e-12


def test_packed_empty_sequence_passes_its_state_through():
    from inputs import random_inputs
    args = random_inputs(1, 9, 1, 16, dtype=torch.float32, device="cpu", seqlens=[4, 0, 5], initial_state=True)
    o, s = ref.reference_forward(**args)
    assert o.shape[1] == 9 and torch.equal(s[1], args["initial_state"][1].double())


@pytest.mark.parametrize("cut", [1, 63, 64, 65, 100])
def test_chunked_form_continues_across_a_cut(cut):
    """The chunked form cut anywhere, the first part's final state starting the second, is the
    recurrence over the whole: what kda_forward's continuation tests rely on."""
    q, k, v, a, beta = make_inputs(1, 130, 2, 16, 8, "sigmoid", seed=cut)
    o, S = ref.recurrent_kda(q, k, v, a, beta)
    part = lambda x, s: x[:, s]
    o1, S1 = ref.chunked_kda(*(part(x, slice(0, cut)) for x in (q, k, v, a, beta)))
    o2, S2 = ref.chunked_kda(*(part(x, slice(cut, None)) for x in (q, k, v, a, beta)), initial_state=S1)
    assert rel_err(torch.cat([o1, o2], dim=1), o) < 1e-10 and rel_err(S2, S) < 1e-10


def test_l2norm_in_kernel_is_normalising_before():
    from inputs import random_inputs
    args = random_inputs(1, 20, 2, 16, dtype=torch.float32, device="cpu", l2norm=True)
    o, _ = ref.reference_forward(**args)
    normed = {**args, "use_qk_l2norm_in_kernel": False,
              **{n: args[n] / (args[n].double().square().sum(-1, keepdim=True) + 1e-6).sqrt() for n in ("q", "k")}}
    assert rel_err(ref.reference_forward(**normed)[0], o) < 1e-12
    assert rel_err(ref.reference_forward(**{**args, "use_qk_l2norm_in_kernel": False})[0], o) > 1e-2


@pytest.mark.parametrize("neg_eigval", [False, True])
def test_beta_logits_and_state_layout(neg_eigval):
    """use_beta_sigmoid_in_kernel / allow_neg_eigval: β = (1 or 2)·sigmoid(beta); state_v_first: the
    states transposed, [N, HV, V, K], on the way in and out."""
    from inputs import random_inputs
    args = random_inputs(2, 30, 2, 16, V=8, dtype=torch.float32, device="cpu", initial_state=True)
    o, s = ref.reference_forward(**args)
    logits = torch.logit(args["beta"].double() / (2.0 if neg_eigval else 1.0))
    o2, s2 = ref.reference_forward(**{**args, "beta": logits, "initial_state": args["initial_state"].transpose(-1, -2)},
                                   use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval, state_v_first=True)
    assert s2.shape == (2, 2, 8, 16)
    assert rel_err(o2, o) < 1e-12 and rel_err(s2.transpose(-1, -2), s) < 1e-12
