"""The checks of kda_forward's and kda_decode's arguments, made once per call signature by
kda_opt/plan before any kernel runs: each raises TypeError or ValueError (RuntimeError for inputs that
require grad) naming the argument. check_host_copies reads the host copies' values, on every call
that passes them."""
import math
import numbers
import operator

import torch

from .options import CHUNK, INT32_MAX, SAFE_LOWER_BOUND, in_safe_range, state_shape

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # q, k, v; and the initial state
SUPPORTED_HEAD_DIMS = (64, 128)  # K and V each; FLA also takes 256, which stage 2's registers cannot hold


def rows_readable(x: torch.Tensor) -> bool:
    """Whether the stages read x [B, T, ...] (q, k, v or beta) through its strides: each token's row
    (heads × channels) dense, 16-byte aligned, tokens evenly spaced through the batch (as in q, k, v or
    beta split from one fused projection); otherwise kda_opt/forward reads a contiguous copy."""
    B, T = x.shape[:2]
    row = x[0, 0]
    return (row.is_contiguous() and x.stride(1) >= row.numel() and (B == 1 or x.stride(0) == T * x.stride(1))
            and x.stride(1) * x.element_size() % 16 == 0 and x.data_ptr() % 16 == 0)


def check_host_copies(T, cu_seqlens_cpu, initial_state_indices_cpu, initial_state, checkpoints, checkpoint_every=CHUNK,
                      pad_slot=None):
    """The checks that read the host copies' values (their types and shapes are checked before):
    cu_seqlens_cpu rising from 0 to T and, with it, checkpoints' rows; initial_state_indices_cpu
    below the pool's slots, no slot twice (but pad_slot, which is neither read nor written). Read as
    lists: a few µs a call."""
    if cu_seqlens_cpu is not None:
        cu = cu_seqlens_cpu.tolist()
        if cu[0] != 0 or cu[-1] != T or not all(map(operator.le, cu, cu[1:])):
            raise ValueError(f"cu_seqlens_cpu must rise from 0 to T={T}, got {cu[:8]}{' ...' if len(cu) > 8 else ''}")
        every = checkpoint_every
        if checkpoints is not None and checkpoints.shape[1] < sum(-(-(b - a) // every) for a, b in zip(cu, cu[1:])):
            raise _checkpoints_shape_error(checkpoints, f"Σ cdiv(len_n, {every})", every)
    if initial_state_indices_cpu is not None:
        slots, ids = initial_state.shape[0], initial_state_indices_cpu.tolist()
        if max(ids) >= slots:
            raise ValueError(f"initial_state_indices_cpu must be below the pool's {slots} slots (negative: "
                             f"no slot), got {max(ids)}")
        used = [i for i in ids if i >= 0 and i != pad_slot]
        if len(set(used)) != len(used):
            raise ValueError("initial_state_indices_cpu names a slot twice: two sequences would write one "
                             "pool row")


def checked_scale(scale) -> float:
    """scale as a float: a finite real number (a bool is not one)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number (None for K ** -0.5), got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def validate(q, k, v, g, beta, initial_state, *, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound,
              use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
              chunk_size) -> int:
    """Checks every argument's type, shape and dtype (devices: validate_devices); returns N, the
    number of sequences."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    optional = {"initial_state": initial_state, "A_log": A_log, "dt_bias": dt_bias}
    for name, x in {**named, **{n: x for n, x in optional.items() if x is not None}}.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if torch.is_grad_enabled():
        wants_grad = [n for n, x in {**named, **optional}.items() if x is not None and x.requires_grad]
        if wants_grad:
            raise RuntimeError(f"kda_opt is forward-only and computes no gradient, but {', '.join(wants_grad)} "
                               "require grad: call it under torch.no_grad() or torch.inference_mode(), or detach them")
    for name, ndim in (("q", 4), ("k", 4), ("v", 4), ("g", 4), ("beta", 3)):
        if named[name].dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(named[name].shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    expected = {"k": (B, T, H, K), "v": (B, T, HV, V), "g": (B, T, HV, K), "beta": (B, T, HV)}
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (from q {list(q.shape)} and v "
                             f"{list(v.shape)}), got {list(named[name].shape)}")
    if B < 1 or T < 1 or H < 1:
        raise ValueError(f"q must have B, T, H ≥ 1, got shape {list(q.shape)}")
    if HV % H != 0 or HV < 1:
        raise ValueError(f"v's head count ({HV}) must be a positive multiple of q's ({H})")
    if K not in SUPPORTED_HEAD_DIMS or V not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims K (q, k) and V (v) must each be one of {SUPPORTED_HEAD_DIMS} "
                         f"(FLA also takes 256; kda_opt does not), got K={K}, V={V}")
    for name in ("q", "k", "v"):
        if named[name].dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {named[name].dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    N = B if cu_seqlens is None and cu_seqlens_cpu is None else _validate_seqlens(cu_seqlens, cu_seqlens_cpu, B)
    s0_shape = state_shape(N, HV, K, V, state_v_first)
    if initial_state is not None and tuple(initial_state.shape) != s0_shape:
        raise ValueError(f"initial_state must have shape {list(s0_shape)} (N = "
                         f"{'B' if cu_seqlens is None else 'the number of sequences'}"
                         f"{', V before K: state_v_first' if state_v_first else ''}), "
                         f"got {list(initial_state.shape)}")
    if initial_state is not None:
        _check_state_dtype("initial_state", initial_state)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True scales sigmoid(beta) to (0, 2): it needs "
                         "use_beta_sigmoid_in_kernel=True (beta given as logits)")
    if chunk_size != CHUNK:
        raise ValueError(f"chunk_size must be {CHUNK} (the only size kda_opt computes), got {chunk_size}")

    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log (softplus gate) or lower_bound "
                             "(sigmoid gate); got neither")
        check_gate_parameters(A_log, dt_bias, HV, K)
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate=True with use_gate_in_kernel=True needs lower_bound")
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are used only with use_gate_in_kernel=True")
    if safe_gate and lower_bound is not None and not in_safe_range(lower_bound):
        raise ValueError(f"safe_gate needs lower_bound in [{SAFE_LOWER_BOUND}, 0), "
                         f"got {lower_bound}")
    return N


def batch_entry_extent(q, k, v, beta, checkpoints=None) -> int:
    """The elements one batch entry spans where B > 1 (T·HV·max(K, V), the inputs' and the
    checkpoints' batch strides), 0 where B = 1: it must not pass INT32_MAX, as the cuTile kernel
    takes arrays by int32 strides (kda_opt/wuso, _int32_strides); with B = 1 the batch stride is
    never used."""
    if q.shape[0] == 1:
        return 0
    T, HV, K, V = q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    return max(T * HV * max(K, V), *(x.stride(0) for x in (q, k, v, beta, checkpoints) if x is not None))


def validate_batch_extent(q, k, v, beta, checkpoints):
    entry = batch_entry_extent(q, k, v, beta, checkpoints)
    if entry > INT32_MAX:
        raise ValueError(f"with B > 1 a batch entry may span at most 2^31 − 1 elements (T·HV·max(K, V), an "
                         f"input's or the checkpoints' batch stride), got {entry}: pass the sequences packed (B = 1, "
                         "cu_seqlens), which has no such limit")


def validate_devices(q, **tensors):
    """q on a CUDA device, and every other tensor (None: absent) on q's; checked after everything
    else, so that the CPU tests reach every other check."""
    if q.device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {q.device}")
    for name, x in tensors.items():
        if x is not None and x.device != q.device:
            raise ValueError(f"{name} must be on {q.device} like q, got {x.device}")


def validate_serving(q, v, N, initial_state, output_final_state, indices, indices_cpu, has_initial_state,
                      checkpoints, checkpoint_every, checkpoint_offsets, state_v_first, cu_seqlens):
    """Checks the state pool (initial_state with initial_state_indices), has_initial_state and the
    checkpoint buffer, as a serving engine passes them (kda_forward's docstring)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    row = state_shape(1, HV, K, V, state_v_first)[1:]
    if indices is None and indices_cpu is not None:
        raise ValueError("initial_state_indices_cpu is given without initial_state_indices (the device copy "
                         "the kernels read)")
    if indices is not None:
        if initial_state is None:
            raise ValueError("initial_state_indices needs initial_state: the state pool they index")
        if output_final_state:
            raise ValueError("with initial_state_indices the final states are written into the pool "
                             "(initial_state) in place: pass output_final_state=False")
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be a floating-point torch.Tensor, got {initial_state!r:.80}")
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != row or initial_state.shape[0] < 1:
            layout = " (V before K: state_v_first)" if state_v_first else ""
            raise ValueError(f"a state pool (initial_state with initial_state_indices) must have shape "
                             f"[slots, {', '.join(map(str, row))}]{layout}, got {list(initial_state.shape)}")
        _check_state_dtype("initial_state", initial_state)
        dense_row = (row[1] * row[2], row[2], 1)
        if tuple(initial_state.stride()[1:]) != dense_row or initial_state.stride(0) < row[0] * dense_row[0]:
            raise ValueError(f"a state pool's rows must each be dense (strides [≥ {row[0] * dense_row[0]}, "
                             f"{', '.join(map(str, dense_row))}]; padding between rows is fine), got strides "
                             f"{list(initial_state.stride())}")
        for name, x in (("initial_state_indices", indices), ("initial_state_indices_cpu", indices_cpu)):
            if x is None:
                continue
            _check_integers(name, x)
            if tuple(x.shape) != (N,):
                raise ValueError(f"{name} must have shape [{N}] (one slot per sequence), got {list(x.shape)}")
        if indices_cpu is not None and indices_cpu.device.type != "cpu":
            raise ValueError(f"initial_state_indices_cpu must be on the CPU, got {indices_cpu.device}")
    if has_initial_state is not None:
        if not isinstance(has_initial_state, torch.Tensor) or has_initial_state.dtype != torch.bool:
            raise TypeError(f"has_initial_state must be a torch.bool tensor, got "
                            f"{getattr(has_initial_state, 'dtype', type(has_initial_state).__name__)}")
        if tuple(has_initial_state.shape) != (N,):
            raise ValueError(f"has_initial_state must have shape [{N}], got {list(has_initial_state.shape)}")
        if initial_state is None:
            raise ValueError("has_initial_state needs initial_state (the states it selects)")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < CHUNK \
            or checkpoint_every % CHUNK:
        raise ValueError(f"checkpoint_every must be a positive multiple of {CHUNK} tokens, got {checkpoint_every!r}")
    if checkpoint_every != CHUNK and checkpoints is None:
        raise ValueError("checkpoint_every is the spacing of the states written into checkpoints: it needs "
                         "checkpoints")
    if checkpoints is not None:
        if not isinstance(checkpoints, torch.Tensor):
            raise TypeError(f"checkpoints must be a torch.Tensor, got {type(checkpoints).__name__}")
        _check_state_dtype("checkpoints", checkpoints)
        every = checkpoint_every
        need = -(-T // every)   # packed: Σ cdiv(len_n, every), checked where cu_seqlens_cpu is given
        if (checkpoints.dim() != 5 or checkpoints.shape[0] != B or tuple(checkpoints.shape[2:]) != row
                or cu_seqlens is None and checkpoints.shape[1] < need):
            raise _checkpoints_shape_error(checkpoints, f"Σ cdiv(len_n, {every})" if cu_seqlens is not None
                                           else f"{need}", every, B, row)
    if checkpoint_offsets is not None:
        if checkpoints is None or cu_seqlens is None:
            raise ValueError("checkpoint_offsets places each packed sequence's first checkpoint: it needs "
                             "checkpoints and cu_seqlens")
        _check_integers("checkpoint_offsets", checkpoint_offsets)
        if tuple(checkpoint_offsets.shape) != (N,):
            raise ValueError(f"checkpoint_offsets must have shape [{N}] (one per sequence), got "
                             f"{list(checkpoint_offsets.shape)}")


def _checkpoints_shape_error(checkpoints, rows: str, every: int, B=None, row=None) -> ValueError:
    """The error of a checkpoint buffer of the wrong shape: B, row (its [HV, K, V] or V-first tail)
    default to the buffer's own, where only its rows are short."""
    B = checkpoints.shape[0] if B is None else B
    row = tuple(checkpoints.shape[2:]) if row is None else row
    return ValueError(f"checkpoints must have shape [{B}, ≥ {rows}, {', '.join(map(str, row))}] (the state "
                      f"after every {every} tokens and at each sequence's end), got {list(checkpoints.shape)}")


def check_gate_parameters(A_log, dt_bias, HV: int, K: int) -> None:
    """The in-kernel gate's A_log (where given) holds one value a value head, dt_bias (where given)
    one a value head's channel."""
    if A_log is not None and A_log.numel() != HV:
        raise ValueError(f"A_log must have {HV} elements (one per value head), got shape {list(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != HV * K:
        raise ValueError(f"dt_bias must have HV·K = {HV * K} elements, got shape {list(dt_bias.shape)}")


def _check_state_dtype(name, x):
    """x, a state tensor (initial state or pool, checkpoint buffer), is float32, bfloat16 or float16."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_integers(name, x):
    """x, an index argument (cu_seqlens, slot indices, or their host copies), is an int32 or int64 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")


def _validate_seqlens(cu_seqlens, cu_seqlens_cpu, B) -> int:
    """Checks cu_seqlens' and cu_seqlens_cpu's types, dtypes, shapes and devices (cu_seqlens_cpu's values:
    check_host_copies); returns N."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu is given without cu_seqlens (the device copy the kernels read)")
    for name, x in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if x is None:
            continue
        _check_integers(name, x)
        if x.dim() != 1 or x.shape[0] < 2:
            raise ValueError(f"{name} must have shape [N + 1] with N ≥ 1, got {list(x.shape)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along T: q's batch size must be 1, "
                         f"got B={B}")
    if cu_seqlens_cpu is not None:
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be on the CPU, got {cu_seqlens_cpu.device}")
        if cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape {list(cu_seqlens.shape)}, "
                             f"got {list(cu_seqlens_cpu.shape)}")
    return cu_seqlens.shape[0] - 1


def check_pad_slot(pad_slot, indices):
    """pad_slot: None, or a slot of the pool (a non-negative int) where slot indices are given."""
    if pad_slot is None:
        return
    if isinstance(pad_slot, bool) or not isinstance(pad_slot, int) or pad_slot < 0:
        raise TypeError(f"pad_slot must be a non-negative int (a slot of the pool), got {pad_slot!r}")
    if indices is None:
        raise ValueError("pad_slot is a slot of the pool that padding rows name: it needs slot indices")


def validate_decode_serving(q, v, N, initial_state, output_final_state, inplace_final_state, indices, accepted,
                             out, pad_slot, state_v_first, cu_seqlens) -> int:
    """Checks kda_decode's state pool, indices, accepted counts, out and pad_slot; returns the index
    columns (0 without indices)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    row = state_shape(1, HV, K, V, state_v_first)[1:]
    if output_final_state and inplace_final_state:
        raise ValueError("output_final_state returns new final states and inplace_final_state writes them into "
                         "initial_state: pass one of them")
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state writes the final states into initial_state: it needs one")
    columns = 0
    if indices is not None:
        if initial_state is None:
            raise ValueError("ssm_state_indices needs initial_state: the state pool they index")
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be a floating-point torch.Tensor, got {initial_state!r:.80}")
        _check_state_dtype("initial_state", initial_state)
        dense_row = (row[1] * row[2], row[2], 1)
        if (initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != row or initial_state.shape[0] < 1
                or tuple(initial_state.stride()[1:]) != dense_row or initial_state.stride(0) < row[0] * dense_row[0]):
            raise ValueError(f"a state pool (initial_state with ssm_state_indices) must have shape "
                             f"[slots, {', '.join(map(str, row))}]{' (V before K: state_v_first)' if state_v_first else ''}"
                             f" with each row dense, got shape {list(initial_state.shape)}, strides "
                             f"{list(initial_state.stride())}")
        _check_integers("ssm_state_indices", indices)
        if indices.dim() not in (1, 2) or indices.shape[0] != N or indices.dim() == 2 and indices.shape[1] < 1:
            raise ValueError(f"ssm_state_indices must have shape [{N}] or [{N}, S] (one slot per request, or per "
                             f"token), got {list(indices.shape)}")
        columns = 1 if indices.dim() == 1 else indices.shape[1]
        if indices.dim() == 2 and inplace_final_state and cu_seqlens is None and columns < T:
            raise ValueError(f"ssm_state_indices [N, S] names the row of each token's state: S must be at least "
                             f"T={T}, got {columns}")
    if accepted is not None:
        if indices is None or indices.dim() != 2:
            raise ValueError("num_accepted_tokens picks a column of ssm_state_indices [N, S]: it needs them")
        _check_integers("num_accepted_tokens", accepted)
        if tuple(accepted.shape) != (N,):
            raise ValueError(f"num_accepted_tokens must have shape [{N}], got {list(accepted.shape)}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != v.dtype or out.shape != v.shape:
            raise ValueError(f"out must be a {v.dtype} tensor of v's shape {list(v.shape)}, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', []))}")
        if out.stride(-1) != 1 or B > 1 and out.stride(0) != T * out.stride(1):
            raise ValueError(f"out's channels must be dense and its tokens evenly spaced through the batch, "
                             f"got strides {list(out.stride())}")
    check_pad_slot(pad_slot, indices)
    return columns


def validate_decode_buffer(q, v, N, buffer, rows, parents, indices, output_final_state, inplace_final_state,
                           accepted, state_v_first, cu_seqlens) -> int:
    """Checks kda_decode's intermediate_states_buffer, intermediate_state_indices and
    retrieve_parent_token (SGLang's verify) against the rest of the call (validate_decode_serving's
    checks made); returns the buffer's states per row, S."""
    if rows is None:
        raise ValueError("intermediate_states_buffer needs intermediate_state_indices: each request's row of it")
    if indices is None or indices.dim() != 1:
        raise ValueError("intermediate_states_buffer needs ssm_state_indices [N]: each request's start in the pool")
    if output_final_state or inplace_final_state or accepted is not None:
        raise ValueError("intermediate_states_buffer takes each token's state, the pool only read: not with "
                         "output_final_state, inplace_final_state or num_accepted_tokens")
    if not isinstance(buffer, torch.Tensor) or not buffer.is_floating_point():
        raise TypeError(f"intermediate_states_buffer must be a floating-point torch.Tensor, got {buffer!r:.80}")
    _check_state_dtype("intermediate_states_buffer", buffer)
    B, T, _, K = q.shape
    row = state_shape(1, v.shape[2], K, v.shape[3], state_v_first)[1:]
    dense = (row[0] * row[1] * row[2], row[1] * row[2], row[2], 1)
    if (buffer.dim() != 5 or tuple(buffer.shape[2:]) != row or min(buffer.shape[:2]) < 1
            or tuple(buffer.stride()[1:]) != dense or buffer.stride(0) < buffer.shape[1] * dense[0]):
        raise ValueError(f"intermediate_states_buffer must have shape [rows, S, {', '.join(map(str, row))}]"
                         f"{' (V before K: state_v_first)' if state_v_first else ''} with each row's S states "
                         f"dense, got shape {list(buffer.shape)}, strides {list(buffer.stride())}")
    _check_integers("intermediate_state_indices", rows)
    if tuple(rows.shape) != (N,):
        raise ValueError(f"intermediate_state_indices must have shape [{N}], got {list(rows.shape)}")
    if parents is not None:
        _check_integers("retrieve_parent_token", parents)
        if parents.dim() != 2 or parents.shape[0] != N or parents.shape[1] < 1:
            raise ValueError(f"retrieve_parent_token must have shape [{N}, P] (request n's token t's parent at "
                             f"[n, t]), got {list(parents.shape)}")
    if cu_seqlens is None and buffer.shape[1] < T:
        raise ValueError(f"intermediate_states_buffer [rows, S, ...] holds each token's state: S must be at least "
                         f"T={T}, got {buffer.shape[1]}")
    return buffer.shape[1]
