"""The plan of one kda_forward call: the arguments validated once and resolved, with every launch
decision, into one frozen value that kda_opt/forward runs; each stage takes the parts it needs.

    plan = make_plan(arguments)                TypeError / ValueError / RuntimeError naming the
                                               argument, before any kernel runs (kda_opt/checks)
    what the options mean                      gate, scale, l2norm, beta_sigmoid, beta_residual, ...
    how the stages launch                      block_v, segments, parallel, parallel_cut, short_sequences,
                                               ahead, intra_warps, worker_warps, decode (one-token sequences)
kda_decode's plan is kda_opt/decode_plan's (a packed call's sequences of one token take one: Plan.decode).
Tuning holds the launch knobs; kda_forward takes its defaults, tests and scripts/bench_stages.py pass
others. kda_forward makes a call signature's plan once (plan_for, kda_opt/plan_cache): the signature holds everything the
checks and the plan read (every tensor's shape, strides, dtype, device, 16-byte alignment and, in
grad mode, requires_grad; every option's value; the grad mode) but the host copies' values
(cu_seqlens_cpu, initial_state_indices_cpu), which are checked on every call; a call whose
signature was planned before has passed every check the plan made. Absent inputs are None in every
signature of the package (the cuTile launch alone swaps in a stand-in, as cuTile takes arrays only:
kda_opt/wuso).

Time segments. Stage 4 runs one program per (sequence, value head, V block) through the whole
sequence, so where B·H is small most SMs idle through it ((1, 65536, 16): 64 programs on 132 SMs).
There a lone sequence is cut at chunk boundaries into segments (time_segments) that kda_opt/forward
overlaps: stages 1–3 of segment s + 1 beside stage 4 of segment s.

Parallel segments. Where a lone sequence is long and its heads few, its segments run at once
instead (kda_opt/schedules, "Parallel segments": three stage-4 passes over the segments and a merge of
their transitions): one wave of (segment, value head) programs at the widest V block that fits
(parallel_segments), where that measured faster than the time segments (_parallel_pays). Packed
sequences whose lengths the call gives on the host (cu_seqlens_cpu) are cut so on every call where
the longest is long enough (ParallelCut, cut_sequences): the plan, made once per signature, cannot
hold lengths that change from call to call.

The longest ahead. Packed sequences with their host copy whose longest is long run its stage 4 from
the moment its own stages 1–3 are done, beside the others' (AheadRule, takes_ahead; kda_opt/schedules,
"The longest ahead"); its launches do not depend on the lengths, so such calls are replayed (their own
Entry.ahead).
"""
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .arguments import ForwardArguments
from .checks import (check_host_copies, check_pad_slot, checked_scale, rows_readable, validate,
                     validate_batch_extent, validate_devices, validate_serving)
from .decode_plan import DecodePlan, routed_decodes
from .intra import warps_for
from .options import CHUNK, GateConfig, Sizes, beta_scale
from .plan_cache import Entry, cached, signature
from .seqs import RANK_MAX, Counts, sequence_counts
from .segment_tables import PieceTables, SegmentTables, piece_tables, segment_tables
from .wuso import WORKER_WARPS, block_v_for



@dataclass(frozen=True)
class Tuning:
    """Launch knobs, each with the default kda_forward uses."""
    segment_tokens: int = 8192    # time segments: at least this many tokens each (a shorter one adds
    max_segments: int = 8         # a launch and a state hand-over for less overlap); 1: off
    block_v: int | None = None    # stage 4's V block; None: block_v_for's choice
    intra_warps: int | None = None  # stages 2+3's warps; None: kda_opt/intra.warps_for's choice
    worker_warps: int = WORKER_WARPS  # stage 4's worker warps
    parallel: bool | None = None  # a long sequence's segments at once (parallel_segments, cut_sequences);
                                  # None: where it pays, True: wherever it applies, False: never
    parallel_tokens: int = 512    # parallel segments: at least this many tokens each
    short_sequences: bool = True  # packed: a sequence of one chunk read by element offsets, not views
    route_decodes: bool = True    # packed, one pass: sequences of one token through kda_opt/recurrence
    longest_first: bool = True    # packed, one pass, more stage-4 programs than SMs (at most RANK_MAX
                                  # sequences): the longest sequences' programs first (kda_opt/seqs)
    sized_launches: bool = True   # packed, one pass, with cu_seqlens_cpu: the stages' grids sized from
                                  # the host lengths on each call outside graph capture (kda_opt/seqs.sequence_counts)
    ahead: bool = True            # packed, one pass, with cu_seqlens_cpu: a call whose longest sequence has
                                  # ahead_from tokens runs it ahead of the others (takes_ahead), replayed
    ahead_from: int = 4096
    ahead_chain: float = 1.0      # and whose chain (its chunks) is at least this many times the call's
                                  # stage-4 work an SM (all chunks x HV x V/block_v over the SMs): below,
                                  # the others' work fills the GPU beside it and the ahead's launches cost
    ahead_segments: int = 2       # in this many time segments
    ahead_block_v: int | None = None  # its stage 4's V block; None: the call's (Plan.block_v)


@dataclass(frozen=True)
class ParallelCut:
    """Packed sequences with their host copy (cu_seqlens_cpu): each call cuts those longer than its
    longest one's parallel segment (on the plan's SMs) into such segments (cut_sequences), where the
    longest has at least `longest` tokens and at least `share` of the call's."""
    min_tokens: int                 # Tuning.parallel_tokens
    align: int                      # segments are whole multiples of it (chunks, or checkpoint intervals)
    longest: int
    share: float
    block_v: int | None             # Tuning.block_v; None: block_v_for's choice for the call's segments


@dataclass(frozen=True)
class AheadRule:
    """Packed sequences with their host copy: a call whose longest sequence has at least `longest`
    tokens, among others, whose chain is at least `chain` times the call's stage-4 work an SM, runs
    that one's stage 4 ahead of the others' stages 1–3 (takes_ahead,
    kda_opt/schedules.longest_ahead), in `segments` time segments, each program `block_v` V columns
    wide."""
    longest: int
    chain: float
    segments: int
    block_v: int


@dataclass(frozen=True)
class Plan(Sizes):
    """One kda_forward call, resolved."""
    dtype: torch.dtype            # q, k and v's
    scale: float
    gate: GateConfig
    l2norm: bool                  # q and k L2-normalised as they are read
    beta_sigmoid: float | None    # β = beta_sigmoid · sigmoid(beta) (1, or 2: allow_neg_eigval); None: beta is β
    beta_residual: bool           # stage 2 writes β − round(β) for stage 4 (kda_opt/intra, "β's residual")
    initial_state: bool
    output_final_state: bool
    state_pool: bool              # initial_state is a pool read and written at initial_state_indices
    state_v_first: bool           # states [N, HV, V, K]
    packed: bool                  # cu_seqlens given (but one sequence checked to span [0, T])
    copied: tuple[str, ...]       # of q, k, v, beta: those read as contiguous copies (their token rows
                                  # not readable through their strides, rows_readable)
    checkpoint_every: int         # tokens between checkpoints (a multiple of CHUNK)
    checkpoint_offsets: bool      # packed: each sequence's first checkpoint where checkpoint_offsets says
    block_v: int                  # stage 4's V columns per program
    segments: tuple[tuple[int, int], ...]  # token ranges: time segments, or parallel segments
    parallel: bool                # the segments run at once (parallel_segments), not one after another
    parallel_cut: ParallelCut | None  # packed: long sequences cut into parallel segments on each call
    pad_slot: int | None          # a pool slot padding sequences name: read and written as a negative one
    short_sequences: bool         # packed: stage 4 reads a sequence of one chunk by element offsets
    longest_first: bool           # packed, one pass: stage 4's programs by descending sequence length
    sized_launches: bool          # packed, one pass, host lengths given: the stages' grids sized from them
    ahead: AheadRule | None       # packed, one pass, host lengths: where the longest sequence runs ahead
    intra_warps: int
    worker_warps: int
    sms: int                      # the GPU's SM count the launches are chosen for
    decode: "DecodePlan | None"   # packed: its sequences of one token through kda_opt/recurrence, stage 4 skipping them

    @property
    def not_replayable(self) -> str | None:
        """Why a call of this plan may launch differently from another (so that it is not replayed,
        kda_opt/replay), or None."""
        if not self.parallel and len(self.segments) > 1:
            return "it runs in time segments"
        if self.parallel_cut is not None or self.sized_launches:
            return "its launches follow the lengths in cu_seqlens_cpu"
        return None


def make_plan(a: ForwardArguments, tuning: Tuning = Tuning(), sms: int | None = None) -> Plan:
    """kda_forward's arguments (their record, kda_opt/arguments) checked and resolved into a Plan;
    kda_forward's docstring says what each means. sms: the GPU's SM count, for the launch choices;
    None reads it from q's device, which must then be a CUDA GPU with every tensor on it (the CPU
    tests pass a count)."""
    state_v_first = a.state_v_first
    if a.transpose_state_layout is not None:
        if state_v_first:
            raise ValueError("pass state_v_first or its deprecated name transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated; its name is now state_v_first",
                      DeprecationWarning, stacklevel=3)
        state_v_first = bool(a.transpose_state_layout)
    scale = None if a.scale is None else checked_scale(a.scale)
    pool = a.initial_state_indices is not None or a.initial_state_indices_cpu is not None
    q, k, v = a.q, a.k, a.v
    N = validate(q, k, v, a.g, a.beta, None if pool else a.initial_state, use_gate_in_kernel=a.use_gate_in_kernel,
                 A_log=a.A_log, dt_bias=a.dt_bias, safe_gate=a.safe_gate, lower_bound=a.lower_bound,
                 use_beta_sigmoid_in_kernel=a.use_beta_sigmoid_in_kernel, allow_neg_eigval=a.allow_neg_eigval,
                 state_v_first=state_v_first, cu_seqlens=a.cu_seqlens, cu_seqlens_cpu=a.cu_seqlens_cpu,
                 chunk_size=a.chunk_size)
    validate_serving(q, v, N, a.initial_state, a.output_final_state, a.initial_state_indices,
                     a.initial_state_indices_cpu, a.has_initial_state, a.checkpoints, a.checkpoint_every,
                     a.checkpoint_offsets, state_v_first, a.cu_seqlens)
    validate_batch_extent(q, k, v, a.beta, a.checkpoints)
    check_pad_slot(a.pad_slot, a.initial_state_indices)
    check_host_copies(q.shape[1], a.cu_seqlens_cpu, a.initial_state_indices_cpu, a.initial_state, a.checkpoints,
                      a.checkpoint_every, a.pad_slot)
    if sms is None:
        validate_devices(q, k=k, v=v, g=a.g, beta=a.beta, initial_state=a.initial_state, A_log=a.A_log,
                         dt_bias=a.dt_bias, cu_seqlens=a.cu_seqlens, initial_state_indices=a.initial_state_indices,
                         has_initial_state=a.has_initial_state, checkpoints=a.checkpoints,
                         checkpoint_offsets=a.checkpoint_offsets)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    align = a.checkpoint_every if a.checkpoints is not None else CHUNK
    # One packed sequence whose host copy says it spans [0, T] (check_host_copies) is the fixed-length
    # call of B = 1, with its time or parallel segments; without the copy the device values are unseen.
    packed = a.cu_seqlens is not None and (N > 1 or a.cu_seqlens_cpu is None or a.checkpoint_offsets is not None)
    parallel = parallel_segments(T, N, HV, sms, packed, tuning.parallel_tokens, align)
    if tuning.parallel is False or tuning.parallel is None and not _parallel_pays(T, HV, V):
        parallel = None
    cut = None
    if packed and a.cu_seqlens_cpu is not None and a.checkpoint_offsets is None and (
            tuning.parallel or tuning.parallel is None and _parallel_pays(T, HV, V)):
        cut = ParallelCut(tuning.parallel_tokens, align, 0 if tuning.parallel else CUT_FROM,
                          0 if tuning.parallel else LONGEST_SHARE, tuning.block_v)
    block_v = (tuning.block_v or block_v_for((len(parallel) - 1) * HV, math.gcd(V, K), sms, q.dtype) if parallel
               else one_pass_block_v(N, HV, V, sms, q.dtype, tuning))
    segments = parallel or time_segments(T, N, N * HV * (V // block_v), sms, packed, tuning.segment_tokens,
                                         tuning.max_segments, align)
    # (With checkpoint offsets a sequence of one chunk may be cut in two: stage 4's own launches.)
    short_sequences = packed and tuning.short_sequences and a.checkpoint_offsets is None
    packed_one_pass = packed and len(segments) == 1 and not parallel     # stage 4 once over the sequences
    hosted = packed_one_pass and short_sequences and a.cu_seqlens_cpu is not None   # the host lengths in hand
    return Plan(
        B=B, T=T, H=H, K=K, HV=HV, V=V, N=N, dtype=q.dtype,
        scale=K ** -0.5 if scale is None else scale,
        gate=GateConfig(in_kernel=a.use_gate_in_kernel, lower_bound=a.lower_bound, safe_gate=a.safe_gate),
        l2norm=a.use_qk_l2norm_in_kernel,
        beta_sigmoid=beta_scale(a.use_beta_sigmoid_in_kernel, a.allow_neg_eigval),
        # Tm (k's dtype) holds β on its diagonal: where β is not a number of that dtype, stage 4 adds
        # back what its rounding lost.
        beta_residual=k.dtype != torch.float32 and (a.use_beta_sigmoid_in_kernel or a.beta.dtype != k.dtype),
        initial_state=a.initial_state is not None, output_final_state=a.output_final_state, state_pool=pool,
        state_v_first=state_v_first, packed=packed,
        copied=tuple(n for n, x in (("q", q), ("k", k), ("v", v), ("beta", a.beta)) if not rows_readable(x)),
        block_v=block_v,
        checkpoint_every=a.checkpoint_every, checkpoint_offsets=a.checkpoint_offsets is not None,
        segments=segments, parallel=parallel is not None, parallel_cut=cut, pad_slot=a.pad_slot,
        short_sequences=short_sequences,
        # Ordered where stage 4 runs in waves: list scheduling longest first (the SMs take programs in
        # grid order) ends its waves together, and a mixed step's prefills start before its decodes'
        # empty programs.
        longest_first=packed_one_pass and tuning.longest_first and N * HV * (V // block_v) > sms and N <= RANK_MAX,
        # Stages 1–2 over the chunks there are, stage 4 without a launch that has no sequence of its
        # kind and its ordered long launch over the long sequences only: a program that would end at
        # once still costs its launch (stage 4's: one CTA per SM at a time).
        sized_launches=hosted and tuning.sized_launches,
        # (Not with checkpoints: the segments would need their rows, which nothing hands them.)
        ahead=ahead_rule(tuning, block_v) if hosted and tuning.ahead and a.checkpoints is None else None,
        intra_warps=tuning.intra_warps or warps_for(q.dtype), worker_warps=tuning.worker_warps, sms=sms,
        decode=routed_decodes(Sizes(B=B, T=T, H=H, K=K, HV=HV, V=V, N=N), scale=scale,
                              l2norm=a.use_qk_l2norm_in_kernel, gate_in_kernel=a.use_gate_in_kernel,
                              lower_bound=a.lower_bound, beta_sigmoid=a.use_beta_sigmoid_in_kernel,
                              neg_eigval=a.allow_neg_eigval, v_first=state_v_first, initial_state=a.initial_state,
                              pool=pool, output_final_state=a.output_final_state, sms=sms)
        if packed and tuning.route_decodes and tuning.short_sequences and a.checkpoints is None else None,
    )


def plan_for(a: ForwardArguments) -> Entry:
    """make_plan(a) (the default tuning) made once per call signature (module docstring), in its
    Entry. The host copies' values are checked on every call."""
    entry, made = cached(signature(a), lambda: make_plan(a))
    if not made:
        check_host_copies(a.q.shape[1], a.cu_seqlens_cpu, a.initial_state_indices_cpu, a.initial_state, a.checkpoints,
                          a.checkpoint_every, a.pad_slot)
    return entry


def parallel_segments(T: int, N: int, HV: int, sms: int, is_packed: bool, min_tokens: int,
                      align: int = CHUNK) -> tuple[tuple[int, int], ...] | None:
    """((t0, t1), ...): a lone sequence cut into segments that run at once (module docstring,
    "Parallel segments"), each of the three passes one wave of (segment, value head) programs (a
    pass runs all segments but one: count − 1 ≤ SMs / HV), each segment at least min_tokens and a
    multiple of `align` tokens but the last; None where there would be fewer than three (several or
    packed sequences, or a short one)."""
    count = min(sms // HV + 1, T // min_tokens) if N == 1 and not is_packed else 0
    if count < 3:
        return None
    step = -(-T // (count * align)) * align
    segments = tuple((t0, min(t0 + step, T)) for t0 in range(0, T, step))
    return segments if len(segments) >= 3 else None


def cut_sequences(cu_seqlens: list[int], HV: int, cut: ParallelCut,
                  sms: int) -> tuple[tuple[int, int, int], ...] | None:
    """Pieces (n, t0, t1) of packed sequences (bounds cu_seqlens, on the host), every sequence's rows
    in order: each longer than the longest's parallel segment (parallel_segments of it alone on `sms`
    SMs) cut into segments of that length, the others whole (an empty one an empty piece); None where
    the longest has fewer than cut.longest tokens or cut.share of them, or would not be cut in three."""
    lengths = [t1 - t0 for t0, t1 in zip(cu_seqlens, cu_seqlens[1:])]
    longest = max(lengths, default=0)
    alone = parallel_segments(longest, 1, HV, sms, False, cut.min_tokens, cut.align)
    if longest < cut.longest or longest < cut.share * sum(lengths) or alone is None:
        return None
    step = alone[0][1]
    return tuple((n, t, min(t + step, t1)) for n, (t0, t1) in enumerate(zip(cu_seqlens, cu_seqlens[1:]))
                 for t in range(t0, max(t1, t0 + 1), step))


class OnePass(NamedTuple):
    """Stage 4 once over the call's sequences."""
    counts: Counts | None   # the stages' launches sized from the host lengths (Plan.sized_launches)
    routed: bool            # packed: its one-token sequences through kda_opt/recurrence (Plan.decode)
    ordered: bool           # packed: stage 4's programs longest first (Plan.longest_first)


class TimeSegments(NamedTuple):
    """One sequence in token ranges one after another (time_segments)."""
    segments: tuple[tuple[int, int], ...]


class ParallelSegments(NamedTuple):
    """One sequence in token ranges at once (parallel_segments)."""
    segments: tuple[tuple[int, int], ...]
    tables: SegmentTables                       # their device tables


class Ahead(NamedTuple):
    """Packed sequences, the longest one's stage 4 ahead of the others' stages 1–3 (takes_ahead), its
    layouts made on the device (kda_opt/seqs.ahead_layout)."""
    segments: int         # its time segments
    block_v: int          # its stage 4's V block
    routed: bool          # as OnePass's


class Pieces(NamedTuple):
    """Packed sequences, the long ones cut into parallel segments on this call (cut_sequences)."""
    pieces: tuple[tuple[int, int, int], ...]    # (sequence, t0, t1), every sequence's rows in order
    block_v: int                                # stage 4's V block over the pieces
    tables: PieceTables                         # their device tables


Schedule = OnePass | TimeSegments | ParallelSegments | Pieces | Ahead


def schedule_of(plan: "Plan", device: torch.device, cu_seqlens_cpu=None, capturing=lambda: False,
                ahead: bool = False) -> Schedule:
    """How kda_opt/forward runs a call of `plan` on `device`: what the plan fixed, with its segments'
    or pieces' device tables (kda_opt/segment_tables), and for packed sequences what their host copy
    (cu_seqlens_cpu) says on this call: whether the long ones are cut (plan.parallel_cut) and the
    launches' sizes (plan.sized_launches; not while capturing() says a CUDA graph is being captured,
    whose replays may see other lengths). ahead: the call's longest sequence runs ahead (takes_ahead,
    which the caller asks first: the call may then be replayed)."""
    if ahead:
        return Ahead(plan.ahead.segments, plan.ahead.block_v, plan.decode is not None)
    if plan.parallel:
        return ParallelSegments(plan.segments, segment_tables(device, plan.segments, plan.checkpoint_every, plan.HV,
                                                              plan.K))
    if len(plan.segments) > 1:
        return TimeSegments(plan.segments)
    cut = plan.parallel_cut
    if cut is not None and cu_seqlens_cpu is not None:
        pieces = cut_sequences(cu_seqlens_cpu.tolist(), plan.HV, cut, plan.sms)
        if pieces is not None:
            return Pieces(pieces, cut.block_v or block_v_for(len(pieces) * plan.HV, math.gcd(plan.V, plan.K),
                                                             plan.sms, plan.dtype),
                          piece_tables(device, pieces, plan.N, plan.checkpoint_every, plan.HV, plan.K))
    routed = plan.decode is not None
    sized = plan.sized_launches and not capturing()
    return OnePass(sequence_counts(cu_seqlens_cpu, routed) if sized else None, routed, plan.longest_first)


def one_pass_block_v(N: int, HV: int, V: int, sms: int, dtype: torch.dtype, tuning: Tuning) -> int:
    """Stage 4's V block for N sequences (packed, or a batch) in one pass: tuning's, or block_v_for's
    choice for its N·HV state rows on `sms` SMs."""
    return tuning.block_v or block_v_for(N * HV, V, sms, dtype)


def ahead_rule(tuning: Tuning, block_v: int) -> AheadRule:
    """tuning's rule for the longest sequence ahead, on a call whose stage-4 V block is block_v."""
    return AheadRule(max(tuning.ahead_from, CHUNK + 1), tuning.ahead_chain, tuning.ahead_segments,
                     tuning.ahead_block_v or block_v)


def takes_ahead(plan: "Plan", cu_seqlens_cpu) -> bool:
    """Whether a call of `plan` with the host copy cu_seqlens_cpu (or None) runs its longest packed
    sequence ahead (plan.ahead): where its lengths lead (`leads`) and they are not cut."""
    rule = plan.ahead
    if rule is None or cu_seqlens_cpu is None:
        return False
    bounds = cu_seqlens_cpu.tolist()
    cut = plan.parallel_cut
    return (leads([t1 - t0 for t0, t1 in zip(bounds, bounds[1:])], plan.HV, plan.V, plan.block_v, plan.sms, rule)
            and (cut is None or cut_sequences(bounds, plan.HV, cut, plan.sms) is None))


def leads(lengths: Sequence[int], HV: int, V: int, block_v: int, sms: int, rule: AheadRule) -> bool:
    """Whether the longest of packed sequences of `lengths` tokens runs ahead of the others by `rule`:
    at least rule.longest tokens, among others (at most RANK_MAX sequences: the others' order is
    kda_opt/seqs.longest_first's), and its chain the call's critical path: its chunks at least
    rule.chain times the call's stage-4 work an SM (every chunk, HV·V/block_v programs each, over
    `sms` SMs)."""
    if not 1 < len(lengths) <= RANK_MAX or max(lengths) < rule.longest:
        return False
    chunks = [-(-n // CHUNK) for n in lengths]
    return max(chunks) >= rule.chain * sum(chunks) * HV * (V // block_v) / sms


# Packed sequences are cut into parallel segments where the longest has at least CUT_FROM tokens and
# LONGEST_SHARE of the call's (its chain is the call's; the others' programs end before it).
CUT_FROM, LONGEST_SHARE = 32768, 0.5
# A lone sequence runs in parallel segments from this many tokens (at few heads: _parallel_pays).
PARALLEL_FROM = 8192


def _parallel_pays(T: int, HV: int, V: int) -> bool:
    """Where parallel segments beat one pass or the time segments (docs/DESIGN.md, "Parallel
    segments"): a sequence of at least PARALLEL_FROM tokens whose chains fill at most 96 programs at
    stage 4's narrowest block (HV·V ≤ 24·128: the tensor-parallel shards of 8–24 heads; wider calls
    run one pass or time segments faster, docs/BENCHMARKING.md)."""
    return HV * V <= 24 * 128 and T >= PARALLEL_FROM


def time_segments(T: int, N: int, programs: int, sms: int, is_packed: bool, segment_tokens: int,
                  max_segments: int, align: int = CHUNK) -> tuple[tuple[int, int], ...]:
    """((t0, t1), ...): the token ranges the forward runs as segments (module docstring), at least
    segment_tokens each and at most max_segments, each a multiple of `align` tokens (a multiple of
    CHUNK: whole chunks, or whole checkpoint intervals) but the last; ((0,
    T),) where cutting does not pay: several or packed sequences, stage 4's programs filling more
    than half the SMs, or T below two segments."""
    if max_segments < 2 or is_packed or N != 1 or 2 * programs > sms or T < 2 * segment_tokens:
        return ((0, T),)
    count = min(max_segments, T // segment_tokens)
    step = -(-T // (count * align)) * align
    return tuple((t0, min(t0 + step, T)) for t0 in range(0, T, step))

