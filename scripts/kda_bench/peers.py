"""The systems the benchmark times beside kda_forward, each called on kda_forward's own arguments:
FLA's chunk_kda (fla-core 0.6.0, kept on its Triton path) and FlashKDA (MoonshotAI's CUTLASS
forward, `flash_kda.fwd`), the latter only where it computes the call."""
import importlib.util
import os

import torch

from kda_opt.seqs import num_sequences

FLASHKDA_CONFIGURATION = ("K = V = 128, bf16, HV = H, the gate in kernel with lower_bound and A_log, q/k "
                          "l2norm and beta sigmoid in kernel (no allow_neg_eigval), states [N, H, V, K]")


def fla_chunk_kda():
    """FLA's chunk_kda, or None without fla-core. FLA_FLASH_KDA=0 unless set: FLA would otherwise hand
    suitable calls to FlashKDA, and "FLA" would not mean FLA."""
    if importlib.util.find_spec("fla") is None:
        return None
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    from fla.ops.kda import chunk_kda
    return chunk_kda


def flashkda(args):
    """(call, None): flash_kda.fwd on kda_forward's keyword arguments `args`, its outputs allocated
    once here (FlashKDA allocates its workspace in every call); call() returns (o, final state or
    None). (None, reason) where flash_kda is missing or cannot compute these arguments."""
    if importlib.util.find_spec("flash_kda") is None:
        return None, "flash_kda is not installed"
    q, v, state = args["q"], args["v"], args.get("initial_state")
    fits = (q.shape[-1] == v.shape[-1] == 128 and v.shape[2] == q.shape[2]
            and all(args[n].dtype == torch.bfloat16 for n in ("q", "k", "v", "g", "beta"))
            and args.get("use_gate_in_kernel") and args.get("lower_bound") is not None
            and args.get("A_log") is not None and args.get("use_qk_l2norm_in_kernel")
            and args.get("use_beta_sigmoid_in_kernel") and not args.get("allow_neg_eigval")
            and (args.get("state_v_first") or (state is None and not args.get("output_final_state"))))
    if not fits:
        return None, f"FlashKDA computes only {FLASHKDA_CONFIGURATION}"
    import flash_kda
    B, _, H, K = q.shape
    cu_seqlens = args.get("cu_seqlens")
    N = num_sequences(B, cu_seqlens)
    out = torch.empty_like(v)
    # FlashKDA writes the final state in the initial state's dtype (fp32 when there is none).
    final = None
    if args.get("output_final_state"):
        final = torch.empty(N, H, K, K, dtype=torch.float32 if state is None else state.dtype, device=q.device)
    dt_bias = args.get("dt_bias")
    dt_bias = torch.zeros(H, K, device=q.device) if dt_bias is None else dt_bias.view(H, K)
    cu64 = None if cu_seqlens is None else cu_seqlens.to(torch.int64)
    scale = K ** -0.5 if args.get("scale") is None else args["scale"]

    def call():
        flash_kda.fwd(q, args["k"], v, args["g"], args["beta"], scale, out, args["A_log"], dt_bias,
                      args["lower_bound"], initial_state=state, final_state=final, cu_seqlens=cu64)
        return out, final
    return call, None
