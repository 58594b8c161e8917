"""Host time per call (`--test host`, docs/BENCHMARKING.md): how long each system keeps the CPU to
enqueue one call, for the calls an engine makes at sizes where that time, not the GPU's, bounds a
layer (Kimi-Linear calls KDA once per layer; prefill steps usually run outside CUDA graphs).

    host ms    wall time of CALLS calls back to back without synchronising, per call (their GPU work
               is shorter, so the GPU waits on the host), the median of REPEATS such runs, the
               systems taking turns (common.host_ms)
    eager ms   the call's median time (do_bench) as launched, for kda_opt
    graph ms   the same call replayed from a CUDA graph (common.graph_ms): eager / graph is what the
               host costs the GPU
Systems: kda_opt called directly (kda_forward, kda_decode); FLA's own function (fla), and the same
function with kda_opt registered in FLA (`use_in_fla`), which FLA's dispatch then sends the call to
(via_fla); FLA's KDA layer's function of that name (via_layer: `fla.layers.kda`'s, which use_in_fla
points at kda_opt past the dispatch; flash-linear-attention installed); the FLA columns set
FLA_KDA_OPT around each call (common.system), so that they pay the same for it; FlashKDA.
Rows: HOST_CALLS, prefill calls at Kimi-Linear's H = 32, K = V = 128, bf16, an fp32 initial state;
DECODE_CALLS, the decode call FLA's KDA layer makes (fused_recurrent_kda: its bf16 A_log and
dt_bias, the softplus gate, an fp32 V-first state in, the final state out). A system that does not
make a row's call as it is leaves its cell empty. Every call runs under torch.inference_mode(), as a
serving engine runs its model. Written to <out-dir>/host_<gpu>.csv.
"""
import importlib

import torch

from kda_opt import fla_backend

from . import peers, serving
from .common import NOT_RUN, Case, graph_ms, host_ms, progress, show, system, write_rows
from .inputs import draw_call

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
# (row name, requests, packed): B requests of one token each, or packed along T with cu_seqlens (the
# layer's call on a left-padded batch).
DECODE_CALLS = [("decode B=2, FLA's layer call", 2, False), ("decode B=64, FLA's layer call", 64, False),
                ("decode B=2 packed (cu_seqlens)", 2, True)]
FIELDS = ["call", "kda_opt_host_ms", "fla_host_ms", "via_fla_host_ms", "via_layer_host_ms", "flashkda_host_ms",
          "kda_opt_eager_ms", "kda_opt_graph_ms"]


def through_fla(function, args) -> dict:
    """{"fla": FLA's own `function` on args, "via_fla": the same sent to kda_opt by FLA's dispatch,
    "via_layer": FLA's KDA layer's function of that name (where flash-linear-attention is installed)}."""
    def run(name, f=function):
        def call():
            with system(name):
                return f(**args)
        return call
    runs = {"fla": run("fla"), "via_fla": run("kda_opt")}
    try:
        layer = getattr(importlib.import_module(fla_backend.LAYER), function.__name__, None)
    except ImportError:
        layer = None
    if layer is not None:
        runs["via_layer"] = run("kda_opt", layer)
    return runs


def decode_calls(B: int, packed: bool, kda_decode) -> dict:
    """{system: call} for a decode row: kda_decode, and FLA's fused_recurrent_kda (own and via_fla)."""
    from fla.ops.kda import fused_recurrent_kda
    a = draw_call(B, 1, H, K, gate="softplus", layout="kimi", initial_state=True)
    args = {n: a[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "use_qk_l2norm_in_kernel",
                              "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "state_v_first")}
    args.update(A_log=a["A_log"].bfloat16(), dt_bias=a["dt_bias"].bfloat16(), output_final_state=True)
    if packed:
        args.update({n: args[n].view(1, B, *args[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")},
                    cu_seqlens=torch.arange(B + 1, dtype=torch.int32, device=a["q"].device))
    return {"kda_opt": lambda: kda_decode(**args), **through_fla(fused_recurrent_kda, args)}


def calls(case: Case, extra: str, fla, kda_forward):
    """{system: call} for one row: kda_opt always, FLA (own and via_fla) and FlashKDA where they make
    the call as it is."""
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
    runs = {"kda_opt": lambda: kda_forward(**args), **through_fla(fla, args)}
    flashkda, _ = peers.flashkda(args)
    if flashkda:
        runs["flashkda"] = flashkda
    return runs


@torch.inference_mode()
def host_rows(fla, out_dir, quiet=False):
    """Measures every row of HOST_CALLS (a progress bar unless quiet), writes <out_dir>/host_<gpu>.csv and
    returns the rows."""
    from triton.testing import do_bench
    import kda_opt
    kda_opt.use_in_fla()
    rows = []
    for name, fields, extra in progress(HOST_CALLS + DECODE_CALLS, lambda c: c[0], quiet):
        if isinstance(fields, dict):
            case = Case(**{"B": 1, "H": H, "K": K, "gate": "safe", "lower_bound": -5.0, "dtype": torch.bfloat16,
                           "seed": 0, **fields})
            runs = calls(case, extra, fla, kda_opt.kda_forward)
        else:
            runs = decode_calls(fields, extra, kda_opt.kda_decode)
        for f in runs.values():   # JIT and FLA's autotuning stay out of the timings
            f()
        host = host_ms(runs)
        row = dict(call=name, kda_opt_host_ms=host["kda_opt"], fla_host_ms=host.get("fla", NOT_RUN),
                   via_fla_host_ms=host.get("via_fla", NOT_RUN), via_layer_host_ms=host.get("via_layer", NOT_RUN),
                   flashkda_host_ms=host.get("flashkda", NOT_RUN),
                   kda_opt_eager_ms=do_bench(runs["kda_opt"], return_mode="median"),
                   kda_opt_graph_ms=graph_ms(runs["kda_opt"]))
        show(row)
        rows.append(row)
    write_rows(rows, out_dir, "host", FIELDS)
    return rows
