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

from . import decode, decode_plan, engines, forward
from .arguments import DecodeArguments
from .checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, batch_entry_extent
from .decode_plan import decode_checks
from .options import CHUNK, INT32_MAX
from .seqs import sequence_counts

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
    return not torch.compiler.is_compiling() and backend.is_enabled() and engines.on_hopper(q.device)


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
    signature: decode_plan.decode_plan_for) run it without FLA's dispatch, the signature read once; the
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
            arguments = DecodeArguments(**named)      # kda_decode's serving arguments at their defaults
            try:
                entry = decode_plan.decode_plan_for(arguments)
            except Exception:             # kda_decode refuses it: FLA's own path decides, as after a verifier
                entry = None
            if entry is not None:
                return decode.call(entry, arguments)
        return own(**named, **kwargs)
    fused_recurrent_kda.fla_own = own
    return fused_recurrent_kda


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
            if not engines.on_hopper(q.device):
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
                h, passed["checkpoints"] = engines.intermediate_states(v, q.shape[-1], rows, state_v_first, k.dtype)
            # Looked up through the module at each call, so that tests can stand in for kda_forward.
            o, final = forward.kda_forward(
                q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate, lower_bound=lower_bound,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, **passed)
            if not return_intermediate_states:
                return o, final
            engines.first_rows(h, initial_state, kwargs.get("has_initial_state"), cu_seqlens)
            return o, final, h

    return KdaOptBackend


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

        def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            """(True, None) if kda_decode takes the call (fused_recurrent_kda_fwd's arguments), else
            (False, the reason): kda_decode's own checks (an error is the reason), on Hopper, but FLA's
            per-token final states (indices without inplace_final_state, with output_final_state)."""
            arguments, reason = _decode_arguments(*args, **kwargs)
            if reason is not None:
                return False, reason
            if not engines.on_hopper(arguments.q.device):
                return False, f"needs a CUDA GPU of compute capability 9.x, q is on {arguments.q.device}"
            decode_checks(arguments)
            return True, None

        def fused_recurrent_kda_fwd(self, *args, **kwargs):
            """kda_decode on fused_recurrent_kda_fwd's arguments; returns (o, final_state) as it does."""
            arguments, _ = _decode_arguments(*args, **kwargs)
            return decode.kda_decode(**arguments._asdict())

    return KdaOptDecodeBackend


def _decode_arguments(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                      output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                      ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                      use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                      lower_bound=None, out=None, **kwargs) -> tuple[DecodeArguments, str | None]:
    """fused_recurrent_kda_fwd's arguments (its signature, FLA 0.6.0's) as kda_decode's, and why
    kda_decode does not take them as FLA computes them (None: it may): an unknown keyword, or per-token
    final states (indices, output_final_state, not in place). In place wins over output_final_state,
    as in FLA; kda_decode's arguments FLA has not stay at their defaults."""
    reason = None
    if kwargs:
        reason = f"unknown keyword {next(iter(kwargs))}"
    elif ssm_state_indices is not None and output_final_state and not inplace_final_state:
        reason = "per-token final states (ssm_state_indices, output_final_state, not in place)"
    return DecodeArguments(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state and not inplace_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        inplace_final_state=inplace_final_state, ssm_state_indices=ssm_state_indices,
        num_accepted_tokens=num_accepted_tokens, out=out), reason
