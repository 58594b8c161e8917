"""`kda_forward`: the call resolved into a plan (kda_opt/plan), then the stages (docs/DESIGN.md,
Pipeline) launched on the current stream.

    seqs     = packed(cu_seqlens)             packed sequences only: chunk table (kda_opt/seqs)
    Γ        = gate_cumsum(g)                 stage 1, Triton   (kda_opt/gate)
    Aqk, Tm  = intra_chunk(q, k, Γ, β)        stages 2+3, Triton (kda_opt/intra: Akk and its
                                              inverse Tm = (I + Akk)⁻¹ Diag(β) in one kernel;
                                              β's residual r where β is not a 16-bit number,
                                              q/k norms for l2norm)
    order    = longest_first(cu_seqlens)      packed, stage 4 in waves: its programs' order (kda_opt/seqs)
    o, S     = wuso(q, k, v, Γ, Tm, Aqk, S0)  stage 4, cuTile   (kda_opt/wuso)
The call's arguments travel as one record (kda_opt/arguments.ForwardArguments), from which its plan
is made once per call signature (kda_opt/plan.plan_for), with a table of its compiled Triton kernels,
launched without the JIT's per-call work (kda_opt/launch); a call whose plan allows it is then
recorded and replayed (kda_opt/replay): its launches recorded on its signature's second call and
replayed from the third, unless KDA_OPT_REPLAY=0. Each stage runs through `launch`, inside an NVTX
range of the `kda_opt` domain where KDA_OPT_NVTX=1 asks for them; nothing here waits on the device.

A call runs in one pass, in time segments or parallel segments, or with its longest packed sequence
ahead, as kda_opt/plan.schedule_of resolves it once per call (from the plan and, for packed
sequences, their host copy); `run` dispatches on that, and kda_opt/schedules runs the others.
"""
import contextlib
import functools
import math

import nvtx
import torch

from . import replay
from .arguments import HOST_COPIES, ForwardArguments, traced_as
from .gate import gate_cumsum
from .intra import intra_chunk
from .launch import Kernels, annotated, direct, nvtx_enabled, one_allocation
from .options import CHUNK
from .plan import (Ahead, OnePass, ParallelSegments, Pieces, Plan, TimeSegments, Tuning, make_plan, plan_for,
                   schedule_of, takes_ahead)
from .plan_cache import Entry
from .recurrence import decode
from .schedules import final_states, longest_ahead, parallel, parallel_packed, pipelined
from .seqs import ahead_layout, block_offsets, longest_first, packed, phased
from .segment_tables import units
from .wuso import wuso


def _traced(a: ForwardArguments):
    """kda_forward while torch.compile traces it: one custom op (kda_opt/op), without the host copies
    (the op validates the call when it runs)."""
    writes = a.initial_state_indices is not None or a.checkpoints is not None
    op = torch.ops.kda_opt.forward_in_place if writes else torch.ops.kda_opt.forward
    o, final = op(**{n: x for n, x in a._asdict().items() if n not in HOST_COPIES})
    return o, final if a.output_final_state else None


@traced_as(_traced, ForwardArguments)
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
    chunk_size: int = CHUNK,
    transpose_state_layout: bool | None = None,
    initial_state_indices: torch.Tensor | None = None,
    initial_state_indices_cpu: torch.Tensor | None = None,
    pad_slot: int | None = None,
    has_initial_state: torch.Tensor | None = None,
    checkpoints: torch.Tensor | None = None,
    checkpoint_every: int = CHUNK,
    checkpoint_offsets: torch.Tensor | None = None,
):
    r"""Forward pass of Kimi Delta Attention; the same function as FLA 0.6.0 ``chunk_kda``.

    Per batch and value head, with state S [K, V] (float32) and for each token t:
    ``S ← Diag(exp a_t) S``, ``S ← S + β_t k_t (v_t − k_tᵀ S)ᵀ``, ``o_t = (scale · q_t)ᵀ S``.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys, bf16 / fp16 / fp32 (q, k, v of one dtype). The
            matrix products take 16-bit operands, or tf32 ones for fp32 inputs, with fp32
            accumulation; the state is carried in fp32 (a 16-bit pool or checkpoint stores it rounded).
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
        A_log: ``[HV]`` per-head decay rate (gate in kernel only), any float dtype: read as float32
            where it is used, so a model's bf16 parameter costs no conversion.
        dt_bias: ``[HV · K]`` per-channel bias (gate in kernel only; optional), any float dtype, read
            as A_log is.
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
            there (values that break this give wrong rows, never an access out of bounds). A
            sequence of one token (a mixed step's decode) runs the token recurrence itself, through
            kda_decode's kernel, except in a call with checkpoints or parallel segments.
        cu_seqlens_cpu: the same values on the CPU (optional, as in FLA): then they are checked
            here, without a host-device synchronisation; one sequence (N = 1), known so to span
            all T tokens, runs as the fixed-length call of B = 1 does (a long one in time or
            parallel segments, docs/DESIGN.md), and a long sequence among others in parallel
            segments where they pay, or ahead of the others (its stage 4 beside their stages 1–3:
            docs/DESIGN.md, "The longest ahead"); without it the device values are trusted unseen
            and every sequence runs in one pass.
        chunk_size: 64, the only size this engine computes (kda_opt/options.CHUNK).
        transpose_state_layout: FLA's deprecated name of ``state_v_first`` (a DeprecationWarning;
            passing both is an error).

    Keyword-only, for serving engines (docs/USAGE.md, "Serving"):
        initial_state_indices: ``[N]`` int32/int64 on q's device (SGLang's name): initial_state is
            then a state **pool** ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` with
            ``state_v_first``; float32, bf16 or fp16; each row dense, rows may be padded:
            ``stride(0) ≥ HV·K·V``). Sequence n starts from ``pool[initial_state_indices[n]]``, and
            its final state is written to that row, in place and rounded to the pool's dtype, by
            this call's last kernel on the current stream (so it is in the pool for any later
            work ordered on that stream; other rows and the padding are left as they are). A
            negative index (SGLang pads with −1) starts from zeros and writes nothing; an index at
            or past ``slots`` reads as zeros and writes nothing on the device (a caller error that
            ``initial_state_indices_cpu`` catches). Then ``output_final_state`` must be False and
            the call returns ``(o, None)``. Two sequences must not name the same slot: their programs
            race on its row, and the state left there (and each one's start, if one reads after the
            other writes) is undefined; ``initial_state_indices_cpu`` catches it.
        initial_state_indices_cpu: the same indices on the CPU (optional): then checked here (below
            ``slots``, no slot twice but ``pad_slot``), without a host-device synchronisation.
        pad_slot: a slot the caller pads with (vLLM's reserved slot 0): it reads as zeros and is not
            written, like a negative index, so any number of padding sequences may name it.
        has_initial_state: ``[N]`` bool on q's device (vLLM's name): sequence n starts from zeros
            where False (its state row is not read, so it may hold anything), from initial_state
            (a pool row or the dense ``initial_state[n]``) where True.
        checkpoints: a buffer ``[B, NT, HV, K, V]`` (``…, V, K]`` with ``state_v_first``; float32,
            bf16 or fp16) that receives the state after every 64-token chunk, for prefix caching:
            ``checkpoints[b, j]`` is sequence b's state after its first ``min(64·(j+1), T)`` tokens,
            for ``j < cdiv(T, 64)``, bit for bit the final state of a call that stops there (in
            the buffer's dtype). Packed (B = 1), sequence n's chunk j is row
            ``Σ_{m<n} cdiv(len_m, 64) + j`` (the layout of FLA's intermediate states); rows past NT
            are not written, and ``NT = cdiv(T, 64) + N − 1`` always suffices. Written in place,
            on the current stream; the rows no chunk maps to are left as they are.
        checkpoint_every: tokens between checkpoints, a positive multiple of 64 (default 64: every
            chunk; needs ``checkpoints``). Row j of a sequence is then its state after its first
            ``min(checkpoint_every·(j+1), len)`` tokens, for ``j < cdiv(len, checkpoint_every)``
            (the last row: its final state), packed ones from row ``Σ_{m<n} cdiv(len_m,
            checkpoint_every)``; ``NT = cdiv(T, checkpoint_every) + N − 1`` suffices. For prefix
            caching at cache-block boundaries (vLLM's block size) without a state per chunk.
        checkpoint_offsets: ``[N]`` int32/int64 on q's device (packed sequences, with
            ``checkpoints``): sequence n's first checkpoint after its first ``f_n =
            checkpoint_offsets[n]`` tokens (``1 ≤ f_n ≤ checkpoint_every``; values outside are
            clamped, not checked), the next ones every ``checkpoint_every`` tokens after it: row j is
            its state after ``min(f_n + checkpoint_every·j, len_n)`` tokens, for ``j < 1 +
            cdiv(max(len_n − f_n, 0), checkpoint_every)`` (the last row: its final state), packed
            ones from row ``Σ_{m<n}`` of those counts (0 for an empty sequence); ``NT = cdiv(T,
            checkpoint_every) + 2N`` suffices. For prefix caching at cache-block boundaries when a
            sequence's computed prefix does not end on one (``f_n = block − computed_n mod
            block``). The sequence's chunks then start after its first ``f_n mod 64`` tokens, which
            are taken as a chunk of their own, so that every checkpoint ends a chunk: each row is
            bit for bit the final state of the same call that stops there, and o is the same
            function at the same accuracy (not bit for bit that of a call without it).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state as above, or None (also
        with a state pool: the final states are then in the pool).

    Needs a CUDA GPU of compute capability 9.0 (Hopper: H100, H200); forward only, with no
    autograd: with gradients enabled, inputs that require grad raise a RuntimeError (call it under
    ``torch.no_grad()`` or ``torch.inference_mode()``, as serving engines do).

    Supported head dims: K and V each 64 or 128 (any pair). q, k, v and beta whose tokens are dense,
    evenly spaced rows (views split from one fused projection) are read through their strides; other
    inputs that are not contiguous are copied first. Length: one sequence (B = 1, or packed) of any
    length; with B > 1 each batch entry within 2^31 elements (T·HV·max(K, V), and the inputs' and
    checkpoints' batch strides; past it a ValueError says to pack them). Bad inputs raise ValueError
    or TypeError naming the argument before any kernel runs. No host-device synchronisation.
    ``kda_opt.plan.make_plan(kda_opt.arguments.ForwardArguments(q, k, v, g, beta, ...))`` takes the
    same arguments and returns the call's resolved options and launch choices without running it.

    Under torch.compile it is one custom op, ``torch.ops.kda_opt.forward`` (``forward_in_place``,
    which declares the pool and the checkpoints written, when either is given; kda_opt/op), which runs
    this function when the compiled graph runs: the same numbers; the ``*_cpu`` host copies are not
    read there.
    """
    arguments = ForwardArguments(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_size=chunk_size, transpose_state_layout=transpose_state_layout,
        initial_state_indices=initial_state_indices, initial_state_indices_cpu=initial_state_indices_cpu,
        pad_slot=pad_slot, has_initial_state=has_initial_state, checkpoints=checkpoints,
        checkpoint_every=checkpoint_every, checkpoint_offsets=checkpoint_offsets)
    entry = plan_for(arguments)
    ahead = takes_ahead(entry.plan, cu_seqlens_cpu)
    if ahead:       # its launches the same for any lengths: replayed in an entry of their own
        entry.ahead = entry.ahead or Entry(entry.plan)
        entry = entry.ahead
    return replay.call(entry, arguments.device_tensors(), lambda: run(
        entry.plan, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias,
        cu_seqlens=cu_seqlens, initial_state_indices=initial_state_indices, has_initial_state=has_initial_state,
        checkpoints=checkpoints, checkpoint_offsets=checkpoint_offsets, cu_seqlens_cpu=cu_seqlens_cpu,
        kernels=entry.kernels, ahead=ahead), None if ahead else entry.plan.not_replayable)


def run(plan: Plan, q, k, v, g, beta, initial_state=None, A_log=None, dt_bias=None, cu_seqlens=None,
        initial_state_indices=None, has_initial_state=None, checkpoints=None, checkpoint_offsets=None,
        cu_seqlens_cpu=None, *, launch=None, kernels: Kernels | None = None, made=None, ahead: bool = False):
    """The forward of a plan made from these inputs (make_plan): (o, final state or None).
    launch(name, launcher, *args, **kwargs) runs each stage's launcher (names: seqs, gate, intra,
    wuso; None: directly, or inside an NVTX range where KDA_OPT_NVTX asks for them, kda_opt/launch);
    scripts/bench_stages.py passes one that records them. kernels: the plan's table of compiled Triton
    kernels (kda_opt/launch; None: every launch through the JIT). made: stages 1–3's outputs over
    these tokens, computed before (Prepared; a plan of one time segment, without checkpoint offsets).
    cu_seqlens_cpu: the host copy, from which packed sequences are cut where plan.parallel_cut says
    and the stages' launches sized where plan.sized_launches says. ahead: the longest packed sequence
    runs ahead (plan.takes_ahead, asked by the caller; the host copy is then not read)."""
    ranges = nvtx_enabled()
    launch = launch or (annotated if ranges else direct)
    schedule = schedule_of(plan, q.device, cu_seqlens_cpu,
                           lambda: q.is_cuda and torch.cuda.is_current_stream_capturing(), ahead)
    q, k, v, g, beta, initial_state, A_log, dt_bias = _as_read(plan, q, k, v, g, beta, initial_state, A_log, dt_bias)
    cu_seqlens = cu_seqlens if plan.packed else None        # one sequence over [0, T]: the B = 1 call
    prepare = functools.partial(_stages_1_to_3, plan, launch, kernels, A_log=A_log, dt_bias=dt_bias)
    if made is not None:
        if plan.checkpoint_offsets or isinstance(schedule, TimeSegments):
            raise ValueError("stages 1–3 computed before serve calls of one time segment, without checkpoint "
                             "offsets")
        prepare = lambda *_, **__: made
    stage4 = functools.partial(launch, "wuso", wuso, scale=plan.scale, block_v=plan.block_v,
                               state_v_first=plan.state_v_first, worker_warps=plan.worker_warps,
                               checkpoint_every=plan.checkpoint_every // CHUNK,
                               short_sequences=plan.short_sequences)
    one_pass = schedule if isinstance(schedule, OnePass) else OnePass(None, False, False)
    with nvtx.annotate("kda_opt/forward", domain="kda_opt") if ranges else contextlib.nullcontext():
        seqs = rows = None
        if plan.checkpoint_offsets:
            seqs, rows = launch("seqs", phased, cu_seqlens, first=checkpoint_offsets, T=plan.T,
                                every=plan.checkpoint_every, kernels=kernels)
        elif plan.packed and not isinstance(schedule, Ahead):        # (Ahead's layouts are its tables)
            seqs = launch("seqs", packed, cu_seqlens, T=plan.T, kernels=kernels, skip_single=one_pass.routed,
                          chunks=None if one_pass.counts is None else one_pass.counts.chunks)
        final = initial_state if plan.state_pool else final_states(plan, v) if plan.output_final_state else None
        if plan.pad_slot is not None:           # the pad slot as a negative one: not read, not written
            initial_state_indices = initial_state_indices.masked_fill(initial_state_indices == plan.pad_slot, -1)
        state = dict(initial_state=initial_state, final_state=final, slots=initial_state_indices,
                     read_slots=plan.state_pool, write_slots=plan.state_pool, has_initial_state=has_initial_state)
        match schedule:
            case TimeSegments(segments):
                o = pipelined(plan, segments, q=q, k=k, v=v, g=g, beta=beta, state=state, checkpoints=checkpoints,
                              prepare=prepare, stage4=stage4)
            case ParallelSegments(_, tables):
                o = parallel(plan, tables, q=q, k=k, v=v, g=g, beta=beta, state=state, checkpoints=checkpoints,
                             prepare=prepare, stage4=stage4)
            case Pieces(_, block_v, tables):
                o = parallel_packed(plan, tables, block_v, q=q, k=k, v=v, g=g, beta=beta, seqs=seqs, state=state,
                                    checkpoints=checkpoints, prepare=prepare, stage4=stage4)
            case Ahead(segments, block_v, routed):
                layout = functools.partial(launch, "seqs", ahead_layout, cu_seqlens, plan.T, kernels=kernels,
                                           skip_single=routed)     # layout(segments, ...)
                o = longest_ahead(plan, segments, block_v, q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens,
                                  state=state, routed=routed, prepare=prepare, stage4=stage4, layout=layout)
            case OnePass(counts, routed, ordered):
                gcum, Aqk, Tm, r, rstd = prepare(q, k, g, beta, seqs)
                order = launch("seqs", longest_first, cu_seqlens, T=plan.T, kernels=kernels) if ordered else None
                o = stage4(q, k, v, gcum, Tm, Aqk, **state, checkpoints=checkpoints, order=order,
                           sequence_counts=counts, checkpoint_rows=rows if rows is not None
                           else _checkpoint_rows(plan, checkpoints, seqs, kernels),
                           checkpoint_first=checkpoint_offsets, cu_seqlens=cu_seqlens, qk_rstd=rstd,
                           beta_residual=r, decoded=routed)
        if isinstance(schedule, (OnePass, Ahead)) and schedule.routed:   # the sequences of one token: o rows, states
            launch("decode", decode, plan.decode, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                   initial_state=initial_state, final_state=final, cu_seqlens=cu_seqlens, indices=initial_state_indices,
                   out=o, has_initial_state=has_initial_state, kernels=kernels)
        return o, None if plan.state_pool else final


# run's tensor parameters, by kda_forward's names: run(plan, **{n: getattr(a, n) for n in RUN_TENSORS}) on
# a call's arguments a (the scripts and tests that run a plan of their own; tests hold it to run's signature).
RUN_TENSORS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens", "initial_state_indices",
               "has_initial_state", "checkpoints", "checkpoint_offsets", "cu_seqlens_cpu")


def _as_read(plan: Plan, q, k, v, g, beta, initial_state, A_log, dt_bias):
    """The inputs as the stages read them: contiguous copies where the plan says so (g and a dense
    initial state always; a pool is read and written where it is), A_log and dt_bias contiguous
    where the gate is activated in kernel (else None), in their own dtype: stage 1 reads them as fp32,
    so a model's bf16 parameters cost no conversion."""
    if plan.copied:
        q, k, v, beta = (x.contiguous() if n in plan.copied else x for n, x in zip(("q", "k", "v", "beta"), (q, k, v, beta)))
    g = g.contiguous()
    if initial_state is not None and not plan.state_pool:
        initial_state = initial_state.contiguous()
    if plan.gate.in_kernel:
        A_log = None if A_log is None else A_log.contiguous()
        dt_bias = None if dt_bias is None else dt_bias.contiguous()
    else:
        A_log = dt_bias = None
    return q, k, v, g, beta, initial_state, A_log, dt_bias


class Prepared:
    """A call's stages 1–3 run once, then its stage 4 from any initial states, as often as asked:
    kda_forward's arguments without a state, pool or checkpoints (B ≥ 1, or packed sequences).
    ends(initial_state) gives (o, final states fp32) as kda_forward(..., initial_state,
    output_final_state=True) does, but for stages 1–3 (one time segment: nothing is left for them to
    overlap); transition() the transitions M [N, HV, K, K] fp32 (kda_opt/schedules,
    "Parallel segments"): each sequence's final state is M S_0 + its final state from zero for any S_0 [K, V]
    (in the K-first layout; V-first, S_0ᵀ Mᵀ). For context parallelism (kda_opt/distributed),
    where a slice of a sequence runs from zero and then from its true start."""

    TUNING = Tuning(max_segments=1)

    def __init__(self, q, k, v, g, beta, scale=None, **options):
        self.call = ForwardArguments(q, k, v, g, beta, scale, **options)
        plan = make_plan(self.call, tuning=self.TUNING)
        if plan.initial_state or plan.state_pool or self.call.checkpoints is not None:
            raise ValueError("Prepared takes sequences without a state, pool or checkpoints")
        self.cu_seqlens = self.call.cu_seqlens if plan.packed else None
        q, k, v, g, beta, _, A_log, dt_bias = _as_read(plan, q, k, v, g, beta, None, self.call.A_log,
                                                       self.call.dt_bias)
        self.inputs = q, k, v, g, beta
        self.made = _stages_1_to_3(plan, annotated if nvtx_enabled() else direct, None, q, k, g, beta,
                                   None if self.cu_seqlens is None else packed(self.cu_seqlens, plan.T),
                                   A_log=A_log, dt_bias=dt_bias)

    def ends(self, initial_state=None):
        plan = make_plan(self.call._replace(initial_state=initial_state, output_final_state=True), tuning=self.TUNING)
        q, k, v, g, beta = self.inputs
        return run(plan, q, k, v, g, beta, initial_state=initial_state, cu_seqlens=self.cu_seqlens,
                   cu_seqlens_cpu=self.call.cu_seqlens_cpu, made=self.made)

    def transition(self) -> torch.Tensor:
        plan = make_plan(self.call, tuning=Tuning(parallel=False, max_segments=1))
        q, k, v, _, _ = self.inputs
        gcum, Aqk, Tm, r, rstd = self.made
        M = v.new_empty((plan.N, plan.HV, plan.K, plan.K), dtype=torch.float32)
        wuso(q, k, v, gcum, Tm, Aqk, plan.scale, math.gcd(plan.block_v, plan.K),
             initial_state=units(q.device, plan.HV, plan.K), read_slots=True,
             slots=torch.zeros(plan.N, dtype=torch.int32, device=q.device), final_state=M,
             cu_seqlens=self.cu_seqlens, qk_rstd=rstd, beta_residual=r, transition=True,
             worker_warps=plan.worker_warps)
        return M


def _checkpoint_rows(plan: Plan, checkpoints, seqs, kernels):
    """Packed with checkpoints: each sequence's first checkpoint row, [N + 1] int32 (kda_opt/seqs);
    else None."""
    if checkpoints is None or seqs is None:
        return None
    if plan.checkpoint_every == CHUNK:
        return seqs.chunk_offsets
    return block_offsets(seqs.cu_seqlens, plan.T, plan.checkpoint_every, kernels)


def _stages_1_to_3(plan: Plan, launch, kernels, q, k, g, beta, seqs=None, *, A_log, dt_bias, out=None):
    """Stages 1–3 over q, k, g, beta [B, T, ...] (seqs: their layout, whose chunks they compute;
    None: B sequences of T tokens): Γ, Aqk, Tm, β's residual r [B, HV, T] (plan.beta_residual, else
    None) and the q/k norms [2, B, H, T] (plan.l2norm, else None), views of one allocation; out: such
    a tuple to write the chunks into (the rows of the others are left as they are), None: a new one."""
    B, T, H, _ = q.shape
    gcum, Aqk, Tm, r, rstd = out or one_allocation(
        q.device, ((B, T, plan.HV, plan.K), torch.float32), ((B, T, plan.HV, CHUNK), q.dtype),
        ((B, T, plan.HV, CHUNK), k.dtype), ((B, plan.HV, T), torch.float32) if plan.beta_residual else None,
        ((2, B, H, T), torch.float32) if plan.l2norm else None)   # 1 / ‖q‖, 1 / ‖k‖
    launch("gate", gate_cumsum, g, plan.gate, A_log=A_log, dt_bias=dt_bias, seqs=seqs, out=gcum, kernels=kernels)
    launch("intra", intra_chunk, q, k, gcum, beta, plan.scale, gate_bounded=plan.gate.bounded,
           seqs=seqs, l2norm=plan.l2norm, beta_sigmoid=plan.beta_sigmoid, beta_residual=r, qk_rstd=rstd,
           num_warps=plan.intra_warps, out=(Aqk, Tm), kernels=kernels)
    return gcum, Aqk, Tm, r, rstd
