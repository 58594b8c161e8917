"""Stage 4: W, U, the chunk-to-chunk state recurrence and the output, in one cuTile kernel.

Per (batch, value head, block of BV value columns), chunk after chunk, with S [K, BV] fp32:
    W = Tm (2^Γ ⊙ k),  U = Tm v,  V' = U − W S,  O = scale·(q ⊙ 2^Γ) S + Aqk V',
    S ← Diag(2^Γ_last) S + (k ⊙ 2^(Γ_last − Γ))ᵀ V'          (Γ_last: the chunk's last valid row)
In: q, k [B, T, H, K]; v [B, T, HV, V]; Γ [B, T, HV, K] fp32 (log2 units); Tm, Aqk [B, T, HV, 64];
S0 [B, HV, K, V] fp32 or none.  Out: o [B, T, HV, V] in v's dtype; final S [B, HV, K, V] fp32.
Products run on tensor cores with operands in q's dtype and fp32 accumulation.
"""
import cuda.tile as ct
import torch

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
BLOCK_V = 32  # B·HV·(V/32) programs: the state chain, not the arithmetic, limits this kernel


@ct.kernel
def wuso_kernel(Q, Kt, Vt, G, TM, AQK, S0, O, SF, scale: float, HV: int, GROUP: int,
                K: ConstInt, BV: ConstInt, C: ConstInt, HAS_S0: ConstBool, STORE_SF: ConstBool):
    i_v = ct.bid(0)
    i_bh = ct.bid(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // GROUP
    T = Q.shape[1]
    dt = Q.dtype
    if HAS_S0:
        S = ct.load(S0, index=(i_b, i_hv, 0, i_v), shape=(1, 1, K, BV)).reshape((K, BV))
    else:
        S = ct.full((K, BV), 0.0, dtype=ct.float32)
    for i_t in range(ct.cdiv(T, C)):
        # Rows past T (tail chunk) load as zeros and contribute nothing; stores past T are dropped.
        q = ct.load(Q, index=(i_b, i_t, i_h, 0), shape=(1, C, 1, K), padding_mode=ZERO).reshape((C, K))
        k = ct.load(Kt, index=(i_b, i_t, i_h, 0), shape=(1, C, 1, K), padding_mode=ZERO).reshape((C, K))
        g = ct.load(G, index=(i_b, i_t, i_hv, 0), shape=(1, C, 1, K), padding_mode=ZERO).reshape((C, K))
        v = ct.load(Vt, index=(i_b, i_t, i_hv, i_v), shape=(1, C, 1, BV), padding_mode=ZERO).reshape((C, BV))
        tm = ct.load(TM, index=(i_b, i_t, i_hv, 0), shape=(1, C, 1, C), padding_mode=ZERO).reshape((C, C))
        aqk = ct.load(AQK, index=(i_b, i_t, i_hv, 0), shape=(1, C, 1, C), padding_mode=ZERO).reshape((C, C))
        last = i_t * C + min(C, T - i_t * C) - 1
        g_last = ct.load(G, index=(i_b, last, i_hv, 0), shape=(1, 1, 1, K)).reshape((1, K))
        kf = k.astype(ct.float32)
        eg = ct.exp2(g)                                                          # [C, K]
        w = ct.mma(tm, (kf * eg).astype(dt), ct.full((C, K), 0.0, dtype=ct.float32))
        u = ct.mma(tm, v, ct.full((C, BV), 0.0, dtype=ct.float32))
        s_op = S.astype(dt)
        v_new = u - ct.mma(w.astype(dt), s_op, ct.full((C, BV), 0.0, dtype=ct.float32))
        v_op = v_new.astype(dt)
        qg = (q.astype(ct.float32) * eg * scale).astype(dt)
        o = ct.mma(aqk, v_op, ct.mma(qg, s_op, ct.full((C, BV), 0.0, dtype=ct.float32)))
        ct.store(O, index=(i_b, i_t, i_hv, i_v), tile=o.astype(O.dtype).reshape((1, C, 1, BV)))
        k_dec = (kf * ct.exp2(g_last - g)).astype(dt)                           # [C, K]
        S = ct.mma(ct.transpose(k_dec), v_op, S * ct.transpose(ct.exp2(g_last)))
    if STORE_SF:
        ct.store(SF, index=(i_b, i_hv, 0, i_v), tile=S.reshape((1, 1, K, BV)))


def launch_config(q, v, chunk_size, has_state, store_state):
    """Grid and compile-time constants: the one place the launcher and the export test get them."""
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    grid = (V // BLOCK_V, B * HV, 1)
    return grid, (HV, HV // H, K, BLOCK_V, chunk_size, has_state, store_state)


def wuso(q, k, v, gcum, Tm, Aqk, scale: float, initial_state=None, output_final_state=False,
         chunk_size: int = 64):
    """o [B, T, HV, V] (v's dtype) and the final state [B, HV, K, V] fp32 (or None)."""
    B, _, HV, V = v.shape
    K = q.shape[-1]
    o = torch.empty_like(v)
    final = torch.empty(B, HV, K, V, dtype=torch.float32, device=v.device) if output_final_state else None
    grid, consts = launch_config(q, v, chunk_size, initial_state is not None, output_final_state)
    # An absent state is never read or written (HAS_S0 / STORE_SF): any fp32 4-D array stands in.
    args = (q, k, v, gcum, Tm, Aqk, gcum if initial_state is None else initial_state, o,
            gcum if final is None else final, float(scale), *consts)
    ct.launch(torch.cuda.current_stream(), grid, wuso_kernel, args)
    return o, final
