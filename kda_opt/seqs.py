"""Where the sequences, and the chunks of each, lie along T: a fixed-length batch or packed sequences.

    fixed:  B sequences of T tokens; sequence b is rows b·T .. b·T + T − 1 of [B·T, ...]
    packed: B = 1; sequence n is tokens cu_seqlens[n] .. cu_seqlens[n+1] − 1 (FlashAttention's
            cu_seqlens, [N + 1]), cut into chunks of C = CHUNK from its own first token
A per-chunk grid has one slot per chunk. Packed, Σ cdiv(len_n, C) ≤ cdiv(T, C) + N − 1, so that many
slots cover any lengths; chunk_indices [slots, 2] names each slot's (sequence, chunk in it), (−1, 0)
for a spare one, and is built on the device from cu_seqlens by two small kernels (no host sync):
offsets = [0, cumsum(cdiv(len_n, C))], then a binary search of offsets per slot (FLA builds the same
table, prepare_chunk_indices, on the host). Sequences of one token that kda_opt/recurrence computes may
own no slot (skip_single), and where the caller gives the lengths on the host (sequence_counts) the
grid has exactly as many slots as chunks. A per-sequence grid (stage 4) reads cu_seqlens directly,
optionally in the order longest_first gives: the sequences by descending chunk count, so that a grid
of more programs than SMs starts its longest ones first (longest-processing-time-first list scheduling).
"""
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import Kernels, constant, one_allocation, triton_launch
from .options import CHUNK

BLOCK = 1024  # sequences per step of the offsets scan; slots per program of the index search
RANK_BLOCK = 64  # sequences per program of longest_first, and per step of its comparisons
RANK_MAX = 4096  # longest_first's O(N²) comparisons stay a few µs up to this many sequences


class Counts(NamedTuple):
    """What a packed call's launches cover, counted from its host copy (sequence_counts)."""
    long: int       # sequences longer than a chunk
    short: int      # sequences of at most one chunk that stage 4 computes
    chunks: int     # chunks of the sequences stages 1–3 compute


def sequence_counts(cu_seqlens_cpu: torch.Tensor, skip_single: bool) -> Counts:
    """From the host copy cu_seqlens_cpu [N + 1]; skip_single: the sequences of one token are left
    out of every count (kda_opt/recurrence computes them): each is one short sequence and one chunk."""
    lengths = cu_seqlens_cpu.diff()
    long = int((lengths > CHUNK).sum())
    single = int((lengths == 1).sum()) if skip_single else 0
    chunks = int(lengths.add(CHUNK - 1).div(CHUNK, rounding_mode="floor").sum())
    return Counts(long, lengths.numel() - long - single, chunks - single)


@dataclass(frozen=True)
class Seqs:
    """The sequence layout the stages launch over (see the module docstring)."""
    chunk_slots: int                          # extent of a per-chunk grid along T
    cu_seqlens: torch.Tensor | None = None    # [N + 1] int32/int64 on the device; None: fixed length
    chunk_indices: torch.Tensor | None = None  # [chunk_slots, 2] int32: (sequence, chunk), packed only
    chunk_offsets: torch.Tensor | None = None  # [N + 1] int32: Σ_{m<n} cdiv(len_m, C), packed only

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


def num_sequences(B: int, cu_seqlens: torch.Tensor | None) -> int:
    """N: the B batch entries, or the sequences cu_seqlens [N + 1] packs into the one entry."""
    return B if cu_seqlens is None else cu_seqlens.shape[0] - 1


@functools.lru_cache(maxsize=1024)
def fixed(T: int) -> Seqs:
    """B sequences of T tokens each: the chunk slots of one (the grid covers B·HV of them)."""
    return Seqs(chunk_slots=-(-T // CHUNK))


def packed(cu_seqlens: torch.Tensor, T: int, kernels: Kernels | None = None, *, skip_single: bool = False,
           chunks: int | None = None, skip_at: torch.Tensor | None = None) -> Seqs:
    """The layout of sequences packed along T by cu_seqlens (validated by the caller). kernels: the
    plan's compiled kernels (kda_opt/launch), or None. skip_single: sequences of one token own no
    chunk (kda_opt/recurrence computes them). chunks: how many chunks the table holds, counted on the
    host (sequence_counts), for a grid of that many slots (at least one); None: the bound. skip_at:
    [1] int32 on the device, a sequence that owns no chunk either (None: none)."""
    N = cu_seqlens.shape[0] - 1
    slots = -(-T // CHUNK) + N - 1 if chunks is None else max(chunks, 1)
    offsets = block_offsets(cu_seqlens, T, CHUNK, kernels, skip_single=skip_single, skip_at=skip_at)
    indices = torch.empty(slots, 2, dtype=torch.int32, device=cu_seqlens.device)
    triton_launch(chunk_indices_kernel, (-(-slots // BLOCK),), kernels, offsets=offsets, indices=indices, N=N,
                  slots=slots, STEPS=N.bit_length(), BLOCK=BLOCK)
    return Seqs(chunk_slots=slots, cu_seqlens=cu_seqlens, chunk_indices=indices, chunk_offsets=offsets)


def phased(cu_seqlens: torch.Tensor, first: torch.Tensor, T: int, every: int,
           kernels: Kernels | None = None) -> tuple[Seqs, torch.Tensor]:
    """Packed sequences whose first checkpoint falls after their first first[n] tokens (clamped to
    1 .. every) and the next ones every `every` tokens (a multiple of C): the layout stages 1–3 run
    over, each sequence cut after its head (its first first[n] mod C tokens) so that its chunks end
    at the checkpoints (kda_opt/wuso, PHASED), and each sequence's first checkpoint row [N + 1]
    int32, Σ_{m<n} rows_m with rows_m = 1 + cdiv(max(len_m − first[m], 0), every) (0 where empty).
    Device ops only, no host sync."""
    bos, lens = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    f = first.to(cu_seqlens.dtype).clamp(1, every)
    cuts = torch.stack((bos, bos + torch.minimum(f % CHUNK, lens)), dim=1).flatten()
    rows = torch.where(lens > 0, 1 + torch.div((lens - f).clamp_min(0) + every - 1, every, rounding_mode="floor"), 0)
    offsets = torch.cat((rows.new_zeros(1), rows.cumsum(0))).to(torch.int32)
    return packed(torch.cat((cuts, cu_seqlens[-1:])), T, kernels), offsets


def block_offsets(cu_seqlens: torch.Tensor, T: int, size: int, kernels: Kernels | None = None, *,
                  skip_single: bool = False, skip_at: torch.Tensor | None = None) -> torch.Tensor:
    """[N + 1] int32 on the device: Σ_{m<n} cdiv(len_m, size) for n = 0 .. N, the first row of each
    packed sequence in a table with a row per `size` tokens of each (chunks: size = CHUNK); with
    skip_single, none for a sequence of one token; none for sequence skip_at[0] ([1] int32 on the
    device; None: none)."""
    N = cu_seqlens.shape[0] - 1
    offsets = torch.empty(N + 1, dtype=torch.int32, device=cu_seqlens.device)
    triton_launch(chunk_offsets_kernel, (1,), kernels, cu_seqlens=cu_seqlens, offsets=offsets,
                  skip_at=_no_sequence(cu_seqlens.device) if skip_at is None else skip_at, N=N, T=T, size=size,
                  skip=int(skip_single), BLOCK=BLOCK)
    return offsets


class AheadLayout(NamedTuple):
    """A packed call's layouts when its longest sequence runs ahead (ahead_layout), on the device."""
    segments: tuple[Seqs, ...]         # the longest sequence's time segments, each as one sequence
    slot: torch.Tensor                 # [1] int32: where its state is read and written (its pool slot, or its row)
    has_state: torch.Tensor | None     # [1] bool: its has_initial_state (None without one)
    rest: Seqs                         # the other sequences' chunks
    order: torch.Tensor                # [N − 1] int32: the other sequences, longest first


def ahead_layout(cu_seqlens: torch.Tensor, T: int, segments: int, kernels: Kernels | None = None, *,
                 slots: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None,
                 skip_single: bool = False) -> AheadLayout:
    """The layouts of packed sequences whose longest (the first of the most chunks: longest_first's
    first) runs ahead in `segments` time segments of whole chunks from its first token, equal but the
    last (some empty where it has fewer chunks): each segment a sequence of its own ([2] bounds as
    cu_seqlens, its chunk table of a replay's slots), the slot its state is read from and written to
    (slots[n] of a pool, else n), its has_initial_state, the others' chunk table (the one-token ones
    left out with skip_single) and their order. Device launches only, sized by T and N: no host sync,
    the same launches for any lengths."""
    N = cu_seqlens.shape[0] - 1
    per = -(-(-(-T // CHUNK)) // segments)   # a segment's chunks at most: cdiv(cdiv(T, C), segments)
    per += per % 2                            # (even: each segment's table on a 16-byte boundary)
    width = 16 // cu_seqlens.element_size()
    bounds, indices, longest, slot, has = one_allocation(
        cu_seqlens.device, ((segments, width), cu_seqlens.dtype), ((segments, per, 2), torch.int32),
        ((1,), torch.int32), ((1,), torch.int32), None if has_initial_state is None else ((1,), torch.bool))
    triton_launch(ahead_layout_kernel, (1,), kernels, cu_seqlens, slots, has_initial_state, bounds, indices, longest,
                  slot, has, N, T, per, CHUNK, segments, width, BLOCK, slots is not None,
                  has_initial_state is not None)
    rest = packed(cu_seqlens, T, kernels, skip_single=skip_single, skip_at=longest)
    order = longest_first(cu_seqlens, T, kernels)
    return AheadLayout(tuple(Seqs(chunk_slots=per, cu_seqlens=bounds[s, :2], chunk_indices=indices[s])
                             for s in range(segments)), slot, has, rest, order[1:])


@functools.lru_cache(maxsize=16)
def _no_sequence(device: torch.device) -> torch.Tensor:
    """[−1] int32: block_offsets' skip_at that names no sequence (a package constant)."""
    return constant(torch.full((1,), -1, dtype=torch.int32, device=device))


def longest_first(cu_seqlens: torch.Tensor, T: int, kernels: Kernels | None = None) -> torch.Tensor:
    """[N] int32 on the device: the packed sequences by descending chunk count cdiv(len_n, C), equal
    counts in their own order (a stable sort). No host sync."""
    N = cu_seqlens.shape[0] - 1
    order = torch.empty(N, dtype=torch.int32, device=cu_seqlens.device)
    triton_launch(longest_first_kernel, (-(-N // RANK_BLOCK),), kernels, cu_seqlens=cu_seqlens, order=order, N=N,
                  T=T, C=CHUNK, BLOCK=RANK_BLOCK)
    return order


@triton.jit
def _bounds(cu_seqlens, n, T):
    """First token and end of sequence n (vectors or scalars), clamped to 0 ≤ bos ≤ eos ≤ T: a
    cu_seqlens that breaks its contract (non-decreasing from 0 to T) gives wrong numbers, never an
    access out of bounds."""
    bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + n).to(tl.int64), 0), T)
    eos = tl.minimum(tl.maximum(tl.load(cu_seqlens + n + 1).to(tl.int64), bos), T)
    return bos, eos


@triton.jit(do_not_specialize=["skip"])
def chunk_offsets_kernel(cu_seqlens, offsets, skip_at, N, T, size, skip, BLOCK: tl.constexpr):
    # offsets[n] = Σ_{m<n} cdiv(len_m, size), 0 for len_m = skip and for m = skip_at[0]: one program,
    # the scan carried across blocks of sequences. skip is an argument, not a constant: one plan's
    # calls may differ in it (kda_opt/launch keeps one compiled kernel per plan), and 0 skips nothing;
    # so is skip_at's sequence (−1: none).
    tl.store(offsets, 0)
    carry = N * 0
    skipped = tl.load(skip_at)
    for n0 in range(0, N, BLOCK):
        o_n = n0 + tl.arange(0, BLOCK)
        m_n = o_n < N
        bos, eos = _bounds(cu_seqlens, tl.where(m_n, o_n, 0), T)
        counts = tl.where(m_n, (eos - bos + size - 1) // size, 0).to(tl.int32)
        counts = tl.where((eos - bos == skip) | (o_n == skipped), 0, counts)
        tl.store(offsets + o_n + 1, carry + tl.cumsum(counts, axis=0), mask=m_n)
        carry += tl.sum(counts, axis=0)


@triton.jit
def ahead_layout_kernel(cu_seqlens, slots, has_state, bounds, indices, longest, slot, has, N, T, PER,
                        C: tl.constexpr, S: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_SLOTS: tl.constexpr, HAS_MASK: tl.constexpr):
    # One program. n: the first sequence of the most chunks (longest_first's first), found in blocks;
    # its S segments of `per` chunks each (the last what is left; empty past its end), each [t0, t1]
    # into bounds[s, :2] and its chunks (0, j), j < its count, into indices[s] (PER slots, spare ones
    # (−1, 0)); n, its slot and its has_initial_state.
    best = (N * 0 - 1).to(tl.int64)
    n = (N * 0).to(tl.int64)
    for n0 in range(0, N, BLOCK):
        o_n = n0 + tl.arange(0, BLOCK)
        m_n = o_n < N
        bos, eos = _bounds(cu_seqlens, tl.where(m_n, o_n, 0), T)
        counts = tl.where(m_n, (eos - bos + C - 1) // C, -1)
        top = tl.max(counts, axis=0)
        first = tl.min(tl.where(counts == top, o_n, N), axis=0).to(tl.int64)
        n = tl.where(top > best, first, n)
        best = tl.maximum(top, best)
    bos, eos = _bounds(cu_seqlens, n, T)
    per = (best + S - 1) // S
    for s in tl.static_range(S):
        t0 = tl.minimum(bos + s * per * C, eos)
        t1 = tl.minimum(bos + (s + 1) * per * C, eos)
        tl.store(bounds + s * WIDTH, t0.to(bounds.dtype.element_ty))
        tl.store(bounds + s * WIDTH + 1, t1.to(bounds.dtype.element_ty))
        used = (t1 - t0 + C - 1) // C
        for j0 in range(0, PER, BLOCK):
            o_j = j0 + tl.arange(0, BLOCK)
            m_j = o_j < PER
            tl.store(indices + (s * PER + o_j) * 2, tl.where(o_j < used, 0, -1), mask=m_j)
            tl.store(indices + (s * PER + o_j) * 2 + 1, tl.where(o_j < used, o_j, 0), mask=m_j)
    tl.store(longest, n.to(tl.int32))
    if HAS_SLOTS:
        tl.store(slot, tl.load(slots + n).to(tl.int32))
    else:
        tl.store(slot, n.to(tl.int32))
    if HAS_MASK:
        tl.store(has, tl.load(has_state + n))


@triton.jit
def chunk_indices_kernel(offsets, indices, N, slots, STEPS, BLOCK: tl.constexpr):
    # Slot s belongs to the last sequence n with offsets[n] ≤ s (empty sequences own no slot): a
    # binary search over n ∈ [0, N − 1], STEPS ≥ log2(N) + 1 halvings, per slot of the block.
    o_s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = o_s * 0
    hi = lo + N - 1
    for _ in range(STEPS):
        mid = (lo + hi + 1) // 2
        below = tl.load(offsets + mid) <= o_s
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    used = o_s < tl.load(offsets + N + 0 * o_s)
    m_s = o_s < slots
    tl.store(indices + 2 * o_s, tl.where(used, lo, -1), mask=m_s)
    tl.store(indices + 2 * o_s + 1, tl.where(used, o_s - tl.load(offsets + lo), 0), mask=m_s)


@triton.jit
def longest_first_kernel(cu_seqlens, order, N, T, C: tl.constexpr, BLOCK: tl.constexpr):
    # Sequence n goes to position rank_n = #{m : c_m > c_n} + #{m < n : c_m = c_n} (c: chunk counts),
    # counted against every m in blocks: O(N²) comparisons, spread over N / BLOCK programs.
    o_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    bos, eos = _bounds(cu_seqlens, tl.where(m_n, o_n, 0), T)
    c_n = (eos - bos + C - 1) // C
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for m0 in range(0, N, BLOCK):
        o_m = m0 + tl.arange(0, BLOCK)
        m_m = o_m < N
        bos_m, eos_m = _bounds(cu_seqlens, tl.where(m_m, o_m, 0), T)
        c_m = tl.where(m_m, (eos_m - bos_m + C - 1) // C, -1)
        ahead = (c_m[None, :] > c_n[:, None]) | ((c_m[None, :] == c_n[:, None]) & (o_m[None, :] < o_n[:, None]))
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    tl.store(order + rank, o_n.to(tl.int32), mask=m_n)


@triton.jit
def chunk_span(i_b, i_t, T, cu_seqlens, chunk_indices, PACKED: tl.constexpr):
    """Chunk slot i_t of batch entry i_b → (its sequence's first token as a row of [B·T], the
    sequence's length, the chunk's index in the sequence). A spare slot is chunk 0 of an empty
    sequence: every mask against the length is false there. Fixed length: cu_seqlens and
    chunk_indices are None, never read."""
    if PACKED:
        n = tl.load(chunk_indices + 2 * i_t)
        bos, eos = _bounds(cu_seqlens, tl.maximum(n, 0), T)
        return bos, tl.where(n >= 0, eos - bos, 0), tl.load(chunk_indices + 2 * i_t + 1).to(tl.int64)
    else:
        return i_b * T, T, i_t
