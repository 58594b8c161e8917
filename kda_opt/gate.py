"""Stage 1: gate activation, chunk-local cumsum and the change to log2 units, in one Triton kernel.

    a = lower_bound · sigmoid(exp(A_log) · (g + dt_bias))    (lower_bound given; A_log optional)
    a = −exp(A_log) · softplus(g + dt_bias)                  (otherwise)
    a = g                                                    (gate not activated in kernel)
    Γ_t = Σ_{s ≤ t in t's chunk} max(a_s, floor) / ln 2      (log2 units: later stages use exp2)
floor = −24 ln 2 (kda_opt/options.LOG_DECAY_FLOOR): a decay below 2^-24 per token counts as 2^-24.
In: g [B, T, HV, K], A_log [HV], dt_bias [HV·K] (any float dtypes, read as fp32).  Out: Γ [B, T, HV, K] fp32.
Chunks start at each sequence's first token (kda_opt/seqs: fixed-length or packed sequences).
"""
import torch
import triton
import triton.language as tl

from .launch import Kernels, triton_launch
from .options import CHUNK, LOG_DECAY_FLOOR, GateConfig
from .seqs import Seqs, chunk_span, fixed

# Gate modes, resolved once by the launcher from the GateConfig.
PREACTIVATED: tl.constexpr = tl.constexpr(0)
SIGMOID: tl.constexpr = tl.constexpr(1)
SOFTPLUS: tl.constexpr = tl.constexpr(2)
FLOOR: tl.constexpr = tl.constexpr(LOG_DECAY_FLOOR)


@triton.jit(do_not_specialize=["T"])
def gate_cumsum_kernel(
    g, A_log, dt_bias, gcum,       # [B, T, HV, K], [HV] or None, [HV·K] or None, [B, T, HV, K]
    cu_seqlens, chunk_indices,      # packed sequences (kda_opt/seqs), or None
    T, lower_bound,
    HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    MODE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, PACKED: tl.constexpr,
):
    i_bh, i_t, i_k = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % HV
    bos, T, i_t = chunk_span(i_bh // HV, i_t, T, cu_seqlens, chunk_indices, PACKED)
    if PACKED:
        if i_t * C >= T:  # a spare slot
            return
    o_t = i_t * C + tl.arange(0, C)
    o_k = i_k * BK + tl.arange(0, BK)
    m_tk = (o_t[:, None] < T) & (o_k[None, :] < K)
    # Row t of the sequence starting at row bos, head h, sits at ((bos + t)·HV + h)·K.
    o_tk = ((bos + o_t[:, None]) * HV + i_h) * K + o_k[None, :]
    b_x = tl.load(g + o_tk, mask=m_tk, other=0.0).to(tl.float32)
    # Rows past T were loaded as 0 and activate to a finite value; they are never stored.
    b_x = log_decay(b_x, A_log, dt_bias, i_h, o_k, lower_bound, K, MODE, HAS_A, HAS_BIAS)
    b_g = tl.cumsum(b_x, axis=0) * 1.4426950408889634  # 1 / ln 2
    tl.store(gcum + o_tk, b_g, mask=m_tk)


@triton.jit
def log_decay(b_x, A_log, dt_bias, i_h, o_k, lower_bound, K: tl.constexpr, MODE: tl.constexpr,
              HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The floored log-decay max(a, floor) of the raw gate b_x [..., BK] (module docstring) of value
    head i_h at channels o_k [BK]; also kda_opt/recurrence's."""
    if MODE != PREACTIVATED:
        if HAS_BIAS:
            b_x += tl.load(dt_bias + i_h * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)
        if HAS_A:
            b_rate = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if MODE == SIGMOID:
            if HAS_A:
                b_x = b_x * b_rate
            b_x = lower_bound * tl.sigmoid(b_x)
        else:
            # softplus(x) = max(x, 0) + log(1 + exp(−|x|)): no overflow for large x.
            b_x = -b_rate * (tl.maximum(b_x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_x))))
    return tl.maximum(b_x, FLOOR)


def gate_mode(gate: GateConfig):
    """The kernels' gate mode (PREACTIVATED, SIGMOID or SOFTPLUS) of a GateConfig."""
    return PREACTIVATED if not gate.in_kernel else SIGMOID if gate.lower_bound is not None else SOFTPLUS


def gate_cumsum(g: torch.Tensor, gate: GateConfig, A_log=None, dt_bias=None, seqs: Seqs | None = None, *,
                out: torch.Tensor | None = None, kernels: Kernels | None = None):
    """Γ = chunk-local cumsum of the activated gate, in log2 units: [B, T, HV, K] float32. A_log,
    dt_bias: contiguous, of any float dtype (read as fp32), or None. seqs: the sequence layout
    (kda_opt/seqs); None is B sequences of T tokens; rows of no chunk in it are left unwritten. out:
    Γ's storage, a contiguous fp32 tensor (None: a new one). kernels: the plan's compiled kernels
    (kda_opt/launch), or None."""
    B, T, HV, K = g.shape
    seqs = seqs or fixed(T)
    gcum = torch.empty(B, T, HV, K, dtype=torch.float32, device=g.device) if out is None else out
    # Plain integer arithmetic: triton.cdiv and next_power_of_2 cost microseconds a call in Python.
    BK = min(64, 1 << (K - 1).bit_length())
    # gate_cumsum_kernel's parameters in order (by name they cost the launch a dict).
    triton_launch(
        gate_cumsum_kernel, (B * HV, seqs.chunk_slots, -(-K // BK)), kernels,
        g, A_log, dt_bias, gcum, seqs.cu_seqlens, seqs.chunk_indices, T, float(gate.lower_bound or 0.0),
        HV, K, CHUNK, BK, gate_mode(gate), A_log is not None, dt_bias is not None, seqs.packed,
    )
    return gcum
