"""The schedules of a call too long for one pass, as kda_opt/forward runs them: each takes the
plan (its sizes and layouts), what kda_opt/plan.schedule_of resolved for the call (its token ranges,
or the device tables of its segments or pieces, kda_opt/segment_tables, and the pieces' V block), the
inputs, stage 4's state arguments of the whole call (`state`), stages 1–3 as one function
(`prepare`) and stage 4's launcher (`stage4`), and returns o. Nothing here chooses a schedule.

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
in one launch (S − 2 products in fp32, kda_opt/merge); (3) segments 1 .. S − 1 from their true starts,
giving their o, checkpoints and the final state. Packed sequences with their host copy (cu_seqlens_cpu)
are cut on each call: the long ones into segments, the others whole, every sequence's rows in order as
pieces, and each pass runs the run of pieces it needs (parallel_packed). Three passes, each with every
(segment, head) program at once, against one pass whose chain is the longest sequence. The result is
that of one pass up to the rounding of M's 16-bit product operands, within one pass's error against
the float64 recurrence (tests/test_parallel.py).

The longest ahead (kda_opt/plan.takes_ahead decides it, from packed sequences' host copy): in
one pass the longest sequence's stage-4 chain, the call's critical path, starts only when stages 1–3
have run over every sequence. Here stages 1–3 run first over the longest sequence's time segments, one
after another on the caller's stream, each segment's stage 4 on a side stream of high priority as soon
as its own stages 1–3 are done (the segments' states handed on in fp32, as time segments do), then
stages 1–3 and stage 4 of the other sequences on the caller's stream, beside that chain on the SMs it
leaves. The same numbers as one pass: every chunk's stages 1–3 and every sequence's chain are the
same arithmetic.
"""
import contextlib
import functools
import math

import torch

from .merge import merge
from .options import state_shape
from .launch import wait
from .seqs import Counts
from .segment_tables import PieceTables, SegmentTables


def final_states(plan, like: torch.Tensor) -> torch.Tensor:
    """An fp32 state for each of the plan's sequences, in its layout."""
    return like.new_empty(state_shape(plan.N, plan.HV, plan.K, plan.V, plan.state_v_first), dtype=torch.float32)


def parallel(plan, t: SegmentTables, q, k, v, g, beta, state, checkpoints, prepare, stage4):
    """o over the segments of one sequence (B = 1) whose tables are `t`, run at once (module docstring,
    "Parallel segments"); `state` holds stage 4's state arguments of the whole call. A pool slot is read by
    segment 0 and written by the last; a dense final state is the last segment's row of its own
    buffer, copied. With a dense state or none, and no has_initial_state, the call runs nothing but
    allocations, views, copies and launches (its tables package constants), so kda_opt/replay can
    replay it."""
    S = len(t.first_bounds)
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
    stage4(q, k, v, gcum, Tm, Aqk, initial_state=t.units, slots=t.middle_zeros, read_slots=True, final_state=M,
           cu_seqlens=t.middle_bounds, transition=True, state_v_first=False, **common)
    final, pool = state["final_state"], state["write_slots"]
    last_slots = _beside(state["slots"], t.no_slots, first=False) if pool else None
    starts = merge(h, M, plan.state_v_first, sms=plan.sms)
    # Pass 2: segments 1 .. S − 1 from their true starts; the last writes the call's final state.
    ends = None if final is None or pool else torch.empty_like(starts)
    stage4(q, k, v, gcum, Tm, Aqk, initial_state=starts, final_state=final if pool else ends, write_slots=pool,
           slots=last_slots, cu_seqlens=t.last_bounds, out=o, checkpoints=checkpoints,
           checkpoint_rows=None if checkpoints is None else t.last_rows, **common)
    if ends is not None:
        final.copy_(ends[-1:])
    return o


def _first_segment_reads(state, t: SegmentTables):
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
    by two copies, so that a replay makes it (kda_opt/replay takes no concatenation or cast)."""
    out = table.new_empty(len(table) + 1)
    (out[:1] if first else out[-1:]).copy_(x)
    (out[1:] if first else out[:-1]).copy_(table)
    return out


def parallel_packed(plan, t: PieceTables, block_v, q, k, v, g, beta, seqs, state, checkpoints, prepare, stage4):
    """o over the pieces whose tables are `t` (every packed sequence's rows in order, the long ones cut
    into segments) run at once (module docstring, "Parallel segments"): three stage-4 passes, each over the
    run of pieces it needs. `state` holds stage 4's state arguments of the whole call: a sequence's
    first piece reads its initial state (a pool slot too), its last writes its final state. Where
    parallel (one sequence) reads the call's state in its first pass and merges into the last pass's
    starts directly, here the starts of every piece are gathered into one buffer first (pass 3 runs
    whole sequences from their initial states beside cut pieces from merged ones)."""
    P = len(t.ck_rows)
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
    stage4(q, k, v, gcum, Tm, Aqk, initial_state=t.units, slots=t.zeros[lo:hi],
           read_slots=True, final_state=M[lo:hi], cu_seqlens=t.bounds[lo:hi + 1], transition=True,
           state_v_first=False, block_v=math.gcd(block_v, plan.K), **common)
    # A cut sequence's piece j + 1 starts where piece j ends, M_j S_j + h_j, and its first piece ends
    # at h_0 (grid: [pieces, cut sequences], padded with the spare row).
    ends = merge(h[t.grid], M[t.grid[1:]], plan.state_v_first, sms=plan.sms)
    starts.index_copy_(0, t.grid[1:].flatten(), ends[:-1].flatten(0, 1))
    # Pass 3: every piece from the first that is not a cut sequence's first, from its true start: o,
    # checkpoints, and by each last piece its sequence's final state (a dense state's row n, or its
    # pool slot).
    final, pool = state["final_state"], state["write_slots"]
    slots = None
    if final is not None:
        rows = state["slots"].to(torch.int32) if pool else t.sequence_rows
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


def _state_row(plan) -> tuple[int, int, int]:
    """One sequence's state shape without N: [HV, K, V], or [HV, V, K] V-first."""
    return state_shape(1, plan.HV, plan.K, plan.V, plan.state_v_first)[1:]


@functools.cache
def _side_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """The package's side stream on `device` of this priority (lower: its blocks are scheduled first)."""
    return torch.cuda.Stream(device, priority=priority)


def longest_ahead(plan, segments: int, block_v: int, q, k, v, g, beta, cu_seqlens, state, routed, prepare, stage4,
                  layout):
    """o over packed sequences whose longest runs ahead (module docstring, "The longest ahead") in
    `segments` time segments at stage 4's V block block_v; layout(segments, slots, has_initial_state)
    makes their layouts (kda_opt/seqs.ahead_layout); routed: the others' sequences of one token are
    kda_opt/recurrence's (the caller's to launch after). `state` holds stage 4's state arguments of the
    whole call: the first segment reads the longest one's initial state, the last writes its final
    one (at its slot: its pool row, or its row of a dense state), and between them the state is handed
    on in fp32 (two one-row buffers in turn). The launches do not depend on the lengths, so the call
    may be replayed (kda_opt/replay). On a device without streams (the CPU of the tests), one after the
    other."""
    side = _side_stream(q.device, AHEAD_PRIORITY) if q.is_cuda else None
    main = torch.cuda.current_stream(q.device) if side is not None else None
    t = layout(segments, slots=state["slots"] if state["read_slots"] or state["write_slots"] else None,
               has_initial_state=state["has_initial_state"])
    o = torch.empty_like(v)
    last = segments - 1
    handed = [v.new_empty((1, *_state_row(plan)), dtype=torch.float32) for _ in range(min(last, 2))]
    made = None
    for i, seqs in enumerate(t.segments):
        made = prepare(q, k, g, beta, seqs, out=made)
        gcum, Aqk, Tm, r, rstd = made
        initial = state["initial_state"] if i == 0 else handed[(i - 1) % 2]
        final = state["final_state"] if i == last else handed[i % 2]
        with _after(main, side):
            stage4(q, k, v, gcum, Tm, Aqk, initial_state=initial, read_slots=i == 0 and initial is not None,
                   has_initial_state=t.has_state if i == 0 else None, final_state=final,
                   write_slots=i == last and final is not None, slots=t.slot, cu_seqlens=seqs.cu_seqlens,
                   qk_rstd=rstd, beta_residual=r, out=o, block_v=block_v, short_sequences=False)
    gcum, Aqk, Tm, r, rstd = prepare(q, k, g, beta, t.rest, out=made)
    # The others' long launch over the order (longest first), their short one over every sequence.
    others = Counts(plan.N - 1, 1, t.rest.chunk_slots)
    stage4(q, k, v, gcum, Tm, Aqk, **state, cu_seqlens=cu_seqlens, order=t.order, sequence_counts=others,
           qk_rstd=rstd, beta_residual=r, decoded=routed, out=o)
    if side is not None:
        wait(main, side)
    return o


# The longest ahead's side stream: the highest priority, so that its chain's blocks go before the
# waiting blocks of the caller's stream.
AHEAD_PRIORITY = -1


@contextlib.contextmanager
def _after(main, side):
    """Work on `side` after what the caller's stream `main` has so far (None: where it is)."""
    if side is None:
        yield
        return
    wait(side, main)
    with torch.cuda.stream(side):
        yield


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
