"""The token recurrence itself, a few tokens per request, over a state pool in place: the kernels of
kda_decode (decode and speculative verify, kda_opt/decode) and of a packed kda_forward call's
sequences of one token. Per request n and value head h, state S [K, V] fp32 from its start row, per token t:
    a = max(log-decay of g_t, floor)   (kda_opt/gate.log_decay: the prefill's activation and floor)
    S ← Diag(exp a) S;  u = β_t (v_t − Sᵀ k_t);  S ← S + k_t uᵀ;  o_t = Sᵀ (scale · q_t)
(q_t, k_t L2-normalised first with l2norm; β_t = β_scale · sigmoid(beta_t) with logits), then S to
its row(s). One program per (request, value head, V block of BV columns; for V-first fp32 states a
(request, head)'s blocks are neighbouring programs, which read its rows together): its state block is read
once and written once (per token only where the caller asks for each token's state), so a step
moves the state's bytes and little else: the recurrence as FLA's `fused_recurrent_kda` computes it
(its decode kernel), not the chunked form. V-first 16-bit states of one state per request (from
decode_plan.STREAMED_FROM programs an SM): one program per (request, value head) instead, its token vectors
made once and its rows walked in blocks of BV, the next block loaded ahead (streamed_decode_kernel).
In: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV] (B = 1 with cu_seqlens);
states [N, HV, K, V] or a pool [slots, HV, K, V] (V-first: [·, HV, V, K]; fp32, bf16 or fp16).
Out: o [B, T, HV, V] in v's dtype; the states written as kda_decode's docstring says.
"""
import triton
import triton.language as tl

from .decode_plan import DecodePlan
from .gate import gate_mode, log_decay
from .launch import Kernels, triton_launch
from .options import L2NORM_EPS, Read, Write


# The modes as the kernel compares them (Triton reads globals only as constexprs).
READ_ROW, READ_SLOT = tl.constexpr(Read.ROW), tl.constexpr(Read.SLOT)
WRITE_ROW, WRITE_SLOT, WRITE_EACH_TOKEN = tl.constexpr(Write.ROW), tl.constexpr(Write.SLOT), tl.constexpr(Write.EACH_TOKEN)
WRITE_BUFFER = tl.constexpr(Write.BUFFER)
L2_EPS = tl.constexpr(L2NORM_EPS)


@triton.jit(do_not_specialize=["T", "slots", "pad_slot", "buffer_slots", "parent_columns"])
def decode_kernel(
    q, k, v, g, beta, A_log, dt_bias, o,    # tokens [·, ·, heads, channels]: row r at r · S*T, head at S*H
    s_in, s_out,                            # states: row r at r · S_IN / r · S_OUT; None where absent
    cu_seqlens, indices, accepted, has_state,  # [N + 1]; [N, COLUMNS] slots (row stride S_IDX); [N]; [N] bool
    buffer_rows,                            # [N]: s_out's rows of [COLUMNS, HV, ·, ·] states (WRITE_BUFFER)
    parents,                                # [N, parent_columns]: token t's parent token (TREE; row stride S_PAR)
    T, slots, pad_slot, buffer_slots, parent_columns, scale, lower_bound,
    SQT, SQH, SKT, SKH, SVT, SVH, SGT, SGH, SBT, SBH, SOT, SOH, S_IN, S_OUT, S_IDX, S_PAR,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    MODE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, V_FIRST: tl.constexpr, PACKED: tl.constexpr, READ: tl.constexpr,
    WRITE: tl.constexpr, COLUMNS: tl.constexpr, ACCEPTED: tl.constexpr, PAD: tl.constexpr, HAS_MASK: tl.constexpr,
    SINGLE: tl.constexpr, BLOCKS_FIRST: tl.constexpr, TREE: tl.constexpr,
):
    # READ (kda_opt/options.Read): zeros, dense row n, or pool row indices[n, accepted[n] − 1] (column
    # 0 without accepted); with HAS_MASK zeros where has_state[n] is false. WRITE (options.Write):
    # nothing, dense row n after the last token, pool row indices[n] after it, or pool row
    # indices[n, t] after each token t (speculative verify), or the buffer's row buffer_rows[n], its
    # state t, after each token t < COLUMNS (SGLang's verify: s_in the pool, only read); with TREE a
    # token t > 0 starts from the buffer's state after its parent token parents[n, t] where that is one
    # of 0 .. t − 1 it wrote, else from the state after token t − 1. SINGLE: only the sequences of one
    # token (kda_forward's, where a packed call leaves them to this kernel); a program of any other
    # reads, computes and writes nothing.
    if BLOCKS_FIRST:    # grid (V / BV, HV, N): a (request, head)'s V blocks are neighbouring programs
        i_v, i_hv, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    else:               # grid (N·HV, V / BV)
        i_nh, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
        i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T = _tokens(cu_seqlens, i_n, T, PACKED)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    # The state block [K, BV] at (channel, column), in either layout.
    o_s = o_v[None, :] * K + o_k[:, None] if V_FIRST else o_k[:, None] * V + o_v[None, :]
    o_s += i_hv * K * V
    # A request is live where its accepted count names one of its columns; a pad row reads zeros and
    # writes nothing. A row's index is compared as a block of it (_rows): Triton 3.9's interpreter
    # compares a loaded scalar into an int64 mask, which it then refuses.
    live = True
    column = 0
    if ACCEPTED:
        column = tl.load(accepted + i_n).to(tl.int64) - 1
        live = (column >= 0) & (column < COLUMNS)
    if SINGLE:
        live = live & (T == 1)
        T = tl.where(T == 1, T, 0)
    reads = live
    if HAS_MASK:
        reads = reads & (tl.load(has_state + i_n) != 0)
    b_s = tl.zeros([K, BV], dtype=tl.float32)
    if READ == READ_ROW:
        row = _rows(tl.where(reads, i_n, -1), K, BV)
        b_s = tl.load(s_in + row * S_IN + o_s, mask=row >= 0, other=0.0).to(tl.float32)
    if READ == READ_SLOT:
        row = _rows(_slot(indices, i_n, column, reads, slots, pad_slot, S_IDX, PAD), K, BV)
        b_s = tl.load(s_in + row * S_IN + o_s, mask=row >= 0, other=0.0).to(tl.float32)
    # The request's buffer row, read once (−1: not written); with TREE, token t + 1's parent is loaded
    # while token t runs, and token t's vectors before its parent's state, so that only the barrier and
    # that state stand before each token. An fp32 buffer's state after token t − 1 is the one in
    # registers, bit for bit: a parent t − 1 is not read back from it.
    buffer_row = i_n * 0 - 1
    if WRITE == WRITE_BUFFER:
        buffer_row = _slot(buffer_rows, i_n, 0, live, buffer_slots, pad_slot, 1, False)
    next_parent = i_n * 0 - 1          # token 0's: never read
    for t in range(T):
        r = bos + t
        b_q, b_k, b_d, b_beta = _token(q, k, g, beta, A_log, dt_bias, r, i_h, i_hv, scale, lower_bound,
                                       SQT, SQH, SKT, SKH, SGT, SGH, SBT, SBH, K, MODE, HAS_A, HAS_BIAS, L2NORM,
                                       BETA_SIGMOID)
        b_v = tl.load(v + r * SVT + i_hv * SVH + o_v).to(tl.float32)
        if TREE:
            parent = next_parent
            next_parent = tl.load(parents + i_n * S_PAR + t + 1, mask=live & (t + 1 < T) & (t + 1 < parent_columns),
                                  other=-1).to(tl.int64)
            reload = (buffer_row >= 0) & (parent >= 0) & (parent < t) & (parent < COLUMNS)
            if s_out.dtype.element_ty == tl.float32:
                reload = reload & (parent != t - 1)
            if reload:
                tl.debug_barrier()      # the parent's state, stored by this program, read back by any thread
                b_s = tl.load(s_out + buffer_row * S_OUT + parent * (HV * K * V) + o_s).to(tl.float32)
        b_s, b_o = step(b_s, b_q, b_k, b_v, b_d, b_beta)
        tl.store(o + r * SOT + i_hv * SOH + o_v, b_o.to(o.dtype.element_ty))
        if WRITE == WRITE_EACH_TOKEN:
            row = _rows(_slot(indices, i_n, t, live & (t < COLUMNS), slots, pad_slot, S_IDX, PAD), K, BV)
            tl.store(s_out + row * S_OUT + o_s, b_s.to(s_out.dtype.element_ty), mask=row >= 0)
        if WRITE == WRITE_BUFFER:
            row = _rows(tl.where(t < COLUMNS, buffer_row, -1), K, BV)
            tl.store(s_out + row * S_OUT + t * (HV * K * V) + o_s, b_s.to(s_out.dtype.element_ty), mask=row >= 0)
    if WRITE == WRITE_ROW:
        row = _rows(tl.where(live, i_n, -1), K, BV)
        tl.store(s_out + row * S_OUT + o_s, b_s.to(s_out.dtype.element_ty), mask=row >= 0)
    if WRITE == WRITE_SLOT:
        row = _rows(_slot(indices, i_n, 0, live, slots, pad_slot, S_IDX, PAD), K, BV)
        tl.store(s_out + row * S_OUT + o_s, b_s.to(s_out.dtype.element_ty), mask=row >= 0)


@triton.jit(do_not_specialize=["T", "slots", "pad_slot"])
def streamed_decode_kernel(
    q, k, v, g, beta, A_log, dt_bias, o,    # as decode_kernel's
    s_in, s_out, cu_seqlens, indices,       # V-first states [·, HV, V, K]; [N + 1]; [N] slots
    T, slots, pad_slot, scale, lower_bound,
    SQT, SQH, SKT, SKH, SVT, SVH, SGT, SGH, SBT, SBH, SOT, SOH, S_IN, S_OUT, S_IDX,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    MODE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, PACKED: tl.constexpr, READ: tl.constexpr, WRITE: tl.constexpr, PAD: tl.constexpr,
    ONE_TOKEN: tl.constexpr, IN_PLACE: tl.constexpr,
):
    # One program (one warp) per (request, value head): its first token's vectors made once, then its
    # V-first state walked in blocks of BV rows (each row's recurrence is its own: the rows share only
    # the token's vectors), the next block (and its first token's v) loaded while this one is computed,
    # each block written back once its tokens are done. READ: zeros, dense row n or pool row indices[n];
    # WRITE: nothing, dense row n or pool row indices[n] (kda_opt/options).
    i_nh = tl.program_id(0).to(tl.int64)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T = _tokens(cu_seqlens, i_n, T, PACKED)
    o_r = tl.arange(0, BV)
    o_s = i_hv * V * K + o_r[:, None] * K + tl.arange(0, K)[None, :]      # block 0's rows of the head
    slot = -1
    if READ == READ_SLOT or WRITE == WRITE_SLOT:
        slot = _slot(indices, i_n, 0, True, slots, pad_slot, S_IDX, PAD)
    row_in = -1
    if READ == READ_ROW:
        row_in = i_n
    if READ == READ_SLOT:
        row_in = slot
    row_out = -1
    if WRITE == WRITE_ROW:
        row_out = i_n
    if WRITE == WRITE_SLOT:
        row_out = slot
    # A row of −1 is neither read (zeros) nor written; IN_PLACE: the state is written where it was read.
    m_in, m_out = _rows(row_in, BV, K) >= 0, _rows(row_out, BV, K) >= 0
    p_in = s_in + tl.maximum(row_in, 0) * S_IN + o_s
    p_out = p_in
    if not IN_PLACE:
        p_out = s_out + tl.maximum(row_out, 0) * S_OUT + o_s
    # The first token's row (a request without tokens reads row 0, which every call has, and uses none).
    r0 = tl.where(T > 0, bos, 0)
    b_q0, b_k0, b_d0, b_beta0 = _token(q, k, g, beta, A_log, dt_bias, r0, i_h, i_hv, scale, lower_bound,
                                       SQT, SQH, SKT, SKH, SGT, SGH, SBT, SBH, K, MODE, HAS_A, HAS_BIAS, L2NORM,
                                       BETA_SIGMOID)
    b_next = tl.load(p_in, mask=m_in, other=0.0)
    b_v_next = tl.load(v + r0 * SVT + i_hv * SVH + o_r)
    for j in range(V // BV):
        b_s, b_v0 = b_next.to(tl.float32), b_v_next.to(tl.float32)
        more = j + 1 < V // BV
        b_next = tl.load(p_in + (j + 1) * BV * K, mask=m_in & more, other=0.0)
        b_v_next = tl.load(v + r0 * SVT + i_hv * SVH + (j + 1) * BV + o_r, mask=(o_r >= 0) & more, other=0.0)
        for t in range(1 if ONE_TOKEN else T):
            r = bos + t
            b_q, b_k, b_d, b_beta, b_v = b_q0, b_k0, b_d0, b_beta0, b_v0
            if not ONE_TOKEN and t > 0:
                b_q, b_k, b_d, b_beta = _token(q, k, g, beta, A_log, dt_bias, r, i_h, i_hv, scale, lower_bound,
                                               SQT, SQH, SKT, SKH, SGT, SGH, SBT, SBH, K, MODE, HAS_A, HAS_BIAS,
                                               L2NORM, BETA_SIGMOID)
                b_v = tl.load(v + r * SVT + i_hv * SVH + j * BV + o_r).to(tl.float32)
            b_s *= b_d[None, :]
            b_u = (b_v - tl.sum(b_s * b_k[None, :], 1)) * b_beta
            b_s += b_u[:, None] * b_k[None, :]
            tl.store(o + r * SOT + i_hv * SOH + j * BV + o_r, tl.sum(b_s * b_q[None, :], 1).to(o.dtype.element_ty))
        tl.store(p_out + j * BV * K, b_s.to(s_out.dtype.element_ty), mask=m_out)


@triton.jit
def _tokens(cu_seqlens, i_n, T, PACKED: tl.constexpr):
    """Request i_n's first token row and its number of tokens: from cu_seqlens where PACKED, else
    i_n · T and T (a batch of requests of T tokens)."""
    if PACKED:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T
    return bos, T


@triton.jit
def _token(q, k, g, beta, A_log, dt_bias, r, i_h, i_hv, scale, lower_bound,
           SQT, SQH, SKT, SKH, SGT, SGH, SBT, SBH, K: tl.constexpr, MODE: tl.constexpr, HAS_A: tl.constexpr,
           HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Token row r's vectors for value head i_hv (query head i_h): scale · q and k [K] (L2-normalised
    first with L2NORM), the decay exp(a) [K] and β."""
    o_k = tl.arange(0, K)
    b_q = tl.load(q + r * SQT + i_h * SQH + o_k).to(tl.float32)
    b_k = tl.load(k + r * SKT + i_h * SKH + o_k).to(tl.float32)
    if L2NORM:
        b_q, b_k = l2normalised(b_q), l2normalised(b_k)
    b_a = log_decay(tl.load(g + r * SGT + i_hv * SGH + o_k).to(tl.float32), A_log, dt_bias, i_hv, o_k, lower_bound,
                    K, MODE, HAS_A, HAS_BIAS)
    b_beta = tl.load(beta + r * SBT + i_hv * SBH).to(tl.float32)
    if BETA_SIGMOID > 0:
        b_beta = BETA_SIGMOID * tl.sigmoid(b_beta)
    return b_q * scale, b_k, tl.exp(b_a), b_beta


@triton.jit
def step(b_s, b_q, b_k, b_v, b_d, b_beta):
    """One token's step on a state block b_s [K, BV] (fp32): (the new block, o [BV])."""
    b_s *= b_d[:, None]
    b_u = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
    b_s += b_k[:, None] * b_u[None, :]
    return b_s, tl.sum(b_s * b_q[:, None], 0)


@triton.jit
def l2normalised(b_x):
    """b_x / sqrt(Σ b_x² + L2NORM_EPS), FLA's l2norm of one head's vector."""
    return b_x / tl.sqrt(tl.sum(b_x * b_x) + L2_EPS)


@triton.jit
def _slot(indices, i_n, column, live, slots, pad_slot, S_IDX, PAD: tl.constexpr):
    """The pool row at indices[i_n, column] (int64), or −1 where the request is not live, the index is
    negative, past the pool, or the declared pad slot: such a row is neither read nor written."""
    row = tl.load(indices + i_n * S_IDX + column, mask=live, other=-1).to(tl.int64)
    ok = (row >= 0) & (row < slots)
    if PAD:
        ok = ok & (row != pad_slot)
    return tl.where(ok, row, -1)


@triton.jit
def _rows(row, R: tl.constexpr, C: tl.constexpr):
    """The pool row index `row` as an [R, C] block, one per element of a state block."""
    return row + tl.zeros([R, C], dtype=tl.int64)


def decode(plan: DecodePlan, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, final_state=None,
           cu_seqlens=None, indices=None, accepted=None, out=None, has_initial_state=None, buffer_rows=None,
           parents=None, *, kernels: Kernels | None = None):
    """o [B, T, HV, V] (into `out` if given), the states read from initial_state and written into
    final_state as the plan says (module docstring; with Write.BUFFER final_state is the buffer
    [rows, S, HV, ·, ·], buffer_rows [N] its rows and parents [N, P], where given, each token's parent).
    Inputs validated by kda_opt/decode_plan's make_decode_plan (or kda_opt/plan's make_plan, for a packed prefill's sequences
    of one token: plan.single); their last dimension dense. has_initial_state: [N] bool, zeros where
    false (kda_forward's)."""
    o = v.new_empty(v.shape) if out is None else out      # dense: token row r at r · stride(1)
    stand_in = q                       # a pointer for absent arrays, never dereferenced
    # One stride() per tensor (each stride(d) call costs more than the whole tuple).
    sq, sk, sv, sg, sb, so = (x.stride() for x in (q, k, v, g, beta, o))
    s_in = stand_in if initial_state is None else initial_state
    s_out = stand_in if final_state is None else final_state
    if plan.streamed:
        triton_launch(
            streamed_decode_kernel, (plan.N * plan.HV,), kernels,
            q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, cu_seqlens, indices,
            plan.T, plan.slots, -1 if plan.pad_slot is None else plan.pad_slot, plan.scale,
            float(plan.gate.lower_bound or 0.0),
            sq[1], sq[2], sk[1], sk[2], sv[1], sv[2], sg[1], sg[2], sb[1], sb[2], so[1], so[2],
            s_in.stride(0), s_out.stride(0), 0 if indices is None else indices.stride(0),
            plan.H, plan.HV, plan.K, plan.V, plan.block_v, gate_mode(plan.gate), A_log is not None,
            dt_bias is not None, plan.l2norm, plan.beta_sigmoid or 0.0, plan.packed, plan.read, plan.write,
            plan.pad_slot is not None, not plan.packed and plan.T == 1,
            s_in is s_out and plan.read == plan.write, num_warps=plan.num_warps,
        )
        return o
    # decode_kernel's parameters in order (a decode step's host time is mostly its launch's).
    triton_launch(
        decode_kernel, (plan.V // plan.block_v, plan.HV, plan.N) if plan.blocks_first
        else (plan.N * plan.HV, plan.V // plan.block_v), kernels,
        q, k, v, g, beta, A_log, dt_bias, o,
        s_in, s_out, cu_seqlens, indices, accepted, has_initial_state, buffer_rows, parents,
        plan.T, plan.slots, -1 if plan.pad_slot is None else plan.pad_slot,
        0 if buffer_rows is None else final_state.shape[0], 0 if parents is None else parents.shape[1], plan.scale,
        float(plan.gate.lower_bound or 0.0),
        sq[1], sq[2], sk[1], sk[2], sv[1], sv[2], sg[1], sg[2], sb[1], sb[2], so[1], so[2],
        0 if initial_state is None else initial_state.stride(0), 0 if final_state is None else final_state.stride(0),
        0 if indices is None else indices.stride(0),      # [N] indices: one column, row n at n · stride
        0 if parents is None else parents.stride(0),
        plan.H, plan.HV, plan.K, plan.V, plan.block_v, gate_mode(plan.gate), A_log is not None, dt_bias is not None,
        plan.l2norm, plan.beta_sigmoid or 0.0, plan.state_v_first, plan.packed, plan.read, plan.write, plan.columns,
        accepted is not None, plan.pad_slot is not None, has_initial_state is not None, plan.single,
        plan.blocks_first, parents is not None, num_warps=plan.num_warps,
    )
    return o
