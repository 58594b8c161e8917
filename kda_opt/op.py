"""kda_forward and kda_decode as torch custom ops, for torch.compile and CUDA graphs.

    torch.ops.kda_opt.forward            mutates nothing: o, and the final state when asked
    torch.ops.kda_opt.forward_in_place   also writes initial_state (a state pool, read and written
                                         at initial_state_indices) and checkpoints in place
    torch.ops.kda_opt.decode             kda_decode, mutating nothing: o, and the final states when asked
    torch.ops.kda_opt.decode_in_place    also writes initial_state (inplace_final_state) and out

Under torch.compile, kda_forward calls one of them: the compiler sees one opaque call whose outputs
the fake implementation describes (o like v; the final state [N, HV, K, V] fp32, V-first with
state_v_first, or an empty tensor when not asked for) and, for the second, which inputs it writes;
it runs the same kernels as an eager call, so the numbers are the same bit for bit. The arguments are
kda_forward's but for the host copies (cu_seqlens_cpu, initial_state_indices_cpu): there the call is
validated when it runs, and no host copy is read. An op returns no tensor that aliases an input: where
kda_decode writes `out` or the pool, the op returns an empty tensor in its place and kda_decode
returns the input itself.
"""
import torch

from .decode import kda_decode
from .forward import kda_forward
from .options import state_shape
from .seqs import num_sequences


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
    use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, safe_gate: bool,
    lower_bound: float | None, state_v_first: bool, cu_seqlens: torch.Tensor | None, chunk_size: int,
    transpose_state_layout: bool | None, initial_state_indices: torch.Tensor | None, pad_slot: int | None,
    has_initial_state: torch.Tensor | None, checkpoints: torch.Tensor | None, checkpoint_every: int,
    checkpoint_offsets: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, final = kda_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                           use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                           A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate, lower_bound=lower_bound,
                           state_v_first=state_v_first, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                           transpose_state_layout=transpose_state_layout, initial_state_indices=initial_state_indices,
                           pad_slot=pad_slot, has_initial_state=has_initial_state, checkpoints=checkpoints,
                           checkpoint_every=checkpoint_every, checkpoint_offsets=checkpoint_offsets)
    # An op returns tensors only, and none that aliases an input: no final state is an empty one.
    return o, v.new_empty(0, dtype=torch.float32) if final is None else final


def _fake(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
          use_beta_sigmoid_in_kernel, allow_neg_eigval, A_log, dt_bias, safe_gate, lower_bound, state_v_first,
          cu_seqlens, chunk_size, transpose_state_layout, initial_state_indices, pad_slot, has_initial_state,
          checkpoints, checkpoint_every, checkpoint_offsets):
    B, _, HV, V = v.shape
    K = q.shape[-1]
    N = num_sequences(B, cu_seqlens)
    v_first = state_v_first or bool(transpose_state_layout)
    shape = state_shape(N, HV, K, V, v_first) if output_final_state else (0,)
    return v.new_empty(v.shape), v.new_empty(shape, dtype=torch.float32)


forward_op = torch.library.custom_op("kda_opt::forward", _forward, mutates_args=())
forward_in_place_op = torch.library.custom_op("kda_opt::forward_in_place", _forward,
                                              mutates_args=("initial_state", "checkpoints"))
forward_op.register_fake(_fake)
forward_in_place_op.register_fake(_fake)


def _decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, scale: float | None,
    initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
    lower_bound: float | None, state_v_first: bool, cu_seqlens: torch.Tensor | None, inplace_final_state: bool,
    ssm_state_indices: torch.Tensor | None, num_accepted_tokens: torch.Tensor | None, out: torch.Tensor | None,
    pad_slot: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, final = kda_decode(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                          lower_bound, state_v_first, cu_seqlens, inplace_final_state=inplace_final_state,
                          ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens, out=out,
                          pad_slot=pad_slot)
    return (v.new_empty(0) if out is not None else o,
            final if output_final_state else v.new_empty(0, dtype=torch.float32))


def _decode_fake(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
                 cu_seqlens, inplace_final_state, ssm_state_indices, num_accepted_tokens, out, pad_slot):
    B, _, HV, V = v.shape
    shape = state_shape(num_sequences(B, cu_seqlens), HV, q.shape[-1], V, state_v_first) if output_final_state else (0,)
    return v.new_empty(v.shape if out is None else (0,)), v.new_empty(shape, dtype=torch.float32)


decode_op = torch.library.custom_op("kda_opt::decode", _decode, mutates_args=())
decode_in_place_op = torch.library.custom_op("kda_opt::decode_in_place", _decode,
                                             mutates_args=("initial_state", "out"))
decode_op.register_fake(_decode_fake)
decode_in_place_op.register_fake(_decode_fake)
