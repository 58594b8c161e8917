"""The device tables a schedule's stage-4 passes read, made by kda_opt/plan.schedule_of as it resolves
a call (kda_opt/schedules, "Parallel segments", runs them): one sequence's parallel segments'
bounds, checkpoint rows and slot rows (package constants, so that a replay takes them), or
packed sequences' pieces' (copied from pinned memory); each cached per segmentation.
"""
import functools
import itertools
from typing import NamedTuple

import torch

from .launch import constant


class SegmentTables(NamedTuple):
    """One sequence's parallel segments' device tables (segment_tables; int32 but no_reads and units),
    each a package constant of its own (kda_opt/launch.constant), S segments."""
    first_bounds: torch.Tensor  # [S] segments 0 .. S − 2's bounds, as cu_seqlens (pass 1)
    middle_bounds: torch.Tensor  # [S − 1] segments 1 .. S − 2's (the transitions)
    last_bounds: torch.Tensor   # [S] segments 1 .. S − 1's (pass 2)
    first_rows: torch.Tensor    # [S − 1] segments 0 .. S − 2's first checkpoint rows
    last_rows: torch.Tensor     # [S − 1] segments 1 .. S − 1's
    no_slots: torch.Tensor      # [S − 2] slot rows of −1 (no state read or written)
    middle_zeros: torch.Tensor  # [S − 2] slot rows of 0 (each transition's start, I)
    first_zero: torch.Tensor    # [S − 1] slot 0 and then −1s: only segment 0 reads a dense initial state
    no_reads: torch.Tensor      # [S − 2] bool, False: has_initial_state of the segments after the first
    units: torch.Tensor         # I [1, HV, K, K] fp32: the transitions' start (units)


@functools.lru_cache(maxsize=64)
def segment_tables(device: torch.device, segments, checkpoint_every: int, HV: int, K: int) -> SegmentTables:
    """The tables of parallel segments (t0, t1), ... (segments start on checkpoint boundaries)."""
    S = len(segments)
    bounds = [t0 for t0, _ in segments] + [segments[-1][1]]
    rows = [t0 // checkpoint_every for t0, _ in segments]
    none = [-1] * (S - 2)
    tables = (bounds[:S], bounds[1:S], bounds[1:], rows[:S - 1], rows[1:], none, [0] * (S - 2), [0] + none)
    return SegmentTables(*(constant(torch.tensor(x, dtype=torch.int32, device=device)) for x in tables),
                         constant(torch.zeros(S - 2, dtype=torch.bool, device=device)), units(device, HV, K))


class PieceTables(NamedTuple):
    """Packed sequences' pieces' tables (piece_tables)."""
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
    units: torch.Tensor         # I [1, HV, K, K] fp32: the transitions' start (units)
    sequence_rows: torch.Tensor  # [N] int32 0 .. N − 1: sequence n's row of a dense final state


@functools.lru_cache(maxsize=64)
def piece_tables(device: torch.device, pieces, N: int, checkpoint_every: int, HV: int, K: int) -> PieceTables:
    """schedules.parallel_packed's tables for pieces (n, t0, t1) of N sequences, at least one of them cut: checkpoint
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
    return PieceTables(bounds, ck, fst.long(), lst.long(), flat.long().view(depth, len(cut)), zeros, none,
                       (first[cut[0]], last[cut[-1]]), (first[cut[0]] + 1, last[cut[-1]]), (rest[0], rest[-1] + 1),
                       units(device, HV, K), _sequence_rows(device, N))


@functools.lru_cache(maxsize=16)
def _sequence_rows(device: torch.device, N: int) -> torch.Tensor:
    """0 .. N − 1, int32: sequence n's row of a dense final state, which pass 3 writes as a slot."""
    return torch.arange(N, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=16)
def units(device: torch.device, HV: int, K: int) -> torch.Tensor:
    """I [1, HV, K, K] fp32: the start from which stage 4's transition mode gives a transition (a
    package constant, kda_opt/launch.constant)."""
    return constant(torch.eye(K, device=device).expand(1, HV, K, K).contiguous())
