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


# NVIDIA cuDNN frontend's KDA engines on Hopper (nvidia-cudnn-frontend 1.32: its heuristics rank the
# first two ahead of the third on sm_90): kda_hopper_cuda, one fused CUDA kernel (NVRTC) per (sequence,
# head, piece), each piece after a warm-up cut where the gate has shrunk the earlier state below
# about 2^-20 (exact only where the walk reaches the sequence's start, so its time and error follow
# the gate); kda_hopper (CuTe DSL, needs nvidia-cutlass-dsl), exact, a segmented scan, log-decay g,
# post-sigmoid β and no norm in kernel only; kda_cutile, its cuTile engine.
CUDNN_ENGINES = ("kda_hopper_cuda", "kda_hopper", "kda_cutile")


def cudnn(args, engine: str):
    """(call, None): cuDNN's `kimi_delta_attention` with plan `engine` on kda_forward's keyword
    arguments `args`, call() returning (o [B, T, HV, V], the final state in args' layout, or None);
    its inputs laid out as it takes them here, once (tokens flat [B·T, ...], cu_seqlens int32, the
    state V-first). (None, reason) where the frontend is missing, cannot make the call as it is
    (the softplus gate), or the engine declines it (tried once here, untimed)."""
    try:
        from cudnn.linear_attention import kimi_delta_attention
    except ImportError as e:
        return None, f"nvidia-cudnn-frontend is not installed ({e})"
    q, v = args["q"], args["v"]
    B, T, _, K = q.shape
    HV, V = v.shape[2:]
    in_kernel, lower_bound = args.get("use_gate_in_kernel", False), args.get("lower_bound")
    if in_kernel and lower_bound is None:
        return None, "cuDNN's gate in kernel is the bounded one (lower_bound · sigmoid), not softplus"
    flat = {n: args[n].reshape(B * T, *args[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")}
    cu_seqlens = args.get("cu_seqlens")
    cu_seqlens = (torch.arange(B + 1, device=q.device) * T if cu_seqlens is None else cu_seqlens).to(torch.int32)
    v_first = args.get("state_v_first", False)
    state = args.get("initial_state")
    if state is not None and not v_first:
        state = state.transpose(-1, -2).contiguous()
    options = dict(scale=args.get("scale"), initial_state=state,
                   output_final_state=args.get("output_final_state", False),
                   use_qk_l2norm_in_kernel=args.get("use_qk_l2norm_in_kernel", False),
                   use_beta_sigmoid_in_kernel=args.get("use_beta_sigmoid_in_kernel", False),
                   allow_neg_eigval=args.get("allow_neg_eigval", False), plan_name=engine)
    if in_kernel:   # a = lower_bound · sigmoid(exp(A_log) · (g + dt_bias)), as kda_forward's
        A_log, dt_bias = args.get("A_log"), args.get("dt_bias")
        options.update(safe_gate=True, gate_lower_bound=lower_bound,
                       a_log=torch.zeros(HV, device=q.device) if A_log is None else A_log,
                       dt_bias=torch.zeros(HV, K, device=q.device) if dt_bias is None else dt_bias.view(HV, K))

    def call():
        o, final = kimi_delta_attention(*flat.values(), cu_seqlens, **options)[:2]
        if not options["output_final_state"]:
            return o.view(B, T, HV, V), None
        return o.view(B, T, HV, V), final if v_first else final.transpose(-1, -2)
    try:
        call()
    except Exception as e:      # the frontend's "no plan" error, or the engine's own refusal
        return None, f"{engine}: {type(e).__name__}: {e}"
    return call, None
