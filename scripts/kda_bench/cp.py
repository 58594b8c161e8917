"""Long sequences with few heads (`--test cp`, docs/BENCHMARKING.md): kda_forward as users call it
(parallel segments where the plan picks them, kda_opt/forward), the sequential path (time segments)
on the same inputs in the same process, FLA, and FlashKDA where it makes the call; medians of
do_bench, the systems in turns. Both configurations, with an fp32 initial state. Written to
<out-dir>/cp_<gpu>.csv.

Across GPUs (`torchrun --nproc-per-node N scripts/test.py --test cp`): one sequence of CP_RANK_SHAPES
split evenly along T over the N ranks (kda_opt.distributed.kda_forward_cp), timed with every rank in
step, against the whole sequence on one GPU; rows with `gpus` = N and `one_gpu_ms`, merged into the
same CSV. o and the final state are checked against the one-GPU call, and the errors and the
collective's own time printed.
"""
import itertools
import os
import statistics
import time

import torch

from . import peers
from .common import NOT_RUN, Case, echo, gpu_tag, medians_in_turns, planned_call, progress, read_csv, show, write_table

CP_SHAPES = [(1, 65536, 16), (1, 131072, 8), (1, 262144, 4)]
# Across GPUs; the last, a Kimi-K3-class model's 12 heads a GPU (tensor-parallel shards).
CP_RANK_SHAPES = [(1, 524288, 32), (1, 1048576, 16), (1, 1048576, 12)]
SLICED = ("q", "k", "v", "g", "beta")                   # the per-token arguments a rank holds a slice of
FIELDS = ["gpus", "B", "T", "H", "config", "kda_opt_ms", "sequential_ms", "fla_ms", "flashkda_ms", "one_gpu_ms",
          "layers_ms"]


def runs(args, fla, kda_forward):
    """{system: call} for one row: kda_forward, its sequential path, FLA, and FlashKDA where it runs."""
    from kda_opt.plan import Tuning
    calls = {"kda_opt": lambda: kda_forward(**args), "sequential": planned_call(args, Tuning(parallel=False)),
             "fla": lambda: fla(**args)}
    flashkda, _ = peers.flashkda(args)
    if flashkda:
        calls["flashkda"] = flashkda
    return calls


@torch.inference_mode()
def cp_rows(fla, out_dir, warmup=5, rep=30, quiet=False):
    """Measures every (shape, configuration) of CP_SHAPES (a progress bar unless quiet), writes
    <out_dir>/cp_<gpu>.csv, returns the rows."""
    from kda_opt import kda_forward
    rows = []
    for (B, T, H), config in progress(list(itertools.product(CP_SHAPES, ("default", "flashkda"))), row_label, quiet):
        case = Case(B=B, T=T, H=H, K=128, gate="safe", lower_bound=-5.0, dtype=torch.bfloat16, seed=0,
                    config=config)
        ms = medians_in_turns(runs(case.inputs(), fla, kda_forward), warmup, rep)
        row = dict(gpus=1, B=B, T=T, H=H, config=config, kda_opt_ms=ms["kda_opt"], sequential_ms=ms["sequential"],
                   fla_ms=ms["fla"], flashkda_ms=ms.get("flashkda", NOT_RUN), one_gpu_ms=ms["kda_opt"],
                   layers_ms=NOT_RUN)
        show(row)
        rows.append(row)
    merge_rows(rows, os.path.join(out_dir, f"cp_{gpu_tag()}.csv"))
    return rows


def row_label(row):
    """A ((B, T, H), configuration) as the progress bar names it."""
    (B, T, H), config = row
    return f"B={B} T={T} H={H} {config}"


def merge_rows(rows, path):
    """rows into the CSV at `path`, in place of those of the same (gpus, B, T, H, config); the others
    (another GPU count's) kept."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    key = lambda r: (int(r["gpus"]), int(r["B"]), int(r["T"]), int(r["H"]), r["config"])
    kept = {key(r): r for r in read_csv(path)}
    kept.update({key(r): r for r in rows})
    write_table(sorted(kept.values(), key=key), path, FIELDS, defaults=dict(layers_ms=NOT_RUN))
    print(f"wrote {path}")


def in_step(fn, sync, group=None, device=None, rounds=5, iters=5, warmup=2):
    """fn's ms per call, every rank of `group` calling it in step (fn may hold a collective): the median
    over `rounds` of `iters` calls between synchronisations, after a barrier; the slowest rank's, on
    every rank. sync: waits for the device (torch.cuda.synchronize, or nothing on the CPU)."""
    import torch.distributed as dist
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        sync()
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3 / iters)
    return _slowest(statistics.median(times), group, device)


def _slowest(x, group, device):
    import torch.distributed as dist
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


@torch.inference_mode()
def cp_rank_rows(out_dir, shapes=CP_RANK_SHAPES, configs=("default", "flashkda"), engine=None, device=None,
                 head_dim=128, dtype=torch.bfloat16, group=None, path=None, rounds=10, layers=5, warmup=2,
                 quiet=False):
    """Every rank of `group` (torch.distributed, initialised) calls this: each (shape, configuration)
    split evenly along T over the ranks and timed with kda_forward_cp, against the whole sequence on
    one device (engine.forward: kda_forward on the GPU); rank 0 merges the rows into `path`
    (<out_dir>/cp_<gpu>.csv, merge_rows). Returns (rows, {(T, H, config): (o error, final-state
    error)}), the errors relative to the one-device call. engine: kda_opt.distributed's (its Engine
    unless given). A row that does not fit a rank's memory is skipped on every rank (_inputs_that_fit).
    kda_opt_ms and one_gpu_ms: one call, every rank starting it together, to the
    slowest rank's end (the median of `rounds`); layers_ms: per call of `layers` calls back to back,
    as a model's layers run, where rank 0 starts the next while the last rank finishes (the slices
    are causal: no rank waits for a later one). quiet: no progress bar (rank 0 draws one otherwise)."""
    import torch.distributed as dist
    from kda_opt.distributed import Engine, kda_forward_cp
    from kda_opt.reference import rel_err
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = device or torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    engine = engine or Engine()
    rows, errors = [], {}
    # The bar on rank 0 only: every rank's stderr reaches the same terminal under torchrun.
    for (B, T, H), config in progress(list(itertools.product(shapes, configs)), row_label, quiet or rank != 0):
        case = Case(B=B, T=T, H=H, K=head_dim, gate="safe", lower_bound=-5.0, dtype=dtype, seed=0, config=config)
        made = _inputs_that_fit(case, engine, device, group)
        if made is None:
            if rank == 0:
                echo(f"    {row_label(((B, T, H), config))}: skipped, out of memory on a rank (the whole "
                     "sequence on one device does not fit beside its inputs)")
            continue
        args, initial = made
        bounds = [T * r // world for r in range(world + 1)]
        mine = {n: x[:, bounds[rank]:bounds[rank + 1]] if n in SLICED else x for n, x in args.items()}
        split = lambda: kda_forward_cp(**mine, initial_state=initial, output_final_state=True, group=group,
                                       engine=engine)
        whole = lambda: engine.forward(args, initial)
        ms = in_step(split, sync, group, device, rounds, 1, warmup)
        layers_ms = in_step(split, sync, group, device, rounds, layers, 0)
        one_ms = in_step(whole, sync, group, device, rounds, 1, warmup)
        # The collective alone: kda_forward_cp's all_gather of each rank's fp32 state and transition.
        HV, K, V = args["v"].shape[2], head_dim, args["v"].shape[3]
        sent = torch.zeros(HV * K * (V + K), device=device)
        comm_ms = in_step(lambda: dist.all_gather([torch.empty_like(sent) for _ in range(world)], sent,
                                                  group=group),
                          sync, group, device, rounds, 1, warmup)
        (o, final), (o_all, final_all) = split(), whole()
        e_o = _slowest(rel_err(o, o_all[:, bounds[rank]:bounds[rank + 1]]), group, device)
        e_s = _slowest(rel_err(final, final_all) if rank == world - 1 else 0.0, group, device)
        errors[(T, H, config)] = (e_o, e_s)
        row = dict(gpus=world, B=B, T=T, H=H, config=config, kda_opt_ms=ms, sequential_ms=NOT_RUN, fla_ms=NOT_RUN,
                   flashkda_ms=NOT_RUN, one_gpu_ms=one_ms, layers_ms=layers_ms)
        rows.append(row)
        if rank == 0:
            show(row)
            echo(f"    {world} ranks {one_ms / ms:.2f}× one device, {one_ms / layers_ms:.2f}× back to back "
                 f"(the all_gather alone {comm_ms:.3f} ms); "
                 f"o {e_o:.1e}, final state {e_s:.1e} against the one-device call")
    if rank == 0:
        merge_rows(rows, path or os.path.join(out_dir, f"cp_{gpu_tag()}.csv"))
    return rows, errors


def _inputs_that_fit(case, engine, device, group):
    """(kda_forward's arguments without the state, the initial state) for `case` on every rank of
    `group`, or None on every rank where some rank ran out of memory making them or running the whole
    sequence once on its device (engine.forward: a row's largest working set, and before any
    collective, so that no rank is left waiting in one)."""
    try:
        args = case.inputs(device=device, draw_on=device)
        initial = args.pop("initial_state")
        args.pop("output_final_state")
        engine.forward(args, initial)
        made = (args, initial)
    except torch.OutOfMemoryError:
        made = None
    if made is None and device.type == "cuda":
        torch.cuda.empty_cache()
    return made if _slowest(0.0 if made else 1.0, group, device) == 0.0 else None


def main_across_ranks(out_dir, quiet=False):
    """`--test cp` under torchrun (WORLD_SIZE > 1): NCCL, one GPU per rank (LOCAL_RANK), cp_rank_rows
    (quiet: without its progress bar)."""
    import torch.distributed as dist
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    try:
        if dist.get_rank() == 0:
            print(f"# {dist.get_world_size()} × {torch.cuda.get_device_name()}, torch {torch.__version__}")
        cp_rank_rows(out_dir, quiet=quiet)
    finally:
        dist.destroy_process_group()
    return 0
