"""Stage 3: Tm = (I + Akk)⁻¹ · Diag(β) for every chunk, one Triton program per chunk and head.

L = I + Akk is unit lower-triangular (64×64). Its 16×16 diagonal blocks are inverted by forward
substitution; the blocks below them follow from X_rc = −X_rr · Σ_{c ≤ m < r} L_rm X_mc (block
forward substitution, as FLA's solve_tril merges 16×16 inverses), all in fp32.
In: Akk [B, T, HV, 64] fp32, β [B, T, HV].  Out: Tm [B, T, HV, 64] in the requested dtype.
"""
import torch
import triton
import triton.language as tl

from .intra import BC, dot_precision


@triton.jit
def _load_block(Akk, row0, T, t0, r: tl.constexpr, c: tl.constexpr, HV: tl.constexpr, C: tl.constexpr,
                BC: tl.constexpr):
    """Block (r, c) of the chunk's Akk, zero for rows past T."""
    o = tl.arange(0, BC)
    rows = t0 + r * BC + o
    ptr = Akk + (row0 + rows.to(tl.int64) * HV) * C + c * BC
    return tl.load(ptr[:, None] + o[None, :], mask=(rows < T)[:, None], other=0.0)


@triton.jit
def _invert_unit_lower(A, BC: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower-triangular 16×16 A, by forward substitution:
    row i of X is e_i − Σ_{j<i} A[i,j] X[j,:]."""
    o = tl.arange(0, BC)
    X = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    for i in range(1, BC):
        a_i = tl.sum(tl.where((o == i)[:, None], A, 0.0), axis=0)        # row i of A
        x_i = -tl.sum(a_i[:, None] * X, axis=0)                          # −A[i,:] X (rows j < i)
        X = tl.where((o == i)[:, None], x_i[None, :] + tl.where(o == i, 1.0, 0.0)[None, :], X)
    return X


@triton.jit
def _store_block(Tm, X, beta_c, row0, T, t0, r: tl.constexpr, c: tl.constexpr, HV: tl.constexpr,
                 C: tl.constexpr, BC: tl.constexpr):
    o = tl.arange(0, BC)
    rows = t0 + r * BC + o
    ptr = Tm + (row0 + rows.to(tl.int64) * HV) * C + c * BC
    tl.store(ptr[:, None] + o[None, :], (X * beta_c[None, :]).to(Tm.dtype.element_ty), mask=(rows < T)[:, None])


@triton.jit
def solve_kernel(
    Akk, beta, Tm,                  # [B,T,HV,C] fp32, [B,T,HV], [B,T,HV,C]
    T,
    HV: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_bh, i_t = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    t0 = i_t * C
    row0 = i_b.to(tl.int64) * T * HV + i_hv    # row t of this head: (row0 + t·HV)·C
    o = tl.arange(0, BC)
    b0 = tl.load(beta + row0 + (t0 + o).to(tl.int64) * HV, mask=t0 + o < T, other=0.0).to(tl.float32)
    b1 = tl.load(beta + row0 + (t0 + BC + o).to(tl.int64) * HV, mask=t0 + BC + o < T, other=0.0).to(tl.float32)
    b2 = tl.load(beta + row0 + (t0 + 2 * BC + o).to(tl.int64) * HV, mask=t0 + 2 * BC + o < T, other=0.0).to(tl.float32)
    b3 = tl.load(beta + row0 + (t0 + 3 * BC + o).to(tl.int64) * HV, mask=t0 + 3 * BC + o < T, other=0.0).to(tl.float32)
    # Diagonal inverses X_rr (rows past T hold zeros in Akk, so they invert to identity rows).
    X00 = _invert_unit_lower(_load_block(Akk, row0, T, t0, 0, 0, HV, C, BC), BC)
    X11 = _invert_unit_lower(_load_block(Akk, row0, T, t0, 1, 1, HV, C, BC), BC)
    X22 = _invert_unit_lower(_load_block(Akk, row0, T, t0, 2, 2, HV, C, BC), BC)
    X33 = _invert_unit_lower(_load_block(Akk, row0, T, t0, 3, 3, HV, C, BC), BC)
    L10 = _load_block(Akk, row0, T, t0, 1, 0, HV, C, BC)
    L20 = _load_block(Akk, row0, T, t0, 2, 0, HV, C, BC)
    L21 = _load_block(Akk, row0, T, t0, 2, 1, HV, C, BC)
    L30 = _load_block(Akk, row0, T, t0, 3, 0, HV, C, BC)
    L31 = _load_block(Akk, row0, T, t0, 3, 1, HV, C, BC)
    L32 = _load_block(Akk, row0, T, t0, 3, 2, HV, C, BC)
    # X_rc = −X_rr Σ_{c ≤ m < r} L_rm X_mc
    X10 = -tl.dot(X11, tl.dot(L10, X00, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    X21 = -tl.dot(X22, tl.dot(L21, X11, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    X32 = -tl.dot(X33, tl.dot(L32, X22, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    X20 = -tl.dot(X22, tl.dot(L20, X00, input_precision=DOT_PRECISION)
                  + tl.dot(L21, X10, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    X31 = -tl.dot(X33, tl.dot(L31, X11, input_precision=DOT_PRECISION)
                  + tl.dot(L32, X21, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    X30 = -tl.dot(X33, tl.dot(L30, X00, input_precision=DOT_PRECISION) + tl.dot(L31, X10, input_precision=DOT_PRECISION)
                  + tl.dot(L32, X20, input_precision=DOT_PRECISION), input_precision=DOT_PRECISION)
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    _store_block(Tm, X00, b0, row0, T, t0, 0, 0, HV, C, BC)
    _store_block(Tm, zero, b1, row0, T, t0, 0, 1, HV, C, BC)
    _store_block(Tm, zero, b2, row0, T, t0, 0, 2, HV, C, BC)
    _store_block(Tm, zero, b3, row0, T, t0, 0, 3, HV, C, BC)
    _store_block(Tm, X10, b0, row0, T, t0, 1, 0, HV, C, BC)
    _store_block(Tm, X11, b1, row0, T, t0, 1, 1, HV, C, BC)
    _store_block(Tm, zero, b2, row0, T, t0, 1, 2, HV, C, BC)
    _store_block(Tm, zero, b3, row0, T, t0, 1, 3, HV, C, BC)
    _store_block(Tm, X20, b0, row0, T, t0, 2, 0, HV, C, BC)
    _store_block(Tm, X21, b1, row0, T, t0, 2, 1, HV, C, BC)
    _store_block(Tm, X22, b2, row0, T, t0, 2, 2, HV, C, BC)
    _store_block(Tm, zero, b3, row0, T, t0, 2, 3, HV, C, BC)
    _store_block(Tm, X30, b0, row0, T, t0, 3, 0, HV, C, BC)
    _store_block(Tm, X31, b1, row0, T, t0, 3, 1, HV, C, BC)
    _store_block(Tm, X32, b2, row0, T, t0, 3, 2, HV, C, BC)
    _store_block(Tm, X33, b3, row0, T, t0, 3, 3, HV, C, BC)


def solve(Akk, beta, out_dtype: torch.dtype):
    """Tm [B, T, HV, C] = (I + Akk)⁻¹ Diag(β) per chunk, in out_dtype."""
    B, T, HV, C = Akk.shape
    Tm = torch.empty(B, T, HV, C, dtype=out_dtype, device=Akk.device)
    grid = (B * HV, triton.cdiv(T, C))
    solve_kernel[grid](Akk, beta, Tm, T, HV=HV, C=C, BC=BC, DOT_PRECISION=dot_precision(Akk.device))
    return Tm
