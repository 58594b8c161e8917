"""kda_decode's plan: the arguments validated once and resolved into one frozen DecodePlan that
kda_opt/recurrence's kernels launch from: what a request's state is read from and written to (Read,
Write), its V block and warps (decode_launch), the kernel (one program per V block, or the streamed
one). make_decode_plan resolves a call; decode_plan_for makes it once per call signature
(kda_opt/plan_cache); routed_decodes is the plan of a packed kda_forward call's sequences of one token,
which run through the same kernel (kda_opt/plan).
"""
from dataclasses import dataclass

import torch

from .arguments import DecodeArguments
from .checks import (checked_scale, validate, validate_decode_buffer, validate_decode_serving,
                     validate_devices)
from .options import CHUNK, GateConfig, Read, Sizes, Write, beta_scale
from .plan_cache import Entry, cached, signature

@dataclass(frozen=True)
class DecodePlan(Sizes):
    """One kda_decode call, resolved: N requests of T tokens (packed: T of the call, lengths from
    cu_seqlens); what its kernel reads and writes (its READ and WRITE, kda_opt/options.Read, Write)."""
    scale: float
    gate: GateConfig
    l2norm: bool
    beta_sigmoid: float | None    # β = beta_sigmoid · sigmoid(beta); None: beta is β
    state_v_first: bool
    packed: bool
    read: Read                    # zeros, initial_state[n], or the pool at ssm_state_indices
    write: Write                  # none, final[n], the pool at [N] indices, or per token at [N, S] ones
    output_final_state: bool      # final[n] a new [N, …] fp32 tensor (else initial_state, in place)
    columns: int                  # S of [N, S] indices or of the buffer (1 for [N] indices, 0 without)
    slots: int                    # the pool's rows (0 without one)
    pad_slot: int | None
    single: bool                  # only the sequences of one token (a packed kda_forward call's)
    block_v: int
    num_warps: int
    blocks_first: bool            # the grid (V / BV, HV, N), a (request, head)'s V blocks neighbouring
                                  # programs (V-first fp32 states, N ≤ GRID_AXIS_MAX); else (N·HV, V / BV)
    streamed: bool                # kda_opt/recurrence's streamed_decode_kernel: a program per (request, head)
                                  # walks its state in blocks of block_v rows (V-first 16-bit states)


def make_decode_plan(a: DecodeArguments, sms: int | None = None) -> DecodePlan:
    """kda_decode's arguments (their record, kda_opt/arguments) checked and resolved into a
    DecodePlan; kda_decode's docstring says what each means. sms: the GPU's SM count, for the launch
    choices; None reads it from q's device, which must then be a CUDA GPU with every tensor on it (the
    CPU tests pass a count)."""
    scale = None if a.scale is None else checked_scale(a.scale)
    q, v, indices, initial_state = a.q, a.v, a.ssm_state_indices, a.initial_state
    N = validate(q, a.k, v, a.g, a.beta, initial_state if indices is None else None,
                 use_gate_in_kernel=a.use_gate_in_kernel, A_log=a.A_log, dt_bias=a.dt_bias, safe_gate=False,
                 lower_bound=a.lower_bound, use_beta_sigmoid_in_kernel=a.use_beta_sigmoid_in_kernel,
                 allow_neg_eigval=a.allow_neg_eigval, state_v_first=a.state_v_first, cu_seqlens=a.cu_seqlens,
                 cu_seqlens_cpu=None, chunk_size=CHUNK)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    columns = validate_decode_serving(q, v, N, initial_state, a.output_final_state, a.inplace_final_state, indices,
                                      a.num_accepted_tokens, a.out, a.pad_slot, a.state_v_first, a.cu_seqlens)
    buffer = a.intermediate_states_buffer
    if buffer is not None:
        columns = validate_decode_buffer(q, v, N, buffer, a.intermediate_state_indices, a.retrieve_parent_token,
                                         indices, a.output_final_state, a.inplace_final_state, a.num_accepted_tokens,
                                         a.state_v_first, a.cu_seqlens)
    elif a.intermediate_state_indices is not None or a.retrieve_parent_token is not None:
        raise ValueError("intermediate_state_indices and retrieve_parent_token name rows and states of "
                         "intermediate_states_buffer: they need one")
    if sms is None:
        validate_devices(q, k=a.k, v=v, g=a.g, beta=a.beta, initial_state=initial_state, A_log=a.A_log,
                         dt_bias=a.dt_bias, cu_seqlens=a.cu_seqlens, ssm_state_indices=indices,
                         num_accepted_tokens=a.num_accepted_tokens, out=a.out, intermediate_states_buffer=buffer,
                         intermediate_state_indices=a.intermediate_state_indices,
                         retrieve_parent_token=a.retrieve_parent_token)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    write = Write.NONE if buffer is None else Write.BUFFER
    if a.output_final_state:
        write = Write.ROW
    elif a.inplace_final_state:
        write = Write.ROW if indices is None else Write.SLOT if indices.dim() == 1 else Write.EACH_TOKEN
    # Measured on V-first bf16 states (docs/DESIGN.md, Decode); one state a request, read from and
    # written to where it was (no [N, S] slots, whose accepted counts come with them, nor a buffer).
    streamed = (a.state_v_first and initial_state is not None and initial_state.element_size() == 2
                and not a.output_final_state and buffer is None and (indices is None or indices.dim() == 1)
                and N * HV >= STREAMED_FROM * sms)
    return _decode_plan(
        Sizes(B, T, H, K, HV, V, N), scale, a.use_qk_l2norm_in_kernel, a.use_gate_in_kernel, a.lower_bound,
        a.use_beta_sigmoid_in_kernel, a.allow_neg_eigval, a.state_v_first, a.cu_seqlens is not None, sms,
        read=Read.ZEROS if initial_state is None else Read.ROW if indices is None else Read.SLOT, write=write,
        output_final_state=a.output_final_state, columns=columns,
        slots=0 if indices is None else initial_state.shape[0], pad_slot=a.pad_slot, single=False,
        state_itemsize=4 if initial_state is None or a.output_final_state else initial_state.element_size(),
        streamed=streamed)


def routed_decodes(sizes: Sizes, *, scale, l2norm, gate_in_kernel, lower_bound, beta_sigmoid, neg_eigval, v_first,
                    initial_state, pool, output_final_state, sms) -> "DecodePlan":
    """The DecodePlan of a packed kda_forward call's sequences of one token (make_plan's checks made):
    read from and written to where stage 4 would (the pool's slot, or row n of the dense states)."""
    return _decode_plan(sizes, scale, l2norm, gate_in_kernel, lower_bound, beta_sigmoid, neg_eigval, v_first, True,
                        sms, read=Read.ZEROS if initial_state is None else Read.SLOT if pool else Read.ROW,
                        write=Write.SLOT if pool else Write.ROW if output_final_state else Write.NONE,
                        output_final_state=output_final_state,
                        columns=1 if pool else 0, slots=initial_state.shape[0] if pool else 0, pad_slot=None,
                        single=True, state_itemsize=4 if initial_state is None else initial_state.element_size(),
                        streamed=False)


def _decode_plan(sizes: Sizes, scale, l2norm, gate_in_kernel, lower_bound, beta_sigmoid, neg_eigval, v_first, packed,
                 sms, state_itemsize, **access) -> "DecodePlan":
    """A DecodePlan from checked options; `access`: what it reads and writes (DecodePlan's fields);
    state_itemsize: the bytes of one element of the states it reads and writes."""
    # Measured for fp32 states only (16-bit ones not yet timed so).
    blocks_first = v_first and state_itemsize == 4 and sizes.N <= GRID_AXIS_MAX
    block_v, num_warps = decode_launch(sizes.N * sizes.HV, sizes.V, v_first, blocks_first, sms)
    return DecodePlan(
        **vars(sizes), scale=sizes.K ** -0.5 if scale is None else scale,
        gate=GateConfig(in_kernel=gate_in_kernel, lower_bound=lower_bound), l2norm=l2norm,
        beta_sigmoid=beta_scale(beta_sigmoid, neg_eigval), state_v_first=v_first, packed=packed,
        block_v=block_v, num_warps=num_warps, blocks_first=blocks_first, **access)


def decode_launch(heads: int, V: int, v_first: bool, blocks_first: bool, sms: int) -> tuple[int, int]:
    """kda_decode's (V columns, warps) per program of (request, value head): a step is the state's
    bytes (kda_opt/recurrence), and what it leaves to hide is the reductions over K of each token. The
    fastest measured (docs/DESIGN.md, Decode), on `heads` (request, value head) pairs:
    - K-first states (a block's columns dense in memory): 64 columns by 2 warps wherever that gives
      every SM a program (16 columns are 64-byte pieces of 128 rows);
    - V-first states with a (request, head)'s V blocks as neighbouring programs (fp32,
      DecodePlan.blocks_first) from EIGHT_COLUMNS_FROM pairs an SM: 8 columns by one warp (half the
      registers of 16, so twice the programs an SM: more of the state's loads in flight);
    - otherwise 16 columns by one warp (the reductions within the warp, and more programs to spread a
      small step)."""
    if not v_first and heads * (V // 64) >= sms:
        return 64, 2
    if blocks_first and heads >= EIGHT_COLUMNS_FROM * sms:
        return 8, 1
    return 16, 1


# decode_launch's 8 columns from this many (request, value head) pairs an SM: measured faster than 16
# from 384 pairs on the H200, slower at 128 and 256 (docs/DESIGN.md, Decode).
EIGHT_COLUMNS_FROM = 3


# kda_decode's streamed kernel from this many (request, value head) programs an SM: each walks its
# state's rows one block after another, so below it too few programs are in flight (docs/DESIGN.md,
# Decode).
STREAMED_FROM = 4


# A grid's second and third axes stop here: decode's grid puts the requests on its third with
# blocks_first.
GRID_AXIS_MAX = 65535


def decode_plan_for(arguments: DecodeArguments) -> Entry:
    """make_decode_plan(arguments) made once per call signature (kda_opt/plan_cache), in its Entry."""
    key = signature(arguments)
    return cached(None if key is None else ("decode", *key), lambda: make_decode_plan(arguments))[0]


def decode_checks(arguments: DecodeArguments) -> None:
    """make_decode_plan's checks of kda_decode's arguments, made once per call signature (as
    decode_plan_for; the launch choices are not needed, nor the device checks, which the call's own
    plan makes): raises as they do."""
    key = signature(arguments)
    cached(None if key is None else ("checked", *key), lambda: make_decode_plan(arguments, sms=1))
