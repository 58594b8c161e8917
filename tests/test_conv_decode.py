"""kda_opt/conv_decode (kda_conv_decode): the fused convolution and decode step against the float64
reference (the convolution, then reference_decode), under Triton's interpreter in fp32 without a GPU
and in bf16 on one; the window's and the pool's untouched rows, the padding rules, the checks."""
import inspect
import json
import subprocess
import sys

import pytest
import torch

import kda_opt
from kda_opt.arguments import ConvDecodeArguments
from kda_opt import conv_decode
from kda_opt.conv_decode import make_conv_decode_plan, run
from kda_opt.reference import reference_conv_decode
from tests.conftest import HAS_CUDA, ROOT, compile_env, kernel_device, rel_err

DEVICE = kernel_device()
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
TOLERANCE = 2e-2 if HAS_CUDA else 1e-5


def step(N, H, K, *, slots=8, indices=None, gate="softplus", bias=True, pad_slot=None, pool_dtype=torch.float32,
         seed=0):
    """kda_conv_decode's arguments: N requests at `indices` of pools of `slots` rows (rows padded)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    channels = 3 * H * K
    args = dict(mixed_qkv=rand(N, channels), g=rand(N, H * K), beta=rand(N, H),
                conv_state=rand(slots, 3, channels + 16)[..., :channels], conv_weight=rand(channels, 4) / 2,
                conv_bias=rand(channels) / 4 if bias else None,
                A_log=torch.rand(H, generator=gen).mul(15).add(1).log(), dt_bias=rand(H * K),
                lower_bound=-5.0 if gate == "safe" else None, pad_slot=pad_slot)
    args = {n: x.to(DEVICE, DTYPE if n in ("mixed_qkv", "g", "beta", "conv_state") else torch.float32)
            if isinstance(x, torch.Tensor) else x for n, x in args.items()}
    pool = rand(slots, H * K * K + 8)[:, :H * K * K].view(slots, H, K, K) / 8
    indices = list(range(N)) if indices is None else indices
    args.update(ssm_state=pool.to(DEVICE, pool_dtype), state_indices=torch.tensor(indices, device=DEVICE))
    return args


def stepped(args, sms=None):
    """kda_conv_decode on the GPU; its plan's run under the interpreter without one (the plan made with
    an SM count), or with `sms`, a count that picks the launch of 8 columns a small call would not get."""
    if HAS_CUDA and sms is None:
        return kda_opt.kda_conv_decode(**args)
    plan = make_conv_decode_plan(ConvDecodeArguments(**args), sms=sms or 132)
    return run(plan, ConvDecodeArguments(**args))


def check(args, sms=None):
    """o, the pool and the window against reference_conv_decode: the written rows within TOLERANCE (the
    window's shifted inputs bit for bit), every other row as it was."""
    pool, window = args["ssm_state"].clone(), args["conv_state"].clone()
    ref_o, ref_pool, ref_window = reference_conv_decode(**{**args, "ssm_state": pool, "conv_state": window})
    o = stepped(args, sms)
    assert rel_err(o, ref_o) < TOLERANCE
    changed = (ref_pool != pool.double()).flatten(1).any(1)
    assert torch.equal(args["ssm_state"][~changed], pool[~changed])
    assert rel_err(args["ssm_state"][changed], ref_pool[changed]) < TOLERANCE
    assert torch.equal(args["conv_state"].double(), ref_window)
    return o, changed


@pytest.mark.parametrize("sms", [None, 1])
@pytest.mark.parametrize("gate", ["softplus", "safe"])
def test_step_matches_the_reference(gate, sms):
    """By 16 columns a program, and by 8 (from decode_plan.EIGHT_COLUMNS_FROM pairs an SM): several
    programs a head, the last of them to read its q and k channels shifting them."""
    args = step(3, 2, 64, gate=gate, indices=[5, 0, 2])
    assert make_conv_decode_plan(ConvDecodeArguments(**args), sms=sms or 132).block_v == (8 if sms else 16)
    _, changed = check(args, sms)
    assert changed.tolist() == [True, False, True, False, False, True, False, False]


def test_readers_are_left_zero():
    """Each launch sets its counts of readers back to zero, for the next."""
    check(step(3, 2, 64, indices=[1, 0, 2]))
    assert not conv_decode.readers(torch.device(DEVICE), 6)[:6].any()


def test_without_a_conv_bias_nor_dt_bias():
    check({**step(2, 2, 64, bias=False), "dt_bias": None})


def test_padding_slots_are_neither_read_nor_written():
    """−1, a slot past the pool and the pad slot: zeros in, nothing out; the window's rows alike."""
    args = step(4, 2, 64, slots=6, indices=[3, -1, 6, 1], pad_slot=1)
    _, changed = check(args)
    assert changed.tolist() == [False, False, False, True, False, False]


def test_padding_request_computes_from_zeros():
    """A padding request's o is the step from a zero window and a zero state."""
    args = step(2, 2, 64, slots=4, indices=[-1, 2])
    zeroed = {**args, "conv_state": torch.zeros_like(args["conv_state"]), "ssm_state": torch.zeros_like(args["ssm_state"])}
    o, o_zero = stepped(args), stepped(zeroed)
    assert torch.equal(o[0], o_zero[0])


def test_arguments_record_is_the_signature():
    assert ConvDecodeArguments._fields == tuple(inspect.signature(kda_opt.kda_conv_decode).parameters)
    defaults = {n: p.default for n, p in inspect.signature(kda_opt.kda_conv_decode).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert defaults == ConvDecodeArguments._field_defaults


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(mixed_qkv=a["mixed_qkv"][:, :-1]), "channels are not q, k and v"),
    (lambda a: a.update(conv_state=a["conv_state"][:, :2]), "conv_state must be"),
    (lambda a: a.update(conv_weight=a["conv_weight"][:, :3]), "conv_weight must be"),
    (lambda a: a.update(conv_bias=a["conv_bias"][:-1]), "conv_bias must be"),
    (lambda a: a.update(beta=a["beta"][:, :1]), "beta must be"),
    (lambda a: a.update(g=a["g"][:, :-1]), "g must be"),
    (lambda a: a.update(state_indices=a["state_indices"][:1]), "state_indices must be"),
    (lambda a: a.update(state_indices=a["state_indices"].float()), "state_indices must be"),
    (lambda a: a.update(A_log=a["A_log"][:1]), "A_log must"),
    (lambda a: a.update(dt_bias=a["dt_bias"][:1]), "dt_bias must"),
    (lambda a: a.update(lower_bound=0.5), "lower_bound must be negative"),
    (lambda a: a.update(ssm_state=a["ssm_state"].new_zeros(8, 2, 64, 32)), "head dims"),
    (lambda a: a.update(ssm_state=a["ssm_state"][..., :32]), "ssm_state must be a pool"),
    (lambda a: a.update(out=torch.empty(1)), "out must be"),
])
def test_bad_input_raises(change, message):
    args = step(2, 2, 64)
    change(args)
    with pytest.raises(ValueError, match=message):
        make_conv_decode_plan(ConvDecodeArguments(**args), sms=132)


# Kimi-Linear's decode step at H = 32, K = V = 128: a bf16 projection and window, an fp32 pool, bf16
# conv weights without a bias (its launch's strides, constants of the kernel).
KIMI_STEP = dict(H=32, K=128, V=128, BV=16, MODE=2, HAS_BIAS=True, HAS_CONV_BIAS=False, PAD=False, S_X=3 * 32 * 128,
                 S_G=32 * 128, S_GH=128, S_B=32, S_O=32 * 128, S_WIN=3 * 3 * 32 * 128, S_ROW=3 * 32 * 128, S_WC=4,
                 S_WJ=1, S_POOL=32 * 128 * 128, S_IDX=1)
POINTERS = dict(x="*bf16", g="*bf16", beta="*bf16", A_log="*fp32", dt_bias="*fp32", o="*bf16", window="*bf16",
                weight="*bf16", bias="*bf16", pool="*fp32", indices="*i32", readers="*i32")
VARIANTS = [dict(), dict(BV=8), dict(MODE=1, HAS_CONV_BIAS=True, PAD=True), dict(K=64, V=64, pool="*bf16")]


def sm90_cubin(pool="*fp32", **changes):
    """conv_decode_kernel compiled for sm_90 (Triton's JIT) with KIMI_STEP's constants, changed by
    `changes`, and one warp (decode_plan.decode_launch's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kda_opt.conv_decode import conv_decode_kernel
    constants = {**KIMI_STEP, **changes}
    pointers = {**POINTERS, "pool": pool}
    params = conv_decode_kernel.params
    signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name)
                 or ("fp32" if p.name in ("scale", "lower_bound") else "i32") for p in params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p.name in pointers}
    kernel = triton.compile(ASTSource(conv_decode_kernel, signature, {n: constants[n] for n in signature
                                                                       if signature[n] == "constexpr"}, aligned),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    return kernel.asm["cubin"]


def test_kernel_compiles_for_sm90_without_spilling():
    """Each kind of launch compiles for sm_90 (what the interpreter does not check) and holds the
    head's state in registers, no stack."""
    code = ("import json\nfrom tests.test_conv_decode import VARIANTS, sm90_cubin\nfrom tests.test_wuso import resources\n"
            "print(json.dumps([resources(sm90_cubin(**v)) for v in VARIANTS]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=compile_env(), cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for registers, stack in json.loads(done.stdout.strip().splitlines()[-1]):
        assert stack == 0 and registers <= 255, (registers, stack)
