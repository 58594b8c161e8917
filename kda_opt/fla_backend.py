"""kda_opt as a backend of FLA 0.6.0's `chunk_kda` and of its decode kernel: after
`kda_opt.use_in_fla()`, calls of `fla.ops.kda.chunk_kda` that kda_opt computes as FLA would (forward
only, Hopper, K and V of 64 or 128, chunk size 64; `KdaOptBackend.chunk_kda_verifier` lists them)
run `kda_forward`, and calls of `fused_recurrent_kda_fwd` (behind `fused_recurrent_kda`, and what
vLLM calls to decode) that kda_decode takes run it (`KdaOptDecodeBackend`); every other call runs
FLA's own path. Set `FLA_KDA_OPT=0` to opt out.

FLA's KDA layer (flash-linear-attention's `fla.layers.kda`, where installed) calls kda_opt without
FLA's dispatch: `use_in_fla` points the layer's `chunk_kda` and `fused_recurrent_kda` at functions that
take the calls the backends would (the same verifier, the same switch) and hand the others to FLA's
own functions. The dispatch costs a decode call about as much host time as kda_decode's whole call.

fla is imported by `use_in_fla` only: `import kda_opt` works without it.
"""
import functools
import importlib

import torch

from . import decode, forward, plan
from .checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, batch_entry_extent
from .options import CHUNK
from .plan import decode_checks
from .seqs import sequence_counts
from .wuso import INT32_MAX

# chunk_kda's keywords past its named parameters that kda_opt takes; any other keyword is left to FLA.
EXTRA_KEYWORDS = ("A_log", "dt_bias", "chunk_size", "transpose_state_layout", "initial_state_indices",
                  "has_initial_state")
# Passed on to kda_forward only when the caller gave them, so that kda_forward's defaults hold.
PASSED_WHEN_GIVEN = ("chunk_size", "transpose_state_layout", "initial_state_indices", "has_initial_state")


def use_in_fla() -> None:
    """Register kda_opt as a backend of `fla.ops.kda.chunk_kda` (ahead of FlashKDA) and of FLA's
    decode kernel, and point FLA's KDA layer, where flash-linear-attention is installed, at kda_opt
    without FLA's dispatch (the module docstring says which calls each takes).

    Calling it again is harmless: FLA's registry holds one backend per type, so the entry is replaced,
    and the layer's functions are wrapped once.
    """
    from fla.backends import register
    from fla.ops.kda import chunk_kda

    register(chunk_kda)(_backend_class())
    register("kda")(_decode_backend_class())
    _direct_layer()


LAYER = "fla.layers.kda"      # flash-linear-attention's KDA layer module


def _direct_layer() -> None:
    """Points FLA's KDA layer module (LAYER), where flash-linear-attention is installed, at
    direct_chunk_kda and direct_fused_recurrent_kda around the functions it imported from FLA (once:
    a second call wraps FLA's functions again, not the wrappers)."""
    try:
        layer = importlib.import_module(LAYER)
    except ImportError:
        return
    for name, direct in (("chunk_kda", direct_chunk_kda), ("fused_recurrent_kda", direct_fused_recurrent_kda)):
        own = getattr(layer, name)
        setattr(layer, name, direct(getattr(own, "fla_own", own)))


def _taken(q, backend) -> bool:
    """Whether kda_opt may take a call at all, as FLA's dispatch would let it: the backend enabled
    (FLA_KDA_OPT, read on every call), q on Hopper, and not inside torch.compile's tracing (FLA's
    dispatch runs outside it; its function then dispatches as it does)."""
    return not torch.compiler.is_compiling() and backend.is_enabled() and _on_hopper(q.device)


def direct_chunk_kda(own):
    """FLA's KDA layer's chunk_kda: the calls KdaOptBackend's verifier accepts run its chunk_kda (so
    kda_forward) without FLA's dispatch; the others run own, FLA's chunk_kda."""
    backend = _backend_class()()

    @functools.wraps(own)
    def chunk_kda(*args, **kwargs):
        if _taken(args[0] if args else kwargs["q"], backend):
            try:
                accepted = backend.chunk_kda_verifier(*args, **kwargs)[0]
            except Exception:             # as FLA's dispatch takes a verifier's error: the call is FLA's
                accepted = False
            if accepted:
                return backend.chunk_kda(*args, **kwargs)
        return own(*args, **kwargs)
    chunk_kda.fla_own = own
    return chunk_kda


def direct_fused_recurrent_kda(own):
    """FLA's KDA layer's fused_recurrent_kda: the calls kda_decode takes (its checks, once per
    signature: plan.decode_plan_for) run it without FLA's dispatch, the signature read once; the
    others run own, FLA's fused_recurrent_kda."""
    backend = _decode_backend_class()()

    @functools.wraps(own)
    def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                            state_v_first=False, cu_seqlens=None, **kwargs):
        named = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                     initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                     lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens)
        if not kwargs and _taken(q, backend):
            arguments = {**named, **DECODE_SERVING}
            try:
                entry = plan.decode_plan_for(arguments)
            except Exception:             # kda_decode refuses it: FLA's own path decides, as after a verifier
                entry = None
            if entry is not None:
                return decode.call(entry, arguments)
        return own(**named, **kwargs)
    fused_recurrent_kda.fla_own = own
    return fused_recurrent_kda


# kda_decode's serving arguments as FLA's fused_recurrent_kda passes them on (none of them).
DECODE_SERVING = dict(inplace_final_state=False, ssm_state_indices=None, num_accepted_tokens=None, out=None,
                      pad_slot=None, intermediate_states_buffer=None, intermediate_state_indices=None,
                      retrieve_parent_token=None)


@functools.cache
def _on_hopper(device: torch.device) -> bool:
    """Whether the device is a CUDA GPU of compute capability 9.x, the only one kda_opt runs on (asked
    of the driver once per device: every verified call asks)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def _backend_class():
    """KdaOptBackend, built once: its base class comes from fla, imported only here."""
    from fla.backends import BaseBackend

    class KdaOptBackend(BaseBackend):
        """kda_opt's forward for the chunk_kda calls it computes as FLA does (see the verifier)."""

        backend_type = "kda_opt"
        package_name = "kda_opt"
        env_var = "FLA_KDA_OPT"
        default_enable = True
        priority = 2            # lower runs first: ahead of FlashKDA (3)

        # Both methods take chunk_kda's parameters as chunk_kda declares them, since FLA's dispatch
        # passes the call's positional and keyword arguments on unchanged.
        def chunk_kda_verifier(self, q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, safe_gate=False, lower_bound=None,
                               disable_recompute=False, return_intermediate_states=False,
                               state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
                               use_graph=False, max_num_seqs=None, **kwargs) -> tuple[bool, str | None]:
            """(True, None) if kda_opt takes the call, else (False, the reason)."""
            unknown = [name for name in kwargs if name not in EXTRA_KEYWORDS]
            if unknown:
                return False, f"unknown keyword {unknown[0]}"
            if torch.is_grad_enabled():
                tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                           "A_log": kwargs.get("A_log"), "dt_bias": kwargs.get("dt_bias")}
                wants_grad = [name for name, x in tensors.items() if x is not None and x.requires_grad]
                if wants_grad:
                    return False, f"forward only: {wants_grad[0]} requires grad"
            if not _on_hopper(q.device):
                return False, f"needs a CUDA GPU of compute capability 9.x, q is on {q.device}"
            if q.dtype not in SUPPORTED_DTYPES:
                return False, f"q's dtype {q.dtype} is not bf16, fp16 or fp32"
            if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
                return False, f"head dim K = {q.shape[-1]} is not 64 or 128"
            if v.shape[-1] not in SUPPORTED_HEAD_DIMS:
                return False, f"head dim V = {v.shape[-1]} is not 64 or 128"
            if batch_entry_extent(q, k, v, beta) > INT32_MAX:
                return False, "B > 1 with a batch entry of 2^31 elements or more"
            if cp_context is not None:
                return False, "context parallelism (cp_context)"
            if return_intermediate_states and kwargs.get("initial_state_indices") is not None:
                return False, "return_intermediate_states with a state pool (initial_state_indices)"
            # FLA's graph mode has its own contract (cu_seqlens padded to max_num_seqs + 1, rows past
            # the real tokens undefined); kda_opt needs none of it, but the call stays FLA's.
            if use_graph:
                return False, "use_graph=True"
            if kwargs.get("chunk_size", CHUNK) != CHUNK:
                return False, f"chunk_size {kwargs['chunk_size']} (kda_opt computes {CHUNK} only)"
            return True, None

        def chunk_kda(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                      allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                      return_intermediate_states=False, state_v_first=False, cu_seqlens=None,
                      cu_seqlens_cpu=None, cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
            """kda_forward on chunk_kda's arguments; returns (o, final_state) as chunk_kda does, and
            the states before each chunk with return_intermediate_states (intermediate_states)."""
            # chunk_kda ignores A_log and dt_bias without the gate in kernel; kda_forward rejects them.
            A_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate_in_kernel else (None, None)
            passed = {name: kwargs[name] for name in PASSED_WHEN_GIVEN if name in kwargs}
            if return_intermediate_states:
                if cu_seqlens is not None and cu_seqlens_cpu is None:
                    cu_seqlens_cpu = cu_seqlens.cpu()   # the rows' count: a synchronisation, as in FLA's own path
                B, T = q.shape[:2]
                rows = B * -(-T // CHUNK) if cu_seqlens_cpu is None else sequence_counts(cu_seqlens_cpu, False).chunks
                h, passed["checkpoints"] = intermediate_states(v, q.shape[-1], rows, state_v_first, k.dtype)
            # chunk_kda's arguments that kda_forward takes, by their (shared) names, and those passed on.
            given = locals()
            named = {n: x for n, x in given.items() if n in forward.PARAMETERS}
            # Looked up through the module at each call, so that tests can stand in for kda_forward.
            o, final = forward.kda_forward(**named, **passed)
            if not return_intermediate_states:
                return o, final
            first_rows(h, initial_state, kwargs.get("has_initial_state"), cu_seqlens)
            return o, final, h

    return KdaOptBackend


def intermediate_states(v, K: int, rows: int, v_first: bool, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, checkpoints): FLA's intermediate states h [B, rows / B, HV, K, V] ([..., V, K] V-first) of
    `dtype`, row j of a sequence its state before its chunk j (rows: B · cdiv(T, 64); packed, B = 1,
    Σ_n cdiv(len_n, 64), sequence n's rows from Σ_{m<n} cdiv(len_m, 64), or more: the rows past the
    last sequence's are left as they are), and the buffer kda_forward writes its checkpoints into: the
    same storage one row on, so that the state after chunk j lands in the row before chunk j + 1. Each
    sequence's last checkpoint lands in the next sequence's first row (or a spare row past h), which
    first_rows then writes."""
    B, _, HV, V = v.shape
    row = (V, K) if v_first else (K, V)
    flat = v.new_empty((rows + 1, HV, *row), dtype=dtype)
    return flat[:rows].view(B, rows // B, HV, *row), flat[1:].view(B, rows // B, HV, *row)


def first_rows(h: torch.Tensor, initial_state, has_initial_state, cu_seqlens) -> None:
    """Writes each sequence's row before its first chunk in h (intermediate_states): its initial
    state in h's dtype, zeros without one (or where has_initial_state is false)."""
    starts = None if initial_state is None else initial_state.to(h.dtype)
    if starts is not None and has_initial_state is not None:
        starts = torch.where(has_initial_state.view(-1, 1, 1, 1), starts, 0)
    if cu_seqlens is None:
        h[:, 0] = 0 if starts is None else starts
        return
    whole, first = spare_rows(h), sequence_rows(cu_seqlens, h.shape[1])
    if starts is None:
        whole.index_fill_(0, first, 0)
    else:
        whole.index_copy_(0, first, starts)


def spare_rows(h: torch.Tensor) -> torch.Tensor:
    """h [1, rows, ...] (intermediate_states, packed) as [rows + 1, ...]: its rows and the spare row
    past them."""
    return h.as_strided((h.shape[1] + 1, *h.shape[2:]), h.stride()[1:])


def sequence_rows(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """[N]: packed sequence n's first row of intermediate states, Σ_{m<n} cdiv(len_m, 64), counted on
    the device; `rows` (the spare row) for a sequence of no token, which has none."""
    lengths = cu_seqlens.diff()
    chunks = lengths.add(CHUNK - 1).div(CHUNK, rounding_mode="floor")
    return torch.where(lengths > 0, chunks.cumsum(0) - chunks, rows)


@functools.cache
def _decode_backend_class():
    """KdaOptDecodeBackend, built once, for FLA's operation registry "kda" (whose dispatched
    functions it leaves alone but fused_recurrent_kda_fwd)."""
    from fla.backends import BaseBackend

    class KdaOptDecodeBackend(BaseBackend):
        """kda_decode for the fused_recurrent_kda_fwd calls it computes as FLA does (see the verifier)."""

        backend_type = "kda_opt"
        package_name = "kda_opt"
        env_var = "FLA_KDA_OPT"
        default_enable = True
        priority = 2

        def fused_recurrent_kda_fwd_verifier(self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None,
                                             scale=None, output_final_state=False, inplace_final_state=True,
                                             state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
                                             num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                                             use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                             allow_neg_eigval=False, lower_bound=None, out=None,
                                             **kwargs) -> tuple[bool, str | None]:
            """(True, None) if kda_decode takes the call, else (False, the reason): kda_decode's own
            checks (an error is the reason), on Hopper, but FLA's per-token final states (indices
            without inplace_final_state, with output_final_state)."""
            if kwargs:
                return False, f"unknown keyword {next(iter(kwargs))}"
            if not _on_hopper(q.device):
                return False, f"needs a CUDA GPU of compute capability 9.x, q is on {q.device}"
            if ssm_state_indices is not None and output_final_state and not inplace_final_state:
                return False, "per-token final states (ssm_state_indices, output_final_state, not in place)"
            decode_checks(_decode_arguments(locals()))
            return True, None

        def fused_recurrent_kda_fwd(self, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None,
                                    scale=None, output_final_state=False, inplace_final_state=True,
                                    state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
                                    num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                                    use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                    allow_neg_eigval=False, lower_bound=None, out=None, **kwargs):
            """kda_decode on fused_recurrent_kda_fwd's arguments; returns (o, final_state) as it does."""
            return decode.kda_decode(**_decode_arguments(locals()))

    return KdaOptDecodeBackend


def _decode_arguments(call: dict) -> dict:
    """fused_recurrent_kda_fwd's arguments (its locals) as kda_decode's keywords, every one (those FLA
    has not: DECODE_SERVING's): in place wins over output_final_state, as in FLA."""
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "scale", "state_v_first", "cu_seqlens",
             "ssm_state_indices", "num_accepted_tokens", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
             "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound", "out", "inplace_final_state")
    return {**DECODE_SERVING, **{n: call[n] for n in names},
            "output_final_state": call["output_final_state"] and not call["inplace_final_state"]}
