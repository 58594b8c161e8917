"""`kda_forward`: validate once, then launch the stages (docs/DESIGN.md, Pipeline) on the current
stream.

    seqs     = packed(cu_seqlens)             packed sequences only: chunk table (kda_opt/seqs)
    Γ        = gate_cumsum(g)                 stage 1, Triton   (kda_opt/gate)
    Aqk, Tm  = intra_chunk(q, k, Γ, β)        stages 2+3, Triton (kda_opt/intra: Akk and its
                                              inverse Tm = (I + Akk)⁻¹ Diag(β) in one kernel;
                                              β's residual r where β is not a 16-bit number,
                                              q/k norms for l2norm)
    o, S     = wuso(q, k, v, Γ, Tm, Aqk, S0)  stage 4, cuTile   (kda_opt/wuso)
Each stage runs inside an NVTX range of the `kda_opt` domain; nothing here waits on the device.

Time segments. Stage 4 runs one program per (sequence, value head, V block) through the whole
sequence, so where B·H is small most SMs idle through it ((1, 65536, 16): 64 programs on 132
SMs). There a lone sequence is cut at chunk boundaries into segments (time_segments), stages 1–3
of segment s + 1 run on a second stream while stage 4 runs segment s on the idle SMs, and each
segment's final state (fp32, as stage 4 keeps it) is the next one's initial state: the same numbers
as one pass. The caller's stream waits for the second stream's work before each stage 4, so the
result is ordered on it as usual.
"""
import functools
import warnings

import nvtx
import torch

from .gate import gate_cumsum
from .intra import intra_chunk
from .options import GateConfig
from .seqs import num_sequences, packed
from .wuso import block_v_for, wuso

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # q, k, v; and the initial state
SUPPORTED_HEAD_DIMS = (64, 128)  # K and V each; FLA also takes 256, which stage 2's registers cannot hold
SAFE_LOWER_BOUND = (-5.0, 0.0)  # the range in which safe_gate keeps in-chunk exponents bounded
# Time segments (module docstring): at least SEGMENT_TOKENS tokens each, at most MAX_SEGMENTS (1: off).
# (Shorter segments measured slower: each adds a launch and a state hand-over to stage 4's chain.)
SEGMENT_TOKENS = 8192
MAX_SEGMENTS = 8

nvtx_range = functools.partial(nvtx.annotate, domain="kda_opt")


def kda_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_size: int = 64,
    transpose_state_layout: bool | None = None,
):
    r"""Forward pass of Kimi Delta Attention; the same function as FLA 0.6.0 ``chunk_kda``.

    Per batch and value head, with state S [K, V] (float32) and for each token t:
    ``S ← Diag(exp a_t) S``, ``S ← S + β_t k_t (v_t − k_tᵀ S)ᵀ``, ``o_t = (scale · q_t)ᵀ S``.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys, bf16 / fp16 / fp32 (q, k, v of one dtype).
        v: ``[B, T, HV, V]`` values; ``HV`` a multiple of ``H`` (grouped value heads: value head
            ``h`` reads q/k head ``h // (HV / H)``).
        g: ``[B, T, HV, K]`` gate, any float dtype: the raw gate if ``use_gate_in_kernel``, else
            the log-decay ``a ≤ 0`` itself.
        beta: ``[B, T, HV]`` delta-rule write strength (post-sigmoid; logits with
            ``use_beta_sigmoid_in_kernel``), any float dtype. A β that is not a number of k's
            dtype (logits, fp32 beta with 16-bit k) costs one small [B, HV, T] fp32 buffer, which
            keeps it exact (kda_opt/intra, "β's residual").
        scale: query scale; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` state before each sequence's first token (N = B, or the
            number of packed sequences; ``[N, HV, V, K]`` with ``state_v_first``); float32, bf16 or
            fp16, read as it is. None starts from zero.
        output_final_state: also return the state after each sequence's last token, float32, in
            initial_state's layout.

    Keyword-only (as FLA names them):
        use_qk_l2norm_in_kernel: L2-normalise q and k per head and token, ``x / sqrt(Σ x² + 1e-6)``,
            as they are read (no pass of its own); the same function as normalising before the call.
        use_gate_in_kernel: activate ``g`` here: ``a = lower_bound · sigmoid(exp(A_log) · (g +
            dt_bias))`` when ``lower_bound`` is given (A_log optional), else ``a = −exp(A_log) ·
            softplus(g + dt_bias)`` (A_log required).
        use_beta_sigmoid_in_kernel: ``beta`` holds logits: ``β = sigmoid(beta)``, taken where β
            is read (no pass of its own).
        allow_neg_eigval: ``β = 2 · sigmoid(beta)``, in (0, 2), so that ``I − β k kᵀ`` may have
            negative eigenvalues; needs ``use_beta_sigmoid_in_kernel`` (as in FLA).
        A_log: ``[HV]`` float32 per-head decay rate (gate in kernel only).
        dt_bias: ``[HV · K]`` float32 per-channel bias (gate in kernel only; optional).
        safe_gate: promise that ``a ≥ lower_bound`` with ``lower_bound ∈ [−5, 0)``, which lets the
            intra-chunk products run on tensor cores in 16-bit. With ``use_gate_in_kernel`` it
            requires ``lower_bound``.
        lower_bound: see ``use_gate_in_kernel`` and ``safe_gate``.
        state_v_first: initial and final states laid out ``[N, HV, V, K]`` (FlashKDA's layout)
            instead of ``[N, HV, K, V]``.
        cu_seqlens: ``[N + 1]`` int32/int64 on q's device: N sequences packed along T (B must be
            1), sequence n being tokens ``cu_seqlens[n] .. cu_seqlens[n+1] − 1``, each with its own
            initial and final state; chunks never cross a sequence boundary. Its values must rise
            from 0 to T (lengths ≥ 0); they are read on the device only, so they are not checked
            there (values that break this give wrong rows, never an access out of bounds).
        cu_seqlens_cpu: the same values on the CPU (optional, as in FLA): then they are checked
            here, without a host-device synchronisation. Nothing else uses it: kda_forward never
            needs the lengths on the host.
        chunk_size: 64 (the only size this engine computes).
        transpose_state_layout: FLA's deprecated name of ``state_v_first`` (a DeprecationWarning;
            passing both is an error).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state as above, or None.

    Needs a CUDA GPU of compute capability 9.0 (Hopper: H100, H200); forward only, with no
    autograd: with gradients enabled, inputs that require grad raise a RuntimeError (call it under
    ``torch.no_grad()`` or ``torch.inference_mode()``, as serving engines do).

    Supported head dims: K and V each 64 or 128 (any pair). Inputs that are not contiguous are made
    contiguous (a copy). Bad inputs raise ValueError or TypeError naming the argument before any
    kernel runs. No host-device synchronisation.
    """
    if transpose_state_layout is not None:
        if state_v_first:
            raise ValueError("pass state_v_first or its deprecated name transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated; its name is now state_v_first",
                      DeprecationWarning, stacklevel=2)
        state_v_first = bool(transpose_state_layout)
    gate = _validate(q, k, v, g, beta, initial_state, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                     dt_bias=dt_bias, safe_gate=safe_gate, lower_bound=lower_bound,
                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                     chunk_size=chunk_size)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if gate.in_kernel:
        A_log = None if A_log is None else A_log.to(torch.float32).contiguous()
        dt_bias = None if dt_bias is None else dt_bias.to(torch.float32).contiguous()
    else:
        A_log = dt_bias = None
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    beta_sigmoid = (2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else None
    # Tm (k's dtype) holds β on its diagonal: where β is not a number of that dtype, stage 4 adds back
    # what its rounding lost (kda_opt/intra, "β's residual").
    residual = k.dtype != torch.float32 and (use_beta_sigmoid_in_kernel or beta.dtype != k.dtype)
    prepare = functools.partial(_stages_1_to_3, gate=gate, A_log=A_log, dt_bias=dt_bias, scale=scale,
                                chunk_size=chunk_size, l2norm=use_qk_l2norm_in_kernel,
                                beta_sigmoid=beta_sigmoid, residual=residual)
    with nvtx_range("kda_opt/forward"):
        seqs = None                                                     # B sequences of T tokens
        if cu_seqlens is not None:
            with nvtx_range("kda_opt/seqs"):
                seqs = packed(cu_seqlens, T, chunk_size)
        N = num_sequences(B, cu_seqlens)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        block_v = block_v_for(N * HV, V, sms, q.dtype)
        stage4 = functools.partial(wuso, scale=scale, chunk_size=chunk_size, block_v=block_v,
                                   state_v_first=state_v_first)
        segments = time_segments(T, N, N * HV * (V // block_v), sms, seqs is not None, chunk_size)
        if len(segments) == 1:
            gcum, Aqk, Tm, r, rstd = prepare(q, k, g, beta, seqs)
            with nvtx_range("kda_opt/wuso"):
                return stage4(q, k, v, gcum, Tm, Aqk, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens, qk_rstd=rstd,
                              beta_residual=r)
        return _pipelined(segments, q, k, v, g, beta, initial_state, output_final_state, prepare, stage4)


def time_segments(T: int, N: int, programs: int, sms: int, is_packed: bool, chunk_size: int = 64):
    """[(t0, t1)]: the token ranges the forward runs as segments (module docstring), each a whole
    number of chunks but the last; [(0, T)] where cutting does not pay: several or packed sequences,
    stage 4's programs filling more than half the SMs, or T below two segments."""
    if MAX_SEGMENTS < 2 or is_packed or N != 1 or 2 * programs > sms or T < 2 * SEGMENT_TOKENS:
        return [(0, T)]
    count = min(MAX_SEGMENTS, T // SEGMENT_TOKENS)
    step = -(-T // (count * chunk_size)) * chunk_size
    return [(t0, min(t0 + step, T)) for t0 in range(0, T, step)]


def _stages_1_to_3(q, k, g, beta, seqs=None, *, gate, A_log, dt_bias, scale, chunk_size, l2norm,
                   beta_sigmoid, residual):
    """Stages 1–3 over q, k, g, beta [B, T, ...] (seqs: their layout; None: B sequences of T tokens):
    Γ, Aqk, Tm, β's residual r [B, HV, T] (where `residual`, else None) and the q/k norms
    [2, B, H, T] (where l2norm, else None)."""
    B, T, H, _ = q.shape
    HV = g.shape[2]
    r = q.new_empty((B, HV, T), dtype=torch.float32) if residual else None
    rstd = q.new_empty((2, B, H, T), dtype=torch.float32) if l2norm else None   # 1 / ‖q‖, 1 / ‖k‖
    with nvtx_range("kda_opt/gate"):
        gcum = gate_cumsum(g, gate, A_log, dt_bias, chunk_size, seqs)
    with nvtx_range("kda_opt/intra"):
        Aqk, Tm = intra_chunk(q, k, gcum, beta, scale, chunk_size, gate_bounded=gate.bounded, seqs=seqs,
                              l2norm=l2norm, beta_sigmoid=beta_sigmoid, beta_residual=r, qk_rstd=rstd)
    return gcum, Aqk, Tm, r, rstd


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _pipelined(segments, q, k, v, g, beta, initial_state, output_final_state, prepare, stage4):
    """The forward over time segments of one sequence (B = 1): stages 1–3 of each segment on a side
    stream, stage 4 on the caller's, which waits for them; the state handed on in fp32."""
    main = torch.cuda.current_stream(q.device)
    side = _side_stream(q.device)
    side.wait_stream(main)                      # q, k, v, g, beta as the caller's stream left them
    o = torch.empty_like(v)
    state = initial_state
    for i, (t0, t1) in enumerate(segments):
        part = lambda x: x[:, t0:t1]            # B = 1: a contiguous view
        with torch.cuda.stream(side):
            made = prepare(part(q), part(k), part(g), part(beta))
            ready = side.record_event()
        for x in made:
            if x is not None:
                x.record_stream(main)           # allocated on the side stream, read on the caller's
        main.wait_event(ready)
        gcum, Aqk, Tm, r, rstd = made
        last = i == len(segments) - 1
        with nvtx_range("kda_opt/wuso"):
            _, state = stage4(part(q), part(k), part(v), gcum, Tm, Aqk, initial_state=state,
                              output_final_state=output_final_state or not last, qk_rstd=rstd,
                              beta_residual=r, out=part(o))
    return o, state


def _validate(q, k, v, g, beta, initial_state, *, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound,
              use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu,
              chunk_size) -> GateConfig:
    """Checks every argument's type, shape, dtype and device; returns the gate configuration."""
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
            raise RuntimeError(f"kda_forward is forward-only and computes no gradient, but {', '.join(wants_grad)} "
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
    N = B if cu_seqlens is None and cu_seqlens_cpu is None else _validate_seqlens(cu_seqlens, cu_seqlens_cpu, B, T)
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must have shape {list(state_shape)} (N = "
                         f"{'B' if cu_seqlens is None else 'the number of sequences'}"
                         f"{', V before K: state_v_first' if state_v_first else ''}), "
                         f"got {list(initial_state.shape)}")
    if initial_state is not None and initial_state.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"initial_state must be float32, bfloat16 or float16, got {initial_state.dtype}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True scales sigmoid(beta) to (0, 2): it needs "
                         "use_beta_sigmoid_in_kernel=True (beta given as logits)")
    if chunk_size != 64:
        raise ValueError(f"chunk_size must be 64, got {chunk_size}")

    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log (softplus gate) or lower_bound "
                             "(sigmoid gate); got neither")
        if A_log is not None and A_log.numel() != HV:
            raise ValueError(f"A_log must have {HV} elements (one per value head), got shape "
                             f"{list(A_log.shape)}")
        if dt_bias is not None and dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have HV·K = {HV * K} elements, got shape {list(dt_bias.shape)}")
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate=True with use_gate_in_kernel=True needs lower_bound")
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are used only with use_gate_in_kernel=True")
    if safe_gate and lower_bound is not None and not SAFE_LOWER_BOUND[0] <= lower_bound < SAFE_LOWER_BOUND[1]:
        raise ValueError(f"safe_gate needs lower_bound in [{SAFE_LOWER_BOUND[0]}, {SAFE_LOWER_BOUND[1]}), "
                         f"got {lower_bound}")

    device = q.device
    if device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {device}")
    for name, x in {**named, **optional, "cu_seqlens": cu_seqlens}.items():
        if x is not None and x.device != device:
            raise ValueError(f"{name} must be on {device} like q, got {x.device}")
    return GateConfig(in_kernel=use_gate_in_kernel, lower_bound=lower_bound, safe_gate=safe_gate)


def _validate_seqlens(cu_seqlens, cu_seqlens_cpu, B, T) -> int:
    """Checks cu_seqlens' type, dtype and shape, and cu_seqlens_cpu's values when given; returns N."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu is given without cu_seqlens (the device copy the kernels read)")
    for name, x in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
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
        lens = cu_seqlens_cpu.diff()
        if cu_seqlens_cpu[0] != 0 or cu_seqlens_cpu[-1] != T or (lens < 0).any():
            raise ValueError(f"cu_seqlens_cpu must rise from 0 to T={T}, got {cu_seqlens_cpu.tolist()[:8]}"
                             f"{' ...' if len(cu_seqlens_cpu) > 8 else ''}")
    return cu_seqlens.shape[0] - 1
