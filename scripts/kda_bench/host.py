"""Host time per call (`--test host`, docs/BENCHMARKING.md): how long each system keeps the CPU to
enqueue one call, for the calls an engine makes at sizes where that time, not the GPU's, bounds a
layer (Kimi-Linear calls KDA once per layer; prefill steps usually run outside CUDA graphs).

    host ms    wall time of CALLS calls back to back without synchronising, per call (their GPU work
               is shorter, so the GPU waits on the host), the median of REPEATS such runs, the
               systems taking turns (common.host_ms)
    eager ms   the call's median time (do_bench) as launched, for kda_opt
    graph ms   the same call replayed from a CUDA graph (common.graph_ms): eager / graph is what the
               host costs the GPU
Rows (HOST_CALLS): Kimi-Linear's H = 32, K = V = 128, bf16, an fp32 initial state; FLA and FlashKDA
where they make the call as it is (empty otherwise). Every call runs under torch.inference_mode(), as
a serving engine runs its model. Written to <out-dir>/host_<gpu>.csv.
"""
import torch

from . import peers, serving
from .common import NOT_RUN, Case, graph_ms, host_ms, progress, show, write_rows

H, K = 32, 128
# (row name, Case fields, what the call adds to the case's arguments): every configuration the
# benchmark knows, fixed-length and packed, packed with and without cu_seqlens_cpu, a state pool
# (serving, with and without initial_state_indices_cpu), checkpoints.
PACKED = (64,) * 8
HOST_CALLS = [
    ("default T=64", dict(T=64), "dense"),
    ("default (1, 2048, 16)", dict(T=2048, H=16), "dense"),
    ("flashkda T=64", dict(T=64, config="flashkda"), "dense"),
    ("flashkda T=1024", dict(T=1024, config="flashkda"), "dense"),
    ("flashkda 8x64 packed, cu_seqlens_cpu", dict(T=512, seqlens=PACKED, config="flashkda"), "dense"),
    ("flashkda 8x64 packed, no cu_seqlens_cpu", dict(T=512, seqlens=PACKED, config="flashkda"), "no host copy"),
    ("serving 8x64 state pool", dict(T=512, seqlens=PACKED, config="serving"), "pool"),
    ("serving 8x64 state pool, indices_cpu", dict(T=512, seqlens=PACKED, config="serving"), "pool, indices_cpu"),
    ("serving 8x64 checkpoints", dict(T=512, seqlens=PACKED, config="serving"), "pool, checkpoints"),
]
FIELDS = ["call", "kda_opt_host_ms", "fla_host_ms", "flashkda_host_ms", "kda_opt_eager_ms", "kda_opt_graph_ms"]


def calls(case: Case, extra: str, fla, kda_forward):
    """{system: call} for one row: kda_opt always, FLA and FlashKDA where they make the call as it is."""
    args = case.inputs()
    if extra == "no host copy":
        args.pop("cu_seqlens_cpu")
    if extra.startswith("pool"):
        pool, slots, has_state = serving.pool_of(args, case.seed)
        args = {**args, "initial_state": pool, "initial_state_indices": slots, "has_initial_state": has_state,
                "output_final_state": False}
        if "indices_cpu" in extra:
            args["initial_state_indices_cpu"] = slots.cpu()
        if "checkpoints" in extra:
            args["checkpoints"] = serving.checkpoint_buffer(pool, 1, case.T, slots.shape[0])
        return {"kda_opt": lambda: kda_forward(**args)}
    runs = {"kda_opt": lambda: kda_forward(**args), "fla": lambda: fla(**args)}
    flashkda, _ = peers.flashkda(args)
    if flashkda:
        runs["flashkda"] = flashkda
    return runs


@torch.inference_mode()
def host_rows(fla, out_dir, quiet=False):
    """Measures every row of HOST_CALLS (a progress bar unless quiet), writes <out_dir>/host_<gpu>.csv and
    returns the rows."""
    from triton.testing import do_bench
    from kda_opt import kda_forward
    rows = []
    for name, fields, extra in progress(HOST_CALLS, lambda c: c[0], quiet):
        case = Case(**{"B": 1, "H": H, "K": K, "gate": "safe", "lower_bound": -5.0, "dtype": torch.bfloat16,
                       "seed": 0, **fields})
        runs = calls(case, extra, fla, kda_forward)
        for f in runs.values():   # JIT and FLA's autotuning stay out of the timings
            f()
        host = host_ms(runs)
        row = dict(call=name, kda_opt_host_ms=host["kda_opt"], fla_host_ms=host.get("fla", NOT_RUN),
                   flashkda_host_ms=host.get("flashkda", NOT_RUN),
                   kda_opt_eager_ms=do_bench(runs["kda_opt"], return_mode="median"),
                   kda_opt_graph_ms=graph_ms(runs["kda_opt"]))
        show(row)
        rows.append(row)
    write_rows(rows, out_dir, "host", FIELDS)
    return rows
