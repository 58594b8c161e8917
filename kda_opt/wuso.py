"""Stage 4: W, U, the chunk-to-chunk state recurrence and the output, in one cuTile kernel.

Per (batch b, value head hv, block of BV value columns), chunk after chunk, carrying S [K, BV] fp32:
    V' = U − W S = Tm (v − (2^Γ ⊙ k) S)          (W = Tm (2^Γ ⊙ k), U = Tm v)
    O  = scale·(q ⊙ 2^Γ) S + Aqk V',   S ← Diag(2^Γ_last) S + (k ⊙ 2^(Γ_last − Γ))ᵀ V'
Γ in log2 units; Γ_last is Γ at the chunk's last valid row. In: q, k [B, T, H, K] bf16/fp16/fp32; their
rows' 1 / ‖·‖ [2, B, H, T] fp32 from stage 2 or none (l2norm: q and k rows scaled by them as they
are read); v [B, T, HV, V]; Γ [B, T, HV, K] fp32; Tm [B, T, HV, 64] (k's dtype); Aqk [B, T, HV, 64]
(q's dtype, scale included); S0 [N, HV, K, V] fp32/bf16/fp16 or none; r [B, HV, T] fp32 or none,
β's residual from stage 2: with it V' = Tm x + r ⊙ x, x taken in fp32 (Tm's diagonal, β rounded to
16 bits, made exact; kda_opt/intra). Out: o [B, T, HV, V] in v's dtype; S [N, HV, K, V]
fp32; both states [N, HV, V, K] if asked (state_v_first). N sequences: the B entries, or with
cu_seqlens [N + 1] the packed sequences of the one entry (B = 1), each read as TMA boxes at element
coordinates on the whole arrays and o stored by element offsets (_packed_tiles: no per-sequence view,
whose TMA descriptor each program would write to memory); where the launcher is asked
(short_sequences), those of at most one chunk in a launch of their own, with no loop (_one_chunk). Optionally
the state after every E chunks into a checkpoint buffer (packed, from a first checkpoint at a given
offset: each sequence's head in a launch of its own, HEADS, then the rest, PHASED); or, in the
transition mode, v = 0 over K state columns and no o, so that from S0 = I the final state is the
sequence's transition M (kda_opt/schedules, "Parallel segments").
Products take 16-bit operands with fp32 accumulation; for fp32 inputs tf32 ones (fp32 operands compile
to products on the CUDA cores that spill kilobytes per thread; tf32 ones to tensor-core products, whose
error against float64 stays below FLA's own in fp32: tests/test_forward.py). For bf16 inputs O's Aqk V'
takes V' as hi + lo, which pays for stage 2's bf16 products (kda_opt/intra): o's error against
float64 is then tf32's (docs/BENCHMARKING.md, "Precision").
"""
import collections
import functools

import cuda.tile as ct
import torch

from .launch import constant, cutile_launch
from .options import CHUNK, INT32_MAX, state_shape
from .seqs import num_sequences

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
F32 = ct.float32

# Launch configuration, in one place. Every 16-bit variant compiled for sm_90 holds 135–230 KB of
# shared memory (the chunk's input tiles and staged mma operands), so one CTA runs per SM; each V
# block repeats the chunk's [C, K] exp2 work, so narrow V blocks only pay while the grid has SMs to
# fill (block_v_for). Eight worker warps split every tile over both consumer warpgroups: at most
# 64 B per thread spill, where the compiler's default (two four-warp groups with different jobs)
# spills 72–400 B (sm_90 cubins from tileiras 13.4 and 13.5).
BLOCK_V_CHOICES = (32, 64, 128)
# Which packed sequences one launch computes (the kernel's SHORT): all of them through _sequence, or
# those longer than a chunk through it, or those of at most one chunk through _one_chunk (SEVERAL_ONLY:
# but those of one token, which kda_opt/recurrence computes); or HEADS, each sequence's head through
# _one_chunk (checkpoints at given offsets: _sequence, PHASED).
EVERY_SEQUENCE, LONG_ONLY, SHORT_ONLY, HEADS, SEVERAL_ONLY = 0, 1, 2, 3, 4
WORKER_WARPS = 8


# The algorithm of FLA's three forward steps after the solve, fused: recompute_w_u_fwd
# (fla/ops/kda/wy_fast.py), chunk_gated_delta_rule_fwd_h (fla/ops/common/chunk_delta_h.py) and
# chunk_gla_fwd_o_gk (fla/ops/gla/chunk.py); S never leaves the chip and W, U never exist.
@ct.kernel(num_worker_warps=WORKER_WARPS)
def wuso_kernel(Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, SF, CU, SLOTS, MASK, CK, CK_ROW0, CK_FIRST, ORDER,
                scale: float, K: ConstInt, BV: ConstInt, C: ConstInt, HAS_S0: ConstBool, STORE_SF: ConstBool,
                SPLIT_V: ConstBool, PACKED: ConstBool, L2NORM: ConstBool, V_FIRST: ConstBool,
                BETA_RESIDUAL: ConstBool, READ_SLOTS: ConstBool, WRITE_SLOTS: ConstBool, HAS_MASK: ConstBool,
                STORE_CK: ConstBool, CK_EVERY: ConstInt, TRANSITION: ConstBool, PHASED: ConstBool,
                ORDERED: ConstBool, SHORT: ConstInt):
    i_v, i_nh = ct.bid(0), ct.bid(1)
    H, HV = Q.shape[2], Vx.shape[2]
    i_n, i_hv = i_nh // HV, i_nh % HV                         # sequence, value head
    if ORDERED:     # packed: the i_n-th longest sequence (ORDER, kda_opt/seqs.longest_first) first
        i_n = ct.load(ORDER, index=(i_n,), shape=(1,)).item()
    i_h = i_hv // (HV // H)                                   # GVA: HV / H value heads per q/k head
    bos, eos = 0, Q.shape[1]
    if PACKED:
        # Sequence i_n is rows cu[i_n] .. cu[i_n + 1] − 1 of the one batch entry. Clamped as in
        # kda_opt/seqs: a cu_seqlens that breaks its contract gives wrong numbers, never an access
        # out of bounds.
        bos = min(max(ct.load(CU, index=(i_n,), shape=(1,)).astype(ct.int32).item(), 0), eos)
        eos = min(max(ct.load(CU, index=(i_n + 1,), shape=(1,)).astype(ct.int32).item(), bos), eos)
    # States [N, HV, K, V], or [N, HV, V, K] (V_FIRST): the tiles are [K, BV] either way. In a state
    # pool (READ_SLOTS / WRITE_SLOTS) sequence i_n's row is SLOTS[i_n]; a slot outside the pool reads
    # zeros and is not written (a store outside an array is dropped: the row past the last stands in
    # for it, as a branch around the store costs the warp-specialised schedule). With HAS_MASK a
    # sequence whose MASK entry is false starts from zeros (its final state is written).
    s_in, s_out, use_s0 = i_n, i_n, True
    if READ_SLOTS or WRITE_SLOTS:
        slot = ct.load(SLOTS, index=(i_n,), shape=(1,)).astype(ct.int32).item()
        if READ_SLOTS:
            use_s0 = (slot >= 0) & (slot < S0.shape[0])
            s_in = min(max(slot, 0), S0.shape[0] - 1)
        if WRITE_SLOTS:
            s_out = ct.where((slot >= 0) & (slot < SF.shape[0]), slot, SF.shape[0])
    if HAS_MASK:
        use_s0 = use_s0 & ct.load(MASK, index=(i_n,), shape=(1,)).item()
    ck_b, ck_row = i_n, 0                                     # checkpoints: sequence i_n's first row
    if PACKED and STORE_CK:
        ck_b, ck_row = 0, ct.load(CK_ROW0, index=(i_n,), shape=(1,)).item()
    # Which packed sequences this launch computes: one launch with both paths, a branch between them,
    # took the compiler off the long path's schedule (255 registers; long packed sequences +40 %).
    if SHORT == SHORT_ONLY or SHORT == SEVERAL_ONLY:
        taken = eos - bos <= C
        if SHORT == SEVERAL_ONLY:
            taken = taken & (eos - bos != 1)
        if taken:
            _one_chunk(Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, SF, CK, bos, eos - bos, i_h, i_hv, i_v, scale, s_in,
                       s_out, use_s0, ck_row, K, BV, C, HAS_S0, STORE_SF, SPLIT_V, L2NORM, V_FIRST, BETA_RESIDUAL,
                       READ_SLOTS or HAS_MASK, STORE_CK, CK_EVERY, TRANSITION)
    elif SHORT == HEADS:
        # The f mod C tokens before the chunks of a PHASED sequence, from its initial state; the
        # state after them into SF (the next launch's S0), and a first checkpoint that falls there
        # (f < C, or the sequence ends in its head).
        first = _first_checkpoint(CK_FIRST, i_n, CK_EVERY, C)
        head = min(first % C, eos - bos)
        ck_row = ct.where((head > 0) & ((first < C) | (head == eos - bos)), ck_row, CK.shape[1])
        _one_chunk(Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, SF, CK, bos, head, i_h, i_hv, i_v, scale, s_in, s_out,
                   use_s0, ck_row, K, BV, C, HAS_S0, STORE_SF, SPLIT_V, L2NORM, V_FIRST, BETA_RESIDUAL,
                   READ_SLOTS or HAS_MASK, STORE_CK, CK_EVERY, TRANSITION)
    elif SHORT == LONG_ONLY:
        if eos - bos > C:
            _sequence(Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, SF, CK, CK_FIRST, bos, eos, i_n, i_h, i_hv, i_v, scale,
                      s_in, s_out, use_s0, ck_b, ck_row, K, BV, C, HAS_S0, STORE_SF, SPLIT_V, PACKED, L2NORM,
                      V_FIRST, BETA_RESIDUAL, READ_SLOTS or HAS_MASK, STORE_CK, CK_EVERY, TRANSITION, PHASED)
    else:
        _sequence(Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, SF, CK, CK_FIRST, bos, eos, i_n, i_h, i_hv, i_v, scale, s_in,
                  s_out, use_s0, ck_b, ck_row, K, BV, C, HAS_S0, STORE_SF, SPLIT_V, PACKED, L2NORM, V_FIRST,
                  BETA_RESIDUAL, READ_SLOTS or HAS_MASK, STORE_CK, CK_EVERY, TRANSITION, PHASED)


@ct.function
def _sequence(Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, SF, CK, CK_FIRST, bos, eos, i_n, i_h, i_hv, i_v, scale,
              s_in, s_out, use_s0, ck_b, ck_row, K: ConstInt, BV: ConstInt, C: ConstInt, HAS_S0: ConstBool,
              STORE_SF: ConstBool, SPLIT_V: ConstBool, PACKED: ConstBool, L2NORM: ConstBool, V_FIRST: ConstBool,
              BETA_RESIDUAL: ConstBool, S0_CHECKED: ConstBool, STORE_CK: ConstBool, CK_EVERY: ConstInt,
              TRANSITION: ConstBool, PHASED: ConstBool):
    """One program's sequence chunk after chunk (the kernel's arguments, resolved): o, checkpoints
    and the final state stored. PHASED (packed, with checkpoints): the sequence's first checkpoint
    falls after its first CK_FIRST[i_n] = f tokens (1 ≤ f ≤ E·C, E = CK_EVERY), the next ones every
    E·C tokens after it; its chunks are then cut from token f mod C on, the f mod C tokens before
    them (its head) taken first as a chunk of their own by the launch before (HEADS, whose states
    after the heads are then S0; stages 1–3 cut them so too: kda_opt/seqs.phased), so that every
    checkpoint falls at the end of a chunk. (The head computed here, before the loop or in its first
    iteration, took the compiler off the warp-specialised schedule: 255 registers, spills.)"""
    i_b = i_n
    ck_shift = 0                          # PHASED: chunks the checkpoint count runs ahead (_checkpoint_row)
    if PHASED:
        # The head (its first f mod C tokens) was the launch before's (HEADS), which left the
        # state after it in S0; the chunks start after it.
        first = _first_checkpoint(CK_FIRST, i_n, CK_EVERY, C)
        bos = bos + min(first % C, eos - bos)
        ck_shift = CK_EVERY - first // C
    if PACKED:
        i_b = 0
    T = eos - bos                                             # the sequence's tokens (after a PHASED head)
    state_order = (0, 1, 3, 2) if V_FIRST else (0, 1, 2, 3)
    # Checkpoints (the state after every CK_EVERY chunks and after the last; a row past the buffer's
    # end is dropped, _checkpoint_row) go where the compiler's schedule hides their store best
    # (docs/DESIGN.md): the state entering chunk i_t (row i_t − 1) stored inside its iteration before
    # the update, for an fp32 V-first buffer and K-first ones with the widest V block; else the state
    # after chunk i_t at the end of its iteration (16-bit V-first buffers stored early took the kernel
    # off its schedule: 255 registers).
    ck_early = (V_FIRST and CK.dtype == F32) or (not V_FIRST and BV == BLOCK_V_CHOICES[-1])
    # An fp32 V-first buffer every few chunks at V blocks wider than the narrowest: the loop runs in
    # intervals of CK_EVERY chunks and stores the state after each. (In the one loop, the store of
    # every iteration, dropped where no checkpoint falls, cost as much as a checkpoint per chunk, and
    # a branch around it took the compiler off its schedule at the widest V block; at the narrowest
    # the intervals cost more than the dropped stores, and with K-first or 16-bit buffers they spill:
    # docs/DESIGN.md.)
    intervals = STORE_CK and CK_EVERY > 1 and BV > BLOCK_V_CHOICES[0] and V_FIRST and CK.dtype == F32
    ck_early, ck_late = STORE_CK and ck_early and not intervals, STORE_CK and not ck_early and not intervals
    # S0 joins S inside the first iteration, not before the loop: loaded there, its tile gave the
    # loop-carried S another layout, and the compiler then dropped the warp-specialised pipeline
    # (255 registers, spills; an initial state doubled this kernel's time). Here the kernel is the
    # one without a state (tests/test_wuso.py compares their resources).
    S = ct.zeros((K, BV), dtype=F32)
    chunks = ct.cdiv(T, C)
    if intervals:
        blocks, lead, row0 = ct.cdiv(chunks, CK_EVERY), CK_EVERY, ck_row
        if PHASED:
            # The first interval ends at the first checkpoint after the head (lead chunks), or, where
            # that one falls in the head (the heads launch's), at the next; none is empty (a loop
            # with an empty first interval hung the GPU).
            lead = ct.where(ck_shift < CK_EVERY, CK_EVERY - ck_shift, CK_EVERY)
            row0 = ct.where(ck_shift < CK_EVERY, ck_row, ck_row + 1)
            blocks = ct.where(chunks > 0, 1 + ct.cdiv(max(chunks - lead, 0), CK_EVERY), 0)
        for i_blk in range(blocks):
            t0 = i_blk * CK_EVERY
            if PHASED:
                t0 = ct.where(i_blk == 0, 0, lead + (i_blk - 1) * CK_EVERY)
            for i_in in range(min(ct.where(i_blk == 0, lead, CK_EVERY) if PHASED else CK_EVERY, chunks - t0)):
                i_t = t0 + i_in
                S = _chunk(S, i_t, Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, CK, i_b, bos, i_h, i_hv, i_v, T, chunks,
                           scale, s_in, use_s0, ck_b, ck_row, ck_shift, K, BV, C, HAS_S0, SPLIT_V, PACKED, L2NORM,
                           V_FIRST, BETA_RESIDUAL, S0_CHECKED, False, False, CK_EVERY, TRANSITION)
            _checkpoint(CK, S, ck_b, row0 + i_blk, i_hv, i_v, K, BV, V_FIRST)
    else:
        for i_t in range(chunks):
            S = _chunk(S, i_t, Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, CK, i_b, bos, i_h, i_hv, i_v, T, chunks, scale,
                       s_in, use_s0, ck_b, ck_row, ck_shift, K, BV, C, HAS_S0, SPLIT_V, PACKED, L2NORM, V_FIRST,
                       BETA_RESIDUAL, S0_CHECKED, ck_early, ck_late, CK_EVERY, TRANSITION)
    if ck_early:                                              # the last chunk's (none if T = 0)
        last = _checkpoint_row(chunks + ck_shift, chunks + ck_shift, ck_row, CK.shape[1], CK_EVERY)
        if PHASED:                                            # (ended in its head: the heads launch's)
            last = ct.where(chunks > 0, last, CK.shape[1])
        _checkpoint(CK, S, ck_b, last, i_hv, i_v, K, BV, V_FIRST)
    if HAS_S0:
        if T == 0:                                            # an empty packed sequence keeps its state
            S = _initial_state(S0, s_in, use_s0, i_hv, i_v, K, BV, V_FIRST, S0_CHECKED)
    if STORE_SF:
        ct.store(SF, index=(s_out, i_hv, 0, i_v), tile=S.astype(SF.dtype).reshape((1, 1, K, BV)), order=state_order)


@ct.function
def _one_chunk(Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, SF, CK, bos, n, i_h, i_hv, i_v, scale, s_in, s_out, use_s0,
               ck_row, K: ConstInt, BV: ConstInt, C: ConstInt, HAS_S0: ConstBool, STORE_SF: ConstBool,
               SPLIT_V: ConstBool, L2NORM: ConstBool, V_FIRST: ConstBool, BETA_RESIDUAL: ConstBool,
               S0_CHECKED: ConstBool, STORE_CK: ConstBool, CK_EVERY: ConstInt, TRANSITION: ConstBool):
    """A packed sequence of n ≤ C tokens from row bos, its one chunk (_packed_tiles), from its
    initial state to its final state, with no loop."""
    dt = ct.tfloat32 if Q.dtype == F32 else Q.dtype                           # products' operands
    # A box wholly past the arrays' end is undefined: an empty sequence at the end (n = 0, none of
    # whose rows is used) reads the last row's.
    row0 = min(bos, Q.shape[1] - 1)
    q, k, g, v, tm, aqk, tok, valid = _packed_tiles(Q, Kx, Vx, G, TM, AQK, row0, n, i_h, i_hv, i_v, K, BV, C,
                                                    TRANSITION)
    last = ct.full((1, 1), bos + n - 1, dtype=ct.int64)
    g_last = _rows(G, last, last >= bos, i_hv, 0, K)                           # [1, K]; 0 where n = 0
    S = ct.zeros((K, BV), dtype=F32)
    if HAS_S0:
        S = _initial_state(S0, s_in, use_s0, i_hv, i_v, K, BV, V_FIRST, S0_CHECKED)
    o, v_new, k_dec_t, decay = _products(S, q, k, g, v, tm, aqk, g_last, RSTD, RB, (0, i_h, 0), (0, i_hv, 0),
                                         tok, valid, scale, dt, C, L2NORM, BETA_RESIDUAL, SPLIT_V, True)
    if not TRANSITION:
        _store_rows(O, o, tok, valid, i_hv, i_v * BV, BV)
    # With n = 0: Γ_last = 0 and k, V' zero, so S stays S0 exactly.
    S = ct.mma(k_dec_t.astype(dt), v_new, S * decay)                            # [K, BV]
    if STORE_CK:
        _checkpoint(CK, S, 0, _checkpoint_row(ct.cdiv(n, C), ct.cdiv(n, C), ck_row, CK.shape[1], CK_EVERY), i_hv,
                    i_v, K, BV, V_FIRST)
    if STORE_SF:
        ct.store(SF, index=(s_out, i_hv, 0, i_v), tile=S.astype(SF.dtype).reshape((1, 1, K, BV)),
                 order=(0, 1, 3, 2) if V_FIRST else (0, 1, 2, 3))


@ct.function
def _packed_tiles(Q, Kx, Vx, G, TM, AQK, row0, n, i_h, i_hv, i_v, K: ConstInt, BV: ConstInt, C: ConstInt,
                  TRANSITION: ConstBool):
    """A packed sequence's chunk, rows row0 .. row0 + C − 1 of the whole [1, T, ...] arrays, of which the
    first n are its own: q, k, Γ [C, K], v [C, BV] (zeros with TRANSITION), Tm, Aqk [C, C] (_slice);
    and their token rows tok [C, 1] int64, valid [C, 1]. The rows past n are the next sequences':
    Γ and v are zeroed there, and _products zeroes k (after its norm) and V' there, so that nothing
    of those rows, NaN included, reaches this sequence's o or S (Tm's and Aqk's rows of this
    sequence are zero past their diagonal; their other rows, and q's, reach only o's rows past n,
    which are not stored). (Zeroing q, Tm and Aqk as well spilled the loop's registers.) A view of
    the sequence's rows instead would have each program write a TMA descriptor per array into a
    per-SM workspace outside the call's allocations (docs/DESIGN.md, "Memory safety"): most of a
    short sequence's time, and writes compute-sanitizer reports as out of bounds."""
    row = ct.arange(C, dtype=ct.int64).reshape((C, 1))
    tok, valid = row0 + row, row < n
    q = _slice(Q, row0, i_h, 0, C, K)
    k = _slice(Kx, row0, i_h, 0, C, K)
    g = ct.where(valid, _slice(G, row0, i_hv, 0, C, K), 0.0)
    if TRANSITION:
        v = ct.zeros((C, BV), dtype=F32)
    else:
        v = ct.where(valid, _slice(Vx, row0, i_hv, i_v * BV, C, BV), 0)
    tm = _slice(TM, row0, i_hv, 0, C, C)
    aqk = _slice(AQK, row0, i_hv, 0, C, C)
    return q, k, g, v, tm, aqk, tok, valid


@ct.function
def _chunk_tile(A, i_b, i_t, head, col_block, C: ConstInt, W: ConstInt, tma: ConstBool):
    """A [B, T, H, ·] array's tile [C, W] of chunk i_t (fixed length) at head `head`, column block
    col_block of W columns: a TMA box where `tma`, else a plain load; zeros past T."""
    return ct.load(A, index=(i_b, i_t, head, col_block), shape=(1, C, 1, W), padding_mode=ZERO,
                   allow_tma=tma).reshape((C, W))


@ct.function
def _slice(A, row0, head, col0, R: ConstInt, W: ConstInt):
    """A [1, T, H, ·] array's tile [R, W] of rows row0 .. row0 + R − 1 at head `head`, columns col0 ..
    col0 + W − 1: one TMA box at element coordinates on the array's own descriptor (no view); zeros
    past T."""
    return ct.load_advanced_indexing(A, (ct.zeros((1,), dtype=ct.int32), ct.Slice(row0, R), ct.Slice(head, 1),
                                         ct.Slice(col0, W)), padding_mode=ZERO).reshape((R, W))


@ct.function
def _rows(A, tok, valid, head, col0, W: ConstInt):
    """A [1, T, H, ·] array's tile [R, W] at token rows tok [R, 1] (int64), head `head`, columns
    col0 .. col0 + W − 1, by element offsets; zeros where not valid [R, 1]."""
    col = ct.arange(W, dtype=ct.int64).reshape((1, W))
    at = tok * A.strides[1] + head * A.strides[2] + (col0 + col) * A.strides[3]
    return A.get_raw_memory().load_offset(at, mask=valid & (col >= 0))


@ct.function
def _store_rows(A, tile, tok, valid, head, col0, W: ConstInt):
    """tile [R, W] into a [1, T, H, ·] array (in its dtype) at token rows tok [R, 1] (int64), head
    `head`, columns col0 .. col0 + W − 1, by element offsets, where valid [R, 1]: a TMA box would
    write the next sequence's rows too."""
    col = ct.arange(W, dtype=ct.int64).reshape((1, W))
    at = tok * A.strides[1] + head * A.strides[2] + (col0 + col) * A.strides[3]
    A.get_raw_memory().store_offset(at, tile.astype(A.dtype), mask=valid & (col >= 0))


@ct.function
def _chunk(S, i_t, Q, Kx, Vx, G, TM, AQK, RB, RSTD, S0, O, CK, i_b, bos, i_h, i_hv, i_v, T, chunks, scale, s_in,
           use_s0, ck_b, ck_row, ck_shift, K: ConstInt, BV: ConstInt, C: ConstInt, HAS_S0: ConstBool,
           SPLIT_V: ConstBool, PACKED: ConstBool, L2NORM: ConstBool, V_FIRST: ConstBool, BETA_RESIDUAL: ConstBool,
           S0_CHECKED: ConstBool, CK_EARLY: ConstBool, CK_LATE: ConstBool, CK_EVERY: ConstInt,
           TRANSITION: ConstBool):
    """Chunk i_t of one program's sequence of T tokens from row bos of entry i_b (the kernel's loop
    body): S after it, o stored; with CK_EARLY the state entering it, with CK_LATE the state after it,
    stored as a checkpoint where one falls. PACKED: rows read and o stored as _packed_tiles says.
    TRANSITION: v taken as zero and no o (the columns of S are the transition's, module docstring)."""
    dt = ct.tfloat32 if Q.dtype == F32 else Q.dtype                           # products' operands
    if HAS_S0:
        if i_t == 0:
            S = S + _initial_state(S0, s_in, use_s0, i_hv, i_v, K, BV, V_FIRST, S0_CHECKED)
    # Γ_last from its own row: a zero-padded tail row would read as Γ = 0.
    last = bos + min(i_t * C + C, T) - 1
    if PACKED:
        row0 = bos + i_t * C
        q, k, g, v, tm, aqk, tok, valid = _packed_tiles(Q, Kx, Vx, G, TM, AQK, row0, T - i_t * C, i_h, i_hv,
                                                        i_v, K, BV, C, TRANSITION)
        g_last = ct.load(G, index=(i_b, last, i_hv, 0), shape=(1, 1, 1, K)).reshape((1, K))
        o, v_new, k_dec_t, decay = _products(S, q, k, g, v, tm, aqk, g_last, RSTD, RB, (i_b, i_h, 0), (i_b, i_hv, 0),
                                             tok, valid, scale, dt, C, L2NORM, BETA_RESIDUAL, SPLIT_V, True)
        if not TRANSITION:
            _store_rows(O, o, tok, valid, i_hv, i_v * BV, BV)
    else:
        # Rows past T (tail chunk) load as zeros, so they add nothing; the O store drops them.
        # fp32 inputs: q, k and Γ by plain loads, not TMA boxes. Staged in shared memory beside Tm and
        # Aqk they leave no room for the products' operands, and every product falls back from wgmma
        # to mma.sync, with kilobytes of stack at the wider V blocks (sm_90 cubins: tests/test_wuso.py).
        tma = Q.dtype != F32
        q = _chunk_tile(Q, i_b, i_t, i_h, 0, C, K, tma)
        k = _chunk_tile(Kx, i_b, i_t, i_h, 0, C, K, tma)
        g = _chunk_tile(G, i_b, i_t, i_hv, 0, C, K, tma)
        if TRANSITION:
            v = ct.zeros((C, BV), dtype=F32)
        else:
            v = _chunk_tile(Vx, i_b, i_t, i_hv, i_v, C, BV, True)
        tm = _chunk_tile(TM, i_b, i_t, i_hv, 0, C, C, True)
        aqk = _chunk_tile(AQK, i_b, i_t, i_hv, 0, C, C, True)
        g_last = ct.load(G, index=(i_b, last, i_hv, 0), shape=(1, 1, 1, K)).reshape((1, K))
        o, v_new, k_dec_t, decay = _products(S, q, k, g, v, tm, aqk, g_last, RSTD, RB, (i_b, i_h, i_t),
                                             (i_b, i_hv, i_t), None, None, scale, dt, C, L2NORM, BETA_RESIDUAL,
                                             SPLIT_V, False)
        if not TRANSITION:
            ct.store(O, index=(i_b, i_t, i_hv, i_v), tile=o.astype(O.dtype).reshape((1, C, 1, BV)))
    if CK_EARLY:
        _checkpoint(CK, S, ck_b, _checkpoint_row(i_t + ck_shift, chunks + ck_shift, ck_row, CK.shape[1], CK_EVERY),
                    i_hv, i_v, K, BV, V_FIRST)
    S = ct.mma(k_dec_t.astype(dt), v_new, S * decay)                            # [K, BV]
    if CK_LATE:
        _checkpoint(CK, S, ck_b, _checkpoint_row(i_t + 1 + ck_shift, chunks + ck_shift, ck_row, CK.shape[1],
                                                 CK_EVERY), i_hv, i_v, K, BV, V_FIRST)
    return S


@ct.function
def _products(S, q, k, g, v, tm, aqk, g_last, RSTD, RB, at_qk, at_v, tok, valid, scale, dt, C: ConstInt,
              L2NORM: ConstBool, BETA_RESIDUAL: ConstBool, SPLIT_V: ConstBool, PACKED: ConstBool):
    """One chunk's products from S [K, BV] fp32 and its tiles (q, k [C, K]; Γ [C, K]; v [C, BV]; Tm,
    Aqk [C, C]; Γ_last [1, K]): o [C, BV], V' (dt), (k ⊙ 2^(Γ_last − Γ))ᵀ [K, C] and 2^Γ_last [K, 1],
    from which S ← decay·S + k_decᵀ V'. Where asked, the q/k norms (RSTD [2, B, H, T]) and β's
    residual (RB [B, HV, T]) are read here, where the chunk uses them (loaded with the other tiles,
    they cost FlashKDA's call 1.5–3 %): at (b, head, chunk) at_qk and at_v, or, PACKED (the tiles
    _packed_tiles'), at (0, head) and token rows tok [C, 1] by element offsets, k and V' then zeroed
    where not valid [C, 1]."""
    kf = k.astype(F32)
    qf = q.astype(F32)
    if L2NORM:
        # FLA's l2norm per row (use_qk_l2norm_in_kernel), with stage 2's norms: a row reduction
        # here would sit on the chunk's dependency chain.
        if PACKED:
            at = at_qk[1] * RSTD.strides[2] + tok * RSTD.strides[3]
            rq = RSTD.get_raw_memory().load_offset(at, mask=valid)
            rk = RSTD.get_raw_memory().load_offset(at + RSTD.strides[0], mask=valid)
        else:
            b, h, t = at_qk[0], at_qk[1], at_qk[2]
            rq = ct.load(RSTD, index=(0, b, h, t), shape=(1, 1, 1, C), padding_mode=ZERO).reshape((C, 1))
            rk = ct.load(RSTD, index=(1, b, h, t), shape=(1, 1, 1, C), padding_mode=ZERO).reshape((C, 1))
        qf = qf * rq
        kf = kf * rk
    if PACKED:
        kf = ct.where(valid, kf, 0.0)
    # ftz: gates drive 2^Γ into subnormals, which are worth nothing next to the state.
    eg = ct.exp2(g, flush_to_zero=True)                                          # [C, K]
    s_op = S.astype(dt)                                                          # [K, BV]
    # V' = Tm (v − (2^Γ ⊙ k) S): W = Tm (2^Γ ⊙ k) and U are never formed, which saves their
    # products and W's [C, K] operand in every V block, at the same error against float64 (a
    # torch emulation of both orders, bf16 and fp32, agreed to two digits).
    x = ct.mma((kf * -eg).astype(dt), s_op, v.astype(F32))                     # v − (2^Γ ⊙ k) S
    if BETA_RESIDUAL:
        if PACKED:
            r = RB.get_raw_memory().load_offset(at_v[1] * RB.strides[1] + tok * RB.strides[2], mask=valid)
        else:
            r = ct.load(RB, index=at_v, shape=(1, 1, C), padding_mode=ZERO).reshape((C, 1))
        v_f32 = ct.mma(tm.astype(dt), x.astype(dt), r * x)                      # V' [C, BV]
    else:
        v_f32 = ct.mma(tm.astype(dt), x.astype(dt), ct.zeros(x.shape, dtype=F32))
    if PACKED:
        v_f32 = ct.where(valid, v_f32, 0.0)
    v_new = v_f32.astype(dt)
    o = ct.mma((qf * eg * scale).astype(dt), s_op, ct.zeros(x.shape, dtype=F32))
    if SPLIT_V:
        # O takes V' as hi + lo (one more product, off the state's chain): V' rounded to
        # bf16 then reaches O only through S.
        o = ct.mma(aqk.astype(dt), (v_f32 - v_new.astype(F32)).astype(dt), o)
    o = ct.mma(aqk.astype(dt), v_new, o)                                         # [C, BV]
    # (k ⊙ 2^(Γ_last − Γ))ᵀ from k and Γ transposed before the product: transposing the product
    # makes the compiler redo its exp2 per fragment of the mma operand (4× the exp2, and spills).
    # 2^(Γ_last − Γ) ≤ 1 on valid rows: never 2^Γ_last · 2^−Γ, which overflows.
    g_last_t = ct.transpose(g_last)                                              # [K, 1]
    k_dec_t = ct.transpose(kf) * ct.exp2(g_last_t - ct.transpose(g), flush_to_zero=True)  # [K, C]
    return o, v_new, k_dec_t, ct.exp2(g_last_t, flush_to_zero=True)


@ct.function
def _initial_state(S0, row, use, i_hv, i_v, K: ConstInt, BV: ConstInt, V_FIRST: ConstBool, CHECKED: ConstBool):
    """S0's [K, BV] tile of (state row, value head i_hv, V block i_v) in fp32, from [N, HV, K, V]
    or [N, HV, V, K] (V_FIRST); if CHECKED, zeros where not `use` (whatever the row holds, NaN too)."""
    order = (0, 1, 3, 2) if V_FIRST else (0, 1, 2, 3)
    tile = ct.load(S0, index=(row, i_hv, 0, i_v), shape=(1, 1, K, BV), order=order).reshape((K, BV)).astype(F32)
    if CHECKED:
        tile = ct.where(use, tile, 0.0)
    return tile


@ct.function
def _first_checkpoint(CK_FIRST, i_n, EVERY: ConstInt, C: ConstInt):
    """f: sequence i_n's tokens before its first checkpoint (PHASED), clamped to 1 .. EVERY·C."""
    return min(max(ct.load(CK_FIRST, index=(i_n,), shape=(1,)).astype(ct.int32).item(), 1), EVERY * C)


@ct.function
def _checkpoint_row(done, chunks, first, rows, EVERY: ConstInt):
    """The checkpoint row of a sequence's state after `done` of its `chunks` chunks: first + cdiv(done,
    EVERY) − 1 where done is a positive multiple of EVERY or the last chunk, else `rows` (past the
    buffer: the store is dropped)."""
    if EVERY == 1:
        return ct.where(done > 0, first + done - 1, rows)
    return ct.where((done > 0) & ((done % EVERY == 0) | (done == chunks)), first + ct.cdiv(done, EVERY) - 1, rows)


@ct.function
def _checkpoint(CK, S, b, row, i_hv, i_v, K: ConstInt, BV: ConstInt, V_FIRST: ConstBool):
    """S [K, BV] into checkpoint row (b, row) of CK [B, rows, HV, K, V] ([…, V, K] if V_FIRST), in CK's
    dtype. An fp32 V-first buffer in four row blocks of S, without TMA: one transposed fp32 [K, BV]
    store took the compiler off the warp-specialised schedule (255 registers); quarters keep 168, as
    one transposed 16-bit store does (sm_90 cubins)."""
    ck = S.astype(CK.dtype)
    if V_FIRST and CK.dtype == F32:
        for j in ct.static_iter(range(4)):
            ct.store(CK, index=(b, row, i_hv, j, i_v), order=(0, 1, 2, 4, 3), allow_tma=False,
                     tile=ct.extract(ck, (j, 0), shape=(K // 4, BV)).reshape((1, 1, 1, K // 4, BV)))
    else:
        ct.store(CK, index=(b, row, i_hv, 0, i_v), tile=ck.reshape((1, 1, 1, K, BV)),
                 order=(0, 1, 2, 4, 3) if V_FIRST else (0, 1, 2, 3, 4))


def block_v_for(programs: int, V: int, sms: int, dtype: torch.dtype) -> int:
    """BV for `programs` = N·HV (sequence, value head) pairs: the narrowest block whose grid still
    fits one wave of one CTA per SM (narrower blocks shorten each CTA's products), else the widest
    (the exp2 work of the chunk, repeated per V block, then dominates)."""
    # fp32 inputs: at most 64 columns. At 128 the tf32 products take about 240 registers, not 168, and the
    # default shape's stage 4 ran slower than at 64 (docs/DESIGN.md, "fp32 inputs").
    widest = 64 if dtype == torch.float32 else V
    fits = [bv for bv in BLOCK_V_CHOICES if bv <= min(V, widest) and V % bv == 0]
    return next((bv for bv in fits if programs * (V // bv) <= sms), fits[-1])


@functools.cache
def _stand_in(device: torch.device, ndim: int, dtype: torch.dtype) -> torch.Tensor:
    """What the launch passes for an absent input (None: S0, final state, cu_seqlens, β residual,
    norms, slots, mask, checkpoints), as cuTile takes arrays only: the matching constant (HAS_S0,
    STORE_SF, PACKED, ...) compiles its access away."""
    return constant(torch.empty((1,) * ndim, dtype=dtype, device=device))


@functools.cache
def _kernel(worker_warps: int):
    """wuso_kernel compiled with `worker_warps` worker warps (WORKER_WARPS: the kernel itself)."""
    return wuso_kernel if worker_warps == WORKER_WARPS else wuso_kernel.replace_hints(num_worker_warps=worker_warps)


# wuso_kernel's parameters in order (tests/test_wuso.py holds them to the kernel's): one launch's
# arguments as a record, which launch_config makes by name and the launcher edits by name.
Arguments = collections.namedtuple("Arguments", (
    "Q Kx Vx G TM AQK RB RSTD S0 O SF CU SLOTS MASK CK CK_ROW0 CK_FIRST ORDER scale K BV C HAS_S0 STORE_SF SPLIT_V "
    "PACKED L2NORM V_FIRST BETA_RESIDUAL READ_SLOTS WRITE_SLOTS HAS_MASK STORE_CK CK_EVERY TRANSITION PHASED ORDERED "
    "SHORT"))


def launch_config(q, k, v, gcum, Tm, Aqk, scale, block_v, initial_state, o, final_state, cu_seqlens=None,
                  qk_rstd=None, state_v_first=False, beta_residual=None, slots=None, read_slots=False,
                  write_slots=False, has_initial_state=None, checkpoints=None, checkpoint_rows=None,
                  checkpoint_every=1, transition=False, sequences=EVERY_SEQUENCE, checkpoint_first=None,
                  order=None):
    """(grid, Arguments) of one launch: the one place both the launcher and the export test
    (tests/test_wuso.py, on meta tensors) take the kernel's specialisation from. sequences: which
    packed sequences, or what of them, the launch computes (EVERY_SEQUENCE, LONG_ONLY, SHORT_ONLY,
    HEADS). checkpoint_first: as wuso's (PHASED). order: as wuso's, or None (grid order)."""
    B, _, HV, V = v.shape
    given = lambda x, ndim, dtype=torch.float32: _stand_in(v.device, ndim, dtype) if x is None else x
    args = Arguments(
        Q=q, Kx=k, Vx=v, G=gcum, TM=Tm, AQK=Aqk, RB=given(beta_residual, 3), RSTD=given(qk_rstd, 4),
        S0=given(initial_state, 4), O=o, SF=given(final_state, 4), CU=given(cu_seqlens, 1, torch.int32),
        SLOTS=given(slots, 1, torch.int32), MASK=given(has_initial_state, 1, torch.bool), CK=given(checkpoints, 5),
        CK_ROW0=given(checkpoint_rows, 1, torch.int32), CK_FIRST=given(checkpoint_first, 1, torch.int32),
        ORDER=given(order, 1, torch.int32), scale=float(scale), K=q.shape[-1], BV=block_v, C=CHUNK,
        HAS_S0=initial_state is not None, STORE_SF=final_state is not None, SPLIT_V=q.dtype == torch.bfloat16,
        PACKED=cu_seqlens is not None, L2NORM=qk_rstd is not None, V_FIRST=state_v_first,
        BETA_RESIDUAL=beta_residual is not None, READ_SLOTS=read_slots, WRITE_SLOTS=write_slots,
        HAS_MASK=has_initial_state is not None, STORE_CK=checkpoints is not None, CK_EVERY=checkpoint_every,
        TRANSITION=transition, PHASED=checkpoint_first is not None, ORDERED=order is not None, SHORT=sequences)
    columns = q.shape[-1] if transition else V                # the transition's state is [K, K]
    if B == 1 and max(x.stride(0) for x in (q, k, v, gcum, o, checkpoints) if x is not None) > INT32_MAX:
        args = args._make(map(_int32_strides, args))   # the largest arrays' batch strides: the others' are smaller
    return (columns // block_v, num_sequences(B, cu_seqlens) * HV, 1), args


_FIELD = {name: i for i, name in enumerate(Arguments._fields)}


def _edited(args: Arguments, **changes) -> Arguments:
    """args with the named fields changed (namedtuple's _replace, for a fraction of its host time)."""
    values = list(args)
    for name, x in changes.items():
        values[_FIELD[name]] = x
    return Arguments._make(values)


def _int32_strides(x):
    """x as cuTile takes an array, whose strides must each fit an int32: a tensor whose leading
    dimension has one entry (B = 1: one sequence, or the packed ones, however long) with that
    dimension's stride, which no index multiplies, set to the next one's; anything else as it is
    (kda_opt/plan refuses a batch entry that would need more)."""
    if isinstance(x, torch.Tensor) and x.dim() > 1 and x.shape[0] == 1 and x.stride(0) > INT32_MAX:
        return x.as_strided(x.shape, (x.stride(1), *x.stride()[1:]))
    return x


def wuso(q, k, v, gcum, Tm, Aqk, scale: float, block_v: int, *, initial_state=None, final_state=None,
         slots=None, read_slots: bool = False, write_slots: bool = False, has_initial_state=None, checkpoints=None,
         checkpoint_rows=None, checkpoint_every: int = 1, checkpoint_first=None, cu_seqlens=None, qk_rstd=None,
         state_v_first: bool = False,
         beta_residual=None, transition: bool = False, short_sequences: bool = False, decoded: bool = False,
         order=None, sequence_counts=None, out=None, worker_warps: int = WORKER_WARPS):
    """Stage 4 on the current stream: o [B, T, HV, V] (v's dtype), returned; the final states written
    into final_state. Inputs as in the module docstring, validated by kda_opt/plan (q, k, v may be
    views whose token rows are dense and evenly spaced); absent ones None; cu_seqlens [N + 1] packs
    N sequences into the one batch entry.
    initial_state, final_state: [N, HV, K, V] ([N, HV, V, K] with state_v_first; final_state fp32,
    bf16 or fp16), or state pools [slots, HV, K, V] whose rows are dense (stride(0) may pad them),
    read (read_slots) or written (write_slots) at row slots[n] ([N] int32/int64) for sequence n;
    has_initial_state ([N] bool): sequence n starts from zeros where false. checkpoints: [B, NT, HV,
    K, V] (V-first with state_v_first; fp32, bf16 or fp16), the state after every checkpoint_every
    chunks and after the last: checkpoint j of sequence n (its state after min((j + 1)·E, its chunks)
    chunks, E = checkpoint_every) at [n, j], or packed (B = 1) at [0, checkpoint_rows[n] + j]
    (checkpoint_rows [N] int32: Σ_{m<n} cdiv(len_m, 64·E), kda_opt/seqs); rows past NT are not
    written. checkpoint_first (packed, with checkpoints): [N] int32/int64, sequence n's first
    checkpoint after its first f_n tokens (1 ≤ f_n ≤ 64·E, clamped), then every 64·E tokens and
    after its last; its chunks then start at token f_n mod 64, the tokens before taken as a chunk
    of their own, as stages 1–3 must have cut them (_sequence); checkpoint_rows then counts
    1 + cdiv(max(len_m − f_m, 0), 64·E) rows per non-empty sequence. block_v: V columns per
    program (block_v_for's choice, made by kda_opt/plan). qk_rstd: stage 2's [2, B, H, T] fp32 norms
    (l2norm). beta_residual: stage 2's r [B, HV, T] fp32 (module docstring). transition: v taken as
    zero over K state columns, no o (returns None): from initial states I [N, HV, K, K] the final
    states are each sequence's transition M, S_out = M S_in + (its final state from zero), which
    kda_opt/schedules' parallel segments merge. out: o's storage, a
    [B, T, HV, V] tensor of v's dtype whose rows are contiguous (a slice along T of a B = 1 tensor,
    kda_opt/schedules' time segments), or None for a new one. short_sequences (packed): two launches, the
    sequences longer than a chunk and those of at most one chunk (_one_chunk), each skipping the
    other's; decoded: the short launch skips the sequences of one token (kda_opt/recurrence computes
    them). order (packed): [N] int32, a permutation of the sequences (kda_opt/seqs.longest_first):
    program i of the grid computes sequence order[i] (the short launch keeps the grid's order).
    sequence_counts (short_sequences): the sequences counted on the host (kda_opt/seqs.Counts): a
    launch with none of its kind is not made, and with an order the long launch's grid covers only
    the long sequences (the first `long` of the order); None: both launches over every sequence.
    worker_warps: the kernel's worker warps. A written pool or checkpoint buffer of one row is
    written through a two-row copy (_two_rows)."""
    o = v if transition else torch.empty_like(v) if out is None else out      # (transition: never written)
    pool = _two_rows(final_state, 0) if write_slots else final_state
    rows = _two_rows(checkpoints, 1)
    # What every launch of this call shares (launch_config's parameters by name).
    common = dict(q=q, k=k, v=v, gcum=gcum, Tm=Tm, Aqk=Aqk, scale=scale, block_v=block_v, o=o, cu_seqlens=cu_seqlens,
                  qk_rstd=qk_rstd, state_v_first=state_v_first, beta_residual=beta_residual, slots=slots,
                  checkpoints=rows, checkpoint_rows=checkpoint_rows, checkpoint_every=checkpoint_every,
                  checkpoint_first=checkpoint_first)
    if checkpoint_first is not None:
        # The heads from the initial states into `heads`, then the chunks from there (_sequence).
        B, _, HV, V = v.shape
        heads = v.new_empty(state_shape(num_sequences(B, cu_seqlens), HV, q.shape[-1], V, state_v_first),
                            dtype=torch.float32)
        grid, first = launch_config(**common, initial_state=initial_state, final_state=heads, read_slots=read_slots,
                                    has_initial_state=has_initial_state, sequences=HEADS)
        _, rest = launch_config(**common, initial_state=heads, final_state=pool, write_slots=write_slots,
                                sequences=EVERY_SEQUENCE, order=order)
        launches = ((grid, first), (grid, rest))
    else:
        grid, args = launch_config(**common, initial_state=initial_state, final_state=pool, read_slots=read_slots,
                                   write_slots=write_slots, has_initial_state=has_initial_state, transition=transition,
                                   order=order)
        launches = ((grid, args),)
        if short_sequences and cu_seqlens is not None:
            short = SEVERAL_ONLY if decoded else SHORT_ONLY
            long_grid, long_count, short_count = grid, 1, 1
            if sequence_counts is not None:
                long_count, short_count = sequence_counts.long, sequence_counts.short
                if order is not None:
                    long_grid = (grid[0], long_count * v.shape[2], 1)
            launches = tuple((g, a) for g, a, count in ((long_grid, _edited(args, SHORT=LONG_ONLY), long_count),
                                                        (grid, _edited(args, ORDERED=False, SHORT=short), short_count))
                             if count)
    for grid, args in launches:
        cutile_launch(grid, _kernel(worker_warps), args)
    _copy_back(final_state, pool, 0)
    _copy_back(checkpoints, rows, 1)
    return None if transition else o


def _two_rows(buffer, dim: int):
    """A buffer the kernel writes, or a two-row copy of it where it has one row along `dim` (then
    _copy_back). The kernel drops a store by pointing it one row past the end (a pool slot outside
    the pool, a checkpoint past the buffer), and cuTile compiles an extent of 1 as that constant:
    such a store would land in row 0."""
    return buffer if buffer is None or buffer.shape[dim] != 1 else torch.cat((buffer, buffer), dim)


def _copy_back(buffer, written, dim: int):
    """Row 0 of _two_rows' copy back into `buffer` (nothing where the buffer was written itself)."""
    if written is not buffer:
        buffer.copy_(written.narrow(dim, 0, 1))
