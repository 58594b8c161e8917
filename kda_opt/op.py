"""kda_forward and kda_decode as torch custom ops, for torch.compile and CUDA graphs.

    torch.ops.kda_opt.forward            mutates nothing: o, and the final state when asked
    torch.ops.kda_opt.forward_in_place   also writes initial_state (a state pool, read and written
                                         at initial_state_indices) and checkpoints in place
    torch.ops.kda_opt.decode             kda_decode, mutating nothing: o, and the final states when asked
    torch.ops.kda_opt.decode_in_place    also writes initial_state (inplace_final_state), out and
                                         intermediate_states_buffer

Under torch.compile, kda_forward calls one of them: the compiler sees one opaque call whose outputs
the fake implementation describes (o like v; the final state [N, HV, K, V] fp32, V-first with
state_v_first, or an empty tensor when not asked for) and, for the second, which inputs it writes;
it runs the same kernels as an eager call, so the numbers are the same bit for bit. The arguments are
kda_forward's but for the host copies (cu_seqlens_cpu, initial_state_indices_cpu): there the call is
validated when it runs, and no host copy is read. An op returns no tensor that aliases an input: where
kda_decode writes `out` or the pool, the op returns an empty tensor in its place and kda_decode
returns the input itself.
"""
import inspect

import torch

from .decode import kda_decode
from .forward import HOST_COPIES, kda_forward
from .options import state_shape
from .seqs import num_sequences


def _op_signature(fn, drop=()) -> inspect.Signature:
    """fn's signature as a custom op's (its schema is inferred from it): fn's parameters, annotations
    and defaults in its order but those named in `drop`, none keyword-only (a custom op takes no
    keyword-only tensor; it is called by keyword all the same), returning two tensors. The one list of
    the op's arguments is thus fn's own."""
    signature = inspect.signature(fn)
    return signature.replace(parameters=[p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                         for n, p in signature.parameters.items() if n not in drop],
                             return_annotation=tuple[torch.Tensor, torch.Tensor])


def _op(name: str, signature: inspect.Signature, body, fake, writes: tuple[str, ...] = ()):
    """The custom op kda_opt::`name` running body(*args, **kwargs), its schema from `signature`, fake
    its fake implementation; `writes`: the arguments it writes in place. Such an op takes every
    argument without a default, so that the dispatcher hands it every one: it leaves out trailing
    arguments equal to their defaults, and torch 2.11's in-place bookkeeping (the ADInplaceOrView
    kernel) finds each written argument by its position among those handed (an absent `out` or
    `checkpoints` there raised IndexError). The callers pass every argument (kda_opt/arguments.traced_as)."""
    if writes:
        signature = signature.replace(parameters=[p.replace(default=inspect.Parameter.empty)
                                                  for p in signature.parameters.values()])

    def run(*args, **kwargs):
        return body(*args, **kwargs)

    def run_fake(*args, **kwargs):
        return fake(*args, **kwargs)

    run.__signature__ = run_fake.__signature__ = signature
    op = torch.library.custom_op(f"kda_opt::{name}", run, mutates_args=writes)
    op.register_fake(run_fake)
    return op


FORWARD = _op_signature(kda_forward, HOST_COPIES)
DECODE = _op_signature(kda_decode)


def _forward(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    o, final = kda_forward(**FORWARD.bind(*args, **kwargs).arguments)
    # An op returns tensors only, and none that aliases an input: no final state is an empty one.
    return o, o.new_empty(0, dtype=torch.float32) if final is None else final


def _fake(*args, **kwargs):
    a = FORWARD.bind(*args, **kwargs)
    a.apply_defaults()
    q, v, cu_seqlens = (a.arguments[n] for n in ("q", "v", "cu_seqlens"))
    B, _, HV, V = v.shape
    v_first = a.arguments["state_v_first"] or bool(a.arguments["transpose_state_layout"])
    shape = state_shape(num_sequences(B, cu_seqlens), HV, q.shape[-1], V, v_first) \
        if a.arguments["output_final_state"] else (0,)
    return v.new_empty(v.shape), v.new_empty(shape, dtype=torch.float32)


forward_op = _op("forward", FORWARD, _forward, _fake)
forward_in_place_op = _op("forward_in_place", FORWARD, _forward, _fake, writes=("initial_state", "checkpoints"))


def _decode(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    a = DECODE.bind(*args, **kwargs).arguments
    o, final = kda_decode(**a)
    return (o.new_empty(0) if a.get("out") is not None else o,
            final if a.get("output_final_state") else o.new_empty(0, dtype=torch.float32))


def _decode_fake(*args, **kwargs):
    a = DECODE.bind(*args, **kwargs)
    a.apply_defaults()
    q, v, out = (a.arguments[n] for n in ("q", "v", "out"))
    B, _, HV, V = v.shape
    shape = state_shape(num_sequences(B, a.arguments["cu_seqlens"]), HV, q.shape[-1], V, a.arguments["state_v_first"]) \
        if a.arguments["output_final_state"] else (0,)
    return v.new_empty(v.shape if out is None else (0,)), v.new_empty(shape, dtype=torch.float32)


decode_op = _op("decode", DECODE, _decode, _decode_fake)
decode_in_place_op = _op("decode_in_place", DECODE, _decode, _decode_fake,
                        writes=("initial_state", "out", "intermediate_states_buffer"))
