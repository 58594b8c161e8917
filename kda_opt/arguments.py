"""The arguments of kda_forward, kda_decode and kda_conv_decode, each call's as one frozen record (a NamedTuple whose
fields are the function's parameters, in its signature's order and with its defaults: a test holds
the two lists equal). The record is what the plan is made from and keyed by, and the replay's inputs
are picked from it by name.

    ForwardArguments(q, k, v, g, beta, ...)   kda_forward's arguments (kda_opt/plan.make_plan)
    DecodeArguments(q, k, v, g, beta, ...)    kda_decode's (kda_opt/decode_plan.make_decode_plan)
    ConvDecodeArguments(mixed_qkv, ...)       kda_conv_decode's (kda_opt/conv_decode)
    @traced_as(op_call, Record)               while torch.compile traces the function, its call is
                                              op_call(Record(*args, **kwargs)): one custom op
                                              (kda_opt/op); other calls run the function itself
Each field means what the function's docstring says. Built by keyword, a record takes the
parameters by name as the function does (a positional one in the function's order, an unknown name a
TypeError).
"""
import functools
from typing import NamedTuple

import torch

from .options import CHUNK

Tensor = torch.Tensor


class ForwardArguments(NamedTuple):
    """kda_forward's arguments (its docstring says what each means)."""
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    scale: float | None = None
    initial_state: Tensor | None = None
    output_final_state: bool = False
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    A_log: Tensor | None = None
    dt_bias: Tensor | None = None
    safe_gate: bool = False
    lower_bound: float | None = None
    state_v_first: bool = False
    cu_seqlens: Tensor | None = None
    cu_seqlens_cpu: Tensor | None = None
    chunk_size: int = CHUNK
    transpose_state_layout: bool | None = None
    initial_state_indices: Tensor | None = None
    initial_state_indices_cpu: Tensor | None = None
    pad_slot: int | None = None
    has_initial_state: Tensor | None = None
    checkpoints: Tensor | None = None
    checkpoint_every: int = CHUNK
    checkpoint_offsets: Tensor | None = None

    def device_tensors(self) -> tuple:
        """The call's tensors but the host copies (None where absent), in a fixed order: what a
        replayed call (kda_opt/replay) takes anew on each call."""
        return (self.q, self.k, self.v, self.g, self.beta, self.initial_state, self.A_log, self.dt_bias,
                self.cu_seqlens, self.initial_state_indices, self.has_initial_state, self.checkpoints,
                self.checkpoint_offsets)


# kda_forward's host copies, which the custom op does not take (kda_opt/op): it validates the call
# when it runs.
HOST_COPIES = ("cu_seqlens_cpu", "initial_state_indices_cpu")


class DecodeArguments(NamedTuple):
    """kda_decode's arguments (its docstring says what each means)."""
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    A_log: Tensor | None = None
    dt_bias: Tensor | None = None
    scale: float | None = None
    initial_state: Tensor | None = None
    output_final_state: bool = False
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    lower_bound: float | None = None
    state_v_first: bool = False
    cu_seqlens: Tensor | None = None
    inplace_final_state: bool = False
    ssm_state_indices: Tensor | None = None
    num_accepted_tokens: Tensor | None = None
    out: Tensor | None = None
    pad_slot: int | None = None
    intermediate_states_buffer: Tensor | None = None
    intermediate_state_indices: Tensor | None = None
    retrieve_parent_token: Tensor | None = None

    def device_tensors(self) -> tuple:
        """The call's tensors (None where absent), in a fixed order: what a replayed call
        (kda_opt/replay) takes anew on each call."""
        return (self.q, self.k, self.v, self.g, self.beta, self.A_log, self.dt_bias, self.initial_state,
                self.cu_seqlens, self.ssm_state_indices, self.num_accepted_tokens, self.out,
                self.intermediate_states_buffer, self.intermediate_state_indices, self.retrieve_parent_token)


class ConvDecodeArguments(NamedTuple):
    """kda_conv_decode's arguments (its docstring says what each means)."""
    mixed_qkv: Tensor
    g: Tensor
    beta: Tensor
    conv_state: Tensor
    conv_weight: Tensor
    ssm_state: Tensor
    state_indices: Tensor
    A_log: Tensor
    conv_bias: Tensor | None = None
    dt_bias: Tensor | None = None
    lower_bound: float | None = None
    scale: float | None = None
    pad_slot: int | None = None
    out: Tensor | None = None


def traced_as(op_call, record):
    """A decorator: the function's calls made while torch.compile traces go to
    op_call(record(*args, **kwargs)) (its arguments as their record, defaults filled); other calls run
    the function."""
    def decorate(function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op_call(record(*args, **kwargs))
            return function(*args, **kwargs)
        return call
    return decorate
