"""Stage 2 (intra-chunk Aqk, and Tm = (I + Akk)⁻¹ Diag(β)) against the reference stages, under the
interpreter or on the GPU.

The reference is fed exactly what the kernel reads: the same (rounded) q, k, β and the fp32 Γ in
log2 units, converted back to natural log in float64; its Tm is the float64 inverse of its Akk."""
import math
import warnings

import pytest
import torch

from kda_opt import reference as ref
from kda_opt.intra import intra_chunk
from kda_opt.options import CHUNK
from kda_opt.seqs import packed
from tests.conftest import INTERPRETED, gpu, kernel_device, rel_err
from tests.stage_inputs import qk_rstd, stage_inputs

C = CHUNK
# fp32 inputs' agreement with the reference fed the same inputs, or with the kernel itself on other
# inputs of the same matrices (norms applied beforehand). Under the interpreter tl.dot multiplies in
# fp32: ≈ 1e-7 (|Γ| ≲ 500 log2 units). On the GPU every product takes one tf32 pass (kda_opt/intra,
# "Precision"): each operand rounded to tf32's 10 fraction bits, within 2^-11 of itself, so an entry
# of a product is within 2 · 2^-11 ≈ 1e-3 of the exact one relative to its terms' sizes (independent
# roundings: ≈ 3e-4), and Tm's inverse adds its own tf32 products. FP32_FAR: Tm far from the identity
# (correlated keys), where the inverse amplifies the products' rounding: test_intra_gpu_inverse_far_from_
# identity's fp32 bound.
FP32 = 2e-6 if INTERPRETED else 2 * 2 ** -11
FP32_FAR = 2e-6 if INTERPRETED else 3e-3


def run(x, scale, **knobs):
    """The kernel's Aqk, Tm and the reference's. knobs: intra_chunk's keyword arguments; the gate
    counts as bounded where x's is (stage_inputs' "safe" gate: a = −5·sigmoid ≥ −5)."""
    knobs.setdefault("gate_bounded", x.get("bounded", False))
    Aqk, Tm = intra_chunk(x["q"], x["k"], x["gcum"], x["beta"], scale, **knobs)
    rAqk, rAkk = ref.intra_chunk(x["q"], x["k"], x["gcum"].double() * math.log(2.0), x["beta"], scale)
    assert Aqk.dtype == x["q"].dtype and Tm.dtype == x["k"].dtype
    assert Aqk.shape == Tm.shape == rAqk.shape
    return Aqk, Tm, rAqk, ref.solve(rAkk, x["beta"])


def with_gate(x, a):
    """x with its gate replaced by the log-decay a [B, T, HV, K] (float64), floored as stage 1 passes
    it on; bounded where a ≥ −5."""
    a = ref.floored(a)
    gamma = ref.chunk_cumsum(a)
    return {**x, "a": a, "gamma": gamma, "gcum": (gamma / math.log(2.0)).float(), "bounded": bool((a >= -5).all())}


def correlated(x, seed=0):
    """x with keys that share one direction and a slow decay (a ≥ −0.2): Akk's entries come near 1
    and its inverse is far from I − Akk."""
    B, T, H, K = x["k"].shape
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(K, generator=gen) + 0.3 * torch.randn(B, T, H, K, generator=gen), dim=-1)
    a = -0.2 * torch.sigmoid(torch.randn(*x["gcum"].shape, dtype=torch.float64, generator=gen))
    return with_gate({**x, "k": k.to(x["k"])}, a.to(x["gcum"].device))


def assert_structure(Aqk, Tm, beta, T, lens=None):
    """Exact zeros above the diagonal (so past a tail chunk's end too), in Aqk and Tm; β on Tm's
    diagonal (exactly in fp32; within one unit of the last place in 16 bits). lens: the lengths of
    sequences packed along T, each chunked from its own first token."""
    rows = (torch.arange(T) if lens is None else torch.cat([torch.arange(n) for n in lens])) % C
    cols = torch.arange(C)
    above = cols[None, :] > rows[:, None]
    per_token = lambda A: A.permute(0, 2, 1, 3).cpu()       # [B, HV, T, C]
    assert (per_token(Aqk)[:, :, above] == 0).all()
    assert (per_token(Tm)[:, :, above] == 0).all()
    diag = per_token(Tm)[:, :, cols[None, :] == rows[:, None]].float()
    beta = beta.float().permute(0, 2, 1).cpu()
    assert ((diag - beta).abs() <= torch.finfo(Tm.dtype).eps * beta).all()


def packed_gamma(x, lens):
    """cu_seqlens of `lens`, the (start, end) of each non-empty sequence, and Γ of x's log-decay
    restarted at each one's first token, as stage 1 writes it."""
    cu = torch.tensor([0, *lens]).cumsum(0)
    bounds = [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
    gcum = (torch.cat([ref.chunk_cumsum(x["a"][:, a:b]) for a, b in bounds], dim=1) / math.log(2.0)).float()
    return cu, bounds, gcum


def run_packed(x, lens, scale, l2norm=False):
    """Sequences of `lens` packed along x's T (B = 1), Γ restarted at each one's first token: the
    kernel's Aqk and Tm, and the reference's, sequence by sequence (q, k L2-normalised if asked; the
    norms the kernel writes then checked here)."""
    cu, bounds, gcum = packed_gamma(x, lens)
    q, k, beta = x["q"], x["k"], x["beta"]
    norms = torch.full((2, q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device) if l2norm else None
    Aqk, Tm = intra_chunk(q, k, gcum, beta, scale, gate_bounded=x["bounded"], l2norm=l2norm,
                          seqs=packed(cu.to(q.device), sum(lens)), qk_rstd=norms)
    if l2norm:
        assert rel_err(norms, qk_rstd(q, k)) < 1e-6
    rq, rk = (ref.l2norm(q), ref.l2norm(k)) if l2norm else (q, k)
    rAqk, rTm = [], []
    for a, b in bounds:
        A, Akk = ref.intra_chunk(rq[:, a:b], rk[:, a:b], gcum[:, a:b].double() * math.log(2.0), beta[:, a:b], scale)
        rAqk.append(A)
        rTm.append(ref.solve(Akk, beta[:, a:b]))
    return Aqk, Tm, torch.cat(rAqk, dim=1), torch.cat(rTm, dim=1)


@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("lens", [[1, 63, 64, 65, 130, 0, 7], [100, 28]])
@pytest.mark.parametrize("l2norm", [False, True])
def test_intra_packed_sequences(lens, gate, l2norm):
    """cu_seqlens: chunks start at each sequence's first token and never cross into the next; with
    l2norm, q and k rows are normalised as they are read (keys here are not unit-norm)."""
    x = stage_inputs(1, sum(lens), 1, 64, HV=2, gate=gate, device=kernel_device(), seed=len(lens))
    x["k"] = 3 * x["k"] + 0.1
    Aqk, Tm, rAqk, rTm = run_packed(x, lens, 0.125, l2norm)
    assert rel_err(Aqk, rAqk) < FP32
    assert rel_err(Tm, rTm) < FP32
    assert_structure(Aqk, Tm, x["beta"], sum(lens), lens)


def test_intra_skips_single_token_sequences():
    """A table without the one-token sequences (packed(skip_single=True), as a plan that routes them
    to kda_opt/decode builds it): their q/k norms are not written (NaN where the buffer starts as
    NaN), and every other row of Aqk, Tm and the norms is as with the whole table, bit for bit."""
    lens = [1, 63, 1, 65, 1, 3]
    x = stage_inputs(1, sum(lens), 1, 64, HV=2, gate="safe", device=kernel_device(), seed=4)
    cu, _, gcum = packed_gamma(x, lens)
    single = torch.tensor([n == 1 for n in lens for _ in range(n)])
    outs = []
    for skip in (False, True):
        norms = torch.full((2, 1, 1, sum(lens)), float("nan"), device=kernel_device())
        Aqk, Tm = intra_chunk(x["q"], x["k"], gcum, x["beta"], 0.125, gate_bounded=True, l2norm=True, seqs=packed(
            cu.to(kernel_device()), sum(lens), skip_single=skip), qk_rstd=norms)
        outs.append((Aqk[:, ~single], Tm[:, ~single], norms[..., ~single], norms[..., single]))
    (Aqk, Tm, rest, ones), (sAqk, sTm, s_rest, s_ones) = outs
    assert torch.equal(sAqk, Aqk) and torch.equal(sTm, Tm) and torch.equal(s_rest, rest)
    assert not ones.isnan().any() and s_ones.isnan().all()


def test_intra_l2norm():
    """l2norm over a fixed-length batch (grouped value heads): the same matrices as q and k
    normalised beforehand, and every token's norms written for stage 4 (or into a buffer of the
    launcher's own when none is given)."""
    x = stage_inputs(2, 130, 2, 64, HV=4, gate="softplus", device=kernel_device(), seed=11)
    x = {**x, "k": 2 * x["k"] - 0.3}
    norms = torch.full((2, 2, 2, 130), float("nan"), device=x["q"].device)
    Aqk, Tm = intra_chunk(x["q"], x["k"], x["gcum"], x["beta"], 0.125, l2norm=True, qk_rstd=norms)
    n = lambda t: ref.l2norm(t).float()
    Aqk_n, Tm_n = intra_chunk(n(x["q"]), n(x["k"]), x["gcum"], x["beta"], 0.125)
    assert rel_err(Aqk, Aqk_n) < FP32 and rel_err(Tm, Tm_n) < FP32
    assert rel_err(norms, qk_rstd(x["q"], x["k"])) < 1e-6
    Aqk_o, Tm_o = intra_chunk(x["q"], x["k"], x["gcum"], x["beta"], 0.125, l2norm=True)
    assert torch.equal(Aqk_o, Aqk) and torch.equal(Tm_o, Tm)


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_intra_beta_logits(scale):
    """beta given as logits (use_beta_sigmoid_in_kernel; 2·sigmoid with allow_neg_eigval): the same
    matrices as β = scale · sigmoid(beta) passed in."""
    x = stage_inputs(2, 130, 1, 64, HV=2, gate="softplus", device=kernel_device(), seed=13)
    logits = 4 * x["beta"] - 2
    Aqk, Tm = intra_chunk(x["q"], x["k"], x["gcum"], logits, 0.125, beta_sigmoid=scale)
    Aqk_b, Tm_b = intra_chunk(x["q"], x["k"], x["gcum"], scale * torch.sigmoid(logits), 0.125)
    assert rel_err(Aqk, Aqk_b) < 2e-6 and rel_err(Tm, Tm_b) < 2e-6


# bf16 inputs under the interpreter: its bf16 tl.dot returns garbage, which overflows in the inverse
# (numpy warns); only r, computed without products, is checked here.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("B,seqlens", [(2, None), (1, (1, 64, 0, 100))])
def test_intra_beta_residual(B, seqlens):
    """β that is not a number of Tm's dtype (fp32 β, bf16 Tm): every row's r = β − bf16(β) is written
    into the given [B, HV, T] buffer (NaN-filled first), per sequence as well. Checked as "β − r is a
    bf16 number within one unit of β", which holds for the GPU's rounding to nearest and the
    interpreter's truncation alike (Tm's store rounds the same way as r's)."""
    T = 165
    x = stage_inputs(B, T, 1, 64, HV=2, gate="softplus", dtype=torch.bfloat16, device=kernel_device(), seed=17)
    beta = torch.rand(B, T, 2, generator=torch.Generator().manual_seed(3)).to(kernel_device())
    seqs = None if seqlens is None else packed(torch.tensor([0, *seqlens]).cumsum(0).to(kernel_device()), T)
    r = torch.full((B, 2, T), float("nan"), device=beta.device)
    intra_chunk(x["q"], x["k"], x["gcum"], beta, 0.125, seqs=seqs, beta_residual=r)
    beta = beta.transpose(1, 2)
    rounded = beta - r
    ulp = torch.exp2(torch.floor(torch.log2(beta)) - 7)   # bf16: 8 significant bits
    assert torch.equal(rounded.bfloat16().float(), rounded) and bool((r.abs() < ulp).all())
    assert r.abs().max() > 0


@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("B,T,H,HV", [(1, 1, 1, 1), (2, 1, 1, 2), (2, 63, 1, 1), (1, 63, 2, 4), (1, 64, 1, 2),
                                      (2, 64, 2, 2), (1, 65, 2, 2), (2, 65, 1, 2), (1, 130, 1, 2), (2, 130, 2, 2)])
def test_intra_fp32(B, T, H, HV, gate):
    """safe: a = −5·sigmoid(x) ≥ −5; softplus: a = −4·softplus(3x), down to about −50 per token."""
    x = stage_inputs(B, T, H, 64, HV=HV, gate=gate, device=kernel_device(), seed=B * 1000 + T + H + HV)
    Aqk, Tm, rAqk, rTm = run(x, 0.125)
    assert rel_err(Aqk, rAqk) < FP32
    assert rel_err(Tm, rTm) < FP32
    assert_structure(Aqk, Tm, x["beta"], T)


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_intra_channel_slabs(gate):
    """K = 128: each row block's products, its diagonal block and its norms summed over two slabs of
    channels (module docstring, "Registers"), against the reference and, with l2norm, against q and k
    normalised beforehand."""
    x = stage_inputs(1, 130, 1, 128, HV=2, gate=gate, device=kernel_device(), seed=23)
    Aqk, Tm, rAqk, rTm = run(x, 128 ** -0.5)
    assert rel_err(Aqk, rAqk) < FP32 and rel_err(Tm, rTm) < FP32
    x = {**x, "k": 2 * x["k"] - 0.3}
    Aqk, Tm = intra_chunk(x["q"], x["k"], x["gcum"], x["beta"], 0.125, l2norm=True, gate_bounded=x["bounded"])
    n = lambda t: ref.l2norm(t).float()
    Aqk_n, Tm_n = intra_chunk(n(x["q"]), n(x["k"]), x["gcum"], x["beta"], 0.125, gate_bounded=x["bounded"])
    assert rel_err(Aqk, Aqk_n) < FP32 and rel_err(Tm, Tm_n) < FP32


@pytest.mark.parametrize("B,T,HV", [(1, 17, 1), (2, 64, 2), (1, 130, 2)])
def test_intra_inverse_far_from_identity(B, T, HV):
    """Keys sharing a direction and a slow decay: Akk entries up to ≈ 0.9, so every term of the
    block inverse and of the merges between blocks counts."""
    x = correlated(stage_inputs(B, T, 1, 64, HV=HV, gate="safe", device=kernel_device(), seed=T), seed=T)
    Aqk, Tm, rAqk, rTm = run(x, 0.125)
    assert rel_err(Aqk, rAqk) < FP32
    assert rel_err(Tm, rTm) < FP32_FAR
    below = torch.arange(C)[None, :] < (torch.arange(T) % C)[:, None]
    assert rTm.permute(0, 2, 1, 3)[:, :, below].abs().max() > 0.3   # off-diagonal terms that count
    assert_structure(Aqk, Tm, x["beta"], T)


@pytest.mark.parametrize("name,a", [
    ("a = -20 everywhere", lambda x: torch.full_like(x, -20.0)),
    ("a = -1000 everywhere (the floor)", lambda x: torch.full_like(x, -1000.0)),
    ("a = 0 or -60 per channel and token", lambda x: torch.where(x < 0, 0.0, -60.0)),
    ("a = 0 or -60 per token", lambda x: torch.where(x[..., :1] < 0, 0.0, -60.0).expand_as(x).clone()),
    ("softplus, down to about -150", lambda x: -8 * torch.nn.functional.softplus(4 * x)),
    ("-0.1, but -60 in the tokens of one 16-row block", lambda x: torch.where(
        (torch.arange(130) // 16 == 5)[None, :, None, None].to(x.device), -60.0, -0.1).expand_as(x).clone()),
    ("uniform in [-30, 0]", lambda x: -15 * (1 + torch.erf(x / 2 ** 0.5))),
])
def test_intra_unbounded_gate_exact(name, a):
    """Unbounded gates span up to 64·24 log2 units inside a chunk (stage 1's floor). No factor may
    overflow, not even in rows that are never stored (under the interpreter an overflowing exp2
    warns, and the warning fails the test), and every entry is exact. Only the products' entries
    above the diagonal, never used, may overflow (up to 2^168: module docstring, "Products")."""
    x = stage_inputs(1, 130, 1, 64, HV=2, gate="softplus", device=kernel_device(), seed=7)
    x = with_gate(x, a(torch.randn(1, 130, 2, 64, dtype=torch.float64,
                                   generator=torch.Generator().manual_seed(7)).to(kernel_device())))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        warnings.filterwarnings("ignore", "(overflow|invalid value) encountered in matmul", RuntimeWarning)
        Aqk, Tm, rAqk, rTm = run(x, 0.125)
    assert torch.isfinite(Aqk).all() and torch.isfinite(Tm).all()
    assert rel_err(Aqk, rAqk) < FP32
    assert rel_err(Tm, rTm) < FP32
    assert_structure(Aqk, Tm, x["beta"], 130)


@pytest.mark.parametrize("num_warps", [1, 4, 8])
def test_intra_num_warps(num_warps):
    """Other warp counts (scripts/bench_stages.py) compute the same matrices, the unbounded gate's
    diagonal blocks included."""
    x = stage_inputs(1, 130, 1, 64, HV=2, gate="softplus", device=kernel_device(), seed=7)
    x = with_gate(x, -8 * torch.nn.functional.softplus(
        4 * torch.randn(1, 130, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(7))).to(kernel_device()))
    Aqk, Tm, rAqk, rTm = run(x, 0.125, num_warps=num_warps)
    assert rel_err(Aqk, rAqk) < FP32 and rel_err(Tm, rTm) < FP32
    assert_structure(Aqk, Tm, x["beta"], 130)


@pytest.mark.parametrize("gate_bounded", [True, False])
@pytest.mark.parametrize("a_value", [0.0, -5.0])
def test_intra_safe_gate_at_its_bounds(a_value, gate_bounded):
    """safe_gate's products reference each sub-chunk half-way through its span: exact at a = 0 and at
    the bound a = −5 in every channel and token, in the bounded gate's products and the unbounded's."""
    x = stage_inputs(2, 100, 1, 64, HV=2, gate="safe", device=kernel_device(), seed=3)
    x = with_gate(x, torch.full((2, 100, 2, 64), a_value, dtype=torch.float64, device=kernel_device()))
    Aqk, Tm, rAqk, rTm = run(x, 0.125, gate_bounded=gate_bounded)
    assert rel_err(Aqk, rAqk) < FP32 and rel_err(Tm, rTm) < FP32
    assert_structure(Aqk, Tm, x["beta"], 100)


@gpu
@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [63, 1000])
@pytest.mark.parametrize("K", [64, 128])
def test_intra_gpu(T, K, dtype, gate):
    x = stage_inputs(2, T, 2, K, HV=4, gate=gate, dtype=dtype, device="cuda", seed=T + K)
    Aqk, Tm, rAqk, rTm = run(x, K ** -0.5)
    # tf32 products (≈ 3e-4 relative, emulated on the CPU) plus 16-bit storage (bf16: ≈ 3e-3).
    bound = {torch.bfloat16: 5e-3, torch.float16: 1e-3}[dtype]
    assert rel_err(Aqk, rAqk) < bound
    assert rel_err(Tm, rTm) < bound
    assert_structure(Aqk, Tm, x["beta"], T)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [65, 1000])
def test_intra_gpu_inverse_far_from_identity(T, dtype):
    x = correlated(stage_inputs(2, T, 2, 128, HV=4, gate="safe", dtype=dtype, device="cuda", seed=T), seed=T)
    Aqk, Tm, rAqk, rTm = run(x, 128 ** -0.5)
    # One tf32 pass (≈ 3e-4 relative per Akk entry), amplified by the inverse where the keys are
    # correlated, above fp16's storage rounding (≈ 3e-4); bf16's (≈ 3e-3) dominates.
    bound = {torch.bfloat16: 5e-3, torch.float16: 3e-3, torch.float32: 3e-3}[dtype]
    errors = (rel_err(Aqk, rAqk), rel_err(Tm, rTm))
    assert max(errors) < bound, errors
    assert_structure(Aqk, Tm, x["beta"], T)


@gpu
@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_intra_gpu_fp32(gate):
    x = stage_inputs(1, 1000, 2, 128, HV=4, gate=gate, device="cuda", seed=5)
    Aqk, Tm, rAqk, rTm = run(x, 128 ** -0.5)
    # fp32 inputs: one tf32 pass, as fp16's (≈ 3e-4 relative per Akk entry, amplified by the inverse).
    assert rel_err(Aqk, rAqk) < 3e-3 and rel_err(Tm, rTm) < 3e-3
    assert_structure(Aqk, Tm, x["beta"], 1000)


@gpu
@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("l2norm", [False, True])
def test_intra_gpu_packed(gate, l2norm):
    lens = [1, 63, 64, 65, 333, 0, 1000, 7]
    x = stage_inputs(1, sum(lens), 2, 128, HV=4, gate=gate, dtype=torch.bfloat16, device="cuda", seed=9)
    Aqk, Tm, rAqk, rTm = run_packed(x, lens, 128 ** -0.5, l2norm)
    assert rel_err(Aqk, rAqk) < 5e-3 and rel_err(Tm, rTm) < 5e-3
    assert_structure(Aqk, Tm, x["beta"], sum(lens), lens)
