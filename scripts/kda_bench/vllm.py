"""--test vllm: vLLM 0.33's KDA calls as its layers make them, kda_opt's replacements (kda_opt/vllm)
against vLLM's own functions and FlashKDA (the kit's `flash_kda.fwd`, K3's prefill backend on Hopper)
on the same inputs -> <out-dir>/vllm_<gpu>.csv.

    prefill       chunk_kda_with_fused_gate (Kimi-Linear H 32 / 16 softplus, K3 H 12 / 24 bounded),
                  eager medians in turns (vLLM runs prefill outside CUDA graphs)
    decode        fused_recurrent_kda_packed_decode, CUDA graph replays (common.graph_ms, cold L2)
    spec_decode   fused_recurrent_kda with 2-4 drafts a request, graph replays

vLLM's compiled extensions do not load beside another torch: the Python copy of its kernels is
imported with K3's package `__init__` stood in for (`kernels`), which would import the whole K3 model.
"""
import importlib
import importlib.util
import os
import sys
import types

import torch

from .common import echo, gpu_tag, graph_ms, medians_in_turns, read_csv, write_rows

GRAPH_CALLS = 10
CALLS = ("prefill", "decode", "spec_decode")
FIELDS = ("call", "H", "requests", "tokens", "gate", "vllm_function", "vllm_ms", "flashkda_ms", "kda_opt_ms",
          "speedup", "speedup_flashkda", "taken", "max_rel_err")
# (call, H, gate, request lengths): Kimi-Linear's heads (softplus) and K3's shards (bounded).
ROWS = (
    ("prefill", 32, "softplus", [8192]), ("prefill", 16, "softplus", [8192]),
    ("prefill", 32, "softplus", [4096, 1024, 512, 256, 128, 64] + [1] * 16),
    ("prefill", 12, "bound", [8192]), ("prefill", 12, "bound", [32768]), ("prefill", 24, "bound", [8192]),
    ("prefill", 12, "bound", [6000, 700, 150] + [1] * 8), ("prefill", 24, "bound", [512] * 64),
    ("decode", 32, "softplus", [1]), ("decode", 32, "softplus", [1] * 32), ("decode", 32, "softplus", [1] * 128),
    ("decode", 32, "softplus", [1] * 512), ("decode", 12, "bound", [1] * 64), ("decode", 24, "bound", [1] * 256),
    ("spec_decode", 32, "softplus", [3] * 32), ("spec_decode", 12, "bound", [4] * 64),
    ("spec_decode", 24, "bound", [5] * 128),
)
BOUND = {"softplus": None, "bound": -5.0}
STABLE_OPS = "vllm._C_stable_libtorch"


def kernels():
    """vllm.models.kimi_k3.nvidia.ops.third_party.kda, vLLM's copy of FLA's KDA kernels, imported
    without running vllm/models/kimi_k3/__init__.py (the whole K3 model and most of vLLM's serving
    stack, ≈ 27 packages more): that package stood in for by a bare one over the same directory. On a
    GPU, vLLM's CUDA platform imports its compiled ops (`vllm._C_stable_libtorch`, built for vLLM's own
    torch), which none of these kernels calls: an empty module stands in where it does not load."""
    stand_in_compiled_ops()
    name = "vllm.models.kimi_k3"
    if name not in sys.modules:
        root = os.path.dirname(importlib.util.find_spec("vllm").origin)
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, "models", "kimi_k3")]
        importlib.import_module("vllm.models")
        sys.modules[name] = package
    return importlib.import_module(name + ".nvidia.ops.third_party.kda")


def stand_in_compiled_ops():
    """An empty `vllm._C_stable_libtorch` where vLLM's own does not load (kernels' docstring)."""
    try:
        importlib.import_module(STABLE_OPS)
    except ImportError:
        sys.modules[STABLE_OPS] = types.ModuleType(STABLE_OPS)


def inputs(call, H, gate, lens, seed=0, K=128):
    """The tensors of one vLLM call: packed tokens (q, k, v, raw gate, β logits), A_log as the Kimi layer
    initialises it, dt_bias, and a V-first fp32 pool with one slot per request (slot 0 reserved)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, N = sum(lens), len(lens)
    x = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=gen, device="cuda")).bfloat16()
    q, k, v = x(1, T, H, K), x(1, T, H, K), x(1, T, H, K)
    A_log = torch.empty(H, device="cuda").uniform_(1, 16, generator=gen).log()
    return dict(q=q, k=k, v=v, raw_g=x(1, T, H, K), raw_beta=x(1, T, H), A_log=A_log,
                dt_bias=0.5 * torch.randn(H * K, generator=gen, device="cuda"),
                lower_bound=BOUND[gate], cu_seqlens=torch.tensor([0, *lens], device="cuda").cumsum(0).int(),
                pool=0.05 * torch.randn(N + 1, H, K, K, generator=gen, device="cuda"),
                slots=torch.arange(1, N + 1, device="cuda"))


def _flashkda(a):
    """FlashKDA's call on a prefill row (its bounded gate only), or None."""
    if a["lower_bound"] is None or importlib.util.find_spec("flash_kda") is None:
        return None
    import flash_kda
    H, K = a["q"].shape[2:]
    out, h0 = torch.empty_like(a["v"]), a["pool"][a["slots"].long()]
    final, cu64 = torch.empty_like(h0), a["cu_seqlens"].long()
    return lambda: flash_kda.fwd(a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], K ** -0.5, out, a["A_log"],
                                 a["dt_bias"].view(H, K), a["lower_bound"], initial_state=h0, final_state=final,
                                 cu_seqlens=cu64) or out


def _callers(call, a, own, ours):
    """{system: () -> o} for one row: vLLM's function and kda_opt's replacement on the same inputs,
    each on a pool of its own (decode rows write it)."""
    def prefill(f):
        h0, out = a["pool"][a["slots"].long()], torch.empty_like(a["v"])
        return lambda: f(a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"],
                         initial_state=h0, output_final_state=True, lower_bound=a["lower_bound"],
                         use_qk_l2norm_in_kernel=True, cu_seqlens=a["cu_seqlens"], out=out)[0]

    def decode(f):
        pool, B = a["pool"].clone(), a["q"].shape[1]
        mixed = torch.cat([a[n].reshape(B, -1) for n in ("q", "k", "v")], dim=-1)
        return lambda: f(mixed, a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"], a["lower_bound"], pool,
                         a["slots"])[0]

    def spec_decode(f):
        pool, lens = a["pool"].clone(), a["cu_seqlens"].diff()
        S, N = int(lens.max()), lens.shape[0]
        slots = torch.arange(1, N * S + 1, device="cuda").view(N, S)
        pool = pool.new_zeros((N * S + 1, *pool.shape[1:]))
        accepted = torch.ones(N, dtype=torch.int32, device="cuda")
        return lambda: f(a["q"], a["k"], a["v"], a["raw_g"], a["raw_beta"], a["A_log"], a["dt_bias"],
                         a["lower_bound"], pool, a["cu_seqlens"], slots, num_accepted_tokens=accepted)[0]
    make = {"prefill": prefill, "decode": decode, "spec_decode": spec_decode}[call]
    return {"vllm": make(own), "kda_opt": make(ours)}


def taken(plugin, call, N):
    """Whether the plugin, at its defaults, runs kda_opt on a row's call (on Hopper, bf16, D 128)."""
    return {"prefill": True, "decode": N >= plugin.PACKED_DECODE_FROM, "spec_decode": plugin.TAKES_SPEC_DECODE}[call]


def vllm_rows(out_dir, warmup=25, rep=100, quiet=False, calls=CALLS):
    """The ROWS rows of `calls`: vLLM's function, FlashKDA (bounded prefill rows) and kda_opt's
    replacement (kda_opt's side run on every row, whatever the plugin takes: `taken`), written row by
    row to <out_dir>/vllm_<gpu>.csv beside its rows of the other calls."""
    from kda_opt import vllm as plugin
    from kda_opt.reference import rel_err
    module = kernels()
    names = {"prefill": "chunk_kda_with_fused_gate", "decode": "fused_recurrent_kda_packed_decode",
             "spec_decode": "fused_recurrent_kda"}
    makers = {"prefill": plugin.prefill, "decode": plugin.packed_decode, "spec_decode": plugin.spec_decode}
    earlier = [r for r in read_csv(os.path.join(out_dir, f"vllm_{gpu_tag()}.csv")) if r["call"] not in calls]
    rows = []
    for call, H, gate, lens in (r for r in ROWS if r[0] in calls):
        a = inputs(call, H, gate, lens)
        own = getattr(module, names[call])
        runs = _callers(call, a, own, makers[call](own))
        if call != "prefill":    # kda_opt's side on every row, whatever the plugin takes
            every = plugin.packed_decode(own, from_requests=1) if call == "decode" else plugin.spec_decode(own, True)
            runs["kda_opt"] = _callers(call, a, own, every)["kda_opt"]
        err = rel_err(runs["kda_opt"](), runs["vllm"]())
        if call == "prefill":
            fk = _flashkda(a)
            if fk is not None:
                runs["flashkda"] = fk
            ms = medians_in_turns(runs, warmup, rep)
        else:
            ms = {s: graph_ms(f, GRAPH_CALLS, cold=True) for s, f in runs.items()}
        row = dict(call=call, H=H, requests=len(lens), tokens=sum(lens), gate=gate, vllm_function=names[call],
                   vllm_ms=ms["vllm"], flashkda_ms=ms.get("flashkda"), kda_opt_ms=ms["kda_opt"],
                   speedup=ms["vllm"] / ms["kda_opt"],
                   speedup_flashkda=ms["flashkda"] / ms["kda_opt"] if "flashkda" in ms else None,
                   taken=taken(plugin, call, len(lens)), max_rel_err=err)
        rows.append(row)
        if not quiet:
            echo("  " + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        order = lambda r: [(c, h, g, len(n), sum(n)) for c, h, g, n in ROWS].index(
            (r["call"], int(r["H"]), r["gate"], int(r["requests"]), int(r["tokens"])))
        write_rows(sorted(earlier + rows, key=order), out_dir, "vllm", FIELDS)
    return rows

