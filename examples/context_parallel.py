"""One long sequence, or packed sequences (--packed), split across processes with
kda_opt.distributed.kda_forward_cp, checked against the float64 recurrence over the whole input.

    torchrun --nproc-per-node 2 examples/context_parallel.py          GPUs, kda_opt's kernels (NCCL with a
                                                                      GPU per rank, else gloo, ranks sharing them)
    torchrun --nproc-per-node 3 examples/context_parallel.py --cpu    CPU (gloo), the float64 reference

Every rank builds the same inputs (one seed), keeps its slice of the tokens (slices of unequal length),
and calls kda_forward_cp; rank 0 gathers the outputs and the final states (from the last rank;
packed, summed over the ranks, each from the rank where its sequence ends) and prints their relative
errors against the float64 recurrence, beside those of one kda_forward call over the whole input (GPUs).
"""
import argparse
import os

import torch
import torch.distributed as dist

from kda_opt import kda_forward, reference
from kda_opt.distributed import ReferenceEngine, kda_forward_cp

T, H, K = 4096, 4, 128
LENGTHS = (700, 0, 1900, 300, 1196)      # --packed: sequences of these lengths (T in all), some crossing ranks


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, each slice by the float64 reference")
    parser.add_argument("--packed", action="store_true", help=f"sequences of {LENGTHS} tokens packed along T")
    args = parser.parse_args()
    cpu, packed = args.cpu, args.packed
    # NCCL takes a GPU per rank; with fewer GPUs than ranks, gloo (through the host) lets them share.
    shared = not cpu and torch.cuda.device_count() < int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo" if cpu or shared else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu") if cpu else torch.device("cuda", local % torch.cuda.device_count())
    if not cpu:
        torch.cuda.set_device(device)
    dtype = torch.float64 if cpu else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    k = randn(1, T, H, K)
    seq = dict(q=randn(1, T, H, K), k=k / k.norm(dim=-1, keepdim=True), v=randn(1, T, H, K),
               g=-0.02 * torch.rand(1, T, H, K, generator=gen), beta=torch.rand(1, T, H, generator=gen))
    seq = {n: x.to(device, dtype) for n, x in seq.items()}
    N = len(LENGTHS) if packed else 1
    h0 = randn(N, H, K, K).to(device)
    if packed:
        seq["cu_seqlens"] = torch.tensor([0, *LENGTHS], device=device).cumsum(0)
    # Slices of unequal lengths, in order (rank r holds tokens bounds[r] .. bounds[r + 1] − 1).
    bounds = [T * r * (r + 3) // (world * (world + 3)) for r in range(world + 1)]
    mine = {n: x[:, bounds[rank]:bounds[rank + 1]].contiguous() if n != "cu_seqlens" else x for n, x in seq.items()}
    engine = ReferenceEngine() if cpu else None
    with torch.inference_mode():
        o, final = kda_forward_cp(**mine, initial_state=h0 if rank == 0 or packed else None,
                                  output_final_state=True, engine=engine)
        # all_gather takes equal shapes: each slice padded to the longest.
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        mine_o = torch.cat([o, o.new_zeros((1, longest - o.shape[1], *o.shape[2:]))], dim=1)
        outs = [torch.empty_like(mine_o) for _ in range(world)]
        dist.all_gather(outs, mine_o)
        finals = [torch.empty(N, H, K, K, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(finals, (final if final is not None else h0.new_zeros(N, H, K, K)).double())
        final_all = sum(finals) if packed else finals[-1]
        if rank == 0:
            o_all = torch.cat([x[:, :b - a] for x, a, b in zip(outs, bounds, bounds[1:])], dim=1)
            truth = reference.reference_forward(**seq, initial_state=h0, output_final_state=True)
            errors = lambda o, s: (reference.rel_err(o, truth[0]), reference.rel_err(s, truth[1]))
            split = errors(o_all, final_all)
            where = "CPU float64 reference" if cpu else f"kda_opt on {torch.cuda.get_device_name()}"
            print(f"{world} ranks, slices {[b - a for a, b in zip(bounds, bounds[1:])]} tokens"
                  f"{f', sequences of {LENGTHS}' if packed else ''}, {where}"
                  f"{' (ranks sharing GPUs, gloo)' if shared else ''}; against the float64 recurrence: "
                  f"o {split[0]:.1e}, final state {split[1]:.1e}", end="")
            if not cpu:   # one call's own error, for scale
                one = errors(*kda_forward(**seq, initial_state=h0, output_final_state=True))
                print(f" (one call over the sequence: o {one[0]:.1e}, final state {one[1]:.1e})", end="")
            print()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
