"""The chunk table of packed sequences (kda_opt/seqs), under the interpreter or on the GPU, against
the table built on the host as FLA does (prepare_chunk_indices); stage 4's longest-first order
against a stable sort on the host; stage 4's sequence counts from the host copy."""
import pytest
import torch
import triton

from kda_opt.options import CHUNK
from kda_opt.seqs import BLOCK, RANK_BLOCK, ahead_layout, block_offsets, longest_first, packed, phased, sequence_counts
from tests.conftest import kernel_device


def host_table(lens):
    """(sequence, chunk) for every chunk of every sequence, in order."""
    return [(n, c) for n, length in enumerate(lens) for c in range(triton.cdiv(length, CHUNK))]


def table(cu_seqlens, T):
    seqs = packed(cu_seqlens.to(kernel_device()), T)
    rows = [tuple(r) for r in seqs.chunk_indices.cpu().tolist()]
    assert seqs.chunk_slots == len(rows) == triton.cdiv(T, CHUNK) + len(cu_seqlens) - 2   # N − 1 spare
    return seqs, rows


@pytest.mark.parametrize("lens", [[1], [64], [65], [1, 63, 64, 65, 130, 0, 7], [0, 0, 5, 0], [200, 1, 1, 1]])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_chunk_table(lens, dtype):
    cu = torch.tensor([0, *lens]).cumsum(0).to(dtype)
    _, rows = table(cu, sum(lens))
    used = host_table(lens)
    assert rows[:len(used)] == used
    assert rows[len(used):] == [(-1, 0)] * (len(rows) - len(used))   # spare slots


@pytest.mark.parametrize("lens", [[1, 63, 1, 65, 130, 0, 1], [1, 1], [200, 1, 1, 1]])
@pytest.mark.parametrize("counted", [False, True])
def test_chunk_table_without_single_tokens(lens, counted):
    """skip_single: the one-token sequences own no slot; with the chunks counted on the host
    (sequence_counts) the table holds exactly the others' chunks (one spare slot where none)."""
    cu = torch.tensor([0, *lens]).cumsum(0)
    counts = sequence_counts(cu, True)
    seqs = packed(cu.to(kernel_device()), sum(lens), skip_single=True, chunks=counts.chunks if counted else None)
    rows = [tuple(r) for r in seqs.chunk_indices.cpu().tolist()]
    used = [(n, c) for n, c in host_table(lens) if lens[n] != 1]
    assert counts.chunks == len(used)
    assert seqs.chunk_slots == (max(len(used), 1) if counted else triton.cdiv(sum(lens), CHUNK) + len(lens) - 1)
    assert rows[:len(used)] == used and rows[len(used):] == [(-1, 0)] * (len(rows) - len(used))


def test_chunk_table_many_sequences():
    """More sequences than one block of the offsets scan, more slots than one search program."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 150, (3 * BLOCK + 5,), generator=gen).tolist()
    _, rows = table(torch.tensor([0, *lens]).cumsum(0), sum(lens))
    used = host_table(lens)
    assert rows[:len(used)] == used and all(r == (-1, 0) for r in rows[len(used):])


def test_chunk_table_of_a_broken_cu_seqlens_is_clamped():
    """Values that break the contract (falling, past T, negative) are clamped to 0 ≤ bos ≤ eos ≤ T,
    as the stages read them: a wrong table, but never a chunk outside the array."""
    cu = [0, 300, 100, -5, 40, 1000]
    T, clamped = 120, []
    for bos, eos in zip(cu[:-1], cu[1:]):
        bos = min(max(bos, 0), T)
        clamped.append(min(max(eos, bos), T) - bos)
    _, rows = table(torch.tensor(cu, dtype=torch.int32), T)
    used = host_table(clamped)
    assert rows[:len(used)] == used and all(r == (-1, 0) for r in rows[len(used):])


@pytest.mark.parametrize("lens", [[1, 63, 64, 65, 130, 0, 7], [5] * 70, [1] * 3 + [4096] + [1] * 130 + [64, 65],
                                  "random"])
def test_longest_first(lens):
    """Sequences by descending chunk count, equal counts in their own order; more sequences than one
    program's block (RANK_BLOCK)."""
    if lens == "random":
        lens = torch.randint(0, 3000, (3 * RANK_BLOCK + 7,), generator=torch.Generator().manual_seed(0)).tolist()
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    order = longest_first(cu.to(kernel_device()), sum(lens)).cpu()
    chunks = torch.tensor([triton.cdiv(n, CHUNK) for n in lens])
    assert order.dtype == torch.int32
    assert order.tolist() == torch.sort(-chunks, stable=True).indices.tolist()


@pytest.mark.parametrize("decoded", [False, True])
def test_sequence_counts(decoded):
    """(longer than a chunk, at most a chunk, chunks) from the host copy; where decoded, the one-token
    sequences are not counted (the decode kernel's); empty sequences are short (stage 4 passes their
    states on) and own no chunk."""
    cu = torch.tensor([0, 1, 1, 65, 130, 131, 431, 495])             # 1, 0, 64, 65, 1, 300, 64 tokens
    assert sequence_counts(cu, decoded) == ((2, 3, 9) if decoded else (2, 5, 11))
    assert sequence_counts(torch.tensor([0, 1, 2]), decoded) == ((0, 0, 0) if decoded else (0, 2, 2))


@pytest.mark.parametrize("size", [CHUNK, 512])
def test_block_offsets(size):
    """Each packed sequence's first row in a table of a row per `size` tokens (checkpoints every
    `size` tokens), across more sequences than one block of the scan."""
    lens = [1, 63, 64, 65, 0, 511, 512, 513, 1500] * (BLOCK // 8)
    offsets = block_offsets(torch.tensor([0, *lens]).cumsum(0).to(kernel_device()), sum(lens), size)
    assert offsets.cpu().tolist() == [sum(triton.cdiv(n, size) for n in lens[:i]) for i in range(len(lens) + 1)]


@pytest.mark.parametrize("every", [CHUNK, 256])
def test_phased(every):
    """Checkpoint offsets (kda_opt/seqs.phased): each sequence cut after its first f_n mod 64 tokens
    (f_n clamped to 1 .. every; no more than it has), and each one's first checkpoint row from
    rows_n = 1 + cdiv(max(len_n − f_n, 0), every), 0 where empty."""
    lens = [130, 1, 64, 0, 257, 600, 20]
    firsts = [37, 5, 64, 10, 0, 100, 1000]
    cu = torch.tensor([0, *lens]).cumsum(0).to(kernel_device())
    seqs, rows = phased(cu, torch.tensor(firsts, device=cu.device), sum(lens), every)
    f = [min(max(x, 1), every) for x in firsts]
    heads = [min(x % CHUNK, n) for x, n in zip(f, lens)]
    cuts = [b for i, n in enumerate(lens) for b in (sum(lens[:i]), sum(lens[:i]) + heads[i])] + [sum(lens)]
    assert seqs.cu_seqlens.cpu().tolist() == cuts
    pieces = [b - a for a, b in zip(cuts[:-1], cuts[1:])]
    assert [tuple(r) for r in seqs.chunk_indices.cpu().tolist()][:len(host_table(pieces))] == host_table(pieces)
    counts = [0 if n == 0 else 1 + -(-max(n - x, 0) // every) for n, x in zip(lens, f)]
    assert rows.cpu().tolist() == [sum(counts[:i]) for i in range(len(lens) + 1)]


@pytest.mark.parametrize("segments", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pool", [False, True])
def test_ahead_layout(segments, dtype, pool):
    """The longest ahead's layouts, made on the device: the first of the most chunks (longest_first's
    first; here after more sequences than one block of the search), its segments of whole chunks (the
    last what is left, past its end empty) with their chunk tables, its slot and has_initial_state, the
    others' chunk table without it and the one-token sequences, and their order."""
    lens = [5] * (BLOCK + 3) + [1, 190, 64, 1, 190, 0, 130]
    n = BLOCK + 4
    cu = torch.tensor([0, *lens]).cumsum(0).to(dtype)
    device = kernel_device()
    slots = torch.arange(len(lens), dtype=torch.int32).flip(0).to(device) if pool else None
    has = (torch.arange(len(lens)) % 2 == 0).to(device)
    t = ahead_layout(cu.to(device), sum(lens), segments, slots=slots, has_initial_state=has, skip_single=True)
    bos, chunks = int(cu[n]), 3
    per = -(-chunks // segments)
    assert [tuple(s.cu_seqlens.tolist()) for s in t.segments] == [
        (min(bos + 64 * per * s, bos + 190), min(bos + 64 * per * (s + 1), bos + 190)) for s in range(segments)]
    assert all(s.cu_seqlens.dtype == dtype for s in t.segments)
    for s, seqs in enumerate(t.segments):
        count = max(0, min(per, chunks - per * s))
        rows = [tuple(r) for r in seqs.chunk_indices.tolist()]
        assert rows == [(0, j) for j in range(count)] + [(-1, 0)] * (seqs.chunk_slots - count)
    assert t.slot.tolist() == [len(lens) - 1 - n if pool else n] and t.has_state.tolist() == [n % 2 == 0]
    rows = [tuple(r) for r in t.rest.chunk_indices.tolist()]
    used = [(m, c) for m, c in host_table(lens) if m != n and lens[m] != 1]
    assert rows[:len(used)] == used and all(r == (-1, 0) for r in rows[len(used):])
    order = longest_first(cu.to(device), sum(lens)).tolist()
    assert order[0] == n and t.order.tolist() == order[1:]
