"""kda_opt as vLLM's KDA functions (kda_opt/vllm): the plugin loaded by vLLM's own load_general_plugins
from its entry point, the replacements' signatures against vLLM's, which calls they take, and each
replaced call against vLLM's own function (the oracle) and the float64 recurrence: on the CPU vLLM's
Triton kernels and kda_decode under the interpreter (kda_forward, whose stage 4 is cuTile, stood in
for by the float64 recurrence); on the GPU both as they run there (K3's FlashKDA prefill against the
float64 recurrence and, where the kit has it, FlashKDA itself).

vLLM runs its Triton kernels without a GPU only where CUDA_VISIBLE_DEVICES is empty (else
vllm.triton_utils stands placeholders in for triton), its autotuner only with
VLLM_TRITON_FORCE_FIRST_CONFIG=1, and under the interpreter only with the bridges of `interpreted`."""
import ast
import builtins
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys

import pytest
import torch

from kda_opt import decode, engines
from kda_opt import vllm as plugin
from kda_opt.arguments import DecodeArguments
from kda_opt.decode import kda_decode
from kda_opt.decode_plan import make_decode_plan
from kda_opt.plan_cache import Entry
from kda_opt.reference import error_bound, reference_decode, reference_forward
from tests.conftest import HAS_CUDA, INTERPRETED, ROOT, TRITON_NEXT_POWER_OF_2, gpu, kernel_device, rel_err

if not HAS_CUDA:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("VLLM_TRITON_FORCE_FIRST_CONFIG", "1")
pytest.importorskip("vllm")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kda_bench.vllm import kernels as vllm_kernels  # noqa: E402

kernels = vllm_kernels()       # vLLM's copy of FLA's KDA kernels, without K3's model (kda_bench/vllm)
DEVICE = kernel_device()
NAMES = {"chunk_kda_with_fused_gate": plugin.prefill, "fused_recurrent_kda": plugin.spec_decode,
         "fused_recurrent_kda_packed_decode": plugin.packed_decode}


# ---- vLLM's kernels under the interpreter ----

@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _exp2(x):
    return tl.exp2(x)


@triton.jit
def _log(x):
    return tl.log(x)


@triton.jit
def _log2(x):
    return tl.log2(x)


@triton.jit
def _gather(src, index, axis):
    return tl.gather(src, index, axis)


def _range(*args):
    """Python's range with Triton scalars for values: the interpreter hands a kernel's `range` loop
    counters out as ints, on which vLLM's kernels call .to()."""
    for i in builtins.range(*(int(a.handle.data.item()) if hasattr(a, "handle") else int(a) for a in args)):
        yield tl.full([], i, tl.int32)


@pytest.fixture(autouse=True)
def _tritons_own_next_power_of_2(monkeypatch):
    """vLLM's kernels call triton.next_power_of_2 inside a kernel: Triton's own, whatever an SGLang
    import in the same process (tests/test_sglang.py on one xdist worker) replaced it with."""
    monkeypatch.setattr(triton, "next_power_of_2", TRITON_NEXT_POWER_OF_2)


@pytest.fixture(scope="module")
def interpreted():
    """vLLM's kernels made to run under Triton's interpreter (a no-op on the GPU): the language
    functions its copy of FLA binds at import (`exp = tl.exp`, `gather = tl.gather`), which the
    interpreter does not patch, as jitted ones; `range` in the state pass; no pinned staging."""
    if not INTERPRETED:
        return
    import vllm.utils.torch_utils as torch_utils
    from vllm.third_party.flash_linear_attention.ops import chunk_delta_h

    torch_utils.PIN_MEMORY = False
    chunk_delta_h.range = _range
    bridged = {tl.exp: _exp, tl.exp2: _exp2, tl.log: _log, tl.log2: _log2, tl.gather: _gather}
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(("vllm.models.kimi_k3.nvidia.ops", "vllm.third_party")):
            for attr, value in list(vars(module).items()):
                if callable(value) and any(value is b for b in bridged):
                    setattr(module, attr, next(j for b, j in bridged.items() if value is b))


# ---- the plugin ----

def test_register_needs_the_switch(monkeypatch):
    finders = list(sys.meta_path)
    for switch in (None, "0"):
        if switch is None:
            monkeypatch.delenv(plugin.SWITCH, raising=False)
        else:
            monkeypatch.setenv(plugin.SWITCH, switch)
        plugin.register()
    assert sys.meta_path == finders
    assert not any(hasattr(getattr(kernels, n), "vllm_own") for n in NAMES)


# The project root and scripts/ (kda_bench) on a subprocess's path, as pytest puts them on its own.
PYTHONPATH = os.pathsep.join([ROOT, os.path.join(ROOT, "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])])


def test_vllm_loads_the_plugin_from_its_entry_point():
    """vLLM's own load_general_plugins, in a fresh process, finds kda_opt's entry point (pyproject.toml)
    and, with the switch, vLLM's three KDA functions are kda_opt's once their module is imported (after
    the plugins, as in vLLM), and K3's layer module waits for its import (which needs K3's whole model,
    not installed here); without it nothing is replaced or waits."""
    code = ("import sys\nfrom kda_bench.vllm import kernels, stand_in_compiled_ops; stand_in_compiled_ops()\n"
            "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
            "k = kernels()\n"
            "pending = [f.name for f in sys.meta_path if type(f).__name__ == '_AfterImport']\n"
            "print(*(f.__module__ for f in (k.chunk_kda_with_fused_gate, k.fused_recurrent_kda,\n"
            "      k.fused_recurrent_kda_packed_decode)), *pending)")
    runs = {switch: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, plugin.SWITCH: switch, "PYTHONPATH": PYTHONPATH})
            for switch in ("1", "0")}
    modules = {}
    for switch, run in runs.items():
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        modules[switch] = out.split("\n")[-2].split()
    assert modules["1"] == ["kda_opt.vllm"] * 3 + [plugin.LAYER]        # K3's layer: replaced when imported
    assert modules["0"] == [plugin.KERNELS + ".chunk", plugin.KERNELS + ".fused_recurrent",
                            plugin.KERNELS + ".fused_recurrent"]


def test_import_needs_no_vllm():
    code = "import sys, kda_opt.vllm; print('vllm' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"]


def test_after_import_patches_a_module_when_it_is_imported(tmp_path, monkeypatch):
    """A module not yet imported is patched right after its code runs (the finder then leaves
    sys.meta_path); one already imported at once; a replaced function is not replaced again."""
    (tmp_path / "kda_opt_after_import.py").write_text("def f():\n    return 'own'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finders = list(sys.meta_path)
    seen = []
    plugin.after_import("kda_opt_after_import", seen.append)
    assert not seen and len(sys.meta_path) == len(finders) + 1
    module = importlib.import_module("kda_opt_after_import")
    assert seen == [module] and sys.meta_path == finders
    plugin.after_import("kda_opt_after_import", lambda m: plugin._replace(m, "f", lambda own: lambda: "ours"))
    plugin.after_import("kda_opt_after_import", lambda m: plugin._replace(m, "f", lambda own: lambda: "twice"))
    assert module.f() == "ours" and module.f.vllm_own() == "own"
    del sys.modules["kda_opt_after_import"]


def _same_parameters(ours, theirs):
    ours, theirs = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [(p.name, p.kind, p.default)
                                                                    for p in theirs.values()]


@pytest.mark.parametrize("name", sorted(NAMES))
def test_replacements_keep_vllms_signature(name):
    own = getattr(kernels, name)
    _same_parameters(NAMES[name](own), own)


def test_flashkda_prefill_keeps_k3s_signature():
    """K3's layer module imports its whole model: its _flashkda_prefill's parameters read from its source."""
    root = os.path.dirname(importlib.util.find_spec("vllm").origin)
    tree = ast.parse(open(os.path.join(root, *plugin.LAYER.split(".")[1:]) + ".py").read())
    theirs = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "_flashkda_prefill").args
    defaults = [None] * (len(theirs.args) - len(theirs.defaults)) + [ast.literal_eval(d) for d in theirs.defaults]
    ours = inspect.signature(plugin.flashkda_prefill(None)).parameters.values()
    assert [(p.name, None if p.default is p.empty else p.default) for p in ours] == \
        [(a.arg, d) for a, d in zip(theirs.args, defaults)]


# ---- vLLM's calls ----

def _tokens(lens, H, K, V, dtype, device, seed=0):
    """q, k, v, raw gate, β logits of packed requests [1, T, ·, ·], and cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    return dict(q=x(1, T, H, K), k=x(1, T, H, K), v=x(1, T, H, V), raw_g=x(1, T, H, K), raw_beta=x(1, T, H),
                cu_seqlens=torch.tensor([0, *lens]).cumsum(0).to(device, torch.int32))


def _gate_weights(H, K, device, seed=1):
    """A_log as the Kimi layer initialises it (log of U(1, 16)), dt_bias [H·K]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.empty(H).uniform_(1, 16, generator=gen).log().to(device),
            (0.5 * torch.randn(H * K, generator=gen)).to(device))


BOUND = {"softplus": None, "bound": -5.0}


def _pool(slots, H, V, K, dtype, device, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return (0.1 * torch.randn(slots, H, V, K, generator=gen)).to(device, dtype)


def _kda_decode_interpreted(*args, **kwargs):
    """kda_decode's plan run under the interpreter (make_decode_plan checks devices only on a GPU: the
    plan made here with an SM count)."""
    call = DecodeArguments(*args, **kwargs)
    return decode.call(Entry(make_decode_plan(call, sms=132)), call)


def _on_hopper(monkeypatch):
    """The CPU taken as Hopper, so that the plugin's side runs here (kda_decode under the interpreter)."""
    if not HAS_CUDA:
        monkeypatch.setattr(engines, "on_hopper", lambda device: True)
        monkeypatch.setattr(plugin, "kda_decode", _kda_decode_interpreted)


def _check_against(ours, vllms, truth, what):
    """ours within FLA's error bound of the float64 truth, where vLLM's own result is as far from it."""
    bound = error_bound(rel_err(vllms, truth))
    assert rel_err(ours, truth) <= bound, (what, rel_err(ours, truth), bound)


def test_off_hopper_every_call_is_vllms():
    """On the CPU (not Hopper) each replacement hands the call, whole, to vLLM's own function."""
    seen = []
    own = lambda *a, **kw: seen.append((a, kw)) or "vllm"
    t = _tokens([3], 2, 64, 64, torch.float32, "cpu")
    pool = torch.zeros(4, 2, 64, 64)
    assert plugin.prefill(own)(t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], torch.zeros(2), None) == "vllm"
    assert plugin.spec_decode(own)(t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], torch.zeros(2), None, None,
                                   pool, t["cu_seqlens"], torch.tensor([1])) == "vllm"
    mixed = torch.zeros(3, 3 * 2 * 64)
    assert plugin.packed_decode(own)(mixed, t["raw_g"], t["raw_beta"], torch.zeros(2), torch.zeros(128), None, pool,
                                     torch.tensor([1, 2, 3])) == "vllm"
    assert plugin.flashkda_prefill(own)(t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], torch.zeros(2), None,
                                        -5.0, pool[:1], t["cu_seqlens"], t["v"], pool[:1], None) == "vllm"
    assert len(seen) == 4 and seen[0][1]["out"] is None


@pytest.mark.parametrize("gate", ["softplus", "bound"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_packed_decode_matches_vllms(interpreted, monkeypatch, gate, pool_dtype):
    """fused_recurrent_kda_packed_decode through kda_decode against vLLM's own kernel on the same pool:
    o and the live rows within FLA's bound of the float64 recurrence; padding requests (slot 0, −1)
    zero in o; every row no live request names, slot 0 included, bit-identical."""
    _on_hopper(monkeypatch)
    H, K, V, dtype = (2, 64, 64, torch.float32) if INTERPRETED else (8, 128, 128, torch.bfloat16)
    indices = torch.tensor([3, 0, 5, -1, 1], device=DEVICE)       # (taken: from_requests=1 below)
    B = indices.shape[0]
    t = _tokens([1] * B, H, K, V, dtype, DEVICE)
    mixed = torch.cat([t[n].reshape(B, -1) for n in ("q", "k", "v")], dim=-1)
    A_log, dt_bias = _gate_weights(H, K, DEVICE)
    pool = _pool(7, H, V, K, pool_dtype, DEVICE)
    outs = {}
    for who, function in (("vllm", kernels.fused_recurrent_kda_packed_decode),
                          ("ours", plugin.packed_decode(kernels.fused_recurrent_kda_packed_decode, 1))):
        p = pool.clone()
        o, returned = function(mixed, t["raw_g"], t["raw_beta"], A_log, dt_bias, BOUND[gate], p, indices)
        assert returned is p and o.shape == (1, B, H, V)
        outs[who] = o, p
    live = indices > 0
    o_ref, p_ref = reference_decode(t["q"].transpose(0, 1), t["k"].transpose(0, 1), t["v"].transpose(0, 1),
                                    t["raw_g"].transpose(0, 1), t["raw_beta"].transpose(0, 1), A_log, dt_bias,
                                    initial_state=pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, lower_bound=BOUND[gate], state_v_first=True,
                                    inplace_final_state=True, ssm_state_indices=indices, pad_slot=0)
    (o, p), (o_v, p_v) = outs["ours"], outs["vllm"]
    _check_against(o[0, live.cpu()], o_v[0, live.cpu()], o_ref.transpose(0, 1)[0, live.cpu()], "o")
    rows = indices[live].long()
    _check_against(p[rows], p_v[rows], p_ref[rows.cpu()], "pool rows")
    assert torch.equal(o[0, ~live], torch.zeros_like(o[0, ~live]))
    untouched = [s for s in range(pool.shape[0]) if s not in rows.tolist()]
    assert torch.equal(p[untouched], pool[untouched]) and torch.equal(p_v[untouched], pool[untouched])


@pytest.mark.parametrize("gate", ["softplus", "bound"])
def test_spec_decode_matches_vllms(interpreted, monkeypatch, gate):
    """fused_recurrent_kda with drafts ([N, S] slots, num_accepted_tokens) through kda_decode against
    vLLM's own kernel: o of live requests and each draft token's state in its slot within FLA's bound
    of the float64 recurrence; a padding request (slot 0 in every column, as vLLM's metadata pads)
    writes nothing; rows no live request writes bit-identical; o written into the out buffer given."""
    _on_hopper(monkeypatch)
    H, K, V, dtype = (2, 64, 64, torch.float32) if INTERPRETED else (12, 128, 128, torch.bfloat16)
    lens = [3, 4, 2, 1]
    t = _tokens(lens, H, K, V, dtype, DEVICE)
    A_log, dt_bias = _gate_weights(H, K, DEVICE)
    # Request n starts from column accepted[n] − 1 and writes token t's state into column t.
    indices = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0], [12, 13, 14, 15]], device=DEVICE)
    accepted = torch.tensor([2, 1, 1, 4], device=DEVICE)
    pool = _pool(17, H, V, K, torch.float32, DEVICE)
    args = (t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], A_log, dt_bias, BOUND[gate])
    outs = {}
    for who, function in (("vllm", kernels.fused_recurrent_kda),
                          ("ours", plugin.spec_decode(kernels.fused_recurrent_kda, taken=True))):
        p, out = pool.clone(), torch.full_like(t["v"], float("nan"))
        o, returned = function(*args, p, t["cu_seqlens"], indices, num_accepted_tokens=accepted, out=out)
        assert o is out and returned is p
        outs[who] = o, p
    o_ref, p_ref = reference_decode(t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], A_log, dt_bias,
                                    initial_state=pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, lower_bound=BOUND[gate], state_v_first=True,
                                    cu_seqlens=t["cu_seqlens"], inplace_final_state=True,
                                    ssm_state_indices=indices, num_accepted_tokens=accepted, pad_slot=0)
    (o, p), (o_v, p_v) = outs["ours"], outs["vllm"]
    live = torch.cat([torch.full((n,), n_i != 2) for n_i, n in enumerate(lens)])    # request 2 pads
    _check_against(o[0, live], o_v[0, live], o_ref[0, live], "o")
    written = [1, 2, 3, 5, 6, 7, 8, 12]     # request n's columns t < its tokens
    _check_against(p[written], p_v[written], p_ref[written], "pool rows")
    untouched = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(p[untouched], pool[untouched]) and torch.equal(p_v[untouched], pool[untouched])


def _forward_in_float64(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
                        initial_state_indices=None, cu_seqlens, checkpoints=None, checkpoint_every=64,
                        checkpoint_offsets=None, safe_gate=False, cu_seqlens_cpu=None, **gate):
    """kda_forward's packed call in float64 (kda_opt/reference), for the plugin's side to run on the
    CPU: each sequence from initial_state[n] (or its pool row initial_state_indices[n]), its final
    state returned (output_final_state) or into its pool row; with checkpoint_offsets f_n its rows
    after min(f_n + checkpoint_every·j, len_n) tokens, from row Σ_{m<n} of their counts."""
    bounds, row, finals = cu_seqlens.tolist(), 0, []
    o = torch.zeros_like(v)
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        slot = n if initial_state_indices is None else int(initial_state_indices[n])
        S = None if initial_state is None else initial_state[slot:slot + 1]
        run = lambda end, S0: reference_forward(*(x[:, bos:end] for x in (q, k, v, g, beta)), scale=scale,
                                                initial_state=S0, output_final_state=True, **gate)
        if eos == bos:              # an empty sequence: its start is its end, and it has no rows
            S_end = initial_state.new_zeros(1, *initial_state.shape[1:]) if S is None else S.clone()
        else:
            o_n, S_end = run(eos, S)
            o[:, bos:eos] = o_n.to(o.dtype)
        if checkpoint_offsets is not None and eos > bos:
            f = min(max(int(checkpoint_offsets[n]), 1), checkpoint_every)
            for j in range(1 + -(-max(eos - bos - f, 0) // checkpoint_every)):
                checkpoints[0, row] = run(bos + min(f + checkpoint_every * j, eos - bos), S)[1][0].to(checkpoints.dtype)
                row += 1
        if initial_state_indices is not None:
            initial_state[slot] = S_end[0].to(initial_state.dtype)
        finals.append(S_end)
    return o, torch.cat(finals).float() if output_final_state else None


def _forward(monkeypatch):
    """kda_forward as the plugin's side calls it: itself on the GPU, its float64 stand-in on the CPU."""
    if not HAS_CUDA:
        monkeypatch.setattr(engines, "on_hopper", lambda device: True)
        monkeypatch.setattr(plugin, "kda_forward", _forward_in_float64)
        monkeypatch.setattr(plugin, "_sms", lambda device: 132)


@pytest.mark.parametrize("gate", ["softplus", "bound"])
def test_prefill_matches_vllms_chunk(interpreted, monkeypatch, gate):
    """chunk_kda_with_fused_gate through kda_forward against vLLM's own chunk: o (into the out buffer
    given) and the final states within FLA's bound of the float64 recurrence."""
    _forward(monkeypatch)
    H, K, V, dtype = (2, 64, 64, torch.float32) if INTERPRETED else (16, 128, 128, torch.bfloat16)
    lens = [70, 30] if INTERPRETED else [700, 1, 3000, 64]
    t = _tokens(lens, H, K, V, dtype, DEVICE)
    A_log, dt_bias = _gate_weights(H, K, DEVICE)
    h0 = _pool(len(lens), H, V, K, torch.float32, DEVICE)
    args = dict(q=t["q"], k=t["k"], v=t["v"], raw_g=t["raw_g"], raw_beta=t["raw_beta"], A_log=A_log, g_bias=dt_bias,
                initial_state=h0, output_final_state=True, lower_bound=BOUND[gate], use_qk_l2norm_in_kernel=True,
                cu_seqlens=t["cu_seqlens"])
    o_v, final_v = kernels.chunk_kda_with_fused_gate(**{**args, "v": t["v"].clone()})
    out = torch.full_like(t["v"], float("nan"))
    o, final = plugin.prefill(kernels.chunk_kda_with_fused_gate)(**args, out=out)
    assert o is out and final.dtype == torch.float32
    o_ref, final_ref = _forward_in_float64(t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], initial_state=h0,
                                           output_final_state=True, cu_seqlens=t["cu_seqlens"],
                                           use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                           use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                           lower_bound=BOUND[gate], state_v_first=True)
    _check_against(o, o_v, o_ref, "o")
    _check_against(final, final_v, final_ref, "final states")


def test_flashkda_prefill_writes_out_final_states_and_checkpoints(monkeypatch):
    """K3's _flashkda_prefill through kda_forward: o into out, each sequence's final state into
    final_state in its dtype, checkpoint_state[n] its state after checkpoint_offsets[n] tokens (16-token
    aligned, as vLLM places them), the row of an offset 0 or an empty sequence left as it is; each
    within FLA's bound of the float64 recurrence (and of FlashKDA's own o and final states, where the
    kit has FlashKDA)."""
    _forward(monkeypatch)
    H, K, dtype = (2, 64, torch.float32) if INTERPRETED else (12, 128, torch.bfloat16)
    # (on the CPU an empty sequence too, which has no checkpoint rows: its row is left as it is)
    lens, offsets = ([100, 0, 40, 48], [16, 32, 0, 48]) if INTERPRETED else ([2000, 300, 4096, 33], [1040, 0, 64, 16])
    N = len(lens)
    t = _tokens(lens, H, K, K, dtype, DEVICE)
    A_log, dt_bias = _gate_weights(H, K, DEVICE)
    h0 = _pool(N, H, K, K, torch.float32, DEVICE)
    out, final = torch.full_like(t["v"], float("nan")), torch.full_like(h0, float("nan"))
    checkpoint = torch.full_like(h0, 7.0)
    returned = plugin.flashkda_prefill(None)(
        t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], A_log, dt_bias, -5.0, h0, t["cu_seqlens"], out, final,
        None, checkpoint_state=checkpoint, checkpoint_offsets=torch.tensor(offsets, device=DEVICE))
    assert returned[0] is out and returned[1] is final
    gate = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, state_v_first=True)
    bounds = t["cu_seqlens"].tolist()
    o_ref = torch.zeros_like(t["v"], dtype=torch.float64)
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        if eos == bos:
            assert torch.equal(final[n], h0[n]) and torch.equal(checkpoint[n], torch.full_like(checkpoint[n], 7.0))
            continue
        piece = lambda end: [x[:, bos:end] for x in (t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"])]
        o_n, S = reference_forward(*piece(eos), initial_state=h0[n:n + 1], output_final_state=True, **gate)
        o_ref[:, bos:eos] = o_n
        assert rel_err(final[n], S[0]) <= error_bound(), n
        if offsets[n]:
            at = reference_forward(*piece(bos + offsets[n]), initial_state=h0[n:n + 1], output_final_state=True,
                                   **gate)[1]
            assert rel_err(checkpoint[n], at[0]) <= error_bound(), n
        else:
            assert torch.equal(checkpoint[n], torch.full_like(checkpoint[n], 7.0))
    assert rel_err(out, o_ref) <= error_bound()
    if HAS_CUDA and importlib.util.find_spec("flash_kda") is not None:
        import flash_kda
        o_fk, final_fk = torch.empty_like(t["v"]), torch.empty_like(h0)
        flash_kda.fwd(t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], K ** -0.5, o_fk, A_log, dt_bias.view(H, K),
                      -5.0, initial_state=h0, final_state=final_fk, cu_seqlens=t["cu_seqlens"].long())
        _check_against(out, o_fk, o_ref, "o against FlashKDA's")
        for n in range(N):
            S = reference_forward(*(x[:, bounds[n]:bounds[n + 1]] for x in (t["q"], t["k"], t["v"], t["raw_g"],
                                                                             t["raw_beta"])),
                                  initial_state=h0[n:n + 1], output_final_state=True, **gate)[1]
            _check_against(final[n], final_fk[n], S[0], f"final state {n} against FlashKDA's")


@gpu
def test_one_sequence_runs_as_one_sequence(monkeypatch):
    """A call of one request passes its host lengths (vLLM packs exactly its requests' tokens), so that
    kda_forward may cut it in parallel segments; a call of several passes none."""
    seen = []
    monkeypatch.setattr(plugin, "kda_forward", lambda *a, **kw: seen.append(kw["cu_seqlens_cpu"]) or
                        (torch.zeros_like(a[2]), None))
    for lens in ([300], [200, 100]):
        t = _tokens(lens, 2, 64, 64, torch.bfloat16, "cuda")
        plugin.prefill(None)(t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], torch.zeros(2, device="cuda"),
                             None, cu_seqlens=t["cu_seqlens"])
    assert seen[0].tolist() == [0, 300] and seen[1] is None


def test_spec_decode_and_full_flashkda_calls_are_vllms(monkeypatch):
    """Speculative decode is vLLM's unless taken; K3's FlashKDA prefill past FLASHKDA_WAVES SMs' worth of
    (request, head) pairs is vLLM's (FlashKDA's)."""
    monkeypatch.setattr(engines, "on_hopper", lambda device: True)
    monkeypatch.setattr(plugin, "_sms", lambda device: 4)
    own = lambda *a, **kw: "vllm"
    t = _tokens([3], 2, 64, 64, torch.float32, "cpu")
    pool = torch.zeros(4, 2, 64, 64)
    assert plugin.spec_decode(own)(t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], torch.zeros(2), None, None,
                                   pool, t["cu_seqlens"], torch.tensor([1])) == "vllm"
    t = _tokens([1] * 5, 2, 64, 64, torch.float32, "cpu")      # N·H 10 > 2 waves of 4 SMs
    assert plugin.flashkda_prefill(own)(t["q"], t["k"], t["v"], t["raw_g"], t["raw_beta"], torch.zeros(2), None, -5.0,
                                        pool[:5], t["cu_seqlens"], t["v"], pool[:5], None) == "vllm"


def test_packed_decode_takes_steps_from_its_rule(monkeypatch):
    """Steps of fewer than PACKED_DECODE_FROM requests are vLLM's own kernel's; from it, kda_decode's."""
    monkeypatch.setattr(engines, "on_hopper", lambda device: True)
    monkeypatch.setattr(plugin, "kda_decode", lambda q, *a, **kw: (torch.zeros(q.shape[0], 1, 2, 64), None))
    own = lambda *a, **kw: "vllm"
    pool = torch.zeros(4, 2, 64, 64)
    ran = []
    for B in (plugin.PACKED_DECODE_FROM - 1, plugin.PACKED_DECODE_FROM):
        mixed, g, beta = torch.zeros(B, 3 * 2 * 64), torch.zeros(1, B, 2, 64), torch.zeros(1, B, 2)
        ran.append(plugin.packed_decode(own)(mixed, g, beta, torch.zeros(2), torch.zeros(128), None, pool,
                                             torch.ones(B, dtype=torch.int64)))
    assert ran[0] == "vllm" and ran[1][0].shape == (1, plugin.PACKED_DECODE_FROM, 2, 64)
