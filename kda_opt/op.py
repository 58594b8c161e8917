"""kda_forward as a torch custom op, `torch.ops.kda_opt.forward`, for torch.compile and CUDA graphs.

Under torch.compile, kda_forward calls this op: the compiler sees one opaque call whose outputs
its fake implementation describes (o like v; the final state [N, HV, K, V] fp32, V-first with
state_v_first, or an empty tensor when not asked for), and runs the same kernels as an eager call,
so the numbers are the same bit for bit. The arguments are kda_forward's but for cu_seqlens_cpu:
there the call is validated when it runs, and the host copy of cu_seqlens is not read.
"""
import torch

from .forward import kda_forward
from .options import state_shape


@torch.library.custom_op("kda_opt::forward", mutates_args=())
def forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
    use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, safe_gate: bool,
    lower_bound: float | None, state_v_first: bool, cu_seqlens: torch.Tensor | None, chunk_size: int,
    transpose_state_layout: bool | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, final = kda_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                           use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                           A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate, lower_bound=lower_bound,
                           state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                           transpose_state_layout=transpose_state_layout)
    # An op returns tensors only, and none that aliases an input: no final state is an empty one.
    return o, v.new_empty(0, dtype=torch.float32) if final is None else final


@forward_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
      use_beta_sigmoid_in_kernel, allow_neg_eigval, A_log, dt_bias, safe_gate, lower_bound, state_v_first,
      cu_seqlens, chunk_size, transpose_state_layout):
    B, _, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    v_first = state_v_first or bool(transpose_state_layout)
    shape = state_shape(N, HV, K, V, v_first) if output_final_state else (0,)
    return v.new_empty(v.shape), v.new_empty(shape, dtype=torch.float32)
