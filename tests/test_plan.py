"""The plan (kda_opt/plan): every bad input raises before any kernel runs (CPU: all shape, dtype and
option checks precede the device check), the launch decisions as pure functions (CPU), and on the GPU
what make_plan resolves for the calls users make."""
import inspect
import itertools

import pytest
import torch

from inputs import PER_TOKEN, random_inputs
from kda_opt import kda_decode, kda_forward
from kda_opt.arguments import DecodeArguments, ForwardArguments
from kda_opt.segment_tables import piece_tables
from kda_opt.seqs import RANK_MAX
from kda_opt.intra import FP32_WARPS, NUM_WARPS
from kda_opt.plan import (ParallelCut, Tuning, _parallel_pays, cut_sequences, parallel_segments,
                          time_segments)
from tests.conftest import gpu
from tests.stage_inputs import plan_of


# ---- validation: every bad input raises before any kernel runs (these run on CPU tensors, since
# all shape/dtype/option checks precede the device check) ----

def cpu_args(**over):
    args = random_inputs(1, 8, 2, 64, device="cpu", dtype=torch.float32)
    args.update(over)
    return args


POOL = torch.zeros(4, 2, 64, 64)  # a state pool of 4 slots for cpu_args' shapes

BAD_INPUTS = {
    "q not a tensor": (TypeError, "q", dict(q=[1.0])),
    "q integer": (TypeError, "q", dict(q=torch.ones(1, 8, 2, 64, dtype=torch.int32))),
    "q 3-D": (ValueError, "q", dict(q=torch.randn(8, 2, 64))),
    "k shape": (ValueError, "k", dict(k=torch.randn(1, 8, 2, 32))),
    "v batch": (ValueError, "v", dict(v=torch.randn(2, 8, 2, 64))),
    "g shape": (ValueError, "g", dict(g=torch.randn(1, 8, 2, 32))),
    "beta shape": (ValueError, "beta", dict(beta=torch.rand(1, 8, 3))),
    "HV not multiple of H": (ValueError, "head count", dict(v=torch.randn(1, 8, 3, 64), g=torch.randn(1, 8, 3, 64),
                                                           beta=torch.rand(1, 8, 3), A_log=torch.randn(3),
                                                           dt_bias=torch.randn(3 * 64))),
    "head dim 96": (ValueError, "head dims", dict(q=torch.randn(1, 8, 2, 96), k=torch.randn(1, 8, 2, 96),
                                                  g=torch.randn(1, 8, 2, 96), dt_bias=torch.randn(2 * 96))),
    "dtype float64": (TypeError, "q", dict(q=torch.randn(1, 8, 2, 64, dtype=torch.float64))),
    "mixed dtypes": (TypeError, "share one dtype", dict(v=torch.randn(1, 8, 2, 64, dtype=torch.bfloat16))),
    "initial_state shape": (ValueError, "initial_state", dict(initial_state=torch.zeros(1, 2, 64, 32))),
    "chunk_size 32": (ValueError, "chunk_size", dict(chunk_size=32)),
    "gate in kernel, no A_log nor lower_bound": (ValueError, "A_log", dict(lower_bound=None, safe_gate=False, A_log=None)),
    "safe_gate in kernel without lower_bound": (ValueError, "lower_bound", dict(lower_bound=None)),
    "safe_gate lower_bound out of range": (ValueError, "lower_bound", dict(lower_bound=-6.0)),
    "A_log wrong size": (ValueError, "A_log", dict(A_log=torch.randn(3))),
    "dt_bias wrong size": (ValueError, "dt_bias", dict(dt_bias=torch.randn(64))),
    "A_log without gate in kernel": (ValueError, "A_log", dict(use_gate_in_kernel=False)),
    "head dim 256": (ValueError, "256", dict(q=torch.randn(1, 8, 2, 256), k=torch.randn(1, 8, 2, 256),
                                             g=torch.randn(1, 8, 2, 256), dt_bias=torch.randn(2 * 256))),
    "cu_seqlens float": (TypeError, "cu_seqlens", dict(cu_seqlens=torch.tensor([0.0, 8.0]))),
    "cu_seqlens not a tensor": (TypeError, "cu_seqlens", dict(cu_seqlens=[0, 8])),
    "cu_seqlens 2-D": (ValueError, "cu_seqlens", dict(cu_seqlens=torch.tensor([[0, 8]]))),
    "cu_seqlens one entry": (ValueError, "cu_seqlens", dict(cu_seqlens=torch.tensor([0]))),
    "cu_seqlens with B > 1": (ValueError, "batch size must be 1", dict(
        cu_seqlens=torch.tensor([0, 8]), **{n: torch.cat([x, x]) for n, x in cpu_args().items()
                                             if n in PER_TOKEN})),
    "initial_state for B, not N": (ValueError, "initial_state", dict(
        cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, 2, 64, 64))),
    "cu_seqlens_cpu alone": (ValueError, "cu_seqlens_cpu", dict(cu_seqlens_cpu=torch.tensor([0, 8]))),
    "cu_seqlens_cpu falls": (ValueError, "cu_seqlens_cpu", dict(
        cu_seqlens=torch.tensor([0, 5, 3, 8]), cu_seqlens_cpu=torch.tensor([0, 5, 3, 8]))),
    "cu_seqlens_cpu short of T": (ValueError, "cu_seqlens_cpu", dict(
        cu_seqlens=torch.tensor([0, 5, 7]), cu_seqlens_cpu=torch.tensor([0, 5, 7]))),
    "cu_seqlens_cpu other length": (ValueError, "cu_seqlens_cpu", dict(
        cu_seqlens=torch.tensor([0, 5, 8]), cu_seqlens_cpu=torch.tensor([0, 8]))),
    "allow_neg_eigval without beta logits": (ValueError, "use_beta_sigmoid_in_kernel", dict(allow_neg_eigval=True)),
    "state_v_first and transpose_state_layout": (ValueError, "transpose_state_layout", dict(
        state_v_first=True, transpose_state_layout=True)),
    "initial_state float64": (TypeError, "initial_state", dict(initial_state=torch.zeros(1, 2, 64, 64, dtype=torch.float64))),
    "initial_state K-first with state_v_first": (ValueError, "state_v_first", dict(
        state_v_first=True, v=torch.randn(1, 8, 2, 128), initial_state=torch.zeros(1, 2, 64, 128))),
    "CPU tensors": (ValueError, "CUDA", dict()),
    **{f"serving: {name}": (exc, words, {"output_final_state": False, **over}) for name, (exc, words, over) in {
        "indices without a pool": (ValueError, "needs initial_state", dict(initial_state_indices=torch.tensor([0]))),
        "indices float": (TypeError, "initial_state_indices must be int32", dict(
            initial_state=POOL, initial_state_indices=torch.tensor([0.0]))),
        "indices per token": (ValueError, r"initial_state_indices must have shape \[1\]", dict(
            initial_state=POOL, initial_state_indices=torch.tensor([0, 1]))),
        "pool with output_final_state": (ValueError, "output_final_state=False", dict(
            initial_state=POOL, initial_state_indices=torch.tensor([0]), output_final_state=True)),
        "pool row shape": (ValueError, "state pool.*shape", dict(
            initial_state=torch.zeros(4, 2, 64, 32), initial_state_indices=torch.tensor([0]))),
        "pool rows not dense": (ValueError, "dense", dict(
            initial_state=torch.zeros(4, 2, 64, 64).transpose(2, 3), initial_state_indices=torch.tensor([0]))),
        "pool float64": (TypeError, "initial_state", dict(
            initial_state=POOL.double(), initial_state_indices=torch.tensor([0]))),
        "indices_cpu alone": (ValueError, "without initial_state_indices", dict(
            initial_state=POOL, initial_state_indices_cpu=torch.tensor([0]))),
        "indices_cpu past the pool": (ValueError, "below the pool's 4 slots", dict(
            initial_state=POOL, initial_state_indices=torch.tensor([4]), initial_state_indices_cpu=torch.tensor([4]))),
        "indices_cpu a slot twice": (ValueError, "twice", dict(
            cu_seqlens=torch.tensor([0, 3, 8]), initial_state=POOL, initial_state_indices=torch.tensor([2, 2]),
            initial_state_indices_cpu=torch.tensor([2, 2]))),
        "pad_slot without slot indices": (ValueError, "needs slot indices", dict(
            initial_state=torch.zeros(1, 2, 64, 64), pad_slot=0)),
        "pad_slot negative": (TypeError, "pad_slot", dict(
            initial_state=POOL, initial_state_indices=torch.tensor([0]), pad_slot=-1)),
        "indices_cpu a slot twice, the pad slot apart": (ValueError, "twice", dict(
            cu_seqlens=torch.tensor([0, 3, 5, 8]), initial_state=POOL, initial_state_indices=torch.tensor([2, 0, 2]),
            initial_state_indices_cpu=torch.tensor([2, 0, 2]), pad_slot=0)),
        "indices_cpu other length": (ValueError, "initial_state_indices_cpu must have shape", dict(
            initial_state=POOL, initial_state_indices=torch.tensor([1]), initial_state_indices_cpu=torch.tensor([1, 2]))),
        "has_initial_state int": (TypeError, "has_initial_state", dict(
            initial_state=torch.zeros(1, 2, 64, 64), has_initial_state=torch.tensor([1]))),
        "has_initial_state shape": (ValueError, "has_initial_state", dict(
            initial_state=torch.zeros(1, 2, 64, 64), has_initial_state=torch.tensor([True, False]))),
        "has_initial_state without a state": (ValueError, "needs initial_state", dict(
            has_initial_state=torch.tensor([True]))),
        "checkpoints too few rows": (ValueError, "checkpoints must have shape", dict(
            q=torch.randn(1, 65, 2, 64), k=torch.randn(1, 65, 2, 64), v=torch.randn(1, 65, 2, 64),
            g=torch.randn(1, 65, 2, 64), beta=torch.rand(1, 65, 2), checkpoints=torch.zeros(1, 1, 2, 64, 64))),
        "checkpoints K-first with state_v_first": (ValueError, "checkpoints must have shape", dict(
            state_v_first=True, v=torch.randn(1, 8, 2, 128), checkpoints=torch.zeros(1, 1, 2, 64, 128))),
        "checkpoints short of the packed chunks": (ValueError, "checkpoints", dict(
            cu_seqlens=torch.tensor([0, 3, 8]), cu_seqlens_cpu=torch.tensor([0, 3, 8]),
            checkpoints=torch.zeros(1, 1, 2, 64, 64))),
        "checkpoints int": (TypeError, "checkpoints", dict(checkpoints=torch.zeros(1, 1, 2, 64, 64, dtype=torch.int32))),
        "checkpoint_every not a multiple of 64": (ValueError, "checkpoint_every must be a positive multiple of 64", dict(
            checkpoints=torch.zeros(1, 1, 2, 64, 64), checkpoint_every=96)),
        "checkpoint_every 0": (ValueError, "checkpoint_every", dict(checkpoints=torch.zeros(1, 1, 2, 64, 64),
                                                                  checkpoint_every=0)),
        "checkpoint_every a bool": (ValueError, "checkpoint_every", dict(checkpoints=torch.zeros(1, 1, 2, 64, 64),
                                                                         checkpoint_every=True)),
        "checkpoint_every without checkpoints": (ValueError, "needs checkpoints", dict(checkpoint_every=128)),
        "checkpoints short of the intervals": (ValueError, r"checkpoints must have shape \[1, ≥ 2, .*every 128 tokens",
                                               dict(q=torch.randn(1, 129, 2, 64), k=torch.randn(1, 129, 2, 64),
                                                    v=torch.randn(1, 129, 2, 64), g=torch.randn(1, 129, 2, 64),
                                                    beta=torch.rand(1, 129, 2), checkpoint_every=128,
                                                    checkpoints=torch.zeros(1, 1, 2, 64, 64))),
        "checkpoint_offsets without checkpoints": (ValueError, "checkpoint_offsets .* needs checkpoints", dict(
            cu_seqlens=torch.tensor([0, 3, 8]), checkpoint_offsets=torch.tensor([1, 2]))),
        "checkpoint_offsets without cu_seqlens": (ValueError, "needs checkpoints and cu_seqlens", dict(
            checkpoints=torch.zeros(1, 1, 2, 64, 64), checkpoint_offsets=torch.tensor([1]))),
        "checkpoint_offsets float": (TypeError, "checkpoint_offsets must be int32", dict(
            cu_seqlens=torch.tensor([0, 3, 8]), checkpoints=torch.zeros(1, 4, 2, 64, 64),
            checkpoint_offsets=torch.tensor([1.0, 2.0]))),
        "checkpoint_offsets per token": (ValueError, r"checkpoint_offsets must have shape \[2\]", dict(
            cu_seqlens=torch.tensor([0, 3, 8]), checkpoints=torch.zeros(1, 4, 2, 64, 64),
            checkpoint_offsets=torch.tensor([1, 2, 3]))),
        "checkpoints short of the packed intervals": (ValueError, r"Σ cdiv\(len_n, 128\)", dict(
            q=torch.randn(1, 200, 2, 64), k=torch.randn(1, 200, 2, 64), v=torch.randn(1, 200, 2, 64),
            g=torch.randn(1, 200, 2, 64), beta=torch.rand(1, 200, 2), cu_seqlens=torch.tensor([0, 129, 200]),
            cu_seqlens_cpu=torch.tensor([0, 129, 200]), checkpoint_every=128, checkpoints=torch.zeros(1, 2, 2, 64, 64))),
    }.items()},
    "scale a string": (TypeError, "scale must be a real number", dict(scale="x")),
    "scale a tensor": (TypeError, "scale must be a real number", dict(scale=torch.tensor(0.5))),
    "scale True": (TypeError, "scale must be a real number", dict(scale=True)),
    "scale NaN": (ValueError, "scale must be finite", dict(scale=float("nan"))),
    "scale infinite": (ValueError, "scale must be finite", dict(scale=-float("inf"))),
    "q requires grad": (RuntimeError, "forward-only.*q require grad", dict(q=torch.randn(1, 8, 2, 64, requires_grad=True))),
    "A_log a parameter": (RuntimeError, "A_log require grad", dict(A_log=torch.nn.Parameter(torch.randn(2)))),
}


def test_requires_grad_is_fine_without_autograd():
    """Under no_grad (as a served model runs) parameters that require grad pass validation (the CPU
    tensors then stop the call)."""
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA"):
        kda_forward(**cpu_args(A_log=torch.nn.Parameter(torch.randn(2))))


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises(case):
    exc, words, over = BAD_INPUTS[case]
    with pytest.raises(exc, match=words):
        kda_forward(**cpu_args(**over))


def test_batch_entry_past_int32_raises():
    """B > 1 whose entries span 2^31 elements or more (2 × 2^20 tokens at HV = 16, K = V = 128; on meta
    tensors): refused with the way out (packed); B = 1 at that length passes to the device check."""
    meta = lambda *shape: torch.empty(*shape, device="meta")
    args = lambda B: dict(q=meta(B, 2 ** 20, 16, 128), k=meta(B, 2 ** 20, 16, 128), v=meta(B, 2 ** 20, 16, 128),
                          g=meta(B, 2 ** 20, 16, 128), beta=meta(B, 2 ** 20, 16))
    with pytest.raises(ValueError, match="batch entry.*packed"):
        kda_forward(**args(2))
    with pytest.raises(ValueError, match="CUDA"):
        kda_forward(**args(1))
    small = cpu_args()
    checkpoints = torch.empty(2, 2 ** 18 + 1, 2, 64, 64, device="meta")     # a batch stride past 2^31
    with pytest.raises(ValueError, match=f"got {checkpoints.stride(0)}: pass the sequences packed"):
        kda_forward(**{n: x.expand(2, *x.shape[1:]) if n in PER_TOKEN else x for n, x in small.items()},
                    checkpoints=checkpoints)


@pytest.mark.parametrize("over", [
    dict(initial_state=torch.zeros(4, 2 * 64 * 64 + 8)[:, :2 * 64 * 64].view(4, 2, 64, 64),
         initial_state_indices=torch.tensor([3]), initial_state_indices_cpu=torch.tensor([3])),
    dict(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=POOL, initial_state_indices=torch.tensor([-1, 2]),
         initial_state_indices_cpu=torch.tensor([-1, 2]), has_initial_state=torch.tensor([False, True])),
    dict(cu_seqlens=torch.tensor([0, 3, 8]), cu_seqlens_cpu=torch.tensor([0, 3, 8]), checkpoints=torch.zeros(1, 2, 2, 64, 64)),
    dict(cu_seqlens=torch.tensor([0, 3, 8]), checkpoints=torch.zeros(1, 1, 2, 64, 64)),  # no host lengths: not checked
    dict(cu_seqlens=torch.tensor([0, 3, 8]), cu_seqlens_cpu=torch.tensor([0, 3, 8]), checkpoints=torch.zeros(1, 2, 2, 64, 64),
         checkpoint_every=512),
], ids=["padded pool rows", "-1 and a mask", "packed checkpoints", "packed checkpoints unchecked",
        "checkpoints every 512 tokens"])
def test_serving_arguments_pass_validation(over):
    """Pools with padded rows, −1 slots (no state), a mask and checkpoint buffers are taken: the CPU
    tensors stop the call only at the device check."""
    with pytest.raises(ValueError, match="CUDA"):
        kda_forward(**cpu_args(output_final_state=False, **over))


def test_transpose_state_layout_is_deprecated():
    """FLA's old name still works, with a DeprecationWarning (the CPU tensors then stop the call)."""
    with pytest.warns(DeprecationWarning, match="state_v_first"), pytest.raises(ValueError, match="CUDA"):
        kda_forward(**cpu_args(transpose_state_layout=True))


def test_options_after_output_final_state_are_keyword_only():
    """FLA's positional order differs past output_final_state: a positional call must not be taken
    for another option."""
    a = cpu_args()
    with pytest.raises(TypeError):
        kda_forward(a["q"], a["k"], a["v"], a["g"], a["beta"], None, None, True, True)


@gpu
@pytest.mark.parametrize("name", ["beta", "cu_seqlens"])
def test_device_mismatch_raises(name):
    args = random_inputs(1, 8, 2, 64, seqlens=[3, 5])
    args[name] = args[name].cpu()
    with pytest.raises(ValueError, match=name):
        kda_forward(**args)


@pytest.mark.parametrize("function, record", [(kda_forward, ForwardArguments), (kda_decode, DecodeArguments)])
def test_argument_records_list_the_functions_parameters(function, record):
    """Each call's record (kda_opt/arguments) has its function's parameters, in order, with their
    defaults: the function builds it by keyword from every one of them."""
    parameters = inspect.signature(function).parameters
    assert record._fields == tuple(parameters)
    assert record._field_defaults == {n: p.default for n, p in parameters.items()
                                      if p.default is not inspect.Parameter.empty}


# ---- the plan cache (kda_opt/plan.plan_for, kda_opt/plan_cache): make_plan stubbed, so that these run on CPU tensors ----

@pytest.fixture
def planned(monkeypatch):
    """plan_for with make_plan counting its calls: (plan_for, calls), calls a list of the arguments
    each new plan was made from."""
    import kda_opt.plan as plan_module
    import kda_opt.plan_cache as plan_cache
    calls = []
    monkeypatch.setattr(plan_module, "make_plan", lambda a: calls.append(a) or object())
    monkeypatch.setattr(plan_cache, "_plans", {})
    arguments = lambda **over: ForwardArguments(**{**cpu_args(output_final_state=False), **over})
    return (lambda **over: plan_module.plan_for(arguments(**over))), calls

SAME_SIGNATURE = {
    "the same tensors": lambda a: {},
    "other values, same metadata": lambda a: dict(q=torch.randn_like(a["q"]), beta=torch.rand_like(a["beta"])),
}
NEW_SIGNATURE = {
    "shape": lambda a: {n: torch.cat([a[n], a[n]], 1) for n in PER_TOKEN},
    "stride": lambda a: dict(q=torch.randn(1, 2, 8, 64).transpose(1, 2)),
    "dtype": lambda a: {n: a[n].half() for n in ("q", "k", "v")},
    "device": lambda a: {n: a[n].to("meta") for n in ("q", "k", "v", "g", "beta")},
    "alignment": lambda a: dict(g=torch.randn(a["g"].numel() + 1)[1:].view(a["g"].shape)),
    "requires_grad": lambda a: dict(q=a["q"].clone().requires_grad_()),
    "a flag": lambda a: dict(use_qk_l2norm_in_kernel=True),
    "an option's value": lambda a: dict(lower_bound=-4.0),
    "the scale": lambda a: dict(scale=0.5),
    "the checkpoint spacing": lambda a: dict(checkpoint_every=128),
    "an input given": lambda a: dict(initial_state=torch.zeros(1, 2, 64, 64)),
    "a host copy given": lambda a: dict(cu_seqlens=torch.tensor([0, 8]), cu_seqlens_cpu=torch.tensor([0, 8])),
}


@pytest.mark.parametrize("name", list(SAME_SIGNATURE) + list(NEW_SIGNATURE))
def test_plan_cache_keys_on_the_whole_signature(planned, name):
    """A call whose signature was planned before reuses that plan; any change a check or a choice of
    make_plan reads (shape, stride, dtype, device, alignment, requires_grad, flag or option) makes a
    new one."""
    plan_for, calls = planned
    base = cpu_args(output_final_state=False)
    first = plan_for(**base)
    change = {**SAME_SIGNATURE, **NEW_SIGNATURE}[name](base)
    second = plan_for(**base, **change) if not set(change) & set(base) else plan_for(**{**base, **change})
    assert (second is first) == (name in SAME_SIGNATURE)
    assert len(calls) == (1 if name in SAME_SIGNATURE else 2)


def test_plan_cache_grad_mode_and_warnings(planned):
    """The grad mode is part of the signature, and requires_grad only with it on (where it is an
    error); a call with the deprecated transpose_state_layout is planned, and so warned about,
    every time."""
    plan_for, calls = planned
    plan_for()
    with torch.no_grad():
        plan_for()
        plan_for(q=cpu_args()["q"].requires_grad_())
    plan_for(transpose_state_layout=True)
    plan_for(transpose_state_layout=True)
    assert len(calls) == 4


HOST_COPY_ERRORS = {
    "cu_seqlens_cpu falls": (dict(cu_seqlens_cpu=torch.tensor([0, 6, 5, 8])), "cu_seqlens_cpu must rise"),
    "cu_seqlens_cpu short of T": (dict(cu_seqlens_cpu=torch.tensor([0, 3, 7, 7])), "cu_seqlens_cpu must rise"),
    "checkpoints short of the lengths": (dict(cu_seqlens_cpu=torch.tensor([0, 3, 5, 8])), "checkpoints must have shape"),
    "a slot past the pool": (dict(initial_state_indices_cpu=torch.tensor([0, 4, 1])), "below the pool's 4 slots"),
    "a slot twice": (dict(initial_state_indices_cpu=torch.tensor([2, -1, 2])), "twice"),
}


def test_pad_slot_may_be_named_many_times():
    """initial_state_indices_cpu may name the declared pad slot any number of times (vLLM pads with
    slot 0): it is neither read nor written."""
    from kda_opt.checks import check_host_copies
    check_host_copies(8, None, torch.tensor([0, 2, 0, 0, 1]), POOL, None, pad_slot=0)
    with pytest.raises(ValueError, match="twice"):
        check_host_copies(8, None, torch.tensor([0, 2, 0, 0, 1]), POOL, None)


@pytest.mark.parametrize("case", list(HOST_COPY_ERRORS))
def test_plan_cache_checks_host_copies_every_call(planned, case):
    """The host copies' values are in no signature: a call that reuses a plan still raises on them,
    with make_plan's message."""
    plan_for, calls = planned
    good = dict(cu_seqlens=torch.tensor([0, 8, 8, 8]), cu_seqlens_cpu=torch.tensor([0, 8, 8, 8]),
                initial_state=POOL, initial_state_indices=torch.tensor([0, 2, 1]),
                initial_state_indices_cpu=torch.tensor([0, 2, 1]), checkpoints=torch.zeros(1, 1, 2, 64, 64))
    plan_for(**good)
    over, words = HOST_COPY_ERRORS[case]
    with pytest.raises(ValueError, match=words):
        plan_for(**{**good, **over})
    assert len(calls) == 1   # the signature's plan, reused


def test_plan_cache_is_bounded(planned):
    """The oldest signature goes past PLAN_CACHE_SIZE."""
    import kda_opt.plan_cache as plan_cache
    plan_for, calls = planned
    for scale in range(plan_cache.PLAN_CACHE_SIZE + 1):
        plan_for(scale=float(scale + 1))
    assert len(plan_cache._plans) == plan_cache.PLAN_CACHE_SIZE
    plan_for(scale=1.0)
    assert len(calls) == plan_cache.PLAN_CACHE_SIZE + 2


def test_time_segments():
    """Where a lone sequence is cut into time segments (kda_opt/plan), and how."""
    cut = lambda T, N=1, programs=64, is_packed=False, tokens=8192, count=8: time_segments(
        T, N, programs, 132, is_packed, tokens, count)
    assert cut(65536) == tuple((t, t + 8192) for t in range(0, 65536, 8192))
    assert cut(20000) == ((0, 10048), (10048, 20000))
    assert cut(65536, programs=67) == ((0, 65536),)     # stage 4 fills half the SMs
    assert cut(65536, N=2) == ((0, 65536),)             # several sequences
    assert cut(65536, is_packed=True) == ((0, 65536),)  # packed
    assert cut(16383) == ((0, 16383),)                  # under two segments
    assert cut(65536, count=1) == ((0, 65536),)         # off
    assert cut(1000, tokens=128) == ((0, 192), (192, 384), (384, 576), (576, 768), (768, 960), (960, 1000))
    # Checkpoints every 256 tokens: segments of whole intervals, so that each writes whole rows.
    assert time_segments(1000, 1, 64, 132, False, 128, 8, align=256) == ((0, 256), (256, 512), (512, 768), (768, 1000))
    for T in range(16384, 200_000, 997):
        segs = cut(T, programs=32)
        assert 2 <= len(segs) <= 8 and segs[0][0] == 0 and segs[-1][1] == T
        assert all(a1 == b0 and b0 % 64 == 0 and b0 - a0 >= 64 for (a0, b0), (a1, _) in zip(segs, segs[1:]))


def test_parallel_segments():
    """Where a lone sequence's segments run at once (kda_opt/plan), and how: one wave of (segment,
    value head) programs, at least three segments of whole chunks (or checkpoint intervals)."""
    # 9 segments: a pass runs 8 of them, 8 · 16 programs on 132 SMs.
    assert parallel_segments(65536, 1, 16, 132, False, 2048) == tuple((t, min(t + 7296, 65536))
                                                                      for t in range(0, 65536, 7296))
    assert parallel_segments(1000, 1, 2, 132, False, 128) == tuple((t, min(t + 192, 1000)) for t in range(0, 1000, 192))
    assert parallel_segments(1000, 1, 2, 132, False, 128, align=256) == ((0, 256), (256, 512), (512, 768), (768, 1000))
    assert parallel_segments(65536, 2, 16, 132, False, 2048) is None     # several sequences
    assert parallel_segments(65536, 1, 16, 132, True, 2048) is None      # packed
    assert len(parallel_segments(65536, 1, 44, 132, False, 2048)) == 4   # a pass: 3 · 44 programs
    assert parallel_segments(65536, 1, 67, 132, False, 2048) is None     # one segment's programs fill the SMs
    assert parallel_segments(5000, 1, 4, 132, False, 2048) is None       # under three segments
    for T in range(6144, 300_000, 7919):
        segs = parallel_segments(T, 1, 4, 132, False, 2048)
        assert 3 <= len(segs) <= 132 // 4 + 1 and segs[0][0] == 0 and segs[-1][1] == T
        assert all(a1 == b0 and b0 % 64 == 0 for (a0, b0), (a1, _) in zip(segs, segs[1:]))


def test_parallel_segments_pay_at_tensor_parallel_shards():
    """The plan's default (Tuning(parallel=None)) takes parallel segments for a lone sequence of 8192
    tokens or more at 8–24 heads of 128 (a Kimi-class model's heads over 4–8 GPUs), and at fewer
    heads; not at 32 heads, nor below 8192 tokens; at V = 64, twice the heads."""
    for T, HV in itertools.product((8192, 32768, 131072), (1, 8, 12, 16, 24)):
        assert _parallel_pays(T, HV, 128)
    assert _parallel_pays(8192, 48, 64)
    assert not _parallel_pays(32768, 32, 128) and not _parallel_pays(8192, 96, 128)
    assert not _parallel_pays(8128, 12, 128) and not _parallel_pays(4096, 8, 128)


def test_packed_calls_cut_where_the_longest_dominates():
    """The plan's default cut (CUT_FROM, LONGEST_SHARE) on the chunked-prefill steps it was measured on
    at H = 12: one 32768-token chunk beside 16 short requests is cut (2.8 -> 1.4 ms), one 8192-token
    chunk beside 32 is not (slower cut), nor a mix whose longest holds under half the tokens."""
    from kda_opt.plan import CUT_FROM, LONGEST_SHARE
    cut = ParallelCut(Tuning().parallel_tokens, 64, CUT_FROM, LONGEST_SHARE, None)
    bounds = lambda lengths: list(itertools.accumulate(lengths, initial=0))
    assert cut_sequences(bounds([32768] + [28] * 16), 12, cut, 132) is not None
    assert cut_sequences(bounds([8192] + [27] * 32), 12, cut, 132) is None
    assert cut_sequences(bounds([32768, 20000, 20000]), 12, cut, 132) is None


def test_cut_sequences():
    """Packed sequences cut on a call (kda_opt/plan.cut_sequences): those longer than the longest's
    parallel segment into segments of its length, the others whole, every sequence's rows in order;
    none where the longest is under the plan's bounds (its tokens, its share of the call's) or gives
    fewer than three segments."""
    cut = ParallelCut(min_tokens=2048, align=64, longest=65536, share=0.5, block_v=None)
    step = parallel_segments(131072, 1, 8, 132, False, 2048)[0][1]
    assert step == 7744                           # 17 segments: a pass runs 16 · 8 programs
    pieces = cut_sequences([0, 100, 131172, 131172, 141172], 8, cut, 132)
    assert pieces == ((0, 0, 100),) + tuple((1, t, min(t + step, 131172)) for t in range(100, 131172, step)) + \
        ((2, 131172, 131172), (3, 131172, 131172 + step), (3, 131172 + step, 141172))
    assert cut_sequences([0, 60000, 70000], 8, cut, 132) is None                        # the longest under 65536
    assert cut_sequences([0, 70000, 140000, 140001], 8, cut, 132) is None               # nor half the tokens
    assert cut_sequences([0, 70000, 140000], 8, cut, 132) is not None                   # (half is enough)
    assert cut_sequences([0, 5000, 70000], 67, ParallelCut(2048, 64, 0, 0, None), 132) is None  # one fills the SMs
    with_ck = cut_sequences([0, 1000, 2000], 2, ParallelCut(128, 256, 0, 0, None), 132)
    assert with_ck == ((0, 0, 256), (0, 256, 512), (0, 512, 768), (0, 768, 1000), (1, 1000, 1256), (1, 1256, 1512),
                       (1, 1512, 1768), (1, 1768, 2000))


def test_piece_tables():
    """The tables of cut sequences (kda_opt/segment_tables): bounds, checkpoint rows as the packed layout
    numbers them, first and last pieces, the merge's grid padded with the spare row, and the run of
    pieces each pass takes (pass 1 the cut sequences' pieces but their last, pass 2 their middle
    ones, pass 3 from the first piece that is not a cut sequence's first)."""
    pieces = ((0, 0, 10), (1, 10, 202), (1, 202, 394), (1, 394, 400), (2, 400, 400), (3, 400, 592), (3, 592, 600))
    t = piece_tables(torch.device("cpu"), pieces, 4, 64, 2, 64)
    assert t.bounds.tolist() == [0, 10, 202, 394, 400, 400, 592, 600]
    assert t.ck_rows.tolist() == [0, 1, 4, 7, 8, 8, 11] and t.first.tolist() == [0, 1, 4, 5]
    assert t.last.tolist() == [0, 3, 4, 6] and t.grid.tolist() == [[1, 5], [2, 6], [3, 7]]
    assert t.first.dtype == t.last.dtype == t.grid.dtype == torch.int64          # index_copy_'s indices
    assert t.zeros.tolist() == [0] * 7 and t.no_slots.tolist() == [-1] * 7
    assert (t.h_pieces, t.m_pieces, t.o_pieces) == ((1, 6), (2, 6), (0, 7))
    assert t.sequence_rows.tolist() == [0, 1, 2, 3] and torch.equal(t.units, torch.eye(64).expand(1, 2, 64, 64))
    lone = piece_tables(torch.device("cpu"), tuple((0, s, s + 100) for s in range(0, 500, 100)), 1, 64, 2, 64)
    assert (lone.h_pieces, lone.m_pieces, lone.o_pieces) == ((0, 4), (1, 4), (1, 5))

# ---- GPU: what the plan resolves ----

@gpu
def test_plan_of_the_default_call():
    """The benchmark's default call (safe gate in kernel, bf16, a state): one pass, stage 4's widest
    V block (96 programs fill one wave), β a bf16 number (no residual), the default scale."""
    plan = plan_of(**random_inputs(1, 8192, 96, 128, initial_state=True))
    assert (plan.B, plan.T, plan.H, plan.K, plan.HV, plan.V, plan.N) == (1, 8192, 96, 128, 96, 128, 1)
    assert plan.segments == ((0, 8192),) and plan.block_v == 128 and not plan.packed
    assert plan.gate.in_kernel and plan.gate.bounded and plan.scale == 128 ** -0.5
    assert plan.initial_state and plan.output_final_state and not plan.state_v_first
    assert not plan.beta_residual and not plan.l2norm and plan.beta_sigmoid is None
    assert (plan.intra_warps, plan.worker_warps) == (NUM_WARPS, Tuning().worker_warps)
    # fp32 inputs: stages 2+3 at their own warp count (kda_opt/intra.warps_for).
    assert plan_of(**random_inputs(1, 256, 2, 64, dtype=torch.float32)).intra_warps == FP32_WARPS != NUM_WARPS


@gpu
def test_plan_longest_first():
    """Packed sequences whose stage-4 programs outnumber the SMs run longest first (in one pass); a
    grid of one wave, more than RANK_MAX sequences, a dense call and Tuning(longest_first=False) keep
    the grid's order."""
    many = random_inputs(1, 300 * 64, 32, 128, seqlens=[64] * 300, initial_state=True)
    assert plan_of(**many).longest_first
    assert not plan_of(**many, tuning=Tuning(longest_first=False)).longest_first
    assert not plan_of(**random_inputs(1, 300, 2, 128, seqlens=[100, 200])).longest_first
    assert not plan_of(**random_inputs(2, 300, 96, 128)).longest_first
    assert not plan_of(**random_inputs(1, RANK_MAX + 1, 2, 128, seqlens=[1] * (RANK_MAX + 1))).longest_first


@gpu
def test_plan_sized_launches():
    """Stage 4's launches are sized from the host lengths where a packed one-pass call gives them
    (cu_seqlens_cpu), not without them, with checkpoint offsets, or with Tuning(sized_launches=False)."""
    args = random_inputs(1, 300, 2, 128, seqlens=[1, 100, 199], initial_state=True)
    assert plan_of(**args).sized_launches
    assert not plan_of(**args, tuning=Tuning(sized_launches=False)).sized_launches
    assert not plan_of(**{**args, "cu_seqlens_cpu": None}).sized_launches
    offsets = dict(checkpoints=torch.zeros(1, 8, 2, 128, 128, device="cuda"), checkpoint_offsets=torch.tensor(
        [1, 64, 64], device="cuda"))
    assert not plan_of(**args, **offsets).sized_launches
    assert not plan_of(**random_inputs(2, 300, 2, 128)).sized_launches


@gpu
def test_plan_of_flashkda_configuration():
    """l2norm, β logits (so a residual for stage 4), V-first states; and with allow_neg_eigval β's
    sigmoid doubled."""
    args = random_inputs(1, 300, 2, 128, l2norm=True, beta_logits=True, state_v_first=True, initial_state=True)
    plan = plan_of(**args)
    assert plan.l2norm and plan.beta_sigmoid == 1.0 and plan.beta_residual and plan.state_v_first
    assert plan_of(**args, allow_neg_eigval=True).beta_sigmoid == 2.0


@gpu
@pytest.mark.parametrize("beta_dtype,k_dtype,residual", [(torch.float32, torch.bfloat16, True),
                                                         (torch.bfloat16, torch.bfloat16, False),
                                                         (torch.float32, torch.float32, False)])
def test_plan_beta_residual_where_beta_is_not_a_number_of_k_dtype(beta_dtype, k_dtype, residual):
    args = random_inputs(1, 64, 2, 64, dtype=k_dtype)
    args["beta"] = args["beta"].to(beta_dtype)
    assert plan_of(**args).beta_residual == residual


@gpu
def test_plan_time_segments_and_block_v():
    """A long lone sequence with few heads is cut into time segments and takes stage 4's narrowest V
    block, or into parallel segments at the widest; packed sequences never are; the tuning knobs
    are taken as given."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    args = random_inputs(1, 65536, 16, 128, initial_state=True)
    plan = plan_of(**args, tuning=Tuning(parallel=False))
    assert plan.block_v == 32 and plan.segments == time_segments(65536, 1, 16 * 4, sms, False, 8192, 8)
    assert len(plan.segments) == 8 and not plan.parallel
    # By default its segments run at once there (parallel segments: one wave at the widest block).
    plan = plan_of(**args)
    assert plan.parallel and plan.block_v == 128 and plan.segments == parallel_segments(65536, 1, 16, sms, False,
                                                                                          Tuning().parallel_tokens)
    # And at a tensor-parallel shard: a wave of SMs / heads + 1 segments.
    shard = plan_of(**random_inputs(1, 8192, 12, 128))
    assert shard.parallel and len(shard.segments) == min(sms // 12 + 1, 8192 // Tuning().parallel_tokens)
    packed = plan_of(**random_inputs(1, 65536, 16, 128, seqlens=[30000, 35536]))
    assert packed.packed and packed.N == 2 and packed.segments == ((0, 65536),)
    tuned = plan_of(**random_inputs(1, 1000, 2, 128), tuning=Tuning(segment_tokens=128, block_v=64,
                                                                       intra_warps=2, worker_warps=4))
    assert tuned.block_v == 64 and len(tuned.segments) == 6 and (tuned.intra_warps, tuned.worker_warps) == (2, 4)


def test_nvtx_ranges_only_when_asked(monkeypatch):
    """kda_forward's stage ranges follow KDA_OPT_NVTX, read on every call (kda_opt/launch)."""
    from kda_opt.launch import NVTX_VARIABLE, nvtx_enabled
    monkeypatch.delenv(NVTX_VARIABLE, raising=False)
    assert not nvtx_enabled()
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(NVTX_VARIABLE, value)
        assert nvtx_enabled() == on
