"""SGLang's KDA calls through kda_opt's kernel and SGLang's own (`--test sglang`, docs/BENCHMARKING.md):
the calls SGLang's KDA backend makes (sglang 0.5.23, `kda_backend.py`), built here as it builds them,
through kda_opt.sglang's KdaOptKDAKernel and SGLang's TritonKDAKernel (the oracle and the peer),
SGLang's FlashKDAKernel where flash_kda is importable, and SGLang's HelionKDAKernel (its Helion prefill,
packed decode and verify, `--linear-attn-{prefill,decode,verify}-backend helion`) where helion is.

    extend         requests packed along T (query_start_loc), raw q/k (L2 norm in kernel), raw gate with
                   A_log [1, 1, H, 1] = log U(1, 16) and dt_bias [H·K] ~ N(0, 1) (fast decay), β logits;
                   an fp32 pool [slots, H, V, K] read and written in place by cache_indices: every other
                   request new (its row zeros, as SGLang hands a new request), one padding request (−1)
                   where asked
    decode         one token per request, a [N, H·K] gate, two padding requests (−1) from 3 requests: K3's decode
    packed_decode  the same step with q, k, v still packed in the short convolution's output
                   mixed_qkv [N, 3·H·K]: Kimi-Linear's decode on Hopper, and K3's where the kernel says
                   supports_packed_decode_safe_gate (kda_opt's does; SGLang's runs its CUDA row-streaming
                   kernel from 8 requests, its Triton one below)
    verify         chain verify: `draft` tokens per request, each token's state into
                   intermediate_states_buffer[request, t], the pool only read
    tree_verify    the same with a tree of draft tokens (EAGLE's topk > 1): retrieve_parent_token [N, draft],
                   token t > 0 from the state after a parent drawn among tokens 0 .. t − 1
    decode_step    the whole decode step, SGLang's `KDAAttnBackend.forward_decode` (its own code) on the
                   packed decode's tensors before the short convolution: mixed_qkv, the conv window
                   [slots, 3, 3·H·K] and weights [3·H·K, 4] in bf16; SGLang's convolution update and
                   its kernel's packed decode against the plugin's hook around it (kda_conv_decode)
Kimi-Linear's calls take the softplus gate (no lower bound), K3's the safe gate (lower bound −5).
Rows: `call, H, requests, tokens, gate, sglang_kernel, timing, sglang_ms, kda_opt_ms, speedup, taken,
sglang_flashkda_ms, sglang_helion_ms, helion_max_rel_err, max_rel_err, untouched_ok, kda_opt_unfused_ms` to
<out-dir>/sglang_<gpu>.csv (helion_max_rel_err: SGLang's Helion kernel against its Triton kernel, as
max_rel_err is kda_opt's). sglang_kernel: the
TritonKDAKernel method and the kernel it ran on the row's call; timing: `eager` (extend: do_bench
medians in turns, host included) or `graph` (decode and verify as servers run them: GRAPH_CALLS
steps replayed from one CUDA graph, the L2 cache written between steps, common.graph_ms); taken:
whether the plugin, at its defaults, runs kda_opt on the call (here it runs every call itself);
max_rel_err: kda_opt against SGLang's kernel, the largest of o's (a decode's live requests') and the
named pool (or buffer) rows' relative errors; untouched_ok: every pool row not named left bit for bit
as it was (both kernels; a decode step's conv windows bit for bit alike); kda_opt_unfused_ms (decode
steps): SGLang's convolution update and kda_opt's kernel, the step without the plugin's hook.
"""
import functools
import os
from unittest import mock

import torch

from .common import NOT_RUN, gpu_tag, graph_ms, host_ms, medians_in_turns, progress, read_csv, show, write_rows

K = 128
GATES = {"softplus": None, "safe": -5.0}
# (call, H, requests, tokens per step, gate): Kimi-Linear (softplus, 32 / 16 / 8 heads a GPU at TP 1 / 2 /
# 4; its packed decode also at 4, TP 8) and K3 (safe, 24 / 12 heads at TP 4 / 8) at chunked-prefill sizes,
# decode at 32 to 512 requests (K3's split, as SGLang's own kernel takes it, and packed, where the plugin's
# supports_packed_decode_safe_gate sends it), chain verify of 2 and 4 draft tokens and tree verify of 4 and
# 8 at 64 requests.
ROWS = ([("extend", H, n, T, "softplus") for H in (32, 16, 8) for n, T in ((1, 2048), (4, 8192), (8, 32768))]
        + [("extend", H, n, T, "safe") for H in (24, 12) for n, T in ((1, 2048), (4, 8192), (8, 32768))]
        + [("packed_decode", H, n, n, "softplus") for H in (32, 8, 4) for n in (32, 128, 512)]
        + [("decode", H, n, n, "safe") for H in (24, 12) for n in (32, 128, 512)]
        + [("packed_decode", H, n, n, "safe") for H in (24, 12) for n in (32, 128, 512)]
        + [("verify", H, 64, draft * 64, gate) for H, gate in ((32, "softplus"), (12, "safe")) for draft in (2, 4)]
        + [("tree_verify", H, 64, draft * 64, gate) for H, gate in ((32, "softplus"), (12, "safe"))
           for draft in (4, 8)]
        + [("decode_step", H, n, n, gate) for H, gate in ((32, "softplus"), (24, "safe"), (12, "safe"))
           for n in (1, 8, 32, 64, 128, 512)])
FIELDS = ["call", "H", "requests", "tokens", "gate", "sglang_kernel", "timing", "sglang_ms", "kda_opt_ms", "speedup",
          "taken", "sglang_flashkda_ms", "sglang_helion_ms", "helion_max_rel_err", "max_rel_err", "untouched_ok",
          "kda_opt_unfused_ms"]
# The calls SGLang's HelionKDAKernel runs with Helion kernels of its own (its decode goes to its Triton
# fallback).
HELION_CALLS = ("extend", "packed_decode", "verify", "tree_verify", "decode_step")
GRAPH_CALLS = 10     # steps per CUDA graph in a decode or verify row's time
# The TritonKDAKernel method SGLang's backend calls for each call, and the kernel it runs there.
METHODS = {"extend": "extend", "decode": "decode", "packed_decode": "packed_decode", "verify": "target_verify",
           "tree_verify": "target_verify", "decode_step": "packed_decode"}
SGLANG_KERNELS = {"extend": "Triton chunk_kda", "decode": "Triton fused_sigmoid_gating_delta_rule_update",
                  "verify": "Triton fused_sigmoid_gating_delta_rule_update",
                  "tree_verify": "Triton fused_sigmoid_gating_delta_rule_update",
                  "packed_decode": "Triton fused_recurrent_kda_packed_decode",
                  "decode_step": "Triton fused_recurrent_kda_packed_decode"}
CUDA_PACKED = "CUDA kda_packed_decode"
VERIFY = ("verify", "tree_verify")
ONE_TOKEN = ("decode", "packed_decode", "decode_step")


def lengths(requests: int, tokens: int, seed: int = 0) -> list[int]:
    """`requests` lengths summing to `tokens`, unequal (a lognormal draw), none shorter than 1."""
    if requests == 1:
        return [tokens]
    gen = torch.Generator().manual_seed(seed)
    w = torch.empty(requests).log_normal_(0.0, 1.0, generator=gen)
    lens = (w / w.sum() * (tokens - requests)).floor().long() + 1
    lens[0] += tokens - int(lens.sum())
    return lens.tolist()


def step(call: str, H: int, lens: list[int], gate: str, *, pad: bool = False, draft: int = 4, seed: int = 0,
         device: str = "cuda") -> dict:
    """The arguments SGLang's KDA backend passes its kernel for one call (module docstring), as a dict
    with `call`: for extend, `lens` are the requests' lengths (pad: one more request of 100 tokens on
    slot −1); for the others, len(lens) is the number of requests. A packed decode's tensors are its
    decode's (the same seed), q, k, v as the one tensor they are views of."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)
    N = len(lens)
    one_token = call in ONE_TOKEN
    if one_token:
        lens = [1] * N
    if call in VERIFY:
        lens = [draft] * N
    if call == "extend" and pad:
        lens = [*lens, 100]
    T = sum(lens)
    slots = 2 * len(lens) + 8
    pool = randn(slots, H, K, K)
    index = torch.randperm(slots, generator=gen)[:len(lens)]
    if call == "extend":
        pool[index[1::2]] = 0                       # new requests: SGLang hands them a zeroed row
    if pad or one_token and N > 2:
        index[-2 if one_token else -1:] = -1
    qsl = torch.tensor([0, *lens]).cumsum(0)
    A_log = torch.empty(1, 1, H, 1).uniform_(1.0, 16.0, generator=gen).log()
    a = randn(T, H * K)
    # q, k, v split from the short convolution's one output, as SGLang's backend hands them on (views:
    # SGLang's Triton kernel writes o into a contiguous copy of v, never into the caller's tensor).
    mixed = randn(T, 3 * H * K).to(device, torch.bfloat16)
    q, k, v = (x.unflatten(-1, (H, K)).unsqueeze(0) for x in mixed.split(H * K, dim=-1))
    args = dict(beta=randn(1, T, H), A_log=A_log, dt_bias=randn(H * K), ssm_states=pool,
                cache_indices=index.int(), query_start_loc=qsl.int(), lower_bound=GATES[gate])
    if call == "extend":
        args.update(g=a.view(1, T, H, K), beta_is_raw=True, extend_seq_lens_cpu=lens)
    else:
        args.update(a=a)
    if call in VERIFY:
        parents = None
        if call == "tree_verify":     # token t's parent among 0 .. t − 1; token 0's (never read) −1
            parents = (torch.rand(N, draft, generator=gen) * torch.arange(draft)).long()
            parents[:, 0] = -1
        args.update(intermediate_states_buffer=torch.zeros(N + 1, draft, H, K, K),
                    intermediate_state_indices=torch.arange(N, dtype=torch.int32), cache_steps=draft,
                    retrieve_parent_token=parents)
    low = ("g", "a", "beta")
    args = {n: (x.to(device, torch.bfloat16 if n in low else None) if isinstance(x, torch.Tensor) else x)
            for n, x in args.items()}
    if call == "decode_step":
        channels = 3 * H * K
        return dict(call=call, mixed_qkv=mixed, a=args["a"], b=args["beta"], A_log=args["A_log"],
                    dt_bias=args["dt_bias"], lower_bound=args["lower_bound"], ssm_states=args["ssm_states"],
                    cache_indices=args["cache_indices"], conv_states=randn(slots, 3, channels).to(device, torch.bfloat16),
                    conv_weights=(randn(channels, 1, 4) / 2).to(device, torch.bfloat16).squeeze(1))
    if call == "packed_decode":
        return dict(call=call, mixed_qkv=mixed, a=args["a"], b=args["beta"][0], A_log=args["A_log"],
                    dt_bias=args["dt_bias"], scale=K ** -0.5, ssm_states=args["ssm_states"],
                    cache_indices=args["cache_indices"], num_v_heads=H, head_v_dim=K, lower_bound=args["lower_bound"])
    return {"call": call, "q": q, "k": k, "v": v, **args}


def arguments(call: dict) -> dict:
    """A step()'s arguments for its kernel method (all but `call`), in a dict of its own."""
    return {n: x for n, x in call.items() if n != "call"}


def run(kernel, call: dict):
    """Runs `call` (step) through `kernel`'s method for it on a copy of its pool (and buffer):
    (its result, the pool after, the buffer after or None)."""
    args = arguments(call)
    args["ssm_states"] = args["ssm_states"].clone()
    if call["call"] == "decode_step":
        args["conv_states"] = args["conv_states"].clone()
    if call["call"] in VERIFY:
        args["intermediate_states_buffer"] = args["intermediate_states_buffer"].clone()
    out = run_in_place(kernel, call["call"], args)
    return out, args["ssm_states"], args.get("intermediate_states_buffer", args.get("conv_states"))


def compare(ours, theirs, call: dict) -> tuple[float, bool]:
    """(largest relative error of kda_opt's kernel's run (run's result `ours`) against SGLang's
    (`theirs`) over o and the named pool or buffer rows, whether every pool row not named is left as
    it was by both; a decode step's: and both conv windows bit for bit alike). A decode's padding requests' o is left out: the caller drops it, and SGLang's
    kernels differ there (its CUDA packed kernel writes zeros, its Triton kernels the step from a zero
    state, as kda_opt does)."""
    from kda_opt.reference import rel_err
    (o, pool, buf), (o_ref, pool_ref, buf_ref) = ours, theirs
    o, o_ref = (x[0] if isinstance(x, tuple) else x for x in (o, o_ref))
    index = call["cache_indices"].long()
    if call["call"] in ONE_TOKEN:
        o, o_ref = o[:, index >= 0], o_ref[:, index >= 0]
    errors = [rel_err(o, o_ref)]
    named = index[index >= 0]
    if call["call"] in VERIFY:
        errors.append(rel_err(buf, buf_ref))
    else:
        errors.append(rel_err(pool[named], pool_ref[named]))
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    if call["call"] not in VERIFY:
        untouched[named] = False
    before = call["ssm_states"]
    same = all(torch.equal(p[untouched], before[untouched]) for p in (pool, pool_ref))
    if call["call"] == "decode_step":       # the conv windows: copies of inputs, so bit for bit alike
        same = same and torch.equal(buf, buf_ref)
    return max(errors), same


def flashkda_kernel():
    """SGLang's FlashKDAKernel where flash_kda is importable, else None."""
    try:
        import flash_kda  # noqa: F401
        from sglang.srt.layers.attention.linear.kernels.kda_flashkda import FlashKDAKernel
    except ImportError:
        return None
    return FlashKDAKernel()


def helion_kernel(triton):
    """SGLang's HelionKDAKernel over the TritonKDAKernel `triton` (its fallback) where helion is
    importable, else None."""
    import importlib.util
    if importlib.util.find_spec("helion") is None:
        return None
    from sglang.srt.layers.attention.linear.kernels.kda_helion import HelionKDAKernel
    return HelionKDAKernel(triton, enable_decode=True, enable_prefill=True)


def kernels():
    """(kda_opt's kernel, SGLang's Triton kernel): KdaOptKDAKernel and the TritonKDAKernel it replaces."""
    from kda_opt.sglang import kernel_class
    ours = kernel_class()
    return ours(), ours.__mro__[1]()


def calls_to(owner, name: str, f) -> tuple:
    """(f()'s result, whether it called owner's function `name`: spied on, and still run)."""
    with mock.patch.object(owner, name, autospec=True, side_effect=getattr(owner, name)) as spy:
        result = f()
    return result, spy.called


def taken(call: dict) -> bool:
    """Whether the plugin's kernel at its defaults runs kda_opt on `call` (step): its method did not
    hand the call to the TritonKDAKernel method it overrides; for a decode step, whether its hook ran
    the step as kda_conv_decode."""
    from kda_opt import sglang as plugin
    ours = plugin.kernel_class()
    if call["call"] == "decode_step":
        return calls_to(plugin, "kda_conv_decode", lambda: run(ours(), call))[1]
    return not calls_to(ours.__mro__[1], METHODS[call["call"]], lambda: run(ours(), call))[1]


def sglang_run(triton, call: dict) -> tuple:
    """(run(triton, call), `method: kernel`): SGLang's TritonKDAKernel `triton` on `call`, and the
    kernel it ran there: for packed decode its CUDA kernel where that kernel's `covered` took the
    call, else its Triton kernel."""
    kernel = SGLANG_KERNELS[call["call"]]
    if call["call"] not in ("packed_decode", "decode_step"):
        return run(triton, call), f"{METHODS[call['call']]}: {kernel}"
    from sglang.kernels.ops.attention import kda_packed_decode
    result, cuda = calls_to(kda_packed_decode, "kda_packed_decode", lambda: run(triton, call))
    return result, f"{METHODS[call['call']]}: {CUDA_PACKED if cuda else kernel}"


def timed(kernel, call: dict, fused: bool = True):
    """A step() of `call` through `kernel`, on the call's own pool (each run continues it); a decode
    step through the plugin's hook only where `fused` (decode_step)."""
    args = arguments(call)
    if call["call"] == "decode_step":
        step_call = decode_step(kernel, args, fused)
        return lambda: step_call(args["mixed_qkv"], args["a"], args["b"])
    return lambda: run_in_place(kernel, call["call"], args)


def decode_step(kernel, args: dict, fused: bool = True):
    """SGLang's own `KDAAttnBackend.forward_decode` with `kernel` as its decode kernel, on a
    decode_step's caches (args; step_backend): a function of (mixed_qkv, a, b) returning o, through the
    plugin's hook (kda_opt.sglang.forward_decode) where `fused`."""
    from kda_opt import sglang as plugin
    backend, layer, batch = step_backend(kernel, args)
    original = type(backend).forward_decode
    if fused:
        return lambda mixed_qkv, a, b: plugin.forward_decode(original, backend, layer, batch, mixed_qkv, a, b)
    return lambda mixed_qkv, a, b: original(backend, layer, batch, mixed_qkv, a, b)


def step_backend(kernel, args: dict):
    """(backend, layer, forward_batch) for SGLang's forward_decode on a decode_step's caches (args): a
    backend of sglang_backend_classes() holding what forward_decode reads (a dispatcher over `kernel`,
    a pool of one layer, the step's cache indices), a layer with RadixLinearAttention's attributes, and
    a batch without prefix-cache tracking."""
    from types import SimpleNamespace
    backend_class, dispatcher_class = sglang_backend_classes()
    dispatcher = dispatcher_class()
    dispatcher.decode_kernel = kernel
    dispatcher.supports_packed_decode = getattr(kernel, "supports_packed_decode", False)
    dispatcher.supports_packed_decode_safe_gate = getattr(kernel, "supports_packed_decode_safe_gate", False)
    cache = SimpleNamespace(conv=[args["conv_states"]], temporal=args["ssm_states"], replayssm_d=None,
                            replayssm_k=None, replayssm_g=None)
    backend = backend_class()
    backend.kernel_dispatcher = dispatcher
    backend.req_to_token_pool = SimpleNamespace(mamba2_layer_cache=lambda layer_id: cache)
    N = args["cache_indices"].shape[0]
    backend.forward_metadata = SimpleNamespace(
        query_start_loc=torch.arange(N + 1, dtype=torch.int32, device=args["mixed_qkv"].device),
        mamba_cache_indices=args["cache_indices"])
    H = args["ssm_states"].shape[1]
    layer = SimpleNamespace(layer_id=0, num_q_heads=H, num_k_heads=H, num_v_heads=H, head_q_dim=K, head_k_dim=K,
                            head_v_dim=K, q_dim=H * K, k_dim=H * K, v_dim=H * K, conv_weights=args["conv_weights"],
                            bias=None, activation="silu", A_log=args["A_log"], dt_bias=args["dt_bias"],
                            lower_bound=args["lower_bound"])
    return backend, layer, SimpleNamespace(mamba_track_mask=None)


@functools.cache
def sglang_backend_classes():
    """(backend, dispatcher): classes whose `forward_decode`, and `packed_decode` and `decode`, are SGLang's
    own `KDAAttnBackend.forward_decode` and `KDAKernelDispatcher` methods, compiled from its
    `kda_backend.py` unchanged but for their type annotations: that module imports SGLang's model
    runner (transformers, torchvision and the rest of a server), these functions only the kernels
    given them here. The backend's `_track_mamba_state_decode` does what SGLang's does without
    prefix-cache tracking (forward_batch.mamba_track_mask None): nothing."""
    import ast
    import importlib.util

    from sglang.kernels.ops.attention import kda_fused_decode
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel
    from sglang.srt.utils.common import is_gfx95_supported, rank0_log
    path = os.path.join(importlib.util.find_spec("sglang").submodule_search_locations[0],
                        "srt", "layers", "attention", "linear", "kda_backend.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    wanted = {"KDAAttnBackend": ("forward_decode",), "KDAKernelDispatcher": ("packed_decode", "decode")}
    functions = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in wanted:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name in wanted[node.name]:
                    for arg in ast.walk(f.args):
                        if isinstance(arg, ast.arg):
                            arg.annotation = None
                    f.returns = None
                    functions.append((node.name, f))
    namespace = dict(torch=torch, causal_conv1d_update=causal_conv1d_update, kda_fused_decode=kda_fused_decode,
                     is_gfx95_supported=is_gfx95_supported, rank0_log=rank0_log, TritonKDAKernel=TritonKDAKernel)
    exec(compile(ast.Module([f for _, f in functions], []), path, "exec"), namespace)
    methods = {name: {f.name: namespace[f.name] for owner, f in functions if owner == name} for name in wanted}
    backend = type("KDAAttnBackend", (), {**methods["KDAAttnBackend"],
                                           "_track_mamba_state_decode": lambda self, *args: None})
    namespace["KDAAttnBackend"] = backend
    return backend, type("KDAKernelDispatcher", (), methods["KDAKernelDispatcher"])


def run_in_place(kernel, name: str, args: dict):
    """`kernel`'s method for the call `name` on `args` (step's, without `call`), as SGLang's backend
    calls it: verify by keyword, the others' tensors positionally and the rest by keyword; a decode
    step through SGLang's backend (decode_step)."""
    a = dict(args)
    if name == "decode_step":
        return decode_step(kernel, a)(a["mixed_qkv"], a["a"], a["b"])
    if name in VERIFY:
        a["b"] = a.pop("beta")
        return kernel.target_verify(**a)
    if name == "packed_decode":
        return kernel.packed_decode(**a)
    gate = a.pop("g" if name == "extend" else "a")
    method = kernel.extend if name == "extend" else kernel.decode
    return method(a.pop("q"), a.pop("k"), a.pop("v"), gate, a.pop("beta"), **a)


@torch.inference_mode()
def sglang_rows(out_dir, warmup=25, rep=100, quiet=False, calls=tuple(METHODS)):
    """Measures the rows of ROWS whose call is among `calls` (a progress bar unless quiet), writes them
    to <out_dir>/sglang_<gpu>.csv row by row beside that CSV's rows of the other calls (so that a run
    cut short keeps what it measured, and the calls can be run in parts), and returns them. kda_opt's
    kernel runs every call itself here, whatever it takes by default (`taken`), so that the rows say
    where it should."""
    earlier = earlier_rows(os.path.join(out_dir, f"sglang_{gpu_tag()}.csv"), calls)
    ours, triton = kernels()
    ours.decode_requests, ours.takes_verify, ours.takes_tree_verify = max(r[2] for r in ROWS), True, True
    flashkda = flashkda_kernel()
    helion = helion_kernel(triton)
    rows = []
    label = lambda r: f"{r[0]} H={r[1]} N={r[2]} T={r[3]} {r[4]}"
    for name, H, requests, tokens, gate in progress([r for r in ROWS if r[0] in calls], label, quiet):
        call = step(name, H, lengths(requests, tokens) if name == "extend" else [1] * requests, gate,
                    draft=tokens // requests)
        theirs, kernel = sglang_run(triton, call)
        err, same = compare(run(ours, call), theirs, call)
        runs = {"kda_opt": timed(ours, call), "sglang": timed(triton, call)}
        if name == "decode_step":
            runs["kda_opt_unfused"] = timed(ours, call, fused=False)
        if flashkda is not None and name == "extend" and gate == "safe":
            runs["sglang_flashkda"] = timed(flashkda, call)
        helion_err = NOT_RUN
        if helion is not None and name in HELION_CALLS:
            helion_err = compare(run(helion, call), theirs, call)[0]
            runs["sglang_helion"] = timed(helion, call)
        if name == "extend":
            ms = medians_in_turns(runs, warmup, rep)
        else:
            ms = {system: graph_ms(f, GRAPH_CALLS, cold=True) for system, f in runs.items()}
        row = dict(call=name, H=H, requests=requests, tokens=tokens, gate=gate, sglang_kernel=kernel,
                   timing="eager" if name == "extend" else "graph", sglang_ms=ms["sglang"], kda_opt_ms=ms["kda_opt"],
                   speedup=ms["sglang"] / ms["kda_opt"], taken=taken(call),
                   sglang_flashkda_ms=ms.get("sglang_flashkda", NOT_RUN),
                   sglang_helion_ms=ms.get("sglang_helion", NOT_RUN), helion_max_rel_err=helion_err, max_rel_err=err,
                   untouched_ok=same, kda_opt_unfused_ms=ms.get("kda_opt_unfused", NOT_RUN))
        show(row)
        rows.append(row)
        write_rows(in_rows_order(earlier + rows), out_dir, "sglang", FIELDS, defaults={"kda_opt_unfused_ms": NOT_RUN})
    return rows


def earlier_rows(path, calls):
    """The rows of the CSV at `path` (if any) whose call is not among `calls`: a run of those keeps them."""
    return [r for r in read_csv(path) if r["call"] not in calls]


def in_rows_order(rows):
    """rows (the CSV's, read back, and measured ones) in ROWS' order."""
    return sorted(rows, key=lambda r: ROWS.index((r["call"], r["H"], r["requests"], r["tokens"], r["gate"])))


def host_rows(quiet=False):
    """Host time per call (common.host_ms) of the serving extend call at (4 requests, 2048 tokens, H 12):
    {system: ms}."""
    ours, triton = kernels()
    call = step("extend", 12, lengths(4, 2048), "safe")
    with torch.inference_mode():
        return host_ms({"kda_opt": timed(ours, call), "sglang_triton": timed(triton, call)})
