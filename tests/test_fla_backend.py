"""kda_opt as FLA's chunk_kda backend (kda_opt/fla_backend): registration, the verifier's decision on
each condition, the FLA_KDA_OPT switch, and dispatch reaching kda_forward (CPU, kda_forward stood in
for); on the GPU, chunk_kda's result is kda_forward's."""
import inspect
import subprocess
import sys

import pytest
import torch

import kda_opt
from kda_opt import decode, engines, fla_backend, forward
from tests.conftest import gpu, rel_err

fla_backends = pytest.importorskip("fla.backends")
from fla.ops.kda import chunk_kda  # noqa: E402  after importorskip: fla is a test dependency


@pytest.fixture
def registry(monkeypatch):
    """chunk_kda's backend registry with kda_opt registered (and enabled); restored to FLA's own
    backends after."""
    monkeypatch.delenv("FLA_KDA_OPT", raising=False)
    registry = fla_backends._function_registries[inspect.unwrap(chunk_kda)]
    kda_opt.use_in_fla()
    yield registry
    registry._backends.pop("kda_opt", None)


@pytest.fixture
def backend(registry):
    return registry._backends["kda_opt"]


def kimi_call(device="meta", dtype=torch.bfloat16, B=1, T=8, H=2, K=128, V=128):
    """chunk_kda's keyword arguments for a Kimi-style call (raw q/k, β logits, gate in kernel)."""
    def x(*shape, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt)
    return dict(q=x(B, T, H, K), k=x(B, T, H, K), v=x(B, T, H, V), g=x(B, T, H, K), beta=x(B, T, H),
                initial_state=x(B, H, K, V, dt=torch.float32), output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=x(H, dt=torch.float32), dt_bias=x(H * K, dt=torch.float32))


@pytest.fixture
def on_hopper(monkeypatch):
    """The verifier's device check passes for any tensor, so CPU and meta tensors can be judged."""
    monkeypatch.setattr(engines, "on_hopper", lambda device: True)


# ---- import and registration ----

def test_import_needs_no_fla():
    code = "import sys, kda_opt; assert callable(kda_opt.use_in_fla); print('fla' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"]


def test_registered_ahead_of_flash_kda(registry):
    ours = registry._backends["kda_opt"]
    assert (ours.backend_type, ours.package_name, ours.env_var) == ("kda_opt", "kda_opt", "FLA_KDA_OPT")
    assert ours.priority < registry._backends["flash_kda"].priority
    assert registry._get_sorted_backends()[0] is ours


def test_use_in_fla_twice_registers_once(registry):
    kda_opt.use_in_fla()
    assert [b.backend_type for b in registry._backends.values()].count("kda_opt") == 1


def test_fla_kda_opt_0_disables(registry, backend, monkeypatch):
    assert backend.is_enabled() and registry.get_active() is backend
    monkeypatch.setenv("FLA_KDA_OPT", "0")
    assert not backend.is_enabled() and registry.get_active() is not backend


# ---- the verifier ----

def test_on_hopper_is_compute_capability_9_asked_once_per_device(monkeypatch):
    assert not engines.on_hopper(torch.device("cpu"))
    asked = []
    for capability, hopper in (((9, 0), True), ((8, 0), False), ((10, 0), False)):
        engines.on_hopper.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: asked.append(c) or c)
        assert engines.on_hopper(torch.device("cuda", 0)) is hopper
        assert engines.on_hopper(torch.device("cuda", 0)) is hopper
    engines.on_hopper.cache_clear()
    assert asked == [(9, 0), (8, 0), (10, 0)]


def test_verifier_rejects_off_hopper(backend, monkeypatch):
    monkeypatch.setattr(engines, "on_hopper", lambda device: False)
    accepted, reason = backend.chunk_kda_verifier(**kimi_call())
    assert not accepted and "compute capability 9" in reason


def test_verifier_accepts_kimi_call_and_options(backend, on_hopper):
    for changes in ({}, dict(dtype=torch.float16), dict(dtype=torch.float32), dict(K=64, V=64),
                    dict(K=64), dict(V=64)):
        assert backend.chunk_kda_verifier(**kimi_call(**changes)) == (True, None), changes
    for extra in (dict(disable_recompute=True), dict(chunk_size=64), dict(transpose_state_layout=True),
                  dict(initial_state_indices=None), dict(has_initial_state=None), dict(state_v_first=True),
                  dict(return_intermediate_states=True)):
        assert backend.chunk_kda_verifier(**kimi_call(), **extra) == (True, None), extra


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"])
def test_verifier_rejects_inputs_that_require_grad(backend, on_hopper, name):
    call = kimi_call()
    call[name].requires_grad_()
    accepted, reason = backend.chunk_kda_verifier(**call)
    assert not accepted and reason == f"forward only: {name} requires grad"
    with torch.no_grad():
        assert backend.chunk_kda_verifier(**call) == (True, None)


@pytest.mark.parametrize("changes,words", [
    (dict(dtype=torch.float64), "torch.float64"),
    (dict(K=32), "K = 32"),
    (dict(K=256), "K = 256"),
    (dict(V=32), "V = 32"),
    (dict(V=256), "V = 256"),
    (dict(B=2, T=2 ** 20, H=16), "batch entry of 2^31"),    # meta tensors: kda_forward would refuse it
])
def test_verifier_rejects_shapes_and_dtypes(backend, on_hopper, changes, words):
    accepted, reason = backend.chunk_kda_verifier(**kimi_call(**changes))
    assert not accepted and words in reason


@pytest.mark.parametrize("extra,words", [
    (dict(cp_context=object()), "cp_context"),
    (dict(return_intermediate_states=True, initial_state_indices=torch.tensor([0])), "return_intermediate_states"),
    (dict(use_graph=True), "use_graph"),
    (dict(use_graph=True, max_num_seqs=4), "use_graph"),
    (dict(chunk_size=32), "chunk_size 32"),
    (dict(checkpoints=None), "unknown keyword checkpoints"),
])
def test_verifier_rejects_options(backend, on_hopper, extra, words):
    accepted, reason = backend.chunk_kda_verifier(**kimi_call(), **extra)
    assert not accepted and words in reason


# ---- dispatch from chunk_kda (CPU: kda_forward stood in for by a recorder) ----

@pytest.fixture
def recorder(monkeypatch):
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return "o", "final_state"
    monkeypatch.setattr(forward, "kda_forward", record)
    return calls


def test_chunk_kda_reaches_kda_forward(registry, on_hopper, recorder):
    call = kimi_call(device="cpu")
    lens = torch.tensor([0, 3, 8])
    assert chunk_kda(**call, cu_seqlens=lens, cu_seqlens_cpu=lens, safe_gate=True, lower_bound=-5.0,
                     chunk_size=64) == ("o", "final_state")
    (args, kwargs), = recorder
    assert args == ()                                                # every argument by name
    assert all(kwargs[n] is call[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    assert kwargs["scale"] is None and kwargs["output_final_state"] is True
    assert kwargs["A_log"] is call["A_log"] and kwargs["dt_bias"] is call["dt_bias"]
    assert kwargs["cu_seqlens"] is lens and kwargs["cu_seqlens_cpu"] is lens
    assert {n: kwargs[n] for n in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                                   "allow_neg_eigval", "safe_gate", "lower_bound", "state_v_first", "chunk_size")} == \
        dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
             allow_neg_eigval=False, safe_gate=True, lower_bound=-5.0, state_v_first=False, chunk_size=64)
    assert not {"transpose_state_layout", "initial_state_indices", "has_initial_state"} & kwargs.keys()


def test_chunk_kda_positional_call_and_passed_keywords(registry, on_hopper, recorder):
    c = kimi_call(device="cpu")
    indices, mask = torch.tensor([1]), torch.tensor([True])
    chunk_kda(c["q"], c["k"], c["v"], c["g"], c["beta"], 0.5, c["initial_state"], False, False, False,
              transpose_state_layout=True, initial_state_indices=indices, has_initial_state=mask)
    (args, kwargs), = recorder
    assert args == () and kwargs["scale"] == 0.5 and kwargs["initial_state"] is c["initial_state"]
    assert kwargs["output_final_state"] is False and kwargs["transpose_state_layout"] is True
    assert kwargs["initial_state_indices"] is indices and kwargs["has_initial_state"] is mask


def test_gate_parameters_dropped_without_gate_in_kernel(registry, on_hopper, recorder):
    # chunk_kda ignores A_log and dt_bias unless the gate is in kernel; kda_forward would reject them.
    chunk_kda(**{**kimi_call(device="cpu"), "use_gate_in_kernel": False})
    (_, kwargs), = recorder
    assert kwargs["A_log"] is None and kwargs["dt_bias"] is None


def checkpoints_writer(monkeypatch):
    """kda_forward stood in for by one that writes checkpoint row r of sequence n (its state after
    chunk r) as the value 1000·n + r + 1, and returns ("o", "final_state")."""
    def write(q, k, v, g, beta, *args, cu_seqlens=None, checkpoints=None, **kwargs):
        if cu_seqlens is None:
            for b in range(q.shape[0]):
                for r in range(checkpoints.shape[1]):
                    checkpoints[b, r] = 1000 * b + r + 1
        else:
            row = 0
            for n, (t0, t1) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())):
                for r in range(-(-(t1 - t0) // 64)):
                    checkpoints[0, row] = 1000 * n + r + 1
                    row += 1
        return "o", "final_state"
    monkeypatch.setattr(forward, "kda_forward", write)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("state", ["none", "dense", "masked"])
def test_intermediate_states_are_the_states_before_each_chunk(registry, on_hopper, monkeypatch, packed, state):
    # FLA's h: row j of a sequence its state before chunk j (its initial state in row 0), in k's dtype,
    # packed sequences' rows one after another (an empty sequence has none).
    checkpoints_writer(monkeypatch)
    lengths = [130, 0, 64, 1] if packed else [130, 130]
    N, T = len(lengths), sum(lengths) if packed else 130
    call = kimi_call(device="cpu", B=1 if packed else N, T=T, V=64)
    call["initial_state"] = torch.randn(N, 2, 128, 64) if state != "none" else None
    extra = {}
    if packed:
        cu = torch.tensor([0, *lengths]).cumsum(0)
        extra = dict(cu_seqlens=cu, cu_seqlens_cpu=cu)
    mask = torch.tensor([True, False] * (N // 2))
    if state == "masked":
        extra["has_initial_state"] = mask
    o, final, h = chunk_kda(**call, **extra, return_intermediate_states=True)
    assert (o, final) == ("o", "final_state") and h.dtype == call["k"].dtype
    expected, rows = [], []
    for n, length in enumerate(lengths):
        start = torch.zeros(2, 128, 64) if state == "none" or state == "masked" and not mask[n] \
            else call["initial_state"][n]
        chunks = -(-length // 64)
        rows += [start.to(h.dtype)] * (chunks > 0) + [torch.full((2, 128, 64), 1000 * n + r + 1.0) for r in range(chunks - 1)]
        if not packed:
            expected.append(torch.stack(rows))
            rows = []
    expected = torch.stack(expected) if not packed else torch.stack(rows)[None]
    assert h.shape == expected.shape and torch.equal(h, expected.to(h.dtype))


# ---- GPU: chunk_kda's result is kda_forward's ----

@gpu
def test_chunk_kda_is_kda_forward_on_gpu(registry, monkeypatch):
    torch.manual_seed(0)
    call = kimi_call(device="cuda", T=300, H=4)
    calls = []
    real = forward.kda_forward

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(forward, "kda_forward", spy)
    with torch.inference_mode():
        o, state = chunk_kda(**call)
        assert len(calls) == 1
        o_ours, state_ours = real(**call)
        assert torch.equal(o, o_ours) and torch.equal(state, state_ours)
        monkeypatch.setenv("FLA_KDA_OPT", "0")
        o_fla, state_fla = chunk_kda(**call)
    assert len(calls) == 1                                          # FLA's own path ran
    assert rel_err(o_fla, o_ours) < 1e-2 and rel_err(state_fla, state_ours) < 1e-2


@gpu
@pytest.mark.parametrize("packed", [False, True])
def test_intermediate_states_match_fla_on_gpu(registry, monkeypatch, packed):
    torch.manual_seed(0)
    lengths = (200, 64, 1, 130) if packed else (300, 300)
    N = len(lengths)
    call = kimi_call(device="cuda", B=1 if packed else N, T=sum(lengths) if packed else 300, H=4)
    call["initial_state"] = torch.randn(N, 4, 128, 128, device="cuda")
    call["state_v_first"] = True
    if packed:      # no host copy: the rows' count is read from the device, as FLA does
        call["cu_seqlens"] = torch.tensor([0, *lengths], device="cuda").cumsum(0)
    with torch.inference_mode():
        o, final, h = chunk_kda(**call, return_intermediate_states=True)
        monkeypatch.setenv("FLA_KDA_OPT", "0")
        o_fla, final_fla, h_fla = chunk_kda(**call, return_intermediate_states=True)
    assert h.shape == h_fla.shape and h.dtype == h_fla.dtype
    assert rel_err(h, h_fla) < 1e-2 and rel_err(o, o_fla) < 1e-2 and rel_err(final, final_fla) < 1e-2


# ---- the decode kernel: fused_recurrent_kda_fwd ----

@pytest.fixture
def decode_registry(monkeypatch):
    """FLA's "kda" operation registry with kda_opt's decode backend registered; restored after."""
    monkeypatch.delenv("FLA_KDA_OPT", raising=False)
    registry = fla_backends._load_operation_registry("kda")
    kda_opt.use_in_fla()
    yield registry
    registry._backends.pop("kda_opt", None)


def decode_call(device="cpu", N=3, slots=5):
    """fused_recurrent_kda_fwd's keywords for vLLM's decode step: one token per request, a V-first pool."""
    call = kimi_call(device=device, B=N, T=1)
    pool = torch.randn(slots, 2, 128, 128, device=device)
    return {**{n: x for n, x in call.items() if n not in ("initial_state", "output_final_state")},
            "initial_state": pool, "ssm_state_indices": torch.tensor([4, 0, 2], device=device),
            "state_v_first": True, "lower_bound": -5.0}


def test_decode_verifier(decode_registry, on_hopper):
    backend = decode_registry._backends["kda_opt"]
    assert backend.verify("fused_recurrent_kda_fwd", **decode_call()) == (True, None)
    per_token = backend.verify("fused_recurrent_kda_fwd", **decode_call(), inplace_final_state=False,
                               output_final_state=True)
    assert per_token[0] is False and "per-token" in per_token[1]
    bad = backend.verify("fused_recurrent_kda_fwd", **{**decode_call(), "ssm_state_indices": torch.tensor([1])})
    assert bad[0] is False and "ssm_state_indices must have shape" in bad[1]
    # Other functions of the registry have no verifier and no implementation here: FLA's own run.
    assert backend.get_implementation("kda_gate_fwd") is None


def test_decode_verifier_checks_a_call_once_per_signature(decode_registry, on_hopper, monkeypatch):
    from kda_opt import decode_plan, plan_cache
    made = []
    real = decode_plan.make_decode_plan
    monkeypatch.setattr(decode_plan, "make_decode_plan", lambda a, **kw: made.append(1) or real(a, **kw))
    monkeypatch.setattr(plan_cache, "_plans", {})           # no signature of an earlier test
    backend = decode_registry._backends["kda_opt"]
    call = decode_call()
    for _ in range(3):
        assert backend.verify("fused_recurrent_kda_fwd", **call) == (True, None)
    assert backend.verify("fused_recurrent_kda_fwd", **{**call, "lower_bound": -4.0}) == (True, None)
    assert len(made) == 2                                   # the second signature checked once more


def test_decode_verifier_rejects_off_hopper(decode_registry, monkeypatch):
    monkeypatch.setattr(engines, "on_hopper", lambda device: False)
    accepted, reason = decode_registry._backends["kda_opt"].verify("fused_recurrent_kda_fwd", **decode_call())
    assert not accepted and "compute capability 9" in reason


def test_fused_recurrent_reaches_kda_decode(decode_registry, on_hopper, monkeypatch):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    calls = []
    monkeypatch.setattr(kda_opt.decode, "kda_decode", lambda **kwargs: calls.append(kwargs) or ("o", "pool"))
    call = decode_call()
    assert fused_recurrent_kda_fwd(**call, output_final_state=True) == ("o", "pool")
    (kwargs,), = [calls]
    assert kwargs["inplace_final_state"] is True and kwargs["output_final_state"] is False   # in place wins, as FLA
    assert kwargs["ssm_state_indices"] is call["ssm_state_indices"] and kwargs["initial_state"] is call["initial_state"]
    assert kwargs["state_v_first"] is True and kwargs["lower_bound"] == -5.0


@gpu
def test_fused_recurrent_is_kda_decode_on_gpu(decode_registry):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    torch.manual_seed(0)
    call = decode_call(device="cuda")
    ours = kda_opt.kda_decode(**{**call, "initial_state": call["initial_state"].clone()}, inplace_final_state=True)
    with torch.inference_mode():
        routed = fused_recurrent_kda_fwd(**call)
    assert torch.equal(routed[0], ours[0]) and torch.equal(routed[1], ours[1])


# ---- FLA's KDA layer, past FLA's dispatch ----

@pytest.fixture
def layer(monkeypatch):
    """A stand-in for flash-linear-attention's fla.layers.kda (not a test dependency): its chunk_kda and
    fused_recurrent_kda record their calls as FLA's own functions would be called; use_in_fla has
    pointed it at kda_opt (twice: the wrappers wrap FLA's functions once)."""
    import types
    module, own = types.ModuleType(fla_backend.LAYER), []
    module.chunk_kda = lambda *args, **kwargs: own.append(("chunk", args, kwargs)) or ("fla o", "fla state")
    module.fused_recurrent_kda = lambda **kwargs: own.append(("decode", (), kwargs)) or ("fla o", "fla state")
    firsts = (module.chunk_kda, module.fused_recurrent_kda)
    monkeypatch.setitem(sys.modules, fla_backend.LAYER, module)
    monkeypatch.delenv("FLA_KDA_OPT", raising=False)
    for _ in range(2):
        kda_opt.use_in_fla()
    assert (module.chunk_kda.fla_own, module.fused_recurrent_kda.fla_own) == firsts
    yield module, own
    for registry in (fla_backends._function_registries[inspect.unwrap(chunk_kda)],
                     fla_backends._load_operation_registry("kda")):
        registry._backends.pop("kda_opt", None)


@pytest.fixture
def decode_stand_ins(monkeypatch):
    """decode.call recorded; decode_plan.decode_plan_for's checks made as on a GPU of one SM (CPU tensors)."""
    from kda_opt import decode_plan, plan_cache
    calls = []
    monkeypatch.setattr(decode_plan, "decode_plan_for",
                        lambda a: plan_cache.Entry(decode_plan.make_decode_plan(a, sms=1)))
    monkeypatch.setattr(decode, "call", lambda entry, arguments: calls.append((entry, arguments)) or ("o", None))
    return calls


def layer_decode_call(K=128):
    """fused_recurrent_kda's keywords as FLA's KDA layer passes them in a decode step (B = 2)."""
    call = kimi_call(device="cpu", B=2, T=1, K=K)
    state = torch.randn(2, 2, 128, K)                                   # V-first
    return {**call, "initial_state": state, "state_v_first": True, "allow_neg_eigval": False, "lower_bound": None,
            "cu_seqlens": None}


def test_layer_decode_runs_kda_decode_past_dispatch(layer, on_hopper, decode_stand_ins):
    module, own = layer
    assert module.fused_recurrent_kda(**layer_decode_call()) == ("o", None)
    (entry, arguments), = decode_stand_ins
    assert not own and entry.plan.write == 1 and entry.plan.state_v_first
    call = layer_decode_call()
    assert arguments._fields == tuple(inspect.signature(kda_opt.kda_decode).parameters)
    assert arguments.inplace_final_state is False and arguments.ssm_state_indices is None
    assert arguments.A_log is not None and arguments.output_final_state is True
    assert arguments.q.shape == call["q"].shape


@pytest.mark.parametrize("case", ["FLA_KDA_OPT=0", "off Hopper", "refused", "FLA's own keyword"])
def test_layer_decode_left_to_fla(layer, on_hopper, decode_stand_ins, monkeypatch, case):
    module, own = layer
    call = layer_decode_call(K=256 if case == "refused" else 128)      # kda_decode takes K of 64 or 128
    extra = {}
    if case == "FLA_KDA_OPT=0":
        monkeypatch.setenv("FLA_KDA_OPT", "0")
    elif case == "off Hopper":
        monkeypatch.setattr(engines, "on_hopper", lambda device: False)
    elif case == "FLA's own keyword":
        extra = dict(transpose_state_layout=True)
    assert module.fused_recurrent_kda(**call, **extra) == ("fla o", "fla state")
    (kind, _, kwargs), = own
    assert kind == "decode" and not decode_stand_ins
    assert kwargs.keys() == {*call, "scale", *extra} and all(kwargs[n] is x for n, x in call.items())


def test_layer_chunk_runs_kda_forward_past_dispatch(layer, on_hopper, recorder):
    module, own = layer
    call = kimi_call(device="cpu")
    assert module.chunk_kda(**call, safe_gate=True, lower_bound=-5.0) == ("o", "final_state")
    (args, kwargs), = recorder
    assert not own and kwargs["q"] is call["q"] and kwargs["A_log"] is call["A_log"] and kwargs["safe_gate"] is True


def test_layer_chunk_left_to_fla(layer, on_hopper, recorder, monkeypatch):
    module, own = layer
    grad = kimi_call(device="cpu")
    grad["q"].requires_grad_()
    module.chunk_kda(**grad)                                            # the verifier declines: training
    monkeypatch.setenv("FLA_KDA_OPT", "0")
    module.chunk_kda(**kimi_call(device="cpu"))
    assert not recorder and [kind for kind, *_ in own] == ["chunk", "chunk"]


@gpu
def test_layer_calls_are_kda_opt_on_gpu(registry, monkeypatch):
    layer = pytest.importorskip(fla_backend.LAYER)          # flash-linear-attention: the bench extra
    for name in ("chunk_kda", "fused_recurrent_kda"):
        monkeypatch.setattr(layer, name, getattr(getattr(layer, name), "fla_own", getattr(layer, name)))
    kda_opt.use_in_fla()
    torch.manual_seed(0)
    for T, ours, routed in ((1, kda_opt.kda_decode, layer.fused_recurrent_kda),
                            (100, kda_opt.kda_forward, layer.chunk_kda)):
        call = {**kimi_call(device="cuda", B=2, T=T), "state_v_first": True}
        with torch.inference_mode():
            expected, got = ours(**call), routed(**call)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), T
    assert layer.fused_recurrent_kda.fla_own is not layer.fused_recurrent_kda
