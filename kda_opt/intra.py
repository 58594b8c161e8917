"""Stage 2: the intra-chunk matrices Aqk and Akk, one Triton program per chunk and value head.

    Aqk[i,j] = scale · Σ_d q_i,d k_j,d 2^(Γ_i,d − Γ_j,d)   (i ≥ j in one chunk of 64)
    Akk[i,j] = β_i   · Σ_d k_i,d k_j,d 2^(Γ_i,d − Γ_j,d)   (i > j)
In: q, k [B, T, H, K] (bf16/fp16/fp32); Γ [B, T, HV, K] fp32 in log2 units; β [B, T, HV]; value
head hv reads q/k head hv // (HV / H). Out: Aqk [B, T, HV, 64] in q's dtype, Akk [B, T, HV, 64] fp32;
row per token, column = position in its chunk, zero above the diagonal and past a tail chunk's end.

Each 16-row block R of the chunk is one product over its columns on tensor cores, through a
reference exponent C: q_i 2^(Γ_i − C) · k_j 2^(C − Γ_j). With C = Γ_n − SHIFT (n the block's first
row) the row factor is ≤ 2^SHIFT and, inside the diagonal block, the column factor ≤ 2^(span − SHIFT),
span = max_d (Γ_n,d − Γ_last,d) over the block's rows: both far inside fp32's range while
span ≤ 2·SHIFT, and before n the column factor only shrinks (FLA 0.6.0's safe-gate sub-chunk
reference). safe_gate's promise (a ≥ −5 per token) bounds span by 15·5/ln 2 = 2·SHIFT, and most
other gates stay below it; the kernel checks every block. A block that does not fit takes C = Γ_n
and only the columns before n (both factors ≤ 1 for any gate; a factor underflows only where the
true 2^(Γ_i − Γ_j) is smaller still; FLA's chunk_kda_fwd_kernel_inter_solve_fused), and its
diagonal block is computed exactly apart (_diagonal_exact).
"""
import math

import torch
import triton
import triton.language as tl

BC = 16  # sub-chunk: rows are computed in blocks of 16, the diagonal in 16×16 blocks
BK = 32  # channels per step of the K loop
NUM_WARPS = 4
SHIFT = 0.5 * (BC - 1) * 5.0 / math.log(2.0)


@triton.jit
def _tile(p, o_t, m_t, o_k, m_k, STRIDE: tl.constexpr):
    """Rows o_t (tokens, STRIDE apart) × channels o_k of p as fp32, zero where masked."""
    return tl.load(p + o_t[:, None] * STRIDE + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _span_fits(gcum, t0, T, R: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
               SHIFT: tl.constexpr):
    """1 if the diagonal block of row block R spans at most 2·SHIFT (log2 units) in every channel, else 0."""
    n = t0 + R * BC
    last = tl.minimum(n + BC - 1, T - 1)
    o_k = tl.arange(0, K)
    # Masks are built per element (n + 0·o_k), never from a scalar comparison: Triton 3.9's
    # interpreter rejects a mask that involves a scalar one ("mask has unsupported dtype").
    m_n = n + 0 * o_k < T
    b_first = tl.load(gcum + n * (HV * K) + o_k, mask=m_n, other=0.0)
    b_last = tl.load(gcum + last * (HV * K) + o_k, mask=m_n, other=0.0)
    return (tl.max(b_first - b_last, axis=0) <= 2 * SHIFT).to(tl.int32)


@triton.jit
def _row_block_step(q, k, gcum, b_kct, b_gc, o_j, o_k, m_k, t0, T, b_Aqk, b_Akk, fits,
                    R: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                    BC: tl.constexpr, SHIFT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Adds channels o_k of row block R's products to b_Aqk, b_Akk [BC, BT]; b_kct, b_gc: k
    (transposed) and Γ of the whole chunk in those channels. fits: the diagonal block is included."""
    o_t = t0 + R * BC + tl.arange(0, BC)
    m_t = o_t < T
    b_q = _tile(q, o_t, m_t, o_k, m_k, H * K)
    b_k = _tile(k, o_t, m_t, o_k, m_k, H * K)
    b_g = _tile(gcum, o_t, m_t, o_k, m_k, HV * K)
    b_c = tl.load(gcum + (t0 + R * BC) * (HV * K) + o_k, mask=m_k & (t0 + R * BC + 0 * o_k < T), other=0.0)
    b_c -= tl.where(fits != 0, SHIFT, 0.0)
    # Exponents are masked before exp2 (rows and columns past T load Γ = 0, where 2^(C − 0) could
    # overflow), so that no inf or NaN arises even in entries that are never stored.
    m_c = (o_j < R * BC + BC * fits) & (t0 + o_j < T)
    b_rf = tl.exp2(tl.where(m_t[:, None], b_g - b_c[None, :], -float("inf")))
    b_cf = tl.exp2(tl.where(m_c[None, :], b_c[:, None] - tl.trans(b_gc), -float("inf")))
    b_kc = b_kct * b_cf
    b_Aqk = tl.dot(b_q * b_rf, b_kc, b_Aqk, input_precision=DOT_PRECISION)
    b_Akk = tl.dot(b_k * b_rf, b_kc, b_Akk, input_precision=DOT_PRECISION)
    return b_Aqk, b_Akk


@triton.jit
def _diagonal_exact(q, k, gcum, o_t, m_t, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                    BC: tl.constexpr, BK: tl.constexpr, EXACT_PRECISION: tl.constexpr):
    """The diagonal block of rows o_t for an unbounded gate: [BC, BC] for q (diagonal included) and
    k (strictly lower). No single reference row serves a whole diagonal block. FLA computes these
    entries token by token (chunk_kda_fwd_kernel_intra_token_parallel); here the block is split
    recursively instead: at level h ∈ {8, 4, 2, 1}, rows in the upper half of each group of 2h meet
    columns in its lower half through the group's middle row m (j < m ≤ i), the off-diagonal
    factorisation with both factors ≤ 1, as one product on tensor cores. Every i > j belongs to
    exactly one level (the highest bit where i and j differ); the diagonal, where the decay is 1,
    is a plain row sum."""
    o_i = tl.arange(0, BC)
    b_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
    b_Akk = tl.zeros([BC, BC], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_q = _tile(q, o_t, m_t, o_k, m_k, H * K)
        b_k = _tile(k, o_t, m_t, o_k, m_k, H * K)
        b_g = _tile(gcum, o_t, m_t, o_k, m_k, HV * K)
        for LVL in tl.static_range(0, 4):
            GROUP = BC >> LVL
            HALF = GROUP // 2
            o_m = o_t - o_i % GROUP + HALF          # the middle row of each row's group
            m_up = o_i % GROUP >= HALF
            m_m = o_m < T
            b_gm = _tile(gcum, o_m, m_m, o_k, m_k, HV * K)
            b_rf = tl.exp2(tl.where((m_up & m_t)[:, None], b_g - b_gm, -float("inf")))
            b_kt = tl.trans(b_k * tl.exp2(tl.where((~m_up & m_m)[:, None], b_gm - b_g, -float("inf"))))
            m_lvl = (o_i[:, None] // GROUP == o_i[None, :] // GROUP) & m_up[:, None] & ~m_up[None, :]
            b_Aqk += tl.where(m_lvl, tl.dot(b_q * b_rf, b_kt, input_precision=EXACT_PRECISION), 0.0)
            b_Akk += tl.where(m_lvl, tl.dot(b_k * b_rf, b_kt, input_precision=EXACT_PRECISION), 0.0)
        b_Aqk += tl.where(o_i[:, None] == o_i[None, :], tl.sum(b_q * b_k, axis=1)[:, None], 0.0)
    return b_Aqk, b_Akk


@triton.jit
def _store(p_t, o_c, b_A, b_s, m):
    """b_A times the row scale b_s at columns o_c of the rows p_t, where m."""
    tl.store(p_t + o_c[None, :], (b_A * b_s[:, None]).to(p_t.dtype.element_ty), mask=m)


@triton.jit
def _store_row_block(q, k, gcum, beta, Aqk, Akk, b_Aqk, b_Akk, t0, T, scale, fits,
                     R: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, EXACT_PRECISION: tl.constexpr):
    """Rows of block R: the triangles zeroed, the row scales applied (scale for Aqk, β for Akk); a
    diagonal block that did not fit is computed exactly (BC channels per step, any BK of the main
    loop: a product needs K ≥ 16) and stored in place of the product's."""
    o_i = tl.arange(0, BC)
    o_t = t0 + R * BC + o_i
    m_t = o_t < T
    o_j = tl.arange(0, BT)
    o_r = R * BC + o_i
    b_s = tl.full([BC], scale, dtype=tl.float32)
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    p_qk = Aqk + o_t[:, None] * (HV * BT)
    p_kk = Akk + o_t[:, None] * (HV * BT)
    m = m_t[:, None] & ((o_j < R * BC) | (o_j >= R * BC + BC) | (fits + 0 * o_j != 0))[None, :]
    _store(p_qk, o_j, tl.where(o_j[None, :] <= o_r[:, None], b_Aqk, 0.0), b_s, m)
    _store(p_kk, o_j, tl.where(o_j[None, :] < o_r[:, None], b_Akk, 0.0), b_beta, m)
    if fits == 0:
        b_Dqk, b_Dkk = _diagonal_exact(q, k, gcum, o_t, m_t, T, H, HV, K, BC, BC, EXACT_PRECISION)
        _store(p_qk, R * BC + o_i, b_Dqk, b_s, m_t[:, None])
        _store(p_kk, R * BC + o_i, b_Dkk, b_beta, m_t[:, None])


@triton.jit(do_not_specialize=["T"])
def intra_chunk_kernel(
    q, k, gcum, beta, Aqk, Akk,     # [B,T,H,K], [B,T,H,K], [B,T,HV,K], [B,T,HV], [B,T,HV,BT] ×2
    T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, SHIFT: tl.constexpr, DOT_PRECISION: tl.constexpr, EXACT_PRECISION: tl.constexpr,
):
    # FLA 0.6.0's chunk_kda_fwd_intra computes the same matrices in two kernels (diagonal blocks,
    # then off-diagonal blocks fused with the solve). Here one program holds a whole chunk: the K
    # loop reads the chunk's columns once and feeds the four row blocks' products from them.
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, t0 = i_b * T, i_t * BT
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    gcum += (bos * HV + i_hv) * K
    beta += bos * HV + i_hv
    Aqk += (bos * HV + i_hv) * BT
    Akk += (bos * HV + i_hv) * BT
    fits0 = _span_fits(gcum, t0, T, 0, HV, K, BC, SHIFT)
    fits1 = _span_fits(gcum, t0, T, 1, HV, K, BC, SHIFT)
    fits2 = _span_fits(gcum, t0, T, 2, HV, K, BC, SHIFT)
    fits3 = _span_fits(gcum, t0, T, 3, HV, K, BC, SHIFT)
    o_j = tl.arange(0, BT)
    m_j = t0 + o_j < T
    b_Aqk0 = tl.zeros([BC, BT], dtype=tl.float32)
    b_Akk0 = tl.zeros([BC, BT], dtype=tl.float32)
    b_Aqk1 = tl.zeros([BC, BT], dtype=tl.float32)
    b_Akk1 = tl.zeros([BC, BT], dtype=tl.float32)
    b_Aqk2 = tl.zeros([BC, BT], dtype=tl.float32)
    b_Akk2 = tl.zeros([BC, BT], dtype=tl.float32)
    b_Aqk3 = tl.zeros([BC, BT], dtype=tl.float32)
    b_Akk3 = tl.zeros([BC, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_kct = tl.trans(_tile(k, t0 + o_j, m_j, o_k, m_k, H * K))        # [BK, BT]
        b_gc = _tile(gcum, t0 + o_j, m_j, o_k, m_k, HV * K)               # [BT, BK]
        b_Aqk0, b_Akk0 = _row_block_step(q, k, gcum, b_kct, b_gc, o_j, o_k, m_k, t0, T, b_Aqk0, b_Akk0,
                                         fits0, 0, H, HV, K, BC, SHIFT, DOT_PRECISION)
        b_Aqk1, b_Akk1 = _row_block_step(q, k, gcum, b_kct, b_gc, o_j, o_k, m_k, t0, T, b_Aqk1, b_Akk1,
                                         fits1, 1, H, HV, K, BC, SHIFT, DOT_PRECISION)
        b_Aqk2, b_Akk2 = _row_block_step(q, k, gcum, b_kct, b_gc, o_j, o_k, m_k, t0, T, b_Aqk2, b_Akk2,
                                         fits2, 2, H, HV, K, BC, SHIFT, DOT_PRECISION)
        b_Aqk3, b_Akk3 = _row_block_step(q, k, gcum, b_kct, b_gc, o_j, o_k, m_k, t0, T, b_Aqk3, b_Akk3,
                                         fits3, 3, H, HV, K, BC, SHIFT, DOT_PRECISION)
    _store_row_block(q, k, gcum, beta, Aqk, Akk, b_Aqk0, b_Akk0, t0, T, scale, fits0, 0, H, HV, K, BT, BC,
                     EXACT_PRECISION)
    _store_row_block(q, k, gcum, beta, Aqk, Akk, b_Aqk1, b_Akk1, t0, T, scale, fits1, 1, H, HV, K, BT, BC,
                     EXACT_PRECISION)
    _store_row_block(q, k, gcum, beta, Aqk, Akk, b_Aqk2, b_Akk2, t0, T, scale, fits2, 2, H, HV, K, BT, BC,
                     EXACT_PRECISION)
    _store_row_block(q, k, gcum, beta, Aqk, Akk, b_Aqk3, b_Akk3, t0, T, scale, fits3, 3, H, HV, K, BT, BC,
                     EXACT_PRECISION)


def intra_chunk(q, k, gcum, beta, scale: float, chunk_size: int = 64, *,
                block_k: int = BK, num_warps: int = NUM_WARPS, num_stages: int | None = None):
    """Aqk [B, T, HV, C] (q's dtype) and Akk [B, T, HV, C] (fp32) of every chunk (C = 64). The
    keyword arguments are tuning knobs (scripts/bench_stages.py); the defaults are the measured best."""
    B, T, H, K = q.shape
    HV = gcum.shape[2]
    if chunk_size != 4 * BC:
        raise ValueError(f"intra_chunk computes chunks of {4 * BC}, got chunk_size={chunk_size}")
    Aqk = torch.empty(B, T, HV, chunk_size, dtype=q.dtype, device=q.device)
    Akk = torch.empty(B, T, HV, chunk_size, dtype=torch.float32, device=q.device)
    intra_chunk_kernel[(triton.cdiv(T, chunk_size), B * HV)](
        q, k, gcum, beta, Aqk, Akk, T, scale,
        H=H, HV=HV, K=K, BT=chunk_size, BC=BC, BK=min(block_k, K), SHIFT=SHIFT,
        # Products on tensor cores in one tf32 pass for 16-bit inputs, as FLA's; fp32 inputs keep
        # fp32 accuracy (three passes), and so does an exact diagonal block (FLA: plain fp32).
        # (The interpreter ignores this and multiplies in fp32.)
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32", EXACT_PRECISION="tf32x3",
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return Aqk, Akk
