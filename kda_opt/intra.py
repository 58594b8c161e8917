"""Stage 2: the intra-chunk matrices Aqk and Akk, one 16×16 block of each per Triton program.

    Aqk[i,j] = scale · Σ_d q_i,d k_j,d 2^(Γ_i,d − Γ_j,d)   (i ≥ j in one chunk of 64)
    Akk[i,j] = β_i   · Σ_d k_i,d k_j,d 2^(Γ_i,d − Γ_j,d)   (i > j)
In: q, k [B, T, H, K]; Γ [B, T, HV, K] fp32, log2 units; β [B, T, HV].
Out: Aqk [B, T, HV, 64] in q's dtype, Akk [B, T, HV, 64] fp32 (row per token, column = position in
its chunk; zero above the diagonal and past the end of a tail chunk).
"""
import torch
import triton
import triton.language as tl

BC = 16  # sub-chunk: the 64×64 matrices are computed as 4×4 blocks of 16×16


@triton.jit
def intra_chunk_kernel(
    q, k, gcum, beta, Aqk, Akk,     # [B,T,H,K], [B,T,H,K], [B,T,HV,K], [B,T,HV], [B,T,HV,C] ×2
    T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, SAFE_GATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Block (r, c) of chunk i_t: rows i in sub-chunk r, columns j in sub-chunk c.
    i_bh, i_t, i_rc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_r, i_c = i_rc // (C // BC), i_rc % (C // BC)
    t0 = i_t * C
    if t0 + i_r * BC >= T:
        return
    o_i = t0 + i_r * BC + tl.arange(0, BC)          # rows (tokens)
    o_j = t0 + i_c * BC + tl.arange(0, BC)          # columns (tokens)
    m_i, m_j = o_i < T, o_j < T
    row_qk_i = ((i_b * T + o_i).to(tl.int64) * H + i_h) * K
    row_qk_j = ((i_b * T + o_j).to(tl.int64) * H + i_h) * K
    row_g_i = ((i_b * T + o_i).to(tl.int64) * HV + i_hv) * K
    row_g_j = ((i_b * T + o_j).to(tl.int64) * HV + i_hv) * K
    b_aqk = tl.zeros([BC, BC], dtype=tl.float32)
    b_akk = tl.zeros([BC, BC], dtype=tl.float32)
    if i_c < i_r:
        # Off the diagonal every j precedes every i. Referencing both sides to the last row n of
        # sub-chunk c splits 2^(Γ_i − Γ_j) = 2^(Γ_i − Γ_n) · 2^(Γ_n − Γ_j) into two factors ≤ 1, so
        # neither overflows for any gate; whole sub-chunks then multiply on tensor cores.
        # (FLA's chunk_kda_fwd_intra references the first row of sub-chunk r, equally safe.)
        row_g_n = ((i_b * T + t0 + i_c * BC + BC - 1).to(tl.int64) * HV + i_hv) * K
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            b_gn = tl.load(gcum + row_g_n + o_k, mask=m_k, other=0.0)
            b_gi = tl.load(gcum + row_g_i[:, None] + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)
            b_gj = tl.load(gcum + row_g_j[:, None] + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.0)
            b_qi = tl.load(q + row_qk_i[:, None] + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)
            b_ki = tl.load(k + row_qk_i[:, None] + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)
            b_kj = tl.load(k + row_qk_j[:, None] + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.0)
            # Rows past T load Γ = 0, whose exponent could overflow: they are zeroed instead.
            b_di = tl.where(m_i[:, None], tl.exp2(b_gi - b_gn[None, :]), 0.0)
            b_kjt = tl.trans(b_kj.to(tl.float32) * tl.exp2(b_gn[None, :] - b_gj))
            b_aqk += tl.dot(b_qi.to(tl.float32) * b_di, b_kjt, input_precision=DOT_PRECISION)
            b_akk += tl.dot(b_ki.to(tl.float32) * b_di, b_kjt, input_precision=DOT_PRECISION)
    elif i_c == i_r:
        if SAFE_GATE:
            # A bounded gate (a ≥ −5 per token) keeps 2^(Γ_n − Γ_j) ≤ 2^(15·5/ln 2) inside one
            # sub-chunk, so the diagonal block is one product referenced to its first row n.
            row_g_n = ((i_b * T + t0 + i_r * BC).to(tl.int64) * HV + i_hv) * K
            for k0 in range(0, K, BK):
                o_k = k0 + tl.arange(0, BK)
                m_k = o_k < K
                b_gn = tl.load(gcum + row_g_n + o_k, mask=m_k, other=0.0)
                b_gi = tl.load(gcum + row_g_i[:, None] + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)
                b_qi = tl.load(q + row_qk_i[:, None] + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)
                b_ki = tl.load(k + row_qk_i[:, None] + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)
                b_di = tl.where(m_i[:, None], tl.exp2(b_gi - b_gn[None, :]), 0.0)
                b_kjt = tl.trans(b_ki.to(tl.float32) * tl.exp2(b_gn[None, :] - b_gi))
                b_aqk += tl.dot(b_qi.to(tl.float32) * b_di, b_kjt, input_precision=DOT_PRECISION)
                b_akk += tl.dot(b_ki.to(tl.float32) * b_di, b_kjt, input_precision=DOT_PRECISION)
        else:
            # Unbounded gate: one column j at a time, 2^(Γ_i − Γ_j) formed only where i ≥ j (≤ 1).
            o_col = tl.arange(0, BC)
            for j in range(0, BC):
                row_qk_c = ((i_b * T + t0 + i_c * BC + j).to(tl.int64) * H + i_h) * K
                row_g_c = ((i_b * T + t0 + i_c * BC + j).to(tl.int64) * HV + i_hv) * K
                m_c = t0 + i_c * BC + j < T
                b_colq = tl.zeros([BC], dtype=tl.float32)
                b_colk = tl.zeros([BC], dtype=tl.float32)
                for k0 in range(0, K, BK):
                    o_k = k0 + tl.arange(0, BK)
                    m_k = o_k < K
                    m_ik = m_i[:, None] & m_k[None, :]
                    b_gi = tl.load(gcum + row_g_i[:, None] + o_k[None, :], mask=m_ik, other=0.0)
                    b_qi = tl.load(q + row_qk_i[:, None] + o_k[None, :], mask=m_ik, other=0.0)
                    b_ki = tl.load(k + row_qk_i[:, None] + o_k[None, :], mask=m_ik, other=0.0)
                    b_gc = tl.load(gcum + row_g_c + o_k, mask=m_k & m_c, other=0.0)
                    b_kc = tl.load(k + row_qk_c + o_k, mask=m_k & m_c, other=0.0).to(tl.float32)
                    b_e = tl.where(((o_col >= j) & m_i)[:, None], b_gi - b_gc[None, :], float("-inf"))
                    b_w = tl.exp2(b_e) * b_kc[None, :]
                    b_colq += tl.sum(b_qi.to(tl.float32) * b_w, axis=1)
                    b_colk += tl.sum(b_ki.to(tl.float32) * b_w, axis=1)
                b_aqk = tl.where((o_col == j)[None, :], b_colq[:, None], b_aqk)
                b_akk = tl.where((o_col == j)[None, :], b_colk[:, None], b_akk)
        o_r = tl.arange(0, BC)
        b_aqk = tl.where(o_r[:, None] >= o_r[None, :], b_aqk, 0.0)
        b_akk = tl.where(o_r[:, None] > o_r[None, :], b_akk, 0.0)
    b_beta = tl.load(beta + (i_b * T + o_i).to(tl.int64) * HV + i_hv, mask=m_i, other=0.0).to(tl.float32)
    row_a = ((i_b * T + o_i).to(tl.int64) * HV + i_hv) * C + i_c * BC
    o_col = tl.arange(0, BC)
    m_a = m_i[:, None] & (o_col < BC)[None, :]
    tl.store(Aqk + row_a[:, None] + o_col[None, :], (scale * b_aqk).to(Aqk.dtype.element_ty), mask=m_a)
    tl.store(Akk + row_a[:, None] + o_col[None, :], b_beta[:, None] * b_akk, mask=m_a)


def intra_chunk(q, k, gcum, beta, scale: float, safe_gate: bool, chunk_size: int = 64):
    """Aqk [B, T, HV, C] (q's dtype) and Akk [B, T, HV, C] (fp32) of every chunk."""
    B, T, H, K = q.shape
    HV = gcum.shape[2]
    Aqk = torch.empty(B, T, HV, chunk_size, dtype=q.dtype, device=q.device)
    Akk = torch.empty(B, T, HV, chunk_size, dtype=torch.float32, device=q.device)
    nblocks = (chunk_size // BC) ** 2
    grid = (B * HV, triton.cdiv(T, chunk_size), nblocks)
    intra_chunk_kernel[grid](
        q, k, gcum, beta, Aqk, Akk, T, scale,
        H=H, HV=HV, K=K, C=chunk_size, BC=BC, BK=min(64, triton.next_power_of_2(K)),
        SAFE_GATE=safe_gate, DOT_PRECISION=dot_precision(q.device),
    )
    return Aqk, Akk


def dot_precision(device) -> str:
    """fp32 products at near-fp32 accuracy: three tf32 passes on the GPU; the interpreter computes
    in fp32 and knows only "ieee"."""
    return "tf32x3" if device.type == "cuda" else "ieee"
