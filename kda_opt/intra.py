"""Stage 2: the intra-chunk matrices, one Triton program per chunk: Aqk, and Tm = (I + Akk)⁻¹ Diag(β).

    Aqk[i,j] = scale · Σ_d q_i,d k_j,d 2^(Γ_i,d − Γ_j,d)   (i ≥ j in one chunk of 64)
    Akk[i,j] = β_i   · Σ_d k_i,d k_j,d 2^(Γ_i,d − Γ_j,d)   (i > j)
    Tm       = (I + Akk)⁻¹ Diag(β)
In: q, k [B, T, H, K] (bf16/fp16/fp32; L2-normalised per row here if asked); Γ [B, T, HV, K] fp32 in
log2 units; β [B, T, HV] (or its logits, the sigmoid taken here); value head hv reads q/k head
hv // (HV / H). Out: Aqk [B, T, HV, 64] in q's dtype, Tm [B, T, HV, 64] in k's dtype; row per token,
column = position in its chunk, zero above the diagonal and past a tail chunk's end. Chunks start at
each sequence's first token (kda_opt/seqs). Akk never leaves the registers.

Products. The chunk's rows are taken in four 16-row blocks R, each one product over its columns on
tensor cores through a reference exponent C: q_i 2^(Γ_i − C) · k_j 2^(C − Γ_j). With C = Γ_n − SHIFT
(n the block's first row) the row factor is ≤ 2^SHIFT and, inside the diagonal block, the column factor
≤ 2^(span − SHIFT), span = max_d (Γ_n,d − Γ_last,d) over the block's rows: both far inside fp32's range
while span ≤ 2·SHIFT, and before n the column factor only shrinks (FLA 0.6.0's safe-gate sub-chunk
reference). A gate a ≥ −5 per token bounds span by 15·5/ln 2 = 2·SHIFT: the sigmoid gate with
lower_bound ∈ [−5, 0] always fits, and the launcher says so (gate_bounded). For any other gate the
kernel checks every block. A block that does not fit takes C = Γ_n and only the columns before n (both
factors ≤ 1 for any gate; a factor underflows only where the true 2^(Γ_i − Γ_j) is smaller still; FLA's
chunk_kda_fwd_kernel_inter_solve_fused), and its diagonal block is computed exactly apart, by a
kernel that runs first (diagonal_exact_kernel, _diagonal_exact).

Precision. bf16 inputs: the row-block products take bf16 operands, Aqk's q rows split as hi + lo
(two products: Aqk then carries only the column operand's rounding, 1.7e-3 relative before its
bf16 store, against 2.4e-3 with one rounded q; emulated in float64). fp16 inputs: one tf32 pass (fp16
stores Aqk 8× finer than bf16, and its range cannot hold the row factor). fp32 inputs: three tf32
passes. Aqk's diagonal is a row sum in fp32 whatever the dtype. The inverse and its merges run in
tf32 (three passes for fp32 inputs).

Inverse. Block forward substitution over the row blocks, as they are computed (FLA's solve_tril merges
16×16 inverses the same way): with A_Rm the 16×16 blocks of Akk and E_R the rows of I in block R,
    X_R = (I + A_RR)⁻¹ (E_R − Σ_{m<R} A_Rm X_m),   (I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸)
(A strictly lower, so A¹⁶ = 0), every product on tensor cores; Tm's rows of block R are X_R Diag(β).

β's residual. Tm's diagonal is β itself (X's diagonal is exactly 1), rounded once to Tm's dtype per
token and applied to every value column alike. Where β is not a number of that dtype (logits, fp32
beta; beta_residual given), the kernel also writes r = β − round(β) [B, HV, T] fp32, and stage 4
adds r ⊙ x to Tm x (kda_opt/wuso), so that the diagonal is exact. (Leaving β out of Tm and scaling
x's rows by it before their rounding instead measured less accurate: NOTES.md, ninth session.)

Norms. With l2norm the kernel writes every token's 1 / sqrt(Σ x² + eps) for q and k, [2, B, H, T]
fp32: each row block scales its products by its rows' norms and its columns' (read back from there),
and stage 4 applies them instead of normalising again.
"""
import math

import torch
import triton
import triton.language as tl

from .options import L2NORM_EPS
from .seqs import Seqs, chunk_span, fixed

BC = 16  # sub-chunk: rows are computed in blocks of 16, the diagonal in 16×16 blocks
# Warps per chunk, measured on H100 at the default shape (NOTES.md); and per 16-row block of the
# exact diagonal path.
NUM_WARPS = 4
EXACT_NUM_WARPS = 2
SHIFT = 0.5 * (BC - 1) * 5.0 / math.log(2.0)
L2_EPS: tl.constexpr = tl.constexpr(L2NORM_EPS)


@triton.jit
def _tile(p, o_t, m_t, o_k, STRIDE: tl.constexpr):
    """Whole rows o_t (tokens, STRIDE apart) × channels o_k of p as fp32, zero where not m_t."""
    return tl.load(p + o_t[:, None] * STRIDE + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)


@triton.jit
def _rstd(x):
    """1 / sqrt(Σ x² + eps) per row of x [M, K]: FLA's l2norm (use_qk_l2norm_in_kernel)."""
    return tl.rsqrt(tl.sum(x * x, axis=1) + L2_EPS)


@triton.jit
def _beta(beta, o_t, m_t, HV: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """β of the rows o_t, zero where not m_t: as given, or BETA_SIGMOID · sigmoid(beta) where beta
    holds logits (BETA_SIGMOID > 0: 1, or 2 for FLA's allow_neg_eigval)."""
    b = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
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
def _span_fits(gcum, n, T, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, SHIFT: tl.constexpr):
    """1 if the diagonal block of the rows n.. n+BC−1 spans at most 2·SHIFT (log2 units) in every
    channel (or starts past T), else 0."""
    last = tl.minimum(n + BC - 1, T - 1)
    o_k = tl.arange(0, K)
    m = n + 0 * o_k < T
    b_first = tl.load(gcum + n * (HV * K) + o_k, mask=m, other=0.0)
    b_last = tl.load(gcum + last * (HV * K) + o_k, mask=m, other=0.0)
    return (tl.max(b_first - b_last, axis=0) <= 2 * SHIFT).to(tl.int32)


@triton.jit
def _diagonal_exact(q, k, gcum, o_t, m_t, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                    BC: tl.constexpr, EXACT_PRECISION: tl.constexpr, L2NORM: tl.constexpr):
    """The diagonal block of rows o_t for an unbounded gate: [BC, BC] for q (diagonal included) and
    k (strictly lower). No single reference row serves a whole diagonal block. FLA computes these
    entries token by token (chunk_kda_fwd_kernel_intra_token_parallel); here the block is split
    recursively instead: at level h ∈ {8, 4, 2, 1}, rows in the upper half of each group of 2h meet
    columns in its lower half through the group's middle row m (j < m ≤ i), the off-diagonal
    factorisation with both factors ≤ 1, as one product on tensor cores. Every i > j belongs to
    exactly one level (the highest bit where i and j differ); the diagonal, where the decay is 1,
    is a plain row sum. BC channels per step: a product needs K ≥ 16."""
    o_i = tl.arange(0, BC)
    b_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
    b_Akk = tl.zeros([BC, BC], dtype=tl.float32)
    if L2NORM:
        b_rq = _rstd(_tile(q, o_t, m_t, tl.arange(0, K), H * K))
        b_rk = _rstd(_tile(k, o_t, m_t, tl.arange(0, K), H * K))
    for k0 in range(0, K, BC):
        o_k = k0 + tl.arange(0, BC)
        b_q = _tile(q, o_t, m_t, o_k, H * K)
        b_k = _tile(k, o_t, m_t, o_k, H * K)
        if L2NORM:
            b_q = b_q * b_rq[:, None]
            b_k = b_k * b_rk[:, None]
        b_g = _tile(gcum, o_t, m_t, o_k, HV * K)
        for LVL in tl.static_range(0, 4):
            GROUP = BC >> LVL
            HALF = GROUP // 2
            o_m = o_t - o_i % GROUP + HALF          # the middle row of each row's group
            m_up = o_i % GROUP >= HALF
            m_m = o_m < T
            b_gm = _tile(gcum, o_m, m_m, o_k, HV * K)
            b_rf = tl.exp2(tl.where((m_up & m_t)[:, None], b_g - b_gm, -float("inf")))
            b_kt = tl.trans(b_k * tl.exp2(tl.where((~m_up & m_m)[:, None], b_gm - b_g, -float("inf"))))
            m_lvl = (o_i[:, None] // GROUP == o_i[None, :] // GROUP) & m_up[:, None] & ~m_up[None, :]
            b_Aqk += tl.where(m_lvl, tl.dot(b_q * b_rf, b_kt, input_precision=EXACT_PRECISION), 0.0)
            b_Akk += tl.where(m_lvl, tl.dot(b_k * b_rf, b_kt, input_precision=EXACT_PRECISION), 0.0)
        b_Aqk += tl.where(o_i[:, None] == o_i[None, :], tl.sum(b_q * b_k, axis=1)[:, None], 0.0)
    return b_Aqk, b_Akk


@triton.jit(do_not_specialize=["T"])
def diagonal_exact_kernel(
    q, k, gcum, Aqk, Dkk,           # [B,T,H,K] ×2, [B,T,HV,K], [B,T,HV,BT], [B,T,HV,BC]
    cu_seqlens, chunk_indices,       # packed sequences (kda_opt/seqs)
    T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    SHIFT: tl.constexpr, EXACT_PRECISION: tl.constexpr, PACKED: tl.constexpr, L2NORM: tl.constexpr,
):
    # For an unbounded gate, before intra_chunk_kernel: one program per 16-row block; a block whose
    # diagonal does not fit gets it exactly, Aqk's in place (scale applied) and Akk's (without β)
    # in Dkk. Kept apart so that the rarely taken exact path costs the main kernel no registers.
    i_bhr, i_t = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_bh, R = i_bhr // (BT // BC), i_bhr % (BT // BC)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, T, i_t = chunk_span(i_b, i_t, T, cu_seqlens, chunk_indices, PACKED)
    n = i_t * BT + R * BC
    if n < T:
        gcum += (bos * HV + i_hv) * K
        if _span_fits(gcum, n, T, HV, K, BC, SHIFT) == 0:
            o_i = tl.arange(0, BC)
            o_t = n + o_i
            m_t = o_t < T
            b_Dqk, b_Dkk = _diagonal_exact(q + (bos * H + i_h) * K, k + (bos * H + i_h) * K, gcum, o_t,
                                           m_t, T, H, HV, K, BC, EXACT_PRECISION, L2NORM)
            p_qk = Aqk + (bos * HV + i_hv) * BT + o_t[:, None] * (HV * BT) + R * BC + o_i[None, :]
            tl.store(p_qk, (b_Dqk * scale).to(Aqk.dtype.element_ty), mask=m_t[:, None])
            tl.store(Dkk + (bos * HV + i_hv) * BC + o_t[:, None] * (HV * BC) + o_i[None, :], b_Dkk,
                     mask=m_t[:, None])


@triton.jit
def _row_block(q, k, gcum, beta, Aqk, Dkk, rstd, rstd_plane, t0, R: tl.constexpr, T, scale,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               BTC: tl.constexpr, SHIFT: tl.constexpr, CHECK_SPAN: tl.constexpr,
               DOT_PRECISION: tl.constexpr, SPLIT_BF16: tl.constexpr, L2NORM: tl.constexpr,
               BETA_SIGMOID: tl.constexpr):
    """Row block R of the chunk at t0 against its first BTC ≥ 16(R + 1) columns. Stores the block's
    Aqk rows (whole rows, zero past BTC, the diagonal block left to diagonal_exact_kernel where it
    did not fit) and, if L2NORM, its rows' q and k norms (rstd[0], rstd[rstd_plane]); returns its
    Akk rows [BC, BTC] (β applied, zero on and above the diagonal), whether its diagonal block came
    from the product (fits), and if not the exact one from Dkk [BC, BC]. A block starting past T is
    all zero."""
    n = t0 + R * BC                                   # the block's first row
    o_i = tl.arange(0, BC)
    o_t = n + o_i
    m_t = o_t < T
    o_j = tl.arange(0, BTC)
    o_k = tl.arange(0, K)
    fits = _span_fits(gcum, n, T, HV, K, BC, SHIFT) if CHECK_SPAN else 1
    # Columns up to the block's diagonal block (before it where the diagonal is computed apart).
    m_c = (o_j < R * BC + BC * fits) & (t0 + o_j < T) & (n + 0 * o_j < T)
    b_kct = tl.trans(_tile(k, t0 + o_j, m_c, o_k, H * K))                # [K, BTC]
    b_gc = _tile(gcum, t0 + o_j, m_c, o_k, HV * K)                       # [BTC, K]
    b_q = _tile(q, o_t, m_t, o_k, H * K)                                 # [BC, K]
    b_k = _tile(k, o_t, m_t, o_k, H * K)
    b_g = _tile(gcum, o_t, m_t, o_k, HV * K)
    b_c = tl.load(gcum + n * (HV * K) + o_k, mask=n + 0 * o_k < T, other=0.0) - SHIFT * fits
    # Exponents are masked before exp2 (rows and columns past T load Γ = 0, where 2^(C − 0) could
    # overflow), so that no inf or NaN arises even in entries that are never stored.
    b_rf = tl.exp2(tl.where(m_t[:, None], b_g - b_c[None, :], -float("inf")))
    b_kc = b_kct * tl.exp2(tl.where(m_c[None, :], b_c[:, None] - tl.trans(b_gc), -float("inf")))
    b_qr = b_q * b_rf                                                    # [BC, K]
    b_kr = b_k * b_rf
    if SPLIT_BF16:
        # bf16 operands: twice tf32's tensor-core rate and half its staged bytes. Akk's rows and
        # columns are rounded once (Tm's error stays near 1e-5); Aqk's rows are split as hi + lo, so
        # that only the columns' rounding reaches Aqk (module docstring, "Precision").
        b_kc = b_kc.to(tl.bfloat16)
        b_qh = b_qr.to(tl.bfloat16)
        b_Aqk = tl.dot(b_qh, b_kc, tl.dot((b_qr - b_qh.to(tl.float32)).to(tl.bfloat16), b_kc))
        b_Akk = tl.dot(b_kr.to(tl.bfloat16), b_kc)
    else:
        b_Aqk = tl.dot(b_qr, b_kc, input_precision=DOT_PRECISION)
        b_Akk = tl.dot(b_kr, b_kc, input_precision=DOT_PRECISION)
    b_qk = tl.sum(b_q * b_k, axis=1)                 # Aqk's diagonal
    if L2NORM:
        # Normalising is a row and column scale of the products, applied to them (fewer operations
        # than scaling the [BTC, K] column tile: NOTES.md, eleventh session). The block's rows' norms
        # are stored for stage 4 (every value head of a GVA group stores the same numbers); the
        # columns are rows of this and earlier blocks, their norms read back (the barrier makes this
        # block's stores visible).
        b_rq = _rstd(b_q)
        b_rk = _rstd(b_k)
        tl.store(rstd + o_t, b_rq, mask=m_t)
        tl.store(rstd + rstd_plane + o_t, b_rk, mask=m_t)
        tl.debug_barrier()
        b_rc = tl.load(rstd + rstd_plane + t0 + o_j, mask=m_c, other=0.0)[None, :]
        b_Aqk = b_Aqk * b_rq[:, None] * b_rc
        b_Akk = b_Akk * b_rk[:, None] * b_rc
        b_qk = b_qk * b_rq * b_rk

    # The triangles zeroed, the row scales applied (scale for Aqk, β for Akk); a diagonal block that
    # did not fit was stored by diagonal_exact_kernel, and its Akk part is read back from Dkk.
    o_r = R * BC + o_i
    b_beta = _beta(beta, o_t, m_t, HV, BETA_SIGMOID)
    p_qk = Aqk + o_t[:, None] * (HV * BT)
    m_diag = (o_j >= R * BC) & (o_j < R * BC + BC) & (fits + 0 * o_j == 0)
    # Aqk's diagonal, where the decay is 1, is a plain row sum in fp32: with 16-bit product operands
    # it would carry the column rounding in full, and at T = 1 it is the whole output.
    b_Aqk = tl.where(o_j[None, :] == o_r[:, None], b_qk[:, None], b_Aqk)
    b_Aqk = tl.where(o_j[None, :] <= o_r[:, None], b_Aqk, 0.0) * scale
    tl.store(p_qk + o_j[None, :], b_Aqk.to(Aqk.dtype.element_ty), mask=m_t[:, None] & ~m_diag[None, :])
    for c0 in tl.static_range(BTC, BT, BTC):
        tl.store(p_qk + c0 + o_j[None, :], tl.zeros([BC, BTC], dtype=Aqk.dtype.element_ty), mask=m_t[:, None])
    b_Akk = tl.where(o_j[None, :] < o_r[:, None], b_Akk, 0.0) * b_beta[:, None]
    b_D = tl.zeros([BC, BC], dtype=tl.float32)
    if CHECK_SPAN:
        if fits == 0:
            b_D = _tile(Dkk, o_t, m_t, o_i, HV * BC) * b_beta[:, None]
    return b_Akk, fits, b_D


@triton.jit
def _diagonal(b_Arr, fits, b_D, CHECK_SPAN: tl.constexpr):
    """The diagonal block of a row block: the product's, or the exact one where it did not fit."""
    if CHECK_SPAN:
        b_Arr = tl.where(fits != 0, b_Arr, b_D)
    return b_Arr


@triton.jit
def _inverse(A, PREC: tl.constexpr):
    """(I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸) for A [16, 16] strictly lower."""
    o = tl.arange(0, A.shape[0])
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    A2 = tl.dot(A, A, input_precision=PREC)
    A4 = tl.dot(A2, A2, input_precision=PREC)
    X = tl.dot(eye - A, eye + A2, input_precision=PREC)
    A8 = tl.dot(A4, A4, input_precision=PREC)
    X = tl.dot(X, eye + A4, input_precision=PREC)
    return tl.dot(X, eye + A8, input_precision=PREC)


@triton.jit
def _solve_rows(Tm, t0, R: tl.constexpr, T, b_Arr, b_Y, b_beta, HV: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, PREC: tl.constexpr):
    """X_R = (I + A_RR)⁻¹ (E_R − Y), the rows of block R of (I + Akk)⁻¹ given Y = Σ_{m<R} A_Rm X_m
    [BC, BT]; stores X_R Diag(β) as Tm's rows and returns X_R."""
    o_i = tl.arange(0, BC)
    o_j = tl.arange(0, BT)
    b_E = tl.where(o_j[None, :] == R * BC + o_i[:, None], 1.0, 0.0)
    b_X = tl.dot(_inverse(b_Arr, PREC), b_E - b_Y, input_precision=PREC)
    o_t = t0 + R * BC + o_i
    tl.store(Tm + o_t[:, None] * (HV * BT) + o_j[None, :], (b_X * b_beta[None, :]).to(Tm.dtype.element_ty),
             mask=(o_t < T)[:, None])
    return b_X


@triton.jit(do_not_specialize=["T"])
def intra_chunk_kernel(
    q, k, gcum, beta, Aqk, Tm, Dkk,  # [B,T,H,K] ×2, [B,T,HV,K], [B,T,HV], [B,T,HV,BT] ×2, [B,T,HV,BC]
    Rb, Rstd,                         # [B,HV,T] fp32 β's residual (BETA_RESIDUAL), [2,B,H,T] fp32 norms (L2NORM)
    cu_seqlens, chunk_indices,        # packed sequences (kda_opt/seqs)
    T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    SHIFT: tl.constexpr, CHECK_SPAN: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_BF16: tl.constexpr,
    PACKED: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, BETA_RESIDUAL: tl.constexpr,
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
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    gcum += (bos * HV + i_hv) * K
    beta += bos * HV + i_hv
    Aqk += (bos * HV + i_hv) * BT
    Tm += (bos * HV + i_hv) * BT
    Dkk += (bos * HV + i_hv) * BC
    o_c = t0 + tl.arange(0, BT)
    b_beta = _beta(beta, o_c, o_c < T, HV, BETA_SIGMOID)
    if BETA_RESIDUAL:
        b_round = b_beta.to(Tm.dtype.element_ty).to(tl.float32)
        tl.store(Rb + (i_b * HV + i_hv) * T_all + tok + o_c, b_beta - b_round, mask=o_c < T)
    Rstd += (i_b * H + i_h) * T_all + tok
    rstd_plane = tl.num_programs(0).to(tl.int64) // HV * H * T_all     # B·H·T: q's norms, then k's
    P: tl.constexpr = DOT_PRECISION
    # Rows past T have zero Akk rows: identity rows of the inverse, never stored, never reached.
    A0, f, D = _row_block(q, k, gcum, beta, Aqk, Dkk, Rstd, rstd_plane, t0, 0, T, scale, H, HV, K, BT, BC, BC,
                          SHIFT, CHECK_SPAN, P, SPLIT_BF16, L2NORM, BETA_SIGMOID)
    X0 = _solve_rows(Tm, t0, 0, T, _diagonal(A0, f, D, CHECK_SPAN), tl.zeros([BC, BT], dtype=tl.float32),
                     b_beta, HV, BT, BC, P)
    A1, f, D = _row_block(q, k, gcum, beta, Aqk, Dkk, Rstd, rstd_plane, t0, 1, T, scale, H, HV, K, BT, BC,
                          2 * BC, SHIFT, CHECK_SPAN, P, SPLIT_BF16, L2NORM, BETA_SIGMOID)
    A10, A11 = _halves(A1)
    X1 = _solve_rows(Tm, t0, 1, T, _diagonal(A11, f, D, CHECK_SPAN), tl.dot(A10, X0, input_precision=P),
                     b_beta, HV, BT, BC, P)
    A2, f, D = _row_block(q, k, gcum, beta, Aqk, Dkk, Rstd, rstd_plane, t0, 2, T, scale, H, HV, K, BT, BC,
                          BT, SHIFT, CHECK_SPAN, P, SPLIT_BF16, L2NORM, BETA_SIGMOID)
    A20, A21, A22, _ = _quarters(A2)
    b_Y = tl.dot(A21, X1, tl.dot(A20, X0, input_precision=P), input_precision=P)
    X2 = _solve_rows(Tm, t0, 2, T, _diagonal(A22, f, D, CHECK_SPAN), b_Y, b_beta, HV, BT, BC, P)
    A3, f, D = _row_block(q, k, gcum, beta, Aqk, Dkk, Rstd, rstd_plane, t0, 3, T, scale, H, HV, K, BT, BC,
                          BT, SHIFT, CHECK_SPAN, P, SPLIT_BF16, L2NORM, BETA_SIGMOID)
    A30, A31, A32, A33 = _quarters(A3)
    b_Y = tl.dot(A32, X2, tl.dot(A31, X1, tl.dot(A30, X0, input_precision=P), input_precision=P),
                 input_precision=P)
    _solve_rows(Tm, t0, 3, T, _diagonal(A33, f, D, CHECK_SPAN), b_Y, b_beta, HV, BT, BC, P)


def intra_chunk(q, k, gcum, beta, scale: float, chunk_size: int = 64, *, gate_bounded: bool = False,
                seqs: Seqs | None = None, l2norm: bool = False, beta_sigmoid: float | None = None,
                beta_residual: torch.Tensor | None = None, qk_rstd: torch.Tensor | None = None,
                num_warps: int = NUM_WARPS):
    """Aqk [B, T, HV, C] (q's dtype) and Tm [B, T, HV, C] (k's dtype) of every chunk (C = 64).
    gate_bounded: every log-decay a ≥ −5 (log2 units: Γ falls at most 5/ln 2 per token), so no
    diagonal block needs the exact path. seqs: the sequence layout (kda_opt/seqs; None is B sequences
    of T tokens). l2norm: q and k rows L2-normalised as they are read. beta_sigmoid: beta holds
    logits and β = beta_sigmoid · sigmoid(beta) (None: beta is β). beta_residual: a [B, HV, T] fp32
    tensor that receives β − β rounded to Tm's dtype (module docstring). qk_rstd: with l2norm, a
    [2, B, H, T] fp32 tensor that receives q's and k's 1 / sqrt(Σ x² + eps) per token (None: a
    buffer of the launcher's own). num_warps is a tuning knob (scripts/bench_stages.py)."""
    B, T, H, K = q.shape
    HV = gcum.shape[2]
    if chunk_size != 4 * BC:
        raise ValueError(f"intra_chunk computes chunks of {4 * BC}, got chunk_size={chunk_size}")
    seqs = seqs or fixed(T, chunk_size)
    Aqk = torch.empty(B, T, HV, chunk_size, dtype=q.dtype, device=q.device)
    Tm = torch.empty(B, T, HV, chunk_size, dtype=k.dtype, device=q.device)
    layout = dict(H=H, HV=HV, K=K, BT=chunk_size, BC=BC, SHIFT=SHIFT, PACKED=seqs.packed, L2NORM=l2norm)
    Dkk = Aqk  # read only where a diagonal block did not fit: never, for a bounded gate
    if l2norm and qk_rstd is None:
        qk_rstd = torch.empty(2, B, H, T, dtype=torch.float32, device=q.device)
    if not gate_bounded:
        Dkk = torch.empty(B, T, HV, BC, dtype=torch.float32, device=q.device)
        # An exact diagonal block keeps fp32 accuracy (three tf32 passes; FLA: plain fp32).
        diagonal_exact_kernel[(B * HV * (chunk_size // BC), seqs.chunk_slots)](
            q, k, gcum, Aqk, Dkk, *seqs.pointers(Aqk), T, scale, **layout,
            EXACT_PRECISION="tf32x3", num_warps=EXACT_NUM_WARPS)
    intra_chunk_kernel[(B * HV, seqs.chunk_slots)](
        q, k, gcum, beta, Aqk, Tm, Dkk, beta if beta_residual is None else beta_residual,
        beta if qk_rstd is None else qk_rstd, *seqs.pointers(Aqk), T, scale, **layout,
        CHECK_SPAN=not gate_bounded, BETA_SIGMOID=float(beta_sigmoid or 0.0),
        BETA_RESIDUAL=beta_residual is not None,
        # Precision (module docstring). The interpreter ignores DOT_PRECISION and multiplies in fp32.
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32", SPLIT_BF16=q.dtype == torch.bfloat16,
        num_warps=num_warps,
    )
    return Aqk, Tm
