"""The merge of parallel segments' states (kda_opt/schedules, "Parallel segments"; kda_opt/distributed
across GPUs): a segment's passage is affine in its start, S_out = M S_in + h, so the states after n
consecutive segments are

    S_0 = h_0,    S_j = M_{j−1} S_{j−1} + h_j        (j = 1 .. n − 1)

per value head, in fp32: one Triton launch, each (chain, V block) program carrying its S through the
n − 1 products, each product three tf32 ones (about fp32's precision). M does not depend on the chain:
its loads run ahead of the products, two steps ahead where the programs fit one an SM.
"""
import torch
import triton
import triton.language as tl

from .launch import triton_launch


def merge(h: torch.Tensor, M: torch.Tensor, v_first: bool = False, sms: int | None = None) -> torch.Tensor:
    """The states after each of n consecutive segments, [n, …, HV, K, V] fp32 ([…, V, K] v_first): from
    h [n, …] (each segment's final state from zero; the first's from the true start) and M [n − 1, …,
    HV, K, K] (the transitions of segments 1 .. n − 1), S_0 = h_0, S_j = M_{j−1} S_{j−1} + h_j: one
    launch (merge_kernel), each (chain, V block) program carrying its S through the n − 1 products in
    fp32 (each product three tf32 ones, about fp32's precision). sms: the GPU's SM count; where the
    programs number no more, M's loads run two steps ahead (MERGE_STAGES_SPREAD), else one (None: one)."""
    K = M.shape[-1]
    V = h.shape[-2] if v_first else h.shape[-1]
    chains = h[0].numel() // (K * V)
    h, M = h.float().contiguous(), M.float().contiguous()
    out = torch.empty_like(h)
    block = min(V, MERGE_BLOCK_V)
    spread = sms is not None and chains * (V // block) <= sms
    triton_launch(merge_kernel, (chains, V // block), None, h, M, out, h.shape[0], K, V, block, chains, v_first,
                  num_warps=MERGE_WARPS, num_stages=MERGE_STAGES_SPREAD if spread else MERGE_STAGES)
    return out


# merge_kernel's launch: V columns per program, warps, and M's loads two stages deep (the next
# transition's quarters copied to shared memory while this one's products run: two programs an SM),
# or three where every program has an SM of its own (one an SM: its shared memory allows no more).
MERGE_BLOCK_V, MERGE_WARPS, MERGE_STAGES, MERGE_STAGES_SPREAD = 8, 4, 2, 3


@triton.jit(do_not_specialize=["n"])
def merge_kernel(h, M, out, n, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, CHAINS: tl.constexpr,
                 V_FIRST: tl.constexpr):
    """out[0] = h[0], out[j] = M[j − 1] out[j − 1] + h[j] (merge) for chain program_id(0) over V block
    program_id(1): h, out [n, CHAINS, K, V] ([…, V, K] V_FIRST), M [n − 1, CHAINS, K, K], contiguous.
    S is carried as its two row halves [K / 2, BV] and each M as its four quarters, each product three
    tf32 ones (about fp32's precision): at merge's launch no spill at any K, V (128–208 registers, 90 KB
    of shared memory at K = 128, sm_90), where whole [K, K] tiles, or "ieee" products, spilled up to
    8 KB a thread."""
    R: tl.constexpr = K // 2
    i_c, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_r = tl.arange(0, R)
    o_v = i_v * BV + tl.arange(0, BV)
    top = o_v[None, :] * K + o_r[:, None] if V_FIRST else o_r[:, None] * V + o_v[None, :]   # rows 0 .. R − 1
    bottom = top + (R if V_FIRST else R * V)                                                 # rows R .. K − 1
    quarter = o_r[:, None] * K + o_r[None, :]                                                # M[:R, :R]
    h += i_c * K * V
    out += i_c * K * V
    M += i_c * K * K
    S0, S1 = tl.load(h + top), tl.load(h + bottom)
    tl.store(out + top, S0)
    tl.store(out + bottom, S1)
    for _ in range(1, n):
        h += CHAINS * K * V
        out += CHAINS * K * V
        T0 = (tl.dot(tl.load(M + quarter), S0, input_precision="tf32x3")
              + tl.dot(tl.load(M + R + quarter), S1, input_precision="tf32x3"))
        T1 = (tl.dot(tl.load(M + R * K + quarter), S0, input_precision="tf32x3")
              + tl.dot(tl.load(M + R * K + R + quarter), S1, input_precision="tf32x3"))
        S0, S1 = T0 + tl.load(h + top), T1 + tl.load(h + bottom)
        tl.store(out + top, S0)
        tl.store(out + bottom, S1)
        M += CHAINS * K * K
