"""kda_opt as SGLang's KDA kernel (kda_opt/sglang): the plugin's registration through SGLang's own entry
points and HookRegistry, the kernel's methods against SGLang's base class, which calls it takes, how it
maps them onto kda_forward and assembles SGLang's per-chunk states from its checkpoints (CPU,
kda_forward stood in for, by a recorder or by the float64 recurrence); on the GPU, SGLang's own calls
through it against SGLang's TritonKDAKernel (the oracle) and the float64 recurrence."""
import inspect
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kda_opt import engines
from kda_opt import sglang as plugin
from kda_opt.reference import ERROR_FLOOR, error_bound, reference_conv_decode, reference_decode, reference_forward
from tests.conftest import gpu, rel_err

pytest.importorskip("sglang")
from sglang.srt.layers.attention.linear.kernels import kda_triton  # noqa: E402  sglang is a test dependency
from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from kda_bench import sglang as calls  # noqa: E402


@pytest.fixture
def registry():
    """SGLang's HookRegistry, emptied before and after (and TritonKDAKernel restored; the backend's
    forward_decode too where its module imports here: it imports SGLang's whole model runner)."""
    original = kda_triton.TritonKDAKernel
    backend = sys.modules.get("sglang.srt.layers.attention.linear.kda_backend")
    step = None if backend is None else backend.KDAAttnBackend.__dict__["forward_decode"]
    HookRegistry.reset()
    yield HookRegistry
    HookRegistry.reset()
    kda_triton.TritonKDAKernel = original
    backend = sys.modules.get("sglang.srt.layers.attention.linear.kda_backend")
    if backend is not None:
        backend.KDAAttnBackend.forward_decode = step or inspect.unwrap(backend.KDAAttnBackend.forward_decode)


# ---- the plugin ----

def test_register_needs_the_switch(registry, monkeypatch):
    monkeypatch.delenv(plugin.SWITCH, raising=False)
    plugin.register()
    monkeypatch.setenv(plugin.SWITCH, "0")
    plugin.register()
    assert plugin.TARGET not in registry._hooks


def test_register_replaces_the_triton_kernel(registry, monkeypatch):
    monkeypatch.setenv(plugin.SWITCH, "1")
    plugin.register()
    registry.apply_hooks()
    assert kda_triton.TritonKDAKernel is plugin.kernel_class()
    assert plugin.kernel_class().__mro__[1].__name__ == "TritonKDAKernel"
    (kind, hook, _), = registry._hooks[plugin.DECODE_STEP]
    assert kind.name == "AROUND" and hook is plugin.forward_decode


def test_decode_step_hook_runs_the_fused_step_or_sglangs(monkeypatch):
    """forward_decode runs SGLang's step as one kda_conv_decode call (its arguments SGLang's layer's),
    and hands SGLang's own function every step it does not fuse: SGLang's kernel as the decode kernel,
    a K3 output-gate stash, the ReplaySSM ring, a 16-bit pool, more (request, head)
    pairs than CONV_DECODE_PAIRS."""
    monkeypatch.setattr(engines, "on_hopper", lambda device: True)
    seen = []
    monkeypatch.setattr(plugin, "kda_conv_decode", lambda *a, **kw: seen.append((a, kw)) or torch.zeros(3, 2, calls.K))
    original = lambda *a, **kw: "sglang"
    ours, triton = calls.kernels()
    call = calls.arguments(calls.step("decode_step", 2, [1] * 3, "safe", device="cpu"))

    def step(kernel=ours, **changes):
        backend, layer, batch = calls.step_backend(kernel, {**call, **changes})
        for name, x in changes.items():
            setattr(layer, name, x)
        if "replayssm_d" in changes:
            backend.req_to_token_pool.mamba2_layer_cache(0).replayssm_d = changes["replayssm_d"]
        return plugin.forward_decode(original, backend, layer, batch, call["mixed_qkv"], call["a"], call["b"])

    assert calls.sglang_backend_classes()[0].forward_decode.__code__.co_filename.endswith("kda_backend.py")
    o = step()
    assert o.shape == (1, 3, 2, calls.K)
    (args, kw), = seen
    assert args == (call["mixed_qkv"], call["a"], call["b"])
    assert kw["conv_state"] is call["conv_states"] and kw["conv_weight"] is call["conv_weights"]
    assert kw["ssm_state"] is call["ssm_states"] and kw["state_indices"] is call["cache_indices"]
    assert kw["lower_bound"] == -5.0 and kw["scale"] == calls.K ** -0.5 and kw["A_log"].shape == (2,)
    assert step(triton) == "sglang"
    assert step(_k3_fused_decode_args=(), _k3_onorm_gate=torch.zeros(1)) == "sglang"
    assert step(replayssm_d=torch.zeros(1)) == "sglang"
    assert step(ssm_states=call["ssm_states"].bfloat16()) == "sglang"
    monkeypatch.setattr(plugin, "CONV_DECODE_PAIRS", 5)
    assert step() == "sglang"
    assert len(seen) == 1


def test_sglang_loads_the_plugin_from_its_entry_point():
    """SGLang's own load_plugins, in a fresh process, finds kda_opt's entry point (pyproject.toml) and,
    with the switch, its kernel replaces TritonKDAKernel; without the switch SGLang keeps its own."""
    code = ("from sglang.srt.plugins import load_plugins; load_plugins()\n"
            "from sglang.srt.layers.attention.linear.kernels import kda_triton\n"
            "print(kda_triton.TritonKDAKernel.__name__)")
    names = []
    for switch in ("1", "0"):
        env = {**os.environ, plugin.SWITCH: switch, "SGLANG_PLUGINS": "kda_opt"}
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        names.append(run.stdout.split()[-1])
    assert names == ["KdaOptKDAKernel", "TritonKDAKernel"]


def test_import_needs_no_sglang():
    code = "import sys, kda_opt.sglang; print('sglang' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"]


@pytest.mark.parametrize("method", ["extend", "decode", "packed_decode", "target_verify"])
def test_methods_take_sglang_calls(method):
    """Each method accepts every parameter of SGLang's base class (where it has the method) and of its
    Triton kernel by the same name and kind (a keyword-only one with a default, such as the ReplaySSM
    ring's, may come through **kwargs, which pass it on)."""
    ours = inspect.signature(getattr(plugin.kernel_class(), method)).parameters
    assert any(p.kind is p.VAR_KEYWORD for p in ours.values())
    for base in (b for b in (LinearAttnKernelBase, plugin.kernel_class().__mro__[1]) if hasattr(b, method)):
        for name, p in inspect.signature(getattr(base, method)).parameters.items():
            if p.kind is p.VAR_KEYWORD:
                continue
            if name not in ours and p.kind is p.KEYWORD_ONLY and p.default is not p.empty:
                continue
            assert name in ours, f"{method} lacks {name}"
            assert ours[name].kind is p.kind, f"{method}'s {name} is {ours[name].kind}, SGLang's {p.kind}"
            if p.default is not p.empty:
                assert ours[name].default == p.default, name


# ---- which calls it takes, and how (CPU: the SGLang side and kda_forward stood in for) ----

@pytest.fixture
def sglang_own(monkeypatch):
    """Records the calls that reach SGLang's own Triton kernel methods (stood in for)."""
    seen = []
    base = plugin.kernel_class().__mro__[1]
    for name in ("extend", "decode", "packed_decode", "target_verify"):
        monkeypatch.setattr(base, name, lambda self, *a, _n=name, **kw: seen.append((_n, a, kw)) or "sglang")
    return seen


def test_off_hopper_every_call_is_sglangs(sglang_own):
    kernel = plugin.kernel_class()()
    kernel.takes_verify = True
    call = calls.step("extend", 2, [70, 5], "safe", device="cpu")
    assert calls.run_in_place(kernel, "extend", calls.arguments(call)) == "sglang"
    for name in ("decode", "verify"):
        call = calls.step(name, 2, [1, 1, 1], "softplus", device="cpu")
        assert calls.run_in_place(kernel, name, calls.arguments(call)) == "sglang"
    assert [s[0] for s in sglang_own] == ["extend", "decode", "target_verify"]
    assert sglang_own[0][2]["extend_seq_lens_cpu"] == [70, 5]      # passed on whole


@pytest.fixture
def stood_in(monkeypatch):
    """kda_forward and kda_decode stood in for on the plugin's side (their keyword arguments recorded),
    the device taken as Hopper."""
    seen = {}

    def forward(*args, **kw):
        seen["forward"] = (args, kw)
        return torch.zeros_like(args[2]), None

    def decode(*args, **kw):
        seen["decode"] = (args, kw)
        return torch.zeros_like(args[2]), None
    monkeypatch.setattr(engines, "on_hopper", lambda device: True)
    monkeypatch.setattr(plugin, "kda_forward", forward)
    monkeypatch.setattr(plugin, "kda_decode", decode)
    return seen


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_extend_maps_sglangs_call_onto_kda_forward(stood_in, sglang_own, gate):
    call = calls.step("extend", 2, [70, 5], gate, device="cpu", pad=True)
    kernel = plugin.kernel_class()()
    o = calls.run_in_place(kernel, "extend", calls.arguments(call))
    assert not sglang_own and o.shape == call["v"].shape
    args, kw = stood_in["forward"]
    assert args[:5] == tuple(call[n] for n in ("q", "k", "v", "g", "beta"))
    assert kw["initial_state"] is call["ssm_states"] and kw["initial_state_indices"] is call["cache_indices"]
    assert kw["cu_seqlens"] is call["query_start_loc"] and kw["state_v_first"]
    assert kw["use_qk_l2norm_in_kernel"] and kw["use_beta_sigmoid_in_kernel"] and kw["use_gate_in_kernel"]
    assert kw["A_log"].shape == (2,) and kw["dt_bias"] is call["dt_bias"]
    assert kw["lower_bound"] == calls.GATES[gate] and kw["safe_gate"] == (gate == "safe")
    assert kw["checkpoints"] is None
    # Three requests, none long enough to be cut: no host lengths (the call stays bound).
    assert kw["cu_seqlens_cpu"] is None


def test_one_request_passes_its_host_lengths(stood_in):
    call = calls.step("extend", 2, [300], "safe", device="cpu")
    calls.run_in_place(plugin.kernel_class()(), "extend", calls.arguments(call))
    assert stood_in["forward"][1]["cu_seqlens_cpu"].tolist() == [0, 300]


def test_a_leading_request_passes_the_host_lengths(stood_in, monkeypatch):
    """A request of Tuning.ahead_from tokens among others whose chain is the step's (plan.leads,
    a GPU of 8 SMs) passes the host lengths (then kda_forward runs it ahead); one whose others' work
    fills the SMs (64 chunks against 352 x 2 heads over 8) does not: the call stays bound."""
    sms = SimpleNamespace(multi_processor_count=8)
    monkeypatch.setattr(plugin.torch.cuda, "get_device_properties", lambda device: sms)
    for lens, passed in (([4096, 300, 70], True), ([4096] + [2000] * 9, False)):
        call = calls.step("extend", 2, lens, "safe", device="cpu")
        calls.run_in_place(plugin.kernel_class()(), "extend", calls.arguments(call))
        got = stood_in["forward"][1]["cu_seqlens_cpu"]
        assert (got.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]) if passed else got is None, lens


def test_decode_taken_only_where_measured(stood_in, sglang_own):
    """Steps of up to DECODE_REQUESTS requests through kda_decode, larger ones through SGLang's."""
    kernel = plugin.kernel_class()()
    assert kernel.decode_requests == plugin.DECODE_REQUESTS
    for n in (plugin.DECODE_REQUESTS + 1, 3):
        call = calls.step("decode", 2, [1] * n, "safe", device="cpu")
        out = calls.run_in_place(kernel, "decode", calls.arguments(call))
    assert [s[0] for s in sglang_own] == ["decode"] and out.shape == call["v"].shape
    args, kw = stood_in["decode"]
    # One token per request: N requests of one token, views of SGLang's tensors, no cu_seqlens.
    assert [x.shape for x in args[:5]] == [(3, 1, 2, calls.K)] * 4 + [(3, 1, 2)]
    assert all(x.data_ptr() == call[n].data_ptr() for x, n in zip(args, ("q", "k", "v", "a", "beta")))
    assert kw["cu_seqlens"] is None and out.shape == (1, 3, 2, calls.K)
    assert kw["ssm_state_indices"] is call["cache_indices"] and kw["inplace_final_state"] and kw["state_v_first"]
    assert kw["use_beta_sigmoid_in_kernel"] and kw["lower_bound"] == -5.0


def packed_call(N, H, pool_dtype=torch.float32, device="cpu", gate="softplus"):
    """A decode step() of N requests at H heads and the same step as SGLang's packed-decode keywords
    (q, k, v in the one mixed_qkv [N, 3·H·K] they are views of), its pool in pool_dtype."""
    call = calls.step("decode", H, [1] * N, gate, device=device)
    packed = calls.arguments(calls.step("packed_decode", H, [1] * N, gate, device=device))
    packed["ssm_states"] = packed["ssm_states"].to(pool_dtype)
    return call, packed


def test_packed_decode_maps_sglangs_call_onto_kda_decode(stood_in, sglang_own):
    """Packed decode on an fp32 pool through kda_decode, q, k, v views of mixed_qkv read in place
    ([N, 1, heads, K], one token per request), o as SGLang returns it ([1, N, HV, V]), K3's lower bound
    passed on (supports_packed_decode_safe_gate sends K3's decode here); a 16-bit pool and the ReplaySSM
    ring are SGLang's."""
    kernel = plugin.kernel_class()()
    call, packed = packed_call(5, 2)
    o = kernel.packed_decode(**packed)
    assert not sglang_own and o.shape == (1, 5, 2, calls.K)
    args, kw = stood_in["decode"]
    mixed = packed["mixed_qkv"]
    for x, at in zip(args[:3], (0, 2 * calls.K, 4 * calls.K)):
        assert x.shape == (5, 1, 2, calls.K) and x.data_ptr() == mixed[:, at:].data_ptr()
        assert x.stride(0) == mixed.stride(0)
    assert args[3].shape == (5, 1, 2, calls.K) and args[4].shape == (5, 1, 2)
    assert kw["ssm_state_indices"] is packed["cache_indices"] and kw["initial_state"] is packed["ssm_states"]
    assert kw["inplace_final_state"] and kw["state_v_first"] and kw["use_qk_l2norm_in_kernel"]
    assert kw["use_beta_sigmoid_in_kernel"] and kw["lower_bound"] is None and kw["scale"] == calls.K ** -0.5
    assert kernel.supports_packed_decode_safe_gate
    kernel.packed_decode(**{**packed, "lower_bound": -5.0})
    assert not sglang_own and stood_in["decode"][1]["lower_bound"] == -5.0
    for changes in (dict(ssm_states=packed["ssm_states"].bfloat16()),
                    dict(replayssm_d=1, replayssm_k=1, replayssm_g=1, replayssm_write_pos=1)):
        assert kernel.packed_decode(**{**packed, **changes}) == "sglang"
    assert [s[0] for s in sglang_own] == ["packed_decode"] * 2


def test_taken_names_the_calls_the_plugin_runs(stood_in, sglang_own):
    """The benchmark's `taken`: whether the plugin at its defaults ran kda_opt on a call, not SGLang's
    method (here stood in for)."""
    small, large = (calls.step("decode", 2, [1] * n, "safe", device="cpu") for n in (3, plugin.DECODE_REQUESTS + 1))
    assert calls.taken(small) and not calls.taken(large)
    packed = calls.step("packed_decode", 2, [1] * 5, "softplus", device="cpu")
    assert calls.taken(packed) and not calls.taken({**packed, "ssm_states": packed["ssm_states"].bfloat16()})
    assert calls.taken(calls.step("packed_decode", 2, [1] * 5, "safe", device="cpu"))
    verify, tree = (calls.step(name, 2, [1] * 3, "safe", device="cpu") for name in ("verify", "tree_verify"))
    ring = {**verify, "cache_ring": True}
    assert calls.taken(verify) and calls.taken(tree) and not calls.taken(ring)
    assert [s[0] for s in sglang_own] == ["decode", "packed_decode", "target_verify"]


def test_tree_verify_passes_its_parents(stood_in, sglang_own):
    """A tree (retrieve_parent_token; `takes_tree_verify`) goes to kda_decode with the buffer, each live
    request's parents row; the ReplaySSM ring stays SGLang's."""
    call = calls.step("tree_verify", 2, [1] * 3, "safe", device="cpu")
    kernel = plugin.kernel_class()()
    args = calls.arguments(call)
    calls.run_in_place(kernel, "verify", args)
    kw = stood_in["decode"][1]
    assert torch.equal(kw["retrieve_parent_token"], call["retrieve_parent_token"][:3])
    assert kw["intermediate_states_buffer"].shape[1] == call["cache_steps"] and not kw["inplace_final_state"]
    assert calls.run_in_place(kernel, "verify", {**args, "cache_ring": True}) == "sglang" and sglang_own


def _recurrence(q, k, v, g, beta, *, initial_state, initial_state_indices, cu_seqlens, checkpoints, **gate):
    """kda_forward's serving call in float64 (kda_opt/reference), for the plugin's side to be run on
    the CPU: each request from its pool row (zeros for −1), the state after each of its 64-token
    chunks into its checkpoint rows (Σ_{m<n} cdiv(len_m, 64) on), its final state into its row."""
    gate = {n: gate[n] for n in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                                 "A_log", "dt_bias", "lower_bound")}
    o, bounds, row = torch.zeros_like(v), cu_seqlens.tolist(), 0
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        slot = int(initial_state_indices[n])
        S = initial_state[slot:slot + 1] if slot >= 0 else initial_state.new_zeros(1, *initial_state.shape[1:])
        for t0 in range(bos, eos, 64):
            piece = [x[:, t0:min(t0 + 64, eos)] for x in (q, k, v, g, beta)]
            o_piece, S = reference_forward(*piece, initial_state=S, output_final_state=True, state_v_first=True,
                                           **gate)
            o[:, t0:t0 + o_piece.shape[1]] = o_piece.to(o.dtype)
            if checkpoints is not None:
                checkpoints[0, row] = S[0].to(checkpoints.dtype)
            row += 1
        if slot >= 0:
            initial_state[slot] = S[0].to(initial_state.dtype)
    return o, None


@pytest.mark.parametrize("track", [False, True])
def test_extend_returns_the_states_before_each_chunk(monkeypatch, track):
    """return_intermediate_states and track_state assembled from kda_forward's checkpoints (its float64
    stand-in here): h's row j of a request is its state before its chunk j (row 0 its pool row, zeros
    for a new request or −1), in k's dtype; track_state[n] the state before chunk track_chunk_idx[n]."""
    monkeypatch.setattr(engines, "on_hopper", lambda device: True)
    monkeypatch.setattr(plugin, "kda_forward", _recurrence)
    lens = [150, 64, 1, 70]
    call = calls.step("extend", 2, lens, "safe", device="cpu", pad=True)
    pool = call["ssm_states"].clone()
    args = calls.arguments(call)
    args.update(return_intermediate_states=True)
    if track:
        args.update(track_state=torch.full((5, *pool.shape[1:]), float("nan")),
                    track_chunk_idx=torch.tensor([2, 0, -1, 1, 1], dtype=torch.int32))
    o, h = calls.run_in_place(plugin.kernel_class()(), "extend", args)
    bounds, idx, row = call["query_start_loc"].tolist(), call["cache_indices"].tolist(), 0
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        start = pool[idx[n]:idx[n] + 1] if idx[n] >= 0 else torch.zeros(1, *pool.shape[1:])
        for j, t0 in enumerate(range(bos, eos, 64)):
            before = start if t0 == bos else reference_forward(
                *(x[:, bos:t0] for x in (call["q"], call["k"], call["v"], call["g"], call["beta"])),
                initial_state=start, output_final_state=True, state_v_first=True, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=call["A_log"].reshape(-1),
                dt_bias=call["dt_bias"], lower_bound=call["lower_bound"])[1]
            assert rel_err(h[0, row], before[0]) <= 4e-3, (n, j)
            if track and args["track_chunk_idx"][n] == j:
                assert rel_err(args["track_state"][n], before[0]) <= 1e-6, n
            row += 1
    assert h.shape[1] == row and h.dtype == call["k"].dtype


def test_chain_verify_writes_each_draft_tokens_state(monkeypatch):
    """Chain verify through kda_decode (its float64 stand-in): request n's state after its draft token t
    in intermediate_states_buffer[intermediate_state_indices[n], t], from its pool row (zeros for −1),
    the pool only read."""
    def decode(*args, **kw):
        o, written = reference_decode(*args, **kw)
        final = kw["intermediate_states_buffer"]
        final.copy_(written)
        return o.to(args[2].dtype), final
    monkeypatch.setattr(engines, "on_hopper", lambda device: True)
    monkeypatch.setattr(plugin, "kda_decode", decode)
    call = calls.step("verify", 2, [1] * 3, "softplus", device="cpu")
    call["cache_indices"][1] = -1
    call["intermediate_state_indices"] = torch.tensor([2, 3, 0], dtype=torch.int32)   # the buffer's rows
    args = calls.arguments(call)
    pool, buffer = args["ssm_states"].clone(), args["intermediate_states_buffer"]
    kernel = plugin.kernel_class()()
    kernel.takes_verify = True
    calls.run_in_place(kernel, "verify", args)
    assert torch.equal(args["ssm_states"], pool)
    g = call["a"].view(*call["v"].shape[:-1], -1)
    for n, (row, slot) in enumerate(zip(call["intermediate_state_indices"].tolist(), call["cache_indices"].tolist())):
        S = pool[slot:slot + 1] if slot >= 0 else torch.zeros(1, *pool.shape[1:])
        for t in range(4):
            r = slice(4 * n + t, 4 * n + t + 1)
            _, S = reference_forward(call["q"][:, r], call["k"][:, r], call["v"][:, r], g[:, r], call["beta"][:, r],
                                     initial_state=S, output_final_state=True, state_v_first=True,
                                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, A_log=call["A_log"].reshape(-1),
                                     dt_bias=call["dt_bias"])
            assert rel_err(buffer[row, t], S[0]) <= 1e-6, (n, t)
    assert torch.equal(buffer[1], torch.zeros_like(buffer[1]))          # no request's row: untouched


# ---- on the GPU: SGLang's calls through both kernels ----

def _reference(call):
    """float64 (o, the states each request leaves) of an extend or decode call (kda_opt/reference)."""
    idx = call["cache_indices"].long()
    pool = call["ssm_states"]
    starts = torch.where((idx >= 0).view(-1, 1, 1, 1), pool[idx.clamp(min=0)], 0)
    common = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  A_log=call["A_log"].reshape(-1), dt_bias=call["dt_bias"], lower_bound=call["lower_bound"],
                  state_v_first=True, cu_seqlens=call["query_start_loc"])
    if call["call"] == "extend":
        return reference_forward(call["q"], call["k"], call["v"], call["g"], call["beta"], initial_state=starts,
                                 output_final_state=True, method="chunked", **common)
    g = call["a"].view(*call["v"].shape[:-1], -1)
    return reference_decode(call["q"], call["k"], call["v"], g, call["beta"], initial_state=starts,
                            output_final_state=True, **common)


@gpu
@pytest.mark.parametrize("gate,H", [("softplus", 32), ("softplus", 16), ("softplus", 8), ("safe", 24), ("safe", 12)])
@pytest.mark.parametrize("name", ["extend", "decode"])
def test_sglang_calls_match_the_recurrence_and_sglang(gate, H, name):
    """Kimi-Linear's (softplus) and K3's (safe) calls: several requests, some new, one padding slot;
    kda_opt's o and the named pool rows within FLA's bound of the float64 recurrence where SGLang's
    Triton kernel's error sets it, every other pool row untouched."""
    ours, triton = calls.kernels()
    lens = [700, 64, 1, 333, 129] if name == "extend" else [1] * 16
    call = calls.step(name, H, lens, gate, pad=name == "extend")
    mine, theirs = calls.run(ours, call), calls.run(triton, call)
    (o, pool, _), (o_t, pool_t, _) = mine, theirs
    o_ref, S_ref = _reference(call)
    idx = call["cache_indices"].long()
    live = idx >= 0
    # SGLang's Triton kernel stands in for FLA's error, its own capped at the floor: a wrong peer
    # loosens nothing.
    err, err_t = rel_err(o, o_ref), rel_err(o_t, o_ref)
    assert err <= error_bound(min(err_t, ERROR_FLOOR)), (err, err_t)
    s_err, s_err_t = rel_err(pool[idx[live]], S_ref[live]), rel_err(pool_t[idx[live]], S_ref[live])
    assert s_err <= error_bound(min(s_err_t, ERROR_FLOOR)), (s_err, s_err_t)
    _, same = calls.compare(mine, theirs, call)
    assert same


@gpu
@pytest.mark.parametrize("gate", ["softplus", "safe"])
@pytest.mark.parametrize("N,H,kernel", [(6, 32, calls.SGLANG_KERNELS["packed_decode"]), (48, 8, calls.CUDA_PACKED)])
def test_packed_decode_matches_the_recurrence_and_sglangs(N, H, kernel, gate):
    """Kimi-Linear's packed decode (softplus, an fp32 pool, padding slots) and K3's (safe): o and the
    named pool rows within FLA's bound of the float64 recurrence where SGLang's own packed decode's
    error sets it (its Triton kernel below 8 requests, its CUDA kernel from 8) and where its split-call
    decode's does, bit for bit the plugin's decode of the same step split into q, k, v, every other
    pool row untouched."""
    if kernel == calls.CUDA_PACKED:
        pytest.importorskip("tvm_ffi", reason="SGLang's CUDA packed decode builds through apache-tvm-ffi")
    ours, triton = calls.kernels()
    call, packed = packed_call(N, H, device="cuda", gate=gate)
    step = {"call": "packed_decode", **packed}
    (o, pool, _), (o_split, pool_split, _) = calls.run(ours, step), calls.run(ours, call)
    assert torch.equal(o, o_split) and torch.equal(pool, pool_split)
    assert calls.sglang_run(triton, step)[1] == f"packed_decode: {kernel}"
    o_ref, S_ref = _reference(call)
    idx = call["cache_indices"].long()
    live = idx >= 0
    for o_t, pool_t, _ in (calls.run(triton, step), calls.run(triton, call)):
        assert rel_err(o, o_ref) <= error_bound(min(rel_err(o_t, o_ref), ERROR_FLOOR))
        s_err, s_err_t = rel_err(pool[idx[live]], S_ref[live]), rel_err(pool_t[idx[live]], S_ref[live])
        assert s_err <= error_bound(min(s_err_t, ERROR_FLOOR))
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    untouched[idx[live]] = False
    assert torch.equal(pool[untouched], packed["ssm_states"][untouched])


@gpu
@pytest.mark.parametrize("gate,H", [("softplus", 32), ("safe", 24), ("safe", 12)])
@pytest.mark.parametrize("N", [1, 8, 48])
def test_decode_step_matches_the_recurrence_and_sglangs(N, H, gate, monkeypatch):
    """SGLang's whole decode step, its own forward_decode (the convolution's update, then its kernel's
    packed decode: Triton below 8 requests, CUDA from 8), against the plugin's hook around it (one
    kda_conv_decode call, at every step's size here, CONV_DECODE_PAIRS raised to it): o and the named pool rows within FLA's bound of the float64 reference where
    SGLang's error sets it, the conv windows bit for bit SGLang's and the reference's, every other
    pool row untouched."""
    monkeypatch.setattr(plugin, "CONV_DECODE_PAIRS", N * H)
    ours, triton = calls.kernels()
    call = calls.step("decode_step", H, [1] * N, gate)
    (o, pool, window), fused = calls.calls_to(plugin, "kda_conv_decode", lambda: calls.run(ours, call))
    assert fused
    o_t, pool_t, window_t = calls.run(triton, call)
    a = calls.arguments(call)
    o_ref, pool_ref, window_ref = reference_conv_decode(
        a["mixed_qkv"], a["a"], a["b"], conv_state=a["conv_states"], conv_weight=a["conv_weights"],
        ssm_state=a["ssm_states"], state_indices=a["cache_indices"], A_log=a["A_log"], dt_bias=a["dt_bias"],
        lower_bound=a["lower_bound"])
    idx = call["cache_indices"].long()
    live = idx >= 0
    assert rel_err(o[0, live], o_ref[live]) <= error_bound(min(rel_err(o_t[0, live], o_ref[live]), ERROR_FLOOR))
    s_err, s_err_t = rel_err(pool[idx[live]], pool_ref[idx[live]]), rel_err(pool_t[idx[live]], pool_ref[idx[live]])
    assert s_err <= error_bound(min(s_err_t, ERROR_FLOOR))
    assert torch.equal(window, window_t) and torch.equal(window.double(), window_ref)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    untouched[idx[live]] = False
    assert torch.equal(pool[untouched], call["ssm_states"][untouched])


@gpu
@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_intermediate_and_tracked_states_match_sglang(gate):
    """return_intermediate_states (h, each request's state before each chunk, in k's dtype) and the
    fp32 track snapshot before a chosen chunk (−1: none), as SGLang's prefix cache asks for them."""
    ours, triton = calls.kernels()
    call = calls.step("extend", 12, [700, 64, 1, 333, 129], gate)
    call.update(return_intermediate_states=True, extend_seq_lens_cpu=[700, 64, 1, 333, 129],
                track_chunk_idx=torch.tensor([10, 0, -1, 2, 1], dtype=torch.int32, device="cuda"))
    results = []
    for kernel in (ours, triton):
        track = torch.full((5, 12, calls.K, calls.K), float("nan"), device="cuda")
        (o, h), pool, _ = calls.run(kernel, {**call, "track_state": track})
        results.append((o, h, track, pool))
    (o, h, track, pool), (o_t, h_t, track_t, pool_t) = results
    assert h.shape == h_t.shape and h.dtype == h_t.dtype
    assert rel_err(h, h_t) <= error_bound()
    tracked = call["track_chunk_idx"] >= 0
    assert rel_err(track[tracked], track_t[tracked]) <= error_bound()
    # o against the recurrence: two chunked kernels' outputs may differ by the sum of their errors.
    o_ref, _ = _reference(call)
    assert rel_err(o, o_ref) <= error_bound(min(rel_err(o_t, o_ref), ERROR_FLOOR))


@gpu
@pytest.mark.parametrize("gate", ["softplus", "safe"])
@pytest.mark.parametrize("name", ["verify", "tree_verify"])
def test_verify_matches_sglang(name, gate):
    """Chain and tree verify through kda_decode: each draft token's state into the buffer, the pool
    only read (bit for bit)."""
    ours, triton = calls.kernels()
    call = calls.step(name, 12, [1] * 8, gate)
    (o, pool, buf), sglangs = calls.calls_to(type(triton), "target_verify", lambda: calls.run(ours, call))
    assert not sglangs
    o_t, pool_t, buf_t = calls.run(triton, call)
    assert rel_err(o, o_t) <= error_bound()
    assert rel_err(buf, buf_t) <= error_bound()
    assert torch.equal(pool, call["ssm_states"]) and torch.equal(pool_t, call["ssm_states"])


@gpu
def test_bad_input_raises_before_any_kernel():
    ours, _ = calls.kernels()
    call = calls.step("extend", 12, [100, 28], "safe")
    call["beta"] = call["beta"][..., :5]
    before = call["ssm_states"].clone()
    with pytest.raises(ValueError, match="beta"):
        calls.run_in_place(ours, "extend", calls.arguments(call))
    torch.cuda.synchronize()
    assert torch.equal(call["ssm_states"], before)
