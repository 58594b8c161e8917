"""Stages 2 and 3: the intra-chunk matrices and the inverse, one Triton program per chunk: Aqk, and
Tm = (I + Akk)⁻¹ Diag(β).

    Aqk[i,j] = scale · Σ_d q_i,d k_j,d 2^(Γ_i,d − Γ_j,d)   (i ≥ j in one chunk of 64)
    Akk[i,j] = β_i   · Σ_d k_i,d k_j,d 2^(Γ_i,d − Γ_j,d)   (i > j)
    Tm       = (I + Akk)⁻¹ Diag(β)
In: q, k [B, T, H, K] (bf16/fp16/fp32; L2-normalised per row here if asked); Γ [B, T, HV, K] fp32 in
log2 units; β [B, T, HV] (or its logits, the sigmoid taken here); value head hv reads q/k head
hv // (HV / H); Γ falls at most 24 per token (stage 1's floor) or, bounded, 5/ln 2. Out: Aqk
[B, T, HV, 64] in q's dtype, Tm [B, T, HV, 64] in k's dtype; row per token, column = position in its
chunk, zero above the diagonal and past a tail chunk's end. Chunks start at each sequence's first
token (kda_opt/seqs). Akk never leaves the registers.

Products. The chunk's rows are taken in four 16-row blocks R, each one product over its columns on
tensor cores through a reference exponent C: q_i 2^(Γ_i − C) · k_j 2^(C − Γ_j).
Bounded gates (the sigmoid gate with lower_bound in kda_opt/options' safe range [−5, 0): Γ falls
at most 5/ln 2 per token, and the launcher says so: gate_bounded): C = Γ_n − SHIFT, n the block's first row, for all its columns up
to its diagonal. The row factor is ≤ 2^SHIFT and, inside the diagonal block, the column factor ≤
2^(span − SHIFT) with span ≤ 15·5/ln 2 = 2·SHIFT; before n the column factor only shrinks (FLA
0.6.0's safe-gate sub-chunk reference).
Unbounded gates (any other; stage 1 floors the log-decay so that Γ falls at most 24 per token): the
columns before n take C = Γ_n (both factors ≤ 1 for any gate: a factor underflows only where the
true 2^(Γ_i − Γ_j) is smaller still; FLA's chunk_kda_fwd_kernel_inter_solve_fused), and the 16 × 16
diagonal block two more products (_diagonal_block): each 8-row half h referenced half-way through
its own span, C_h = (Γ_first + Γ_last) / 2 per channel, so that every factor lies within 2^±84
(a half spans at most 7·24 log2 units), and the second half's rows meet the first half's columns
through the second half's reference (column factors ≤ 1). The same work for every gate and every
decay rate: no data-dependent path (FLA computes these entries token by token instead).

Precision. bf16 inputs: the row-block products take bf16 operands, Aqk's q rows split as hi + lo
(two products: Aqk then carries only the column operand's rounding, not the q row's: docs/BENCHMARKING.md,
"Precision", gives both errors). fp16 inputs: one tf32 pass (fp16
stores Aqk 8× finer than bf16, and its range cannot hold the row factor). fp32 inputs: one tf32 pass
too (three passes, tf32x3, keep o nearer fp32, but the error against float64 with one pass is still
below FLA's fp32 call's on the same inputs, ill-conditioned chunks included: docs/DESIGN.md, "fp32
inputs"). Aqk's diagonal is a row sum in fp32 whatever the dtype. The inverse and its merges run in
tf32.

Inverse. Block forward substitution over the row blocks, as they are computed (FLA's solve_tril merges
16×16 inverses the same way): with A_Rm the 16×16 blocks of Akk and E_R the rows of I in block R,
    X_R = (I + A_RR)⁻¹ (E_R − Σ_{m<R} A_Rm X_m),
each (I + A_RR)⁻¹ itself by blocks of 4 and 8 (_inverse), every product on tensor cores; Tm's rows of
block R are X_R Diag(β).

β's residual. Tm's diagonal is β itself (X's diagonal is exactly 1), rounded once to Tm's dtype per
token and applied to every value column alike. Where β is not a number of that dtype (logits, fp32
beta; beta_residual given), the kernel also writes r = β − round(β) [B, HV, T] fp32, and stage 4
adds r ⊙ x to Tm x (kda_opt/wuso), so that the diagonal is exact. (Leaving β out of Tm and scaling
x's rows by it before their rounding instead is less accurate.)

Registers. A program holds a chunk (its Akk rows and the inverse's rows in registers), so how many
run on an SM is set by registers: a row block's products are summed over slabs of CHANNEL_SLAB
channels, so that its [64, K] column tiles are never all live, and a chunk takes NUM_WARPS warps:
several small programs per SM, not two large ones (docs/DESIGN.md, "Where the time goes").

Norms. With l2norm the kernel writes every token's 1 / sqrt(Σ x² + eps) for q and k, [2, B, H, T]
fp32: each row block scales its products by its rows' norms and its columns' (read back from there),
and stage 4 applies them instead of normalising again.
"""
import math

import torch
import triton
import triton.language as tl

from .launch import Kernels, triton_launch
from .options import CHUNK, L2NORM_EPS
from .seqs import Seqs, chunk_span, fixed

BT: tl.constexpr = tl.constexpr(CHUNK)
BC: tl.constexpr = tl.constexpr(CHUNK // 4)  # sub-chunk: rows in four blocks of 16, the diagonal in 16×16 blocks
SHIFT: tl.constexpr = tl.constexpr(0.5 * (CHUNK // 4 - 1) * 5.0 / math.log(2.0))
L2_EPS: tl.constexpr = tl.constexpr(L2NORM_EPS)
# Channels per slab and warps per chunk (module docstring, "Registers"): the fastest pair tried at the
# default shape in both calls and with the softplus gate, bf16 and fp16, K = 64 and 128; for fp32 inputs
# the faster of 4 and 8 warps (scripts/bench_stages.py --intra-warps).
CHANNEL_SLAB = 64
NUM_WARPS = 2
FP32_WARPS = 4


def warps_for(dtype: torch.dtype) -> int:
    """Stages 2+3's warps per chunk for q and k of this dtype."""
    return FP32_WARPS if dtype == torch.float32 else NUM_WARPS


@triton.jit
def _tile(p, o_t, m_t, o_k, STRIDE: tl.constexpr):
    """Whole rows o_t (tokens, STRIDE apart) × channels o_k of p as fp32, zero where not m_t."""
    return tl.load(p + o_t[:, None] * STRIDE + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)


@triton.jit
def _beta(beta, o_t, m_t, STRIDE: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """β of the rows o_t (tokens, STRIDE apart), zero where not m_t: as given, or BETA_SIGMOID ·
    sigmoid(beta) where beta holds logits (BETA_SIGMOID > 0: 1, or 2 for FLA's allow_neg_eigval)."""
    b = tl.load(beta + o_t * STRIDE, mask=m_t, other=0.0).to(tl.float32)
    if BETA_SIGMOID > 0:
        b = tl.where(m_t, BETA_SIGMOID * tl.sigmoid(b), 0.0)
    return b


@triton.jit
def _halves(x):
    """[M, 2N] → x[:, :N], x[:, N:]."""
    M: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1] // 2
    return tl.split(tl.permute(tl.reshape(x, [M, 2, N]), [0, 2, 1]))


@triton.jit
def _quarters(x):
    """[M, 4N] → its four [M, N] column blocks, left to right."""
    left, right = _halves(x)
    x0, x1 = _halves(left)
    x2, x3 = _halves(right)
    return x0, x1, x2, x3


@triton.jit
def _gamma_row(gcum, t, n, T, o_k, HV: tl.constexpr, K: tl.constexpr):
    """Γ of channels o_k at row min(t, T − 1) of the block starting at n; zeros if the block starts past T."""
    return tl.load(gcum + tl.minimum(t, T - 1) * (HV * K) + o_k, mask=n + 0 * o_k < T, other=0.0)


@triton.jit
def _products(b_qr, b_kr, b_cols, SPLIT_BF16: tl.constexpr, PREC: tl.constexpr):
    """(q ⊙ row factor)(k ⊙ column factor)ᵀ for Aqk and for Akk: b_qr, b_kr [M, K] fp32 rows,
    b_cols [K, N] fp32 columns (module docstring, "Precision")."""
    if SPLIT_BF16:
        # bf16 operands: twice tf32's tensor-core rate and half its staged bytes. Akk's rows and
        # columns are rounded once (Tm's error stays near 1e-5); Aqk's rows are split as hi + lo, so
        # that only the columns' rounding reaches Aqk.
        b_c = b_cols.to(tl.bfloat16)
        b_qh = b_qr.to(tl.bfloat16)
        b_Aqk = tl.dot(b_qh, b_c, tl.dot((b_qr - b_qh.to(tl.float32)).to(tl.bfloat16), b_c))
        b_Akk = tl.dot(b_kr.to(tl.bfloat16), b_c)
    else:
        b_Aqk = tl.dot(b_qr, b_cols, input_precision=PREC)
        b_Akk = tl.dot(b_kr, b_cols, input_precision=PREC)
    return b_Aqk, b_Akk


@triton.jit
def _diagonal_block(b_q, b_k, b_g, g_n, g_a_last, g_b_first, g_b_last, m_t, SPLIT_BF16: tl.constexpr,
                    PREC: tl.constexpr):
    """An unbounded gate's diagonal block of one row block over one slab of channels (module
    docstring, "Products"): Aqk's and Akk's [BC, BC] products on and below the diagonal (no scale or
    β; zero above it), and the row factor 2^(Γ_i − Γ_n) [BC, KS] of the columns before the block.
    b_q, b_k, b_g [BC, KS] fp32: the block's rows; g_n … g_b_last [KS]: Γ at the first and last rows
    of its halves (clamped to T − 1)."""
    HALF: tl.constexpr = BC // 2
    o_i = tl.arange(0, BC)
    first_half = (o_i < HALF)[:, None]
    c_a = 0.5 * (g_n + g_a_last)
    c_b = 0.5 * (g_b_first + g_b_last)
    b_C = tl.where(first_half, c_a[None, :], c_b[None, :])                          # [BC, K]
    b_rf = tl.exp2(tl.where(m_t[:, None], b_g - b_C, -float("inf")))                 # ≤ 2^84
    b_kc = b_k * tl.exp2(tl.where(m_t[:, None], b_C - b_g, -float("inf")))           # ≤ 2^84
    b_qr = b_q * b_rf
    b_kr = b_k * b_rf
    # Columns of the first half referenced to the second half's C: 2^(C_b − Γ_j) ≤ 1. One exp2 of
    # its own: as 2^(C_a − Γ_j) · 2^(C_b − C_a), the second factor underflows (down to 2^−192) where
    # the entry is of order 1.
    b_cross = b_k * tl.exp2(tl.where(first_half & m_t[:, None], c_b[None, :] - b_g, -float("inf")))
    b_Dqk, b_Dkk = _products(b_qr, b_kr, tl.trans(b_kc), SPLIT_BF16, PREC)
    b_Xqk, b_Xkk = _products(b_qr, b_kr, tl.trans(b_cross), SPLIT_BF16, PREC)
    half_i = o_i // HALF
    # Above the diagonal the products overflow (up to 2^168): zeroed here, as the slabs' sums add them.
    same = (half_i[:, None] == half_i[None, :]) & (o_i[None, :] <= o_i[:, None])
    cross = (half_i[:, None] == 1) & (half_i[None, :] == 0)
    b_Dqk = tl.where(same, b_Dqk, tl.where(cross, b_Xqk, 0.0))
    b_Dkk = tl.where(same, b_Dkk, tl.where(cross, b_Xkk, 0.0))
    # 2^(Γ_i − Γ_n) = 2^(Γ_i − C_h) 2^(C_h − Γ_n): no more exp2 over the tile. Where the second
    # factor underflows, the true value is below 2^(84 − 126): the columns before n, whose factors
    # are ≤ 1, cannot lift it.
    b_rn = b_rf * tl.where(first_half, tl.exp2(c_a - g_n)[None, :], tl.exp2(c_b - g_n)[None, :])
    return b_Dqk, b_Dkk, b_rn


@triton.jit
def _row_block(q, k, gcum, beta, Aqk, rstd, rstd_plane, t0, T, scale, SQ: tl.constexpr, SK: tl.constexpr,
               SB: tl.constexpr, R: tl.constexpr, BTC: tl.constexpr,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, UNBOUNDED: tl.constexpr,
               DOT_PRECISION: tl.constexpr, SPLIT_BF16: tl.constexpr, L2NORM: tl.constexpr,
               BETA_SIGMOID: tl.constexpr):
    """Row block R of the chunk at t0 against its first BTC columns: BTC ≥ 16(R + 1), or for an
    unbounded gate BTC ≥ 16R (R > 0), the columns before its diagonal block. Stores the block's Aqk
    rows (whole rows, zero past its diagonal) and, if L2NORM, its rows' q and k norms (rstd[0],
    rstd[rstd_plane]); returns its Akk rows [BC, BTC] (β applied, zero on and above the diagonal)
    and, for an unbounded gate, its diagonal block [BC, BC] apart (the [BC, BTC] rows then hold
    zeros there). A block starting past T is all zero. SQ, SK, SB: q's, k's and beta's token strides.
    The products are sums over slabs of KS channels (module docstring, "Registers")."""
    n = t0 + R * BC                                   # the block's first row
    o_i = tl.arange(0, BC)
    o_t = n + o_i
    m_t = o_t < T
    o_j = tl.arange(0, BTC)
    if UNBOUNDED:
        m_c = (o_j < R * BC) & (t0 + o_j < T) & (n + 0 * o_j < T)         # the columns before n
    else:
        m_c = (o_j < R * BC + BC) & (t0 + o_j < T) & (n + 0 * o_j < T)    # columns up to the diagonal
    b_Aqk = tl.zeros([BC, BTC], dtype=tl.float32)
    b_Akk = tl.zeros([BC, BTC], dtype=tl.float32)
    b_Dqk = tl.zeros([BC, BC], dtype=tl.float32)
    b_Dkk = tl.zeros([BC, BC], dtype=tl.float32)
    b_qk = tl.zeros([BC], dtype=tl.float32)          # Aqk's diagonal
    b_qq = tl.zeros([BC], dtype=tl.float32)          # Σ q², Σ k² (L2NORM)
    b_kk = tl.zeros([BC], dtype=tl.float32)
    # One slab at a time, not software-pipelined: a prefetched slab's registers cost more than the
    # latency they would hide.
    for c0 in tl.range(0, K, KS, num_stages=1):
        o_k = c0 + tl.arange(0, KS)
        b_q = _tile(q, o_t, m_t, o_k, SQ)                                    # [BC, KS]
        b_k = _tile(k, o_t, m_t, o_k, SK)
        b_g = _tile(gcum, o_t, m_t, o_k, HV * K)
        g_n = _gamma_row(gcum, n, n, T, o_k, HV, K)
        # Exponents are masked before exp2 (rows and columns past T load Γ = 0, where 2^(C − 0) could
        # overflow), so that no factor is inf or NaN, not even in rows that are never stored.
        if UNBOUNDED:
            b_dqk, b_dkk, b_rn = _diagonal_block(
                b_q, b_k, b_g, g_n, _gamma_row(gcum, n + BC // 2 - 1, n, T, o_k, HV, K),
                _gamma_row(gcum, n + BC // 2, n, T, o_k, HV, K), _gamma_row(gcum, n + BC - 1, n, T, o_k, HV, K),
                m_t, SPLIT_BF16, DOT_PRECISION)
            b_Dqk += b_dqk
            b_Dkk += b_dkk
            b_c = g_n                                 # the columns before n
        else:
            b_c = g_n - SHIFT                         # columns up to the block's diagonal
            b_rn = tl.exp2(tl.where(m_t[:, None], b_g - b_c[None, :], -float("inf")))
        if R > 0 or not UNBOUNDED:                    # (R = 0, unbounded: no columns before the block)
            b_kct = tl.trans(_tile(k, t0 + o_j, m_c, o_k, SK))                # [KS, BTC]
            b_gc = _tile(gcum, t0 + o_j, m_c, o_k, HV * K)                   # [BTC, KS]
            b_kc = b_kct * tl.exp2(tl.where(m_c[None, :], b_c[:, None] - tl.trans(b_gc), -float("inf")))
            b_aqk, b_akk = _products(b_q * b_rn, b_k * b_rn, b_kc, SPLIT_BF16, DOT_PRECISION)
            b_Aqk += b_aqk
            b_Akk += b_akk
        b_qk += tl.sum(b_q * b_k, axis=1)
        if L2NORM:
            b_qq += tl.sum(b_q * b_q, axis=1)
            b_kk += tl.sum(b_k * b_k, axis=1)
    if L2NORM:
        # Normalising is a row and column scale of the products, applied to them (fewer operations
        # than scaling the [BTC, K] column tile): FLA's l2norm, 1 / sqrt(Σ x² + eps). The block's
        # rows' norms are stored for stage 4 (every value head of a GVA group stores the same
        # numbers); the columns are rows of this and earlier blocks, their norms read back (the
        # barrier makes this block's stores visible).
        b_rq = tl.rsqrt(b_qq + L2_EPS)
        b_rk = tl.rsqrt(b_kk + L2_EPS)
        tl.store(rstd + o_t, b_rq, mask=m_t)
        tl.store(rstd + rstd_plane + o_t, b_rk, mask=m_t)
        tl.debug_barrier()
        b_rc = tl.load(rstd + rstd_plane + t0 + o_j, mask=m_c, other=0.0)[None, :]
        b_Aqk = b_Aqk * b_rq[:, None] * b_rc
        b_Akk = b_Akk * b_rk[:, None] * b_rc
        b_qk = b_qk * b_rq * b_rk
        if UNBOUNDED:
            b_rd = tl.load(rstd + rstd_plane + o_t, mask=m_t, other=0.0)[None, :]
            b_Dqk = b_Dqk * b_rq[:, None] * b_rd
            b_Dkk = b_Dkk * b_rk[:, None] * b_rd

    # The triangles zeroed, the row scales applied (scale for Aqk, β for Akk). Aqk's diagonal, where
    # the decay is 1, is a plain row sum in fp32: with 16-bit product operands it would carry the
    # column rounding in full, and at T = 1 it is the whole output.
    o_r = o_i + R * BC
    b_beta = _beta(beta, o_t, m_t, SB, BETA_SIGMOID)
    p_qk = Aqk + o_t[:, None] * (HV * BT)
    if UNBOUNDED:
        b_Dqk = tl.where(o_i[None, :] == o_i[:, None], b_qk[:, None], b_Dqk)
        b_Dqk = tl.where(o_i[None, :] <= o_i[:, None], b_Dqk, 0.0) * scale
        tl.store(p_qk + R * BC + o_i[None, :], b_Dqk.to(Aqk.dtype.element_ty), mask=m_t[:, None])
        b_D = tl.where(o_i[None, :] < o_i[:, None], b_Dkk, 0.0) * b_beta[:, None]
        if R > 0:  # R = 0: its BTC columns are its diagonal block
            m_diag = (o_j >= R * BC) & (o_j < R * BC + BC)
            tl.store(p_qk + o_j[None, :], (b_Aqk * scale).to(Aqk.dtype.element_ty),
                     mask=m_t[:, None] & ~m_diag[None, :])
    else:
        b_Aqk = tl.where(o_j[None, :] == o_r[:, None], b_qk[:, None], b_Aqk)
        b_Aqk = tl.where(o_j[None, :] <= o_r[:, None], b_Aqk, 0.0) * scale
        tl.store(p_qk + o_j[None, :], b_Aqk.to(Aqk.dtype.element_ty), mask=m_t[:, None])
        b_D = tl.zeros([BC, BC], dtype=tl.float32)
    for c0 in tl.static_range(BTC, BT, BTC):        # the zeros past the diagonal block
        tl.store(p_qk + c0 + o_j[None, :], tl.zeros([BC, BTC], dtype=Aqk.dtype.element_ty),
                 mask=m_t[:, None] & (c0 + o_j >= R * BC + BC)[None, :])
    b_Akk = tl.where(o_j[None, :] < o_r[:, None], b_Akk, 0.0) * b_beta[:, None]
    return b_Akk, b_D


@triton.jit
def _diagonal(b_Arr, b_D, UNBOUNDED: tl.constexpr):
    """The diagonal block of a row block: from its product, or computed apart (unbounded gate)."""
    if UNBOUNDED:
        b_Arr = b_D
    return b_Arr


@triton.jit
def _inverse(A, PREC: tl.constexpr):
    """(I + A)⁻¹ for A [16, 16] strictly lower, by blocks: the 4 × 4 diagonal blocks D inverted as
    (I − D)(I + D²) (exact: D⁴ = 0), then merged into 8 × 8 and 16 × 16 blocks as (I + D + O)⁻¹ =
    (I − X O) X, X = (I + D)⁻¹ block diagonal, O the lower off-diagonal block (X O squares to zero).
    Every intermediate is a product of true inverse blocks, bounded where the inverse is. (The
    series (I − A)(I + A²)(I + A⁴)(I + A⁸) is not: its terms cancel, and in tf32 it loses the inverse
    of near-collinear keys with β near 2: 0.3 relative error, emulated.)"""
    o = tl.arange(0, A.shape[0])
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    D = tl.where(o[:, None] // 4 == o[None, :] // 4, A, 0.0)
    X = tl.dot(eye - D, eye + tl.dot(D, D, input_precision=PREC), input_precision=PREC)
    O = tl.where((o[:, None] // 8 == o[None, :] // 8) & (o[:, None] // 4 != o[None, :] // 4), A, 0.0)
    X = tl.dot(eye - tl.dot(X, O, input_precision=PREC), X, input_precision=PREC)
    O = tl.where(o[:, None] // 8 != o[None, :] // 8, A, 0.0)
    return tl.dot(eye - tl.dot(X, O, input_precision=PREC), X, input_precision=PREC)


@triton.jit
def _solve_rows(Tm, t0, R: tl.constexpr, T, b_Arr, b_Y, b_beta, HV: tl.constexpr, PREC: tl.constexpr):
    """X_R = (I + A_RR)⁻¹ (E_R − Y), the rows of block R of (I + Akk)⁻¹ given Y = Σ_{m<R} A_Rm X_m
    [BC, BT]; stores X_R Diag(β) as Tm's rows and returns X_R."""
    o_i = tl.arange(0, BC)
    o_j = tl.arange(0, BT)
    b_E = tl.where(o_j[None, :] == o_i[:, None] + R * BC, 1.0, 0.0)
    b_X = tl.dot(_inverse(b_Arr, PREC), b_E - b_Y, input_precision=PREC)
    o_t = t0 + R * BC + o_i
    tl.store(Tm + o_t[:, None] * (HV * BT) + o_j[None, :], (b_X * b_beta[None, :]).to(Tm.dtype.element_ty),
             mask=(o_t < T)[:, None])
    return b_X


@triton.jit(do_not_specialize=["T"])
def intra_chunk_kernel(
    q, k, gcum, beta, Aqk, Tm,        # [B,T,H,K] ×2, [B,T,HV,K], [B,T,HV], [B,T,HV,BT] ×2
    Rb, Rstd,                         # [B,HV,T] fp32 β's residual (BETA_RESIDUAL), [2,B,H,T] fp32 norms (L2NORM), or None
    cu_seqlens, chunk_indices,        # packed sequences (kda_opt/seqs), or None
    T, scale,
    SQ: tl.constexpr, SK: tl.constexpr, SB: tl.constexpr,  # q's, k's and beta's token strides (views)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, UNBOUNDED: tl.constexpr,
    SPLIT_BF16: tl.constexpr, PACKED: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    BETA_RESIDUAL: tl.constexpr, KS: tl.constexpr,
):
    # FLA 0.6.0 computes these matrices in three kernels (diagonal blocks, off-diagonal blocks fused
    # with the solve, then the inverse's merges); here one program holds a chunk's Akk in registers,
    # one 16-row block at a time, the columns of the first two blocks cut to 16 and 32. Heads run
    # fastest: programs running together read neighbouring heads of the same tokens.
    i_bh, i_t = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    T_all = T
    bos, T, i_t = chunk_span(i_b, i_t, T, cu_seqlens, chunk_indices, PACKED)
    t0 = i_t * BT
    if PACKED:
        if t0 >= T:  # a spare slot
            return
    tok = bos - i_b * T_all                    # the sequence's first token in its batch entry
    q += bos * SQ + i_h * K
    k += bos * SK + i_h * K
    gcum += (bos * HV + i_hv) * K
    beta += bos * SB + i_hv
    Aqk += (bos * HV + i_hv) * BT
    Tm += (bos * HV + i_hv) * BT
    o_c = t0 + tl.arange(0, BT)
    b_beta = _beta(beta, o_c, o_c < T, SB, BETA_SIGMOID)
    if BETA_RESIDUAL:
        b_round = b_beta.to(Tm.dtype.element_ty).to(tl.float32)
        tl.store(Rb + (i_b * HV + i_hv) * T_all + tok + o_c, b_beta - b_round, mask=o_c < T)
    rstd_plane = 0
    if L2NORM:
        Rstd += (i_b * H + i_h) * T_all + tok
        rstd_plane = tl.num_programs(0).to(tl.int64) // HV * H * T_all     # B·H·T: q's norms, then k's
    P: tl.constexpr = "tf32"          # every product's operands (module docstring, "Precision")
    # The row blocks R = 0..3 against their first BTC columns (_row_block); an unbounded gate's
    # blocks 1 and 2 need only the columns before their diagonal blocks.
    # Rows past T have zero Akk rows: identity rows of the inverse, never stored, never reached. A
    # block whose rows all lie past T would store nothing: the program ends before it (a short
    # sequence's chunk then costs its valid rows' share of the work; a tail chunk's too).
    A0, D = _row_block(q, k, gcum, beta, Aqk, Rstd, rstd_plane, t0, T, scale, SQ, SK, SB, 0, BC,
                       H, HV, K, KS, UNBOUNDED, P, SPLIT_BF16, L2NORM, BETA_SIGMOID)
    X0 = _solve_rows(Tm, t0, 0, T, _diagonal(A0, D, UNBOUNDED), tl.zeros([BC, BT], dtype=tl.float32), b_beta, HV, P)
    if t0 + BC >= T:
        return
    A1, D = _row_block(q, k, gcum, beta, Aqk, Rstd, rstd_plane, t0, T, scale, SQ, SK, SB, 1,
                       BC if UNBOUNDED else 2 * BC,
                       H, HV, K, KS, UNBOUNDED, P, SPLIT_BF16, L2NORM, BETA_SIGMOID)
    if UNBOUNDED:
        A10, A11 = A1, D
    else:
        A10, A11 = _halves(A1)
    X1 = _solve_rows(Tm, t0, 1, T, A11, tl.dot(A10, X0, input_precision=P), b_beta, HV, P)
    if t0 + 2 * BC >= T:
        return
    A2, D = _row_block(q, k, gcum, beta, Aqk, Rstd, rstd_plane, t0, T, scale, SQ, SK, SB, 2,
                       2 * BC if UNBOUNDED else BT,
                       H, HV, K, KS, UNBOUNDED, P, SPLIT_BF16, L2NORM, BETA_SIGMOID)
    if UNBOUNDED:
        A20, A21 = _halves(A2)
        A22 = D
    else:
        A20, A21, A22, _ = _quarters(A2)
    b_Y = tl.dot(A21, X1, tl.dot(A20, X0, input_precision=P), input_precision=P)
    X2 = _solve_rows(Tm, t0, 2, T, A22, b_Y, b_beta, HV, P)
    if t0 + 3 * BC >= T:
        return
    A3, D = _row_block(q, k, gcum, beta, Aqk, Rstd, rstd_plane, t0, T, scale, SQ, SK, SB, 3, BT,
                       H, HV, K, KS, UNBOUNDED, P, SPLIT_BF16, L2NORM, BETA_SIGMOID)
    A30, A31, A32, A33 = _quarters(A3)
    b_Y = tl.dot(A32, X2, tl.dot(A31, X1, tl.dot(A30, X0, input_precision=P), input_precision=P),
                 input_precision=P)
    _solve_rows(Tm, t0, 3, T, _diagonal(A33, D, UNBOUNDED), b_Y, b_beta, HV, P)


def intra_chunk(q, k, gcum, beta, scale: float, *, gate_bounded: bool = False, seqs: Seqs | None = None,
                l2norm: bool = False, beta_sigmoid: float | None = None, beta_residual: torch.Tensor | None = None,
                qk_rstd: torch.Tensor | None = None, num_warps: int | None = None, out=None,
                kernels: Kernels | None = None):
    """Aqk [B, T, HV, C] (q's dtype) and Tm [B, T, HV, C] (k's dtype) of every chunk (C = CHUNK).
    gate_bounded: every log-decay a ≥ −5 (Γ falls at most 5/ln 2 per token in log2 units), so one
    product per row block serves its diagonal too; otherwise Γ must fall at most 24 per token, as
    stage 1's floor makes it (module docstring, "Products"). seqs: the sequence layout (kda_opt/seqs;
    None is B sequences of T tokens). l2norm: q and k rows L2-normalised as they are read.
    beta_sigmoid: beta holds logits and β = beta_sigmoid · sigmoid(beta) (None: beta is β).
    beta_residual: a [B, HV, T] fp32 tensor that receives β − β rounded to Tm's dtype (module
    docstring). qk_rstd: with l2norm, a [2, B, H, T] fp32 tensor that receives q's and k's
    1 / sqrt(Σ x² + eps) per token (None: a buffer of the launcher's own). num_warps: the kernel's
    warps (None: warps_for(q.dtype); kda_opt/plan.Tuning). out: (Aqk, Tm)'s storage, contiguous
    tensors of their shapes and dtypes (None: new ones). Rows of no chunk in seqs are left
    unwritten. kernels: the plan's compiled kernels (kda_opt/launch), or None."""
    B, T, H, K = q.shape
    HV = gcum.shape[2]
    seqs = seqs or fixed(T)
    if out is None:
        out = (torch.empty(B, T, HV, CHUNK, dtype=q.dtype, device=q.device),
               torch.empty(B, T, HV, CHUNK, dtype=k.dtype, device=q.device))
    Aqk, Tm = out
    if l2norm and qk_rstd is None:
        qk_rstd = torch.empty(2, B, H, T, dtype=torch.float32, device=q.device)
    # intra_chunk_kernel's parameters in order (by name they cost the launch a dict).
    triton_launch(
        intra_chunk_kernel, (B * HV, seqs.chunk_slots), kernels,
        q, k, gcum, beta, Aqk, Tm, beta_residual, qk_rstd if l2norm else None, seqs.cu_seqlens, seqs.chunk_indices,
        T, scale, q.stride(1), k.stride(1), beta.stride(1), H, HV, K, not gate_bounded, q.dtype == torch.bfloat16,
        seqs.packed, l2norm, float(beta_sigmoid or 0.0), beta_residual is not None, min(CHANNEL_SLAB, K),
        num_warps=num_warps or warps_for(q.dtype),
    )
    return Aqk, Tm
