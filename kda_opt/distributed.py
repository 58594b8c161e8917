"""Context parallel over torch.distributed: one long sequence split along T across the ranks of a
process group, each rank holding its slice (kda_opt/forward, "Parallel segments", across ranks).

    rank r holds tokens [t_r, t_{r+1}) of the sequence: q, k, v, g, beta [1, T_r, ...]
    0. stages 1–3 over its slice, once (they do not depend on the state)
    1. rank 0: its o and final state h_0 from the sequence's initial state; 0 < r < W − 1: its final
       state h_r from zero and its transition M_r (kda_opt/forward.Prepared); the last rank: nothing
    2. all_gather of h and M over the group (fp32: HV·K·(V + K) numbers per rank)
    3. its start S_{r−1} = merge(h_0 .. h_{r−1}, M_1 .. M_{r−1}) in float64 (kda_opt/forward.merge)
    4. r > 0: o_r from that start, and on the last rank the sequence's final state
Stage 4 runs over a slice once on rank 0 and on the last rank, three times on the others; the
collective is one all_gather of two small tensors. The last rank's stages 1–3 run while rank 0
computes h_0, so two ranks take about rank 0's call plus the last rank's stage 4.
"""
import torch
import torch.distributed as dist

from . import forward, reference
from .options import state_shape


class Engine:
    """How a rank computes on its slice: prepare(kda_forward's arguments) runs what does not depend
    on the start and returns an object whose ends(initial_state) gives (o, final state) and whose
    transition() gives the slice's transition. This one is kda_opt's (forward.Prepared), on the GPU."""

    def prepare(self, args):
        return forward.Prepared(**args)

    def forward(self, args, initial_state):
        """The whole call on one device, as a user makes it: (o, final state)."""
        return forward.kda_forward(**args, initial_state=initial_state, output_final_state=True)


class ReferenceEngine(Engine):
    """Each slice by the float64 recurrence (kda_opt/reference), on any device, the CPU too: its (o,
    final state) from a start, its transition as the final state of v = 0 over K state columns from
    I. For checking a setup (the collective, the split) where kda_opt's kernels cannot run."""

    def prepare(self, args):
        return _ReferenceSlice(args)

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
        units = torch.eye(K, dtype=torch.float64, device=q.device).expand(1, HV, K, K)
        call = {**self.args, "v": v.new_zeros(*v.shape[:3], K), "state_v_first": False}
        return reference.reference_forward(**call, initial_state=units, output_final_state=True)[1]


def kda_forward_cp(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *, group=None,
                   engine: Engine | None = None, **options):
    """kda_forward over one sequence whose tokens are split, in order, across the ranks of `group`
    (None: the default group). Each rank passes its slice q, k [1, T_r, H, K], v [1, T_r, HV, V], g,
    beta (any T_r ≥ 1: no multiple of 64 is needed, as the chunks of a slice need not be those of the
    whole) and the same options (kda_forward's keyword arguments, without cu_seqlens, a state pool or
    checkpoints). initial_state: the sequence's [1, HV, K, V] ([1, HV, V, K] with state_v_first), read
    on rank 0 only (others pass None or anything). Returns (o_r [1, T_r, HV, V], the sequence's final
    state on the last rank if output_final_state, else None). Every rank must call it: it holds one
    all_gather. engine: how a slice is computed (Engine: kda_opt's)."""
    for name in ("cu_seqlens", "cu_seqlens_cpu", "initial_state_indices", "initial_state_indices_cpu",
                 "has_initial_state", "checkpoints"):
        if options.get(name) is not None:
            raise ValueError(f"kda_forward_cp takes one sequence split across ranks: {name} is not supported")
    if q.shape[0] != 1:
        raise ValueError(f"kda_forward_cp takes one sequence (B = 1) split across ranks, got B={q.shape[0]}")
    engine = engine or Engine()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    v_first = bool(options.get("state_v_first"))
    HV, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    here = engine.prepare(dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, **options))
    h = q.new_zeros(state_shape(1, HV, K, V, v_first), dtype=torch.float32)   # the last rank's: unused
    if rank == 0:
        o, h = here.ends(initial_state)
    elif rank < world - 1:
        _, h = here.ends(None)
    M = here.transition() if 0 < rank < world - 1 else h.new_zeros((1, HV, K, K))
    hs = _all_gather(h.float().contiguous(), group, world)
    Ms = _all_gather(M.float().contiguous(), group, world)
    if rank > 0:
        start = forward.merge(torch.cat(hs[:rank]), torch.cat(Ms[:rank])[1:], v_first)[-1:]
        o, h = here.ends(start)
    final = h.float() if output_final_state and rank == world - 1 else None
    return o, final


def _all_gather(x, group, world):
    """[x of rank 0, ..., x of rank W − 1]."""
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x, group=group)
    return out
