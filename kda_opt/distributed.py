"""Context parallel over torch.distributed: sequences split along T across the ranks of a process
group, each rank holding its slice of the tokens (kda_opt/schedules, "Parallel segments", across
ranks): one sequence, or packed ones by their global cu_seqlens (FLA's convention), a sequence may
cross ranks.

    rank r holds tokens [t_r, t_{r+1}): q, k, v, g, beta [1, T_r, ...]; its sequences are the parts of
    those that meet its slice, the first perhaps begun on an earlier rank (continued), the last
    perhaps ending on a later one (continues)
    0. stages 1–3 over its slice, once (they do not depend on the state)
    1. unless its first sequence is continued and its last ends here: a pass from the sequences'
       initial states, the continued one's from zero, giving o (final where nothing is continued) and
       the last sequence's state at the slice's end h_r; where one sequence spans the slice, its
       transition M_r (kda_opt/forward.Prepared)
    2. all_gather of h and M over the group (fp32: HV·K·(V + K) numbers per rank)
    3. a continued sequence's start, from the rank a where it begins: the merge of h_a .. h_{r−1}
       and M_{a+1} .. M_{r−1} (the engine's: kda_opt/merge in fp32, or float64), and the pass again
       from it
A sequence's final state is returned by the rank where it ends. With one sequence, stage 4 runs over
a slice once on rank 0 and on the last rank, three times on the others, and the last rank's stages
1–3 run while rank 0 computes h_0, so two ranks take about rank 0's call plus the last rank's stage 4.
"""
import bisect
import itertools
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import forward, reference
from .merge import merge
from .options import state_shape


class Engine:
    """How a rank computes on its slice: prepare(kda_forward's arguments) runs what does not depend
    on the start and returns an object whose ends(initial_state) gives (o, final state) and whose
    transition() gives the slice's transition; merge(h, M, v_first) chains the ranks' states as
    kda_opt/merge's merge does. This one is kda_opt's (forward.Prepared, the merge kernel), on the GPU."""

    def prepare(self, args):
        return forward.Prepared(**args)

    def merge(self, h, M, v_first):
        return merge(h, M, v_first)

    def forward(self, args, initial_state):
        """The whole call on one device, as a user makes it: (o, final state)."""
        return forward.kda_forward(**args, initial_state=initial_state, output_final_state=True)


class ReferenceEngine(Engine):
    """Each slice by the float64 recurrence (kda_opt/reference), on any device, the CPU too: its (o,
    final state) from a start, its transition as the final state of v = 0 over K state columns from
    I; its merge the same chain in float64. For checking a setup (the collective, the split) where
    kda_opt's kernels cannot run: any head dim, no kernel launched."""

    def prepare(self, args):
        return _ReferenceSlice(args)

    def merge(self, h, M, v_first):
        return reference.merge(h, M, v_first)

    def forward(self, args, initial_state):
        return _ReferenceSlice(args).ends(initial_state)


class _ReferenceSlice:
    """ReferenceEngine's prepared slice: nothing is computed before a start is given."""

    def __init__(self, args):
        self.args = args

    def ends(self, initial_state=None):
        return reference.reference_forward(**self.args, initial_state=initial_state, output_final_state=True)

    def transition(self):
        q, v = self.args["q"], self.args["v"]
        K, HV = q.shape[-1], v.shape[2]
        cu_seqlens = self.args.get("cu_seqlens")
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        units = torch.eye(K, dtype=torch.float64, device=q.device).expand(N, HV, K, K)
        call = {**self.args, "v": v.new_zeros(*v.shape[:3], K), "state_v_first": False}
        return reference.reference_forward(**call, initial_state=units, output_final_state=True)[1]


def kda_forward_cp(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *, cu_seqlens=None,
                   group=None, engine: Engine | None = None, **options):
    """kda_forward over sequences whose tokens are split, in order, across the ranks of `group` (None:
    the default group). Each rank passes its slice q, k [1, T_r, H, K], v [1, T_r, HV, V], g, beta
    (any T_r ≥ 1: no multiple of 64 is needed, as the chunks of a slice need not be those of the
    whole) and the same options (kda_forward's keyword arguments, without cu_seqlens_cpu, a state
    pool or checkpoints). Every rank must call it: it holds one all_gather (two with cu_seqlens).
    engine: how a slice is computed (Engine: kda_opt's).

    One sequence (cu_seqlens None): initial_state its [1, HV, K, V] ([1, HV, V, K] with
    state_v_first), read on rank 0 only (others pass None or anything); returns (o_r [1, T_r, HV, V],
    the sequence's final state on the last rank if output_final_state, else None).

    Packed sequences: cu_seqlens the [N + 1] boundaries over all ranks' tokens (FLA's convention:
    before the split; the same on every rank, read on the host), a sequence may cross ranks;
    initial_state [N, ...], the same on every rank (each row read by the rank where its sequence
    begins); returns (o_r, final states [N, ...] fp32 if output_final_state: the rows of the sequences
    that end on this rank, zeros in the others, so that their sum over the ranks holds them all)."""
    for name in ("cu_seqlens_cpu", "initial_state_indices", "initial_state_indices_cpu", "has_initial_state",
                 "checkpoints"):
        if options.get(name) is not None:
            raise ValueError(f"kda_forward_cp splits sequences across ranks: {name} is not supported")
    if q.shape[0] != 1:
        raise ValueError(f"kda_forward_cp takes the sequences of one batch entry (B = 1), got B={q.shape[0]}")
    engine = engine or Engine()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    v_first = bool(options.get("state_v_first"))
    HV, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    part = _Part.one(rank, world) if cu_seqlens is None else _Part.of(cu_seqlens, _slices(q, group, world), rank)
    call = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, **options)
    if part.packed:
        cu = torch.tensor(part.cu_seqlens, dtype=torch.int32)
        call.update(cu_seqlens=cu.to(q.device), cu_seqlens_cpu=cu)
    here = engine.prepare(call)
    states = lambda first: _local_initial_states(part, initial_state, first, state_shape(1, HV, K, V, v_first))
    h = q.new_zeros(state_shape(1, HV, K, V, v_first), dtype=torch.float32)   # unused where nothing continues
    o = ends = None
    if not part.continued or part.continues:
        o, ends = here.ends(states(None))
        h = ends[-1:]
    M = here.transition()[-1:] if part.continued and part.continues and part.count == 1 else h.new_zeros((1, HV, K, K))
    gathered = _all_gather(torch.cat((h.float().flatten(), M.float().flatten())), group, world)   # h and M at once
    hs = [x[:h.numel()].view(h.shape) for x in gathered]
    Ms = [x[h.numel():].view(M.shape) for x in gathered]
    if part.continued:
        start = engine.merge(torch.cat(hs[part.origin:rank]), torch.cat(Ms[part.origin:rank])[1:], v_first)[-1:]
        o, ends = here.ends(states(start))
    if not output_final_state:
        return o, None
    if not part.packed:
        return o, ends.float() if rank == world - 1 else None
    final = ends.new_zeros((part.total, *ends.shape[1:]), dtype=torch.float32)
    done = part.count - 1 if part.continues else part.count      # the local sequences that end here
    final[part.first:part.first + done] = ends[:done].float()
    return o, final


class _Part(NamedTuple):
    """What of the sequences a rank holds (kda_forward_cp): its local sequences, global indices
    first .. first + count − 1 of total, their local bounds cu_seqlens (None: one sequence, not
    packed), whether the first began on an earlier rank (continued; origin: that rank) and whether the
    last ends on a later one (continues)."""
    packed: bool
    cu_seqlens: list[int] | None
    first: int
    count: int
    total: int
    continued: bool
    continues: bool
    origin: int

    @staticmethod
    def one(rank: int, world: int) -> "_Part":
        return _Part(False, None, 0, 1, 1, rank > 0, rank < world - 1, 0)

    @staticmethod
    def of(cu_seqlens: torch.Tensor, slices: list[int], rank: int) -> "_Part":
        """The part of packed sequences (global bounds cu_seqlens) that rank `rank` holds, the ranks'
        slices of the tokens being `slices` [world + 1] (their bounds)."""
        cu = [int(x) for x in cu_seqlens.tolist()]
        if cu[0] != 0 or cu[-1] != slices[-1] or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to the ranks' tokens together ({slices[-1]}), "
                             f"got {cu[:8]}{' ...' if len(cu) > 8 else ''}")
        owner = lambda t: min(bisect.bisect_right(slices, t) - 1, len(slices) - 2)   # the rank holding token t
        t0, t1 = slices[rank], slices[rank + 1]
        # Its sequences: those that meet its tokens, and the empty ones at a position it holds.
        mine = [n for n in range(len(cu) - 1)
                if cu[n] < t1 and cu[n + 1] > t0 or cu[n] == cu[n + 1] and owner(cu[n]) == rank]
        first, last = mine[0], mine[-1]
        bounds = [max(cu[n], t0) - t0 for n in mine] + [min(cu[last + 1], t1) - t0]
        return _Part(True, bounds, first, len(mine), len(cu) - 1, cu[first] < t0, cu[last + 1] > t1, owner(cu[first]))


def _slices(q, group, world) -> list[int]:
    """The bounds [world + 1] of the ranks' slices of the tokens, from each rank's T (one all_gather)."""
    sizes = _all_gather(torch.tensor([q.shape[1]], dtype=torch.int64, device=q.device), group, world)
    return [0, *itertools.accumulate(int(x) for x in torch.cat(sizes).tolist())]


def _local_initial_states(part: _Part, initial_state, first, like_shape):
    """A rank's local initial states: one sequence's as given (rank 0) or `first` (later ranks: None
    before the merge); packed, the rows of its sequences, the first replaced by `first` (zeros where
    None) if it is continued; None where no state is given and none is merged."""
    if not part.packed:
        return first if part.continued else initial_state
    if initial_state is None and (first is None or not part.continued):
        return None
    rows = initial_state[part.first:part.first + part.count].float() if initial_state is not None else \
        torch.zeros((part.count, *like_shape[1:]), dtype=torch.float32, device=first.device)
    if part.continued:
        rows = rows.clone()
        rows[0] = 0.0 if first is None else first[0]
    return rows


def _all_gather(x, group, world):
    """[x of rank 0, ..., x of rank W − 1]."""
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x, group=group)
    return out
