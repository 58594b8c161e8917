"""Stage 3: Tm = (I + Akk)⁻¹ · Diag(β) for every chunk, one Triton program per chunk and value head.

L = I + Akk is unit lower-triangular (64×64, Akk strictly lower). Its four 16×16 diagonal blocks are
inverted by forward substitution, X_rr = (I + A_rr)⁻¹; the blocks below follow by block forward
substitution, X_rc = −X_rr · Σ_{c ≤ m < r} A_rm X_mc; then Tm_rc = X_rc · Diag(β_c). All in fp32.
In: Akk [B, T, HV, 64] fp32, β [B, T, HV]. Out: Tm [B, T, HV, 64] in the requested dtype (row per
token, column = position in its chunk; zero above the diagonal and past the end of a tail chunk).
Akk and Tm move as whole 64-column rows (256 B of fp32 in, 128 B of bf16 out per row), cut into and
assembled from their 16×16 blocks in registers: on H100 0.30 ms against 0.34 with a load and a store
per block (NOTES.md).
"""
import torch
import triton
import triton.language as tl

from .intra import BC  # the 64×64 inverse is assembled from 16×16 blocks
# Two warps per chunk: the substitution's row reductions stay (mostly) in shuffles; on sm_90 this
# compiles to 168 registers without spills for a 16-bit Tm (4 warps: 192, and 0.57 ms on H100
# against 0.30).
NUM_WARPS = 2


@triton.jit
def _rows(p, o_t, m_t, STRIDE: tl.constexpr, BT: tl.constexpr):
    """The whole rows o_t of a chunk matrix [len(o_t), BT], zero for rows past T."""
    o_c = tl.arange(0, BT)
    return tl.load(p + o_t[:, None] * STRIDE + o_c[None, :], mask=m_t[:, None], other=0.0)


@triton.jit
def _halves(x):
    """[M, 2N] → x[:, :N], x[:, N:]."""
    M: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1] // 2
    return tl.split(tl.permute(tl.reshape(x, [M, 2, N]), [0, 2, 1]))


@triton.jit
def _cat(a, b):
    """[M, N], [M, N] → [M, 2N] = [a | b]."""
    M: tl.constexpr = a.shape[0]
    N: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), [0, 2, 1]), [M, 2 * N])


@triton.jit
def _quarters(x):
    """[M, 4N] → its four [M, N] column blocks, left to right."""
    left, right = _halves(x)
    x0, x1 = _halves(left)
    x2, x3 = _halves(right)
    return x0, x1, x2, x3


@triton.jit
def _substitute_step(Akk, X, t, T, c: tl.constexpr, i: tl.constexpr, STRIDE: tl.constexpr,
                     BC: tl.constexpr):
    """Row i of Y = (I + A)⁻¹ − I for the diagonal block A at column block c, given Y's rows < i in X:
    y_i = −a_i − Σ_{j<i} a_ij y_j, with row i of A (token t) read back from memory."""
    o_i = tl.arange(0, BC)
    # (t + 0·o_i: a per-element mask; Triton 3.9's interpreter rejects one mixed with a scalar.)
    b_a = -tl.load(Akk + t * STRIDE + c * BC + o_i, mask=(o_i < i) & (t + 0 * o_i < T), other=0.0)
    b_a += tl.sum(b_a[:, None] * X, 0)
    return tl.where((o_i == i)[:, None], b_a[None, :], X)


@triton.jit
def _store_rows(Tm, o_t, m_t, X0, X1, X2, X3, b_beta, STRIDE: tl.constexpr, BT: tl.constexpr):
    """[X0 | X1 | X2 | X3] · Diag(b_beta) as the whole rows o_t of Tm."""
    o_c = tl.arange(0, BT)
    b_x = _cat(_cat(X0, X1), _cat(X2, X3)) * b_beta[None, :]
    tl.store(Tm + o_t[:, None] * STRIDE + o_c[None, :], b_x.to(Tm.dtype.element_ty), mask=m_t[:, None])


@triton.jit(do_not_specialize=["T"])
def solve_kernel(
    Akk, beta, Tm,                  # [B,T,HV,BT] fp32, [B,T,HV], [B,T,HV,BT]
    T,
    HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # FLA 0.6.0's solve_tril (and the solve half of chunk_kda_fwd_kernel_inter_solve_fused):
    # forward substitution inside 16×16 blocks, block formulas between them.
    # Heads run fastest: programs running together read neighbouring heads of the same tokens.
    i_bh, i_t = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    bos, t0 = i_b * T, i_t * BT
    Akk += (bos * HV + i_hv) * BT
    Tm += (bos * HV + i_hv) * BT
    beta += bos * HV + i_hv
    o_i = tl.arange(0, BC)
    o_t0, o_t1, o_t2, o_t3 = t0 + o_i, t0 + BC + o_i, t0 + 2 * BC + o_i, t0 + 3 * BC + o_i
    m_t0, m_t1, m_t2, m_t3 = o_t0 < T, o_t1 < T, o_t2 < T, o_t3 < T
    STRIDE: tl.constexpr = HV * BT

    # Rows past T load as zero, so they invert to identity rows and never reach a valid row.
    A00, _, _, _ = _quarters(_rows(Akk, o_t0, m_t0, STRIDE, BT))
    A10, A11, _, _ = _quarters(_rows(Akk, o_t1, m_t1, STRIDE, BT))
    A20, A21, A22, _ = _quarters(_rows(Akk, o_t2, m_t2, STRIDE, BT))
    A30, A31, A32, A33 = _quarters(_rows(Akk, o_t3, m_t3, STRIDE, BT))
    m_low = o_i[:, None] > o_i[None, :]
    X00 = -tl.where(m_low, A00, 0.0)
    X11 = -tl.where(m_low, A11, 0.0)
    X22 = -tl.where(m_low, A22, 0.0)
    X33 = -tl.where(m_low, A33, 0.0)
    # Rows 0 and 1 of −A are already those of (I + A)⁻¹ − I; the four chains run side by side.
    for i in tl.static_range(2, BC):
        X00 = _substitute_step(Akk, X00, t0 + i, T, 0, i, STRIDE, BC)
        X11 = _substitute_step(Akk, X11, t0 + BC + i, T, 1, i, STRIDE, BC)
        X22 = _substitute_step(Akk, X22, t0 + 2 * BC + i, T, 2, i, STRIDE, BC)
        X33 = _substitute_step(Akk, X33, t0 + 3 * BC + i, T, 3, i, STRIDE, BC)
    b_eye = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    X00, X11, X22, X33 = X00 + b_eye, X11 + b_eye, X22 + b_eye, X33 + b_eye

    X10 = -tl.dot(X11, tl.dot(A10, X00, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    X21 = -tl.dot(X22, tl.dot(A21, X11, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    X32 = -tl.dot(X33, tl.dot(A32, X22, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    b_Y = tl.dot(A21, X10, tl.dot(A20, X00, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    X20 = -tl.dot(X22, b_Y, input_precision=DOT_PRECISION)
    b_Y = tl.dot(A32, X21, tl.dot(A31, X11, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    X31 = -tl.dot(X33, b_Y, input_precision=DOT_PRECISION)
    b_Y = tl.dot(A30, X00, tl.dot(A31, X10, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    b_Y = tl.dot(A32, X20, b_Y, input_precision=DOT_PRECISION)
    X30 = -tl.dot(X33, b_Y, input_precision=DOT_PRECISION)

    o_c = t0 + tl.arange(0, BT)
    b_beta = tl.load(beta + o_c * HV, mask=o_c < T, other=0.0).to(tl.float32)
    b_0 = tl.zeros([BC, BC], dtype=tl.float32)
    _store_rows(Tm, o_t0, m_t0, X00, b_0, b_0, b_0, b_beta, STRIDE, BT)
    _store_rows(Tm, o_t1, m_t1, X10, X11, b_0, b_0, b_beta, STRIDE, BT)
    _store_rows(Tm, o_t2, m_t2, X20, X21, X22, b_0, b_beta, STRIDE, BT)
    _store_rows(Tm, o_t3, m_t3, X30, X31, X32, X33, b_beta, STRIDE, BT)


def solve(Akk, beta, out_dtype: torch.dtype, *, num_warps: int = NUM_WARPS):
    """Tm [B, T, HV, C] = (I + Akk)⁻¹ Diag(β) per chunk (C = 64, from Akk's last dimension), in out_dtype.
    num_warps is a tuning knob (scripts/bench_stages.py)."""
    B, T, HV, C = Akk.shape
    if C != 4 * BC:
        raise ValueError(f"solve inverts chunks of {4 * BC}, got Akk {list(Akk.shape)}")
    Tm = torch.empty(B, T, HV, C, dtype=out_dtype, device=Akk.device)
    solve_kernel[(B * HV, triton.cdiv(T, C))](
        Akk, beta, Tm, T, HV=HV, BT=C, BC=BC,
        # Block products in one tf32 pass where Tm is stored in 16 bits (as FLA's), three (≈ fp32)
        # where it is stored in fp32. (The interpreter ignores this and multiplies in fp32.)
        DOT_PRECISION="tf32x3" if out_dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    return Tm
