"""The schedules of a call too long for one pass, as kda_opt/forward runs them: each takes the
plan (its sizes and layouts), what kda_opt/plan.schedule_of resolved for the call (its token ranges, or
its pieces and their V block), the inputs, stage 4's state arguments of the whole call (`state`),
stages 1–3 as one function (`prepare`) and stage 4's launcher (`stage4`), and returns o. Nothing here
chooses a schedule.

Time segments (kda_opt/plan decides them): stages 1–3 of segment s + 1 run on a second stream while
stage 4 runs segment s on the SMs it leaves idle, and each segment's final state (fp32, as stage 4
keeps it) is the next one's initial state: the same numbers as one pass. The caller's stream waits
for the second stream's work before each stage 4, so the result is ordered on it as usual.

Parallel segments (kda_opt/plan decides them, where few heads and a long sequence leave the SMs
idle): a segment's passage is affine in its start, S_out = M S_in + h, per value head, with h its
final state from zero and M [K, K] the product of its chunks' transitions Diag(2^Γ_last) − (k ⊙
2^(Γ_last − Γ))ᵀ Tm (2^Γ ⊙ k). Stages 1–3 run once over the whole call (their outputs are
chunk-local, and segments start at whole chunks), then stage 4 three times over the segments as
packed sequences: (1) segments 0 .. S − 2, segment 0 from the call's initial state and the others
from zero, giving h (and segment 0's o and checkpoints); (2) the transitions M of segments 1 .. S − 2
(stage 4 with v = 0 over K state columns from S_in = I, no o); then the merge, S_{j+1} = M_j S_j + h_j
in one launch (S − 2 products in fp32, merge_kernel); (3) segments 1 .. S − 1 from their true starts,
giving their o, checkpoints and the final state. Packed sequences with their host copy (cu_seqlens_cpu)
are cut on each call: the long ones into segments, the others whole, every sequence's rows in order as
pieces, and each pass runs the run of pieces it needs (parallel_packed). Three passes, each with every
(segment, head) program at once, against one pass whose chain is the longest sequence. The result is
that of one pass up to the rounding of M's 16-bit product operands, within one pass's error against
the float64 recurrence (tests/test_parallel.py).
"""
import functools
import itertools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import launch
from .launch import triton_launch
from .options import state_shape


def final_states(plan, like: torch.Tensor) -> torch.Tensor:
    """An fp32 state for each of the plan's sequences, in its layout."""
    return like.new_empty(state_shape(plan.N, plan.HV, plan.K, plan.V, plan.state_v_first), dtype=torch.float32)


def parallel(plan, segments, q, k, v, g, beta, state, checkpoints, prepare, stage4):
    """o over `segments` ((t0, t1), ...) of one sequence (B = 1) run at once (module docstring, "Parallel
    segments"); `state` holds stage 4's state arguments of the whole call. A pool slot is read by
    segment 0 and written by the last; a dense final state is the last segment's row of its own
    buffer, copied. With a dense state or none, and no has_initial_state, the call runs nothing but
    allocations, views, copies and launches (its tables package constants), so kda_opt/bound can
    replay it."""
    S = len(segments)
    t = _segment_tables(q.device, segments, plan.checkpoint_every)
    gcum, Aqk, Tm, r, rstd = prepare(q, k, g, beta)
    common = dict(qk_rstd=rstd, beta_residual=r)
    o = torch.empty_like(v)
    # Pass 1: segments 0 .. S − 2 from zero (segment 0 from the call's initial state), and their
    # transitions from I (1 .. S − 2).
    initial = state["initial_state"]
    slots, mask = _first_segment_reads(state, t)
    h = v.new_empty((S - 1, *_state_row(plan)), dtype=torch.float32)
    stage4(q, k, v, gcum, Tm, Aqk, initial_state=initial, slots=slots, read_slots=initial is not None,
           has_initial_state=mask, final_state=h, cu_seqlens=t.first_bounds, out=o, checkpoints=checkpoints,
           checkpoint_rows=None if checkpoints is None else t.first_rows, **common)
    M = v.new_empty((S - 2, plan.HV, plan.K, plan.K), dtype=torch.float32)
    stage4(q, k, v, gcum, Tm, Aqk, initial_state=units(q.device, plan.HV, plan.K), slots=t.middle_zeros,
           read_slots=True, final_state=M, cu_seqlens=t.middle_bounds, transition=True, state_v_first=False,
           **common)
    starts = merge(h, M, plan.state_v_first)
    # Pass 2: segments 1 .. S − 1 from their true starts; the last writes the call's final state.
    final, pool = state["final_state"], state["write_slots"]
    ends = None if final is None or pool else torch.empty_like(starts)
    stage4(q, k, v, gcum, Tm, Aqk, initial_state=starts, final_state=final if pool else ends, write_slots=pool,
           slots=_beside(state["slots"], t.no_slots, first=False) if pool else None,
           cu_seqlens=t.last_bounds, out=o, checkpoints=checkpoints,
           checkpoint_rows=None if checkpoints is None else t.last_rows, **common)
    if ends is not None:
        final.copy_(ends[-1:])
    return o


def _first_segment_reads(state, t: "_Segments"):
    """(slots, has_initial_state) of pass 1, whose first segment starts from the call's initial state
    (its pool slot, or row 0 of a dense state) and whose others read none (zeros); without an
    initial state, (None, the call's has_initial_state)."""
    mask = state["has_initial_state"]
    if state["initial_state"] is None:
        return None, mask
    if mask is not None:
        mask = _beside(mask, t.no_reads, first=True)
    if state["read_slots"]:
        return _beside(state["slots"], t.no_slots, first=True), mask
    return t.first_zero, mask


def _beside(x: torch.Tensor, table: torch.Tensor, first: bool) -> torch.Tensor:
    """[x, *table] (first) or [*table, x] in table's dtype, x one sequence's entry: a new buffer filled
    by two copies, so that a bound call replays it (kda_opt/bound takes no concatenation or cast)."""
    out = table.new_empty(len(table) + 1)
    (out[:1] if first else out[-1:]).copy_(x)
    (out[1:] if first else out[:-1]).copy_(table)
    return out


def parallel_packed(plan, pieces, block_v, q, k, v, g, beta, seqs, state, checkpoints, prepare, stage4):
    """o over `pieces` ((n, t0, t1), ...: every packed sequence's rows in order, the long ones cut into
    segments) run at once (module docstring, "Parallel segments"): three stage-4 passes, each over the
    run of pieces it needs. `state` holds stage 4's state arguments of the whole call: a sequence's
    first piece reads its initial state (a pool slot too), its last writes its final state. Where
    _parallel (one sequence) reads the call's state in its first pass and merges into the last pass's
    starts directly, here the starts of every piece are gathered into one buffer first (pass 3 runs
    whole sequences from their initial states beside cut pieces from merged ones)."""
    P = len(pieces)
    t = piece_tables(q.device, pieces, plan.N, plan.checkpoint_every)
    gcum, Aqk, Tm, r, rstd = prepare(q, k, g, beta, seqs)
    common = dict(qk_rstd=rstd, beta_residual=r)
    o = torch.empty_like(v)
    # Each piece's start, fp32 (a row more: where the merge's padding lands): a sequence's first
    # piece from its initial state, the others from zero until the merge gives them theirs.
    starts = v.new_zeros((P + 1, *_state_row(plan)), dtype=torch.float32)
    if state["initial_state"] is not None:
        starts.index_copy_(0, t.first, _initial_states(state))
    # Pass 1: the cut sequences' pieces but their last, h (their final states from those starts), with
    # o and checkpoints (final for first pieces that pass 3 skips); pass 2: their middle pieces'
    # transitions M, from I with v = 0 over K state columns.
    # Rows no pass writes (the last pieces' and the spare) reach only merged states nothing reads:
    # zeros, so that the merge reads no memory never written.
    h, M = torch.empty_like(starts), v.new_empty((P + 1, plan.HV, plan.K, plan.K), dtype=torch.float32)
    for x, (lo, hi) in ((h, t.h_pieces), (M, t.m_pieces)):
        x[:lo].zero_()
        x[hi:].zero_()
    lo, hi = t.h_pieces
    stage4(q, k, v, gcum, Tm, Aqk, initial_state=starts[lo:], final_state=h[lo:hi], cu_seqlens=t.bounds[lo:hi + 1],
           out=o, checkpoints=checkpoints, checkpoint_rows=None if checkpoints is None else t.ck_rows[lo:hi],
           block_v=block_v, **common)
    lo, hi = t.m_pieces
    stage4(q, k, v, gcum, Tm, Aqk, initial_state=units(q.device, plan.HV, plan.K), slots=t.zeros[lo:hi],
           read_slots=True, final_state=M[lo:hi], cu_seqlens=t.bounds[lo:hi + 1], transition=True,
           state_v_first=False, block_v=math.gcd(block_v, plan.K), **common)
    # A cut sequence's piece j + 1 starts where piece j ends, M_j S_j + h_j, and its first piece ends
    # at h_0 (grid: [pieces, cut sequences], padded with the spare row).
    ends = merge(h[t.grid], M[t.grid[1:]], plan.state_v_first)
    starts.index_copy_(0, t.grid[1:].flatten(), ends[:-1].flatten(0, 1))
    # Pass 3: every piece from the first that is not a cut sequence's first, from its true start: o,
    # checkpoints, and by each last piece its sequence's final state (a dense state's row n, or its
    # pool slot).
    final, pool = state["final_state"], state["write_slots"]
    slots = None
    if final is not None:
        rows = state["slots"].to(torch.int32) if pool else _sequence_rows(q.device, plan.N)
        slots = t.no_slots.index_copy(0, t.last, rows)
    lo, hi = t.o_pieces
    stage4(q, k, v, gcum, Tm, Aqk, initial_state=starts[lo:], final_state=final,
           slots=None if slots is None else slots[lo:hi], write_slots=final is not None,
           cu_seqlens=t.bounds[lo:hi + 1], out=o, checkpoints=checkpoints,
           checkpoint_rows=None if checkpoints is None else t.ck_rows[lo:hi], block_v=block_v, **common)
    return o


def _initial_states(state) -> torch.Tensor:
    """Each sequence's initial state as stage 4 reads it, fp32 [N, ...]: a pool's rows at the slots
    (zeros where a slot is outside the pool), zeros where has_initial_state is false."""
    initial, use = state["initial_state"], state["has_initial_state"]
    if state["read_slots"]:
        slots = state["slots"].long()
        inside = (slots >= 0) & (slots < initial.shape[0])
        initial = initial[slots.clamp(0, initial.shape[0] - 1)]
        use = inside if use is None else inside & use
    initial = initial.float()
    return initial if use is None else torch.where(use.view(-1, 1, 1, 1), initial, 0.0)


def merge(h: torch.Tensor, M: torch.Tensor, v_first: bool = False) -> torch.Tensor:
    """The states after each of n consecutive segments, [n, …, HV, K, V] fp32 ([…, V, K] v_first): from
    h [n, …] (each segment's final state from zero; the first's from the true start) and M [n − 1, …,
    HV, K, K] (the transitions of segments 1 .. n − 1), S_0 = h_0, S_j = M_{j−1} S_{j−1} + h_j: one
    launch (merge_kernel), each (chain, V block) program carrying its S through the n − 1 products in
    fp32 (each product three tf32 ones, about fp32's precision)."""
    K = M.shape[-1]
    V = h.shape[-2] if v_first else h.shape[-1]
    chains = h[0].numel() // (K * V)
    h, M = h.float().contiguous(), M.float().contiguous()
    out = torch.empty_like(h)
    block = min(V, MERGE_BLOCK_V)
    triton_launch(merge_kernel, (chains, V // block), None, h, M, out, h.shape[0], K, V, block, chains, v_first,
                  num_warps=MERGE_WARPS, num_stages=MERGE_STAGES)
    return out


# merge_kernel's launch: V columns per program, warps, and M's loads two stages deep (the next
# transition's quarters copied to shared memory while this one's products run).
MERGE_BLOCK_V, MERGE_WARPS, MERGE_STAGES = 8, 4, 2


@triton.jit(do_not_specialize=["n"])
def merge_kernel(h, M, out, n, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, CHAINS: tl.constexpr,
                 V_FIRST: tl.constexpr):
    """out[0] = h[0], out[j] = M[j − 1] out[j − 1] + h[j] (merge) for chain program_id(0) over V block
    program_id(1): h, out [n, CHAINS, K, V] ([…, V, K] V_FIRST), M [n − 1, CHAINS, K, K], contiguous.
    S is carried as its two row halves [K / 2, BV] and each M as its four quarters, each product three
    tf32 ones (about fp32's precision): at merge's launch no spill at any K, V (128–208 registers, 90 KB
    of shared memory at K = 128, sm_90), where whole [K, K] tiles, or "ieee" products, spilled up to
    8 KB a thread."""
    R: tl.constexpr = K // 2
    i_c, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_r = tl.arange(0, R)
    o_v = i_v * BV + tl.arange(0, BV)
    top = o_v[None, :] * K + o_r[:, None] if V_FIRST else o_r[:, None] * V + o_v[None, :]   # rows 0 .. R − 1
    bottom = top + (R if V_FIRST else R * V)                                                 # rows R .. K − 1
    quarter = o_r[:, None] * K + o_r[None, :]                                                # M[:R, :R]
    h += i_c * K * V
    out += i_c * K * V
    M += i_c * K * K
    S0, S1 = tl.load(h + top), tl.load(h + bottom)
    tl.store(out + top, S0)
    tl.store(out + bottom, S1)
    for _ in range(1, n):
        h += CHAINS * K * V
        out += CHAINS * K * V
        T0 = (tl.dot(tl.load(M + quarter), S0, input_precision="tf32x3")
              + tl.dot(tl.load(M + R + quarter), S1, input_precision="tf32x3"))
        T1 = (tl.dot(tl.load(M + R * K + quarter), S0, input_precision="tf32x3")
              + tl.dot(tl.load(M + R * K + R + quarter), S1, input_precision="tf32x3"))
        S0, S1 = T0 + tl.load(h + top), T1 + tl.load(h + bottom)
        tl.store(out + top, S0)
        tl.store(out + bottom, S1)
        M += CHAINS * K * K


def _state_row(plan) -> tuple[int, int, int]:
    """One sequence's state shape without N: [HV, K, V], or [HV, V, K] V-first."""
    return state_shape(1, plan.HV, plan.K, plan.V, plan.state_v_first)[1:]


class _Segments(NamedTuple):
    """One sequence's parallel segments' device tables (_segment_tables; int32 but no_reads), each a
    package constant of its own (kda_opt/launch.constant), S segments."""
    first_bounds: torch.Tensor  # [S] segments 0 .. S − 2's bounds, as cu_seqlens (pass 1)
    middle_bounds: torch.Tensor  # [S − 1] segments 1 .. S − 2's (the transitions)
    last_bounds: torch.Tensor   # [S] segments 1 .. S − 1's (pass 2)
    first_rows: torch.Tensor    # [S − 1] segments 0 .. S − 2's first checkpoint rows
    last_rows: torch.Tensor     # [S − 1] segments 1 .. S − 1's
    no_slots: torch.Tensor      # [S − 2] slot rows of −1 (no state read or written)
    middle_zeros: torch.Tensor  # [S − 2] slot rows of 0 (each transition's start, I)
    first_zero: torch.Tensor    # [S − 1] slot 0 and then −1s: only segment 0 reads a dense initial state
    no_reads: torch.Tensor      # [S − 2] bool, False: has_initial_state of the segments after the first


@functools.lru_cache(maxsize=64)
def _segment_tables(device: torch.device, segments, checkpoint_every: int) -> _Segments:
    """The tables of parallel segments (t0, t1), ... (segments start on checkpoint boundaries)."""
    S = len(segments)
    bounds = [t0 for t0, _ in segments] + [segments[-1][1]]
    rows = [t0 // checkpoint_every for t0, _ in segments]
    none = [-1] * (S - 2)
    tables = (bounds[:S], bounds[1:S], bounds[1:], rows[:S - 1], rows[1:], none, [0] * (S - 2), [0] + none)
    return _Segments(*(launch.constant(torch.tensor(x, dtype=torch.int32, device=device)) for x in tables),
                     launch.constant(torch.zeros(S - 2, dtype=torch.bool, device=device)))


class _Pieces(NamedTuple):
    """Parallel segments' tables (piece_tables)."""
    bounds: torch.Tensor        # [P + 1] int32: the pieces' bounds, as cu_seqlens
    ck_rows: torch.Tensor       # [P] int32: each piece's first checkpoint row
    first: torch.Tensor         # [N] int64: each sequence's first piece
    last: torch.Tensor          # [N] int64: and its last
    grid: torch.Tensor          # [most pieces, cut sequences] int64: the cut sequences' pieces, padded with P
    zeros: torch.Tensor         # [P] int32 slot rows of 0
    no_slots: torch.Tensor      # [P] int32 slot rows of −1
    h_pieces: tuple[int, int]   # the run of pieces pass 1 takes: from the first to the last cut sequence's last but one
    m_pieces: tuple[int, int]   # pass 2: their middle pieces' run
    o_pieces: tuple[int, int]   # pass 3: from the first piece that is not a cut sequence's first, to the end


@functools.lru_cache(maxsize=64)
def piece_tables(device: torch.device, pieces, N: int, checkpoint_every: int) -> _Pieces:
    """_parallel_packed's tables for pieces (n, t0, t1) of N sequences, at least one of them cut: checkpoint
    rows as packed checkpoints are laid out (sequence n's from Σ_{m<n} cdiv(len_m, checkpoint_every));
    the device ones copied from pinned memory, without waiting for the device."""
    P = len(pieces)
    first, last, lengths = [P] * N, [0] * N, [0] * N
    for p, (n, t0, t1) in enumerate(pieces):
        first[n], last[n], lengths[n] = min(first[n], p), p, lengths[n] + t1 - t0
    rows = list(itertools.accumulate((-(-x // checkpoint_every) for x in lengths), initial=0))
    ck_rows = [rows[n] + (t0 - pieces[first[n]][1]) // checkpoint_every for n, t0, _ in pieces]
    cut = [n for n in range(N) if last[n] > first[n]]
    depth = max(last[n] - first[n] + 1 for n in cut)
    grid = [first[n] + j if first[n] + j <= last[n] else P for j in range(depth) for n in cut]
    firsts = {first[n] for n in cut}
    rest = [p for p in range(P) if p not in firsts]
    host = torch.tensor([t0 for _, t0, _ in pieces] + [pieces[-1][2]] + ck_rows + first + last + [0] * P + [-1] * P
                        + grid, dtype=torch.int32)
    host = host.pin_memory() if device.type == "cuda" else host
    table = host.to(device, non_blocking=True)
    bounds, ck, fst, lst, zeros, none, flat = table.split((P + 1, P, N, N, P, P, len(grid)))
    return _Pieces(bounds, ck, fst.long(), lst.long(), flat.long().view(depth, len(cut)), zeros, none,
                   (first[cut[0]], last[cut[-1]]), (first[cut[0]] + 1, last[cut[-1]]), (rest[0], rest[-1] + 1))


@functools.lru_cache(maxsize=16)
def _sequence_rows(device: torch.device, N: int) -> torch.Tensor:
    """0 .. N − 1, int32: sequence n's row of a dense final state, which pass 3 writes as a slot."""
    return torch.arange(N, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=16)
def units(device: torch.device, HV: int, K: int) -> torch.Tensor:
    """I [1, HV, K, K] fp32: the start from which stage 4's transition mode gives a transition (a
    package constant, kda_opt/launch.constant)."""
    return launch.constant(torch.eye(K, device=device).expand(1, HV, K, K).contiguous())


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def pipelined(plan, segments, q, k, v, g, beta, state, checkpoints, prepare, stage4):
    """o over `segments` ((t0, t1), ...) of one sequence (B = 1): stages 1–3 of each segment on a side stream,
    stage 4 on the caller's, which waits for them (on a device without streams, the CPU of the tests,
    one after the other). `state` holds stage 4's state arguments of the whole call: the first segment
    reads the initial state (a pool row too), the last writes the final one; between them the state is
    handed on in fp32 (two buffers in turn)."""
    side = _side_stream(q.device) if q.is_cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(q.device))   # q, k, v, g, beta as the caller's stream left them
    o = torch.empty_like(v)
    handed = [final_states(plan, v), final_states(plan, v)]
    last = len(segments) - 1
    for i, (t0, t1) in enumerate(segments):
        part = lambda x: x[:, t0:t1]            # B = 1: a view of whole token rows
        gcum, Aqk, Tm, r, rstd = _ahead(side, lambda: prepare(part(q), part(k), part(g), part(beta)))
        reads = dict(initial_state=state["initial_state"], has_initial_state=state["has_initial_state"]) if i == 0 \
            else dict(initial_state=handed[(i - 1) % 2])
        rows = None if checkpoints is None else checkpoints[:, t0 // plan.checkpoint_every:]
        stage4(part(q), part(k), part(v), gcum, Tm, Aqk, **reads,
               final_state=state["final_state"] if i == last else handed[i % 2], slots=state["slots"],
               read_slots=i == 0 and state["read_slots"], write_slots=i == last and state["write_slots"],
               checkpoints=rows, qk_rstd=rstd, beta_residual=r, out=part(o))
    return o


def _ahead(side, work):
    """work()'s tensors, made on the side stream with the caller's stream waiting for them (and each
    recorded as used there, since it was allocated on the side); without a side stream, work()'s."""
    if side is None:
        return work()
    main = torch.cuda.current_stream(side.device)
    with torch.cuda.stream(side):
        made = work()
        ready = side.record_event()
    for x in made:
        if x is not None:
            x.record_stream(main)
    main.wait_event(ready)
    return made
