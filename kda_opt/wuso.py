"""Stage 4: W, U, the chunk-to-chunk state recurrence and the output, in one cuTile kernel.

Per (batch b, value head hv, block of BV value columns), chunk after chunk, carrying S [K, BV] fp32:
    V' = U − W S = Tm (v − (2^Γ ⊙ k) S)          (W = Tm (2^Γ ⊙ k), U = Tm v)
    O  = scale·(q ⊙ 2^Γ) S + Aqk V',   S ← Diag(2^Γ_last) S + (k ⊙ 2^(Γ_last − Γ))ᵀ V'
Γ in log2 units; Γ_last is Γ at the chunk's last valid row. In: q, k [B, T, H, K] bf16/fp16/fp32;
v [B, T, HV, V]; Γ [B, T, HV, K] fp32; Tm [B, T, HV, 64] (k's dtype); Aqk [B, T, HV, 64] (q's dtype,
scale included); S0 [B, HV, K, V] fp32 or none. Out: o [B, T, HV, V] in v's dtype; S [B, HV, K, V] fp32.
Products take 16-bit operands (fp32 inputs: fp32) with fp32 accumulation. For bf16 inputs O's Aqk V'
takes V' as hi + lo, which pays for stage 2's bf16 products (kda_opt/intra): o's error against
float64, emulated, is 3.3e-3 with them and one rounded V', 2.9e-3 with the split, as with tf32.
"""
import functools

import cuda.tile as ct
import torch

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
WORKER_WARPS = 8


# The algorithm of FLA's three forward steps after the solve, fused: recompute_w_u_fwd
# (fla/ops/kda/wy_fast.py), chunk_gated_delta_rule_fwd_h (fla/ops/common/chunk_delta_h.py) and
# chunk_gla_fwd_o_gk (fla/ops/gla/chunk.py); S never leaves the chip and W, U never exist.
@ct.kernel(num_worker_warps=WORKER_WARPS)
def wuso_kernel(Q, Kx, Vx, G, TM, AQK, S0, O, SF, scale: float,
                K: ConstInt, BV: ConstInt, C: ConstInt, HAS_S0: ConstBool, STORE_SF: ConstBool,
                SPLIT_V: ConstBool):
    i_v, i_bh = ct.bid(0), ct.bid(1)
    T, H, HV = Q.shape[1], Q.shape[2], Vx.shape[2]
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)                                   # GVA: HV / H value heads per q/k head
    dt = Q.dtype                                              # mma operand dtype; fp32 stays fp32
    if HAS_S0:
        S = ct.load(S0, index=(i_b, i_hv, 0, i_v), shape=(1, 1, K, BV)).reshape((K, BV))
    else:
        S = ct.zeros((K, BV), dtype=F32)
    for i_t in range(ct.cdiv(T, C)):
        # Rows past T (tail chunk) load as zeros, so they add nothing; the O store drops them.
        q = ct.load(Q, index=(i_b, i_t, i_h, 0), shape=(1, C, 1, K), padding_mode=ZERO).reshape((C, K))
        k = ct.load(Kx, index=(i_b, i_t, i_h, 0), shape=(1, C, 1, K), padding_mode=ZERO).reshape((C, K))
        g = ct.load(G, index=(i_b, i_t, i_hv, 0), shape=(1, C, 1, K), padding_mode=ZERO).reshape((C, K))
        v = ct.load(Vx, index=(i_b, i_t, i_hv, i_v), shape=(1, C, 1, BV), padding_mode=ZERO).reshape((C, BV))
        tm = ct.load(TM, index=(i_b, i_t, i_hv, 0), shape=(1, C, 1, C), padding_mode=ZERO).reshape((C, C))
        aqk = ct.load(AQK, index=(i_b, i_t, i_hv, 0), shape=(1, C, 1, C), padding_mode=ZERO).reshape((C, C))
        # Γ_last from its own row: a zero-padded tail row would read as Γ = 0.
        last = min(i_t * C + C, T) - 1
        g_last = ct.load(G, index=(i_b, last, i_hv, 0), shape=(1, 1, 1, K)).reshape((1, K))
        kf = k.astype(F32)
        # ftz: gates drive 2^Γ into subnormals, which are worth nothing next to the state.
        eg = ct.exp2(g, flush_to_zero=True)                                          # [C, K]
        s_op = S.astype(dt)                                                          # [K, BV]
        # V' = Tm (v − (2^Γ ⊙ k) S): W = Tm (2^Γ ⊙ k) and U are never formed, which saves their
        # products and W's [C, K] operand in every V block, at the same error against float64 (a
        # torch emulation of both orders, bf16 and fp32, agreed to two digits).
        x = ct.mma((kf * -eg).astype(dt), s_op, v.astype(F32))                     # v − (2^Γ ⊙ k) S
        v_f32 = ct.mma(tm.astype(dt), x.astype(dt), ct.zeros((C, BV), dtype=F32))   # V' [C, BV]
        v_new = v_f32.astype(dt)
        o = ct.mma((q.astype(F32) * eg * scale).astype(dt), s_op, ct.zeros((C, BV), dtype=F32))
        if SPLIT_V:
            # O takes V' as hi + lo (one more product, off the state's chain): V' rounded to
            # bf16 then reaches O only through S.
            o = ct.mma(aqk.astype(dt), (v_f32 - v_new.astype(F32)).astype(dt), o)
        o = ct.mma(aqk.astype(dt), v_new, o)                                         # [C, BV]
        ct.store(O, index=(i_b, i_t, i_hv, i_v), tile=o.astype(O.dtype).reshape((1, C, 1, BV)))
        # (k ⊙ 2^(Γ_last − Γ))ᵀ from k and Γ transposed before the product: transposing the product
        # makes the compiler redo its exp2 per fragment of the mma operand (4× the exp2, and spills).
        # 2^(Γ_last − Γ) ≤ 1 on valid rows: never 2^Γ_last · 2^−Γ, which overflows.
        g_last_t = ct.transpose(g_last)                                              # [K, 1]
        k_dec_t = ct.transpose(kf) * ct.exp2(g_last_t - ct.transpose(g), flush_to_zero=True)  # [K, C]
        S = ct.mma(k_dec_t.astype(dt), v_new, S * ct.exp2(g_last_t, flush_to_zero=True))     # [K, BV]
    if STORE_SF:
        ct.store(SF, index=(i_b, i_hv, 0, i_v), tile=S.reshape((1, 1, K, BV)))


def block_v_for(programs: int, V: int, sms: int, dtype: torch.dtype) -> int:
    """BV for `programs` = B·HV (batch, value head) pairs: the narrowest block whose grid still fits
    one wave of one CTA per SM (narrower blocks shorten each CTA's products), else the widest (the
    exp2 work of the chunk, repeated per V block, then dominates)."""
    fits = [bv for bv in BLOCK_V_CHOICES if bv <= V and V % bv == 0]
    if dtype == torch.float32:
        # fp32 products run on CUDA cores (no fp32 wgmma) and already spill at the narrowest block.
        return fits[0]
    return next((bv for bv in fits if programs * (V // bv) <= sms), fits[-1])


@functools.cache
def _absent(device: torch.device) -> torch.Tensor:
    """Stands in for a missing S0 / final state: HAS_S0 / STORE_SF compile its access away."""
    return torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device)


def launch_config(q, k, v, gcum, Tm, Aqk, scale, initial_state, o, final_state, block_v, chunk_size=64):
    """(grid, kernel arguments) of one launch: the one place both the launcher and the export test
    (tests/test_wuso.py, on meta tensors) take the kernel's specialisation from."""
    B, _, HV, V = v.shape
    absent = _absent(v.device)
    args = (q, k, v, gcum, Tm, Aqk, absent if initial_state is None else initial_state, o,
            absent if final_state is None else final_state, float(scale),
            q.shape[-1], block_v, chunk_size, initial_state is not None, final_state is not None,
            q.dtype == torch.bfloat16)
    return (V // block_v, B * HV, 1), args


def wuso(q, k, v, gcum, Tm, Aqk, scale: float, initial_state=None, output_final_state=False,
         chunk_size: int = 64, block_v: int | None = None):
    """Stage 4 on the current stream: o [B, T, HV, V] (v's dtype) and the final state [B, HV, K, V]
    fp32, or None unless output_final_state. Inputs as in the module docstring, contiguous (kda_forward
    validates them). block_v: V columns per program; None picks it with block_v_for."""
    B, _, HV, V = v.shape
    o = torch.empty_like(v)
    final = v.new_empty((B, HV, q.shape[-1], V), dtype=torch.float32) if output_final_state else None
    if block_v is None:
        sms = torch.cuda.get_device_properties(v.device).multi_processor_count
        block_v = block_v_for(B * HV, V, sms, q.dtype)
    grid, args = launch_config(q, k, v, gcum, Tm, Aqk, scale, initial_state, o, final, block_v, chunk_size)
    ct.launch(torch.cuda.current_stream(), grid, wuso_kernel, args)
    return o, final
