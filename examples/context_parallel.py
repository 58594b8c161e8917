"""One long sequence, or packed sequences (--packed), split across processes with
kda_opt.distributed.kda_forward_cp, checked against the whole call computed in one process.

    torchrun --nproc-per-node 2 examples/context_parallel.py          GPUs (NCCL), kda_opt's kernels
    torchrun --nproc-per-node 3 examples/context_parallel.py --cpu    CPU (gloo), the float64 reference

Every rank builds the same inputs (one seed), keeps its slice of the tokens (slices of unequal length),
and calls kda_forward_cp; rank 0 gathers the outputs and compares them, and the final states (from
the last rank; packed, summed over the ranks, each from the rank where its sequence ends), with one
call over the whole sequence, and prints the relative errors.
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
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
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
            whole = (reference.reference_forward(**seq, initial_state=h0, output_final_state=True) if cpu
                     else kda_forward(**seq, initial_state=h0, output_final_state=True))
            print(f"{world} ranks, slices {[b - a for a, b in zip(bounds, bounds[1:])]} tokens"
                  f"{f', sequences of {LENGTHS}' if packed else ''}, "
                  f"{'CPU float64 reference' if cpu else 'kda_opt on ' + torch.cuda.get_device_name()}: "
                  f"o {reference.rel_err(o_all, whole[0]):.1e}, final state "
                  f"{reference.rel_err(final_all, whole[1]):.1e} (relative to one call over the sequence)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
