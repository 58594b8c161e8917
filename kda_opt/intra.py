"""Stage 2: the intra-chunk matrices Aqk and Akk, one Triton program per 16-row block of a chunk.

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
reference). A gate a ≥ −5 per token bounds span by 15·5/ln 2 = 2·SHIFT: the sigmoid gate with
lower_bound ∈ [−5, 0] always fits, and the launcher says so (gate_bounded). For any other gate the
kernel checks every block. A block that does not fit takes C = Γ_n and only the columns before n
(both factors ≤ 1 for any gate; a factor underflows only where the true 2^(Γ_i − Γ_j) is smaller
still; FLA's chunk_kda_fwd_kernel_inter_solve_fused), and its diagonal block is computed exactly
apart (_diagonal_exact).
"""
import math

import torch
import triton
import triton.language as tl

BC = 16  # sub-chunk: rows are computed in blocks of 16, the diagonal in 16×16 blocks
# Channels per step of the K loop: whole rows up to 128 (256-512 B per row and load). Measured on
# H100 at the default shape: 0.74 ms at 128, 1.05 at 64, 0.86 at 32 (NOTES.md).
MAX_BK = 128
# Warps: 4 where the gate is bounded; 2 where the exact diagonal path is compiled in (its registers
# cost a third of the speed at 4 warps: 0.87 vs 0.75 ms).
NUM_WARPS = {False: 4, True: 2}
SHIFT = 0.5 * (BC - 1) * 5.0 / math.log(2.0)


@triton.jit
def _tile(p, o_t, m_t, o_k, m_k, STRIDE: tl.constexpr):
    """Rows o_t (tokens, STRIDE apart) × channels o_k of p as fp32, zero where masked."""
    return tl.load(p + o_t[:, None] * STRIDE + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _span_fits(gcum, n, T, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, SHIFT: tl.constexpr):
    """1 if the diagonal block of the rows n.. n+BC−1 (n < T) spans at most 2·SHIFT (log2 units) in
    every channel, else 0."""
    last = tl.minimum(n + BC - 1, T - 1)
    o_k = tl.arange(0, K)
    b_first = tl.load(gcum + n * (HV * K) + o_k)
    b_last = tl.load(gcum + last * (HV * K) + o_k)
    return (tl.max(b_first - b_last, axis=0) <= 2 * SHIFT).to(tl.int32)


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


@triton.jit(do_not_specialize=["T"])
def intra_chunk_kernel(
    q, k, gcum, beta, Aqk, Akk,     # [B,T,H,K], [B,T,H,K], [B,T,HV,K], [B,T,HV], [B,T,HV,BT] ×2
    T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, SHIFT: tl.constexpr, CHECK_SPAN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EXACT_PRECISION: tl.constexpr,
):
    # FLA 0.6.0's chunk_kda_fwd_intra computes the same matrices in two kernels (diagonal blocks,
    # then off-diagonal blocks fused with the solve). Here one program computes one 16-row block R
    # of a chunk against the chunk's columns. Programs run row blocks, then heads, then chunks: the
    # four programs of a chunk share its column tiles through L2, and programs running together
    # read the neighbouring heads of the same tokens.
    i_bhr, i_t = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_bh, R = i_bhr // (BT // BC), i_bhr % (BT // BC)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    bos, t0 = i_b * T, i_t * BT
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    gcum += (bos * HV + i_hv) * K
    beta += bos * HV + i_hv
    Aqk += (bos * HV + i_hv) * BT
    Akk += (bos * HV + i_hv) * BT
    n = t0 + R * BC                                   # the block's first row
    if n >= T:
        return                                        # a tail chunk's blocks past its end
    o_i = tl.arange(0, BC)
    o_t = n + o_i
    m_t = o_t < T
    o_j = tl.arange(0, BT)
    fits = _span_fits(gcum, n, T, HV, K, BC, SHIFT) if CHECK_SPAN else 1
    # Columns up to the block's diagonal block (before it where the diagonal is computed apart).
    m_c = (o_j < R * BC + BC * fits) & (t0 + o_j < T)
    b_Aqk = tl.zeros([BC, BT], dtype=tl.float32)
    b_Akk = tl.zeros([BC, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_kct = tl.trans(_tile(k, t0 + o_j, m_c, o_k, m_k, H * K))        # [BK, BT]
        b_gc = _tile(gcum, t0 + o_j, m_c, o_k, m_k, HV * K)               # [BT, BK]
        b_q = _tile(q, o_t, m_t, o_k, m_k, H * K)                         # [BC, BK]
        b_k = _tile(k, o_t, m_t, o_k, m_k, H * K)
        b_g = _tile(gcum, o_t, m_t, o_k, m_k, HV * K)
        b_c = tl.load(gcum + n * (HV * K) + o_k, mask=m_k, other=0.0) - SHIFT * fits
        # Exponents are masked before exp2 (rows and columns past T load Γ = 0, where 2^(C − 0) could
        # overflow), so that no inf or NaN arises even in entries that are never stored.
        b_rf = tl.exp2(tl.where(m_t[:, None], b_g - b_c[None, :], -float("inf")))
        b_kc = b_kct * tl.exp2(tl.where(m_c[None, :], b_c[:, None] - tl.trans(b_gc), -float("inf")))
        b_Aqk = tl.dot(b_q * b_rf, b_kc, b_Aqk, input_precision=DOT_PRECISION)
        b_Akk = tl.dot(b_k * b_rf, b_kc, b_Akk, input_precision=DOT_PRECISION)

    # The triangles zeroed, the row scales applied (scale for Aqk, β for Akk); a diagonal block that
    # did not fit is computed exactly (BC channels per step: a product needs K ≥ 16) and stored in
    # place of the product's.
    o_r = R * BC + o_i
    b_s = tl.full([BC], scale, dtype=tl.float32)
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    p_qk = Aqk + o_t[:, None] * (HV * BT)
    p_kk = Akk + o_t[:, None] * (HV * BT)
    m = m_t[:, None] & ((o_j < R * BC) | (o_j >= R * BC + BC) | (fits + 0 * o_j != 0))[None, :]
    _store(p_qk, o_j, tl.where(o_j[None, :] <= o_r[:, None], b_Aqk, 0.0), b_s, m)
    _store(p_kk, o_j, tl.where(o_j[None, :] < o_r[:, None], b_Akk, 0.0), b_beta, m)
    if CHECK_SPAN:
        if fits == 0:
            b_Dqk, b_Dkk = _diagonal_exact(q, k, gcum, o_t, m_t, T, H, HV, K, BC, BC, EXACT_PRECISION)
            _store(p_qk, o_r, b_Dqk, b_s, m_t[:, None])
            _store(p_kk, o_r, b_Dkk, b_beta, m_t[:, None])


def intra_chunk(q, k, gcum, beta, scale: float, chunk_size: int = 64, *, gate_bounded: bool = False,
                block_k: int = MAX_BK, num_warps: int | None = None, num_stages: int | None = None):
    """Aqk [B, T, HV, C] (q's dtype) and Akk [B, T, HV, C] (fp32) of every chunk (C = 64).
    gate_bounded: every log-decay a ≥ −5 (log2 units: Γ falls at most 5/ln 2 per token), so no
    diagonal block needs the exact path. The other keyword arguments are tuning knobs
    (scripts/bench_stages.py); the defaults are the measured best."""
    B, T, H, K = q.shape
    HV = gcum.shape[2]
    if chunk_size != 4 * BC:
        raise ValueError(f"intra_chunk computes chunks of {4 * BC}, got chunk_size={chunk_size}")
    Aqk = torch.empty(B, T, HV, chunk_size, dtype=q.dtype, device=q.device)
    Akk = torch.empty(B, T, HV, chunk_size, dtype=torch.float32, device=q.device)
    intra_chunk_kernel[(B * HV * (chunk_size // BC), triton.cdiv(T, chunk_size))](
        q, k, gcum, beta, Aqk, Akk, T, scale,
        H=H, HV=HV, K=K, BT=chunk_size, BC=BC, BK=min(block_k, K), SHIFT=SHIFT, CHECK_SPAN=not gate_bounded,
        # Products on tensor cores in one tf32 pass for 16-bit inputs, as FLA's; fp32 inputs keep
        # fp32 accuracy (three passes), and so does an exact diagonal block (FLA: plain fp32).
        # (The interpreter ignores this and multiplies in fp32.)
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32", EXACT_PRECISION="tf32x3",
        num_warps=NUM_WARPS[not gate_bounded] if num_warps is None else num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return Aqk, Akk
