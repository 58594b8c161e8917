"""`kda_decode`: decode steps and speculative verify, the call resolved into its plan
(kda_opt/decode_plan, once per call signature) and run through the token recurrence's kernels
(kda_opt/recurrence), replayed from the third call of a signature on (kda_opt/replay).
"""
import torch

from . import replay
from .arguments import DecodeArguments, traced_as
from .decode_plan import DecodePlan, decode_plan_for
from .launch import Kernels
from .options import Write, state_shape
from .plan_cache import Entry
from .recurrence import decode


def _traced(a: DecodeArguments):
    """kda_decode while torch.compile traces it: one custom op (kda_opt/op)."""
    buffer = a.intermediate_states_buffer
    writes = a.inplace_final_state or a.out is not None or buffer is not None
    o, final = (torch.ops.kda_opt.decode_in_place if writes else torch.ops.kda_opt.decode)(**a._asdict())
    return (o if a.out is None else a.out,
            final if a.output_final_state else a.initial_state if a.inplace_final_state else buffer)


@traced_as(_traced, DecodeArguments)
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, scale: float | None = None,
               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
               use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
               use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
               lower_bound: float | None = None, state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
               *, inplace_final_state: bool = False, ssm_state_indices: torch.Tensor | None = None,
               num_accepted_tokens: torch.Tensor | None = None, out: torch.Tensor | None = None,
               pad_slot: int | None = None, intermediate_states_buffer: torch.Tensor | None = None,
               intermediate_state_indices: torch.Tensor | None = None,
               retrieve_parent_token: torch.Tensor | None = None):
    r"""Decode steps and speculative verify; the same function and arguments as FLA 0.6.0's
    ``fused_recurrent_kda``, with the serving arguments of its ``fused_recurrent_kda_fwd``.

    Each request's tokens run through the recurrence one after another from its start state (the
    math: kda_forward's docstring); for a few tokens per request (decode: 1; verify: up to 16),
    where kda_forward's chunked prefill is built for long sequences.

    Args (as ``fused_recurrent_kda``'s):
        q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``: request b's
            T tokens (B requests of T tokens), or with ``cu_seqlens`` (B = 1) request n's tokens
            ``cu_seqlens[n] .. cu_seqlens[n+1] − 1``. Dtypes, head dims, the gate, β and the norm
            options as kda_forward's (``A_log``, ``dt_bias``, ``scale``, ``lower_bound``,
            ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``,
            ``allow_neg_eigval``, ``state_v_first``). Each token row of q, k, v, g, beta is read
            through its strides (its last dimension must be dense).
        initial_state: without ``ssm_state_indices``, ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
            ``state_v_first``), request n's start; with them, a state **pool** ``[slots, HV, K, V]``
            (each row dense, rows may be padded). fp32, bf16 or fp16; None starts from zeros.
        output_final_state: also return each request's state after its last token, ``[N, HV, K, V]``
            fp32 in the states' layout (not with ``inplace_final_state``).

    Serving arguments (as ``fused_recurrent_kda_fwd``'s), keyword-only:
        ssm_state_indices: ``[N]`` or ``[N, S]`` int32/int64 slots of the pool. Request n starts
            from ``pool[ssm_state_indices[n, c]]`` with ``c = num_accepted_tokens[n] − 1`` (``c = 0``
            without it).
        inplace_final_state: write the states into the pool, in the pool's dtype: with ``[N]``
            indices the state after request n's last token into ``pool[ssm_state_indices[n]]``; with
            ``[N, S]`` the state after its token t into ``pool[ssm_state_indices[n, t]]`` for each
            ``t < min(S, its tokens)`` (speculative verify: the caller keeps the row of the last
            accepted token). Returns the pool as the final state, as FLA does.
        num_accepted_tokens: ``[N]`` int32/int64: the column of ``ssm_state_indices`` request n
            starts from, plus one (needs ``[N, S]`` indices).
        out: o's storage, ``[B, T, HV, V]`` of v's dtype with a dense last dimension (for CUDA
            graphs: the call then allocates nothing but o's absence).
        pad_slot: a slot the caller pads with (vLLM's reserved slot 0): like a negative index, it is
            never read (the request starts from zeros) nor written, so any number of padding rows
            may name it.

    SGLang's verify (its ``fused_sigmoid_gating_delta_rule_update``'s names), keyword-only:
        intermediate_states_buffer: ``[rows, S, HV, K, V]`` (``[rows, S, HV, V, K]`` with
            ``state_v_first``; each of its ``S`` states dense, fp32, bf16 or fp16): request n's state
            after its token t is written to ``buffer[intermediate_state_indices[n], t]`` for each
            ``t < min(S, its tokens)``, in the buffer's dtype; the pool (initial_state with ``[N]``
            ssm_state_indices, which it needs) is only read. Not with ``inplace_final_state``,
            ``output_final_state`` or ``num_accepted_tokens``.
        intermediate_state_indices: ``[N]`` int32/int64 rows of the buffer (a negative one, or one
            past it, is not written).
        retrieve_parent_token: ``[N, P]`` int32/int64, a tree of draft tokens (SGLang's tree verify;
            needs the buffer): request n's token ``t > 0`` starts from the state after its parent
            token ``p = retrieve_parent_token[n, t]``, read back from ``buffer[row, p]`` as written
            there (in the buffer's dtype), instead of from the state after token ``t − 1``. A parent
            outside ``0 .. t − 1``, one at or past ``S``, a column ``t ≥ P`` and a request whose buffer
            row is not written keep the state after token ``t − 1``; column 0 is not read.

    Padding: a negative index, one at or past ``slots`` and ``pad_slot`` read as zeros and are not
    written; a request whose ``num_accepted_tokens`` is outside ``1 .. S`` (vLLM's rows of zero
    accepted tokens) starts from zeros and writes no state. No row of the pool other than those the
    live requests name is read or written, and live requests must name distinct rows (two requests
    writing one row race; nothing checks it on the device).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype (``out`` if given); final_state the pool
        (``inplace_final_state``), the new ``[N, …]`` states (``output_final_state``), the buffer
        (``intermediate_states_buffer``), or None.

    Needs a CUDA GPU of compute capability 9.0; forward only. No host-device synchronisation: it
    may be captured in a CUDA graph. Under torch.compile it is one custom op (kda_opt/op:
    ``torch.ops.kda_opt.decode``, or ``decode_in_place`` where it writes the pool, the buffer or
    ``out``).
    """
    arguments = DecodeArguments(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, inplace_final_state=inplace_final_state, ssm_state_indices=ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens, out=out, pad_slot=pad_slot,
        intermediate_states_buffer=intermediate_states_buffer, intermediate_state_indices=intermediate_state_indices,
        retrieve_parent_token=retrieve_parent_token)
    return call(decode_plan_for(arguments), arguments)


def call(entry: Entry, a: DecodeArguments):
    """kda_decode's result for its arguments `a` under their plan's entry (decode_plan_for(a), which
    has checked them)."""
    return replay.call(entry, a.device_tensors(), lambda: run(
        entry.plan, q=a.q, k=a.k, v=a.v, g=a.g, beta=a.beta, A_log=a.A_log, dt_bias=a.dt_bias,
        initial_state=a.initial_state, cu_seqlens=a.cu_seqlens, ssm_state_indices=a.ssm_state_indices,
        num_accepted_tokens=a.num_accepted_tokens, out=a.out, intermediate_states_buffer=a.intermediate_states_buffer,
        intermediate_state_indices=a.intermediate_state_indices, retrieve_parent_token=a.retrieve_parent_token,
        kernels=entry.kernels))


def run(plan: DecodePlan, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, cu_seqlens=None,
        ssm_state_indices=None, num_accepted_tokens=None, out=None, intermediate_states_buffer=None,
        intermediate_state_indices=None, retrieve_parent_token=None, *, kernels: Kernels | None = None):
    """kda_decode's call under its plan: (o, final_state)."""
    final = intermediate_states_buffer if plan.write == Write.BUFFER else initial_state if plan.write else None
    if plan.output_final_state:
        final = q.new_empty(state_shape(plan.N, plan.HV, plan.K, plan.V, plan.state_v_first), dtype=torch.float32)
    q, k, v, g, beta = (_token_rows(x) for x in (q, k, v, g, beta))
    o = decode(plan, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, final_state=final,
               cu_seqlens=cu_seqlens, indices=ssm_state_indices, accepted=num_accepted_tokens, out=out,
               buffer_rows=intermediate_state_indices, parents=retrieve_parent_token, kernels=kernels)
    return o, final


def _token_rows(x):
    """x [B, T, heads(, channels)] as the kernel reads it: channels dense and token rows evenly spaced
    through the batch (row n·T + t at (n·T + t) · stride(1)); else a contiguous copy. One token per
    request (T = 1): the rows are stride(0) apart, whatever stride(1) says (SGLang's decode views
    of one fused projection, [N, 1, H, K], are read in place; so is a transposed [1, N, …] tensor,
    which torch calls contiguous whatever stride(1) says)."""
    B, T = x.shape[:2]
    if T == 1 and x.stride(1) != x.stride(0):
        x = x.as_strided(x.shape, (x.stride(0), x.stride(0), *x.stride()[2:]))
    if x.is_contiguous():
        return x
    dense = x.dim() == 3 or x.stride(-1) == 1
    return x if dense and (B == 1 or x.stride(0) == T * x.stride(1)) else x.contiguous()
