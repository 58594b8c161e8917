"""Long sequences with few heads (`--test cp`, docs/BENCHMARKING.md): kda_forward as users call it
(parallel segments where the plan picks them, kda_opt/forward), the sequential path (time segments)
on the same inputs in the same process, FLA, and FlashKDA where it makes the call; medians of
do_bench, the systems in turns. Both configurations, with an fp32 initial state. Written to
<out-dir>/cp_<gpu>.csv (one GPU; `gpus` and `one_gpu_ms` are there for rows across GPUs).
"""
import torch

from . import peers
from .bench import NOT_RUN, Case, medians_in_turns, show, write_rows

CP_SHAPES = [(1, 65536, 16), (1, 131072, 8), (1, 262144, 4)]
FIELDS = ["gpus", "B", "T", "H", "config", "kda_opt_ms", "sequential_ms", "fla_ms", "flashkda_ms", "one_gpu_ms"]


def runs(args, fla, kda_forward):
    """{system: call} for one row: kda_forward, its sequential path, FLA, and FlashKDA where it runs."""
    from kda_opt.forward import RUN_TENSORS, run
    from kda_opt.plan import Tuning, make_plan
    sequential = make_plan(**args, tuning=Tuning(parallel=False))
    calls = {"kda_opt": lambda: kda_forward(**args),
             "sequential": lambda: run(sequential, **{n: args.get(n) for n in RUN_TENSORS}),
             "fla": lambda: fla(**args)}
    flashkda, _ = peers.flashkda(args)
    if flashkda:
        calls["flashkda"] = flashkda
    return calls


@torch.inference_mode()
def cp_rows(fla, out_dir, warmup=5, rep=30):
    """Measures every (shape, configuration) of CP_SHAPES, writes <out_dir>/cp_<gpu>.csv, returns the rows."""
    from kda_opt import kda_forward
    rows = []
    for B, T, H in CP_SHAPES:
        for config in ("default", "flashkda"):
            case = Case(B=B, T=T, H=H, K=128, gate="safe", lower_bound=-5.0, dtype=torch.bfloat16, seed=0,
                        config=config)
            ms = medians_in_turns(runs(case.inputs(), fla, kda_forward), warmup, rep)
            row = dict(gpus=1, B=B, T=T, H=H, config=config, kda_opt_ms=ms["kda_opt"], sequential_ms=ms["sequential"],
                       fla_ms=ms["fla"], flashkda_ms=ms.get("flashkda", NOT_RUN), one_gpu_ms=ms["kda_opt"])
            show(row)
            rows.append(row)
    write_rows(rows, out_dir, "cp", FIELDS)
    return rows
