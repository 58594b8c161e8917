"""Stage 4, the cuTile W/U/S/O kernel: compiled to sm_90 cubins without a GPU (tier c), and on the
GPU against the float64 state pass fed the same Γ, Tm and Aqk (tier d)."""
import inspect
import io
import math
import os
import re
import subprocess
import tempfile

import pytest
import torch

import cuda.tile as ct
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint, export_kernel
from kda_opt import reference as ref
from kda_opt.wuso import (EVERY_SEQUENCE, HEADS, LONG_ONLY, SEVERAL_ONLY, SHORT_ONLY, Arguments, _edited,
                          block_v_for, launch_config, wuso, wuso_kernel)
from tests.conftest import gpu, rel_err
from tests.stage_inputs import qk_rstd, stage_inputs

CT_DTYPES = {torch.bfloat16: ct.bfloat16, torch.float16: ct.float16, torch.float32: ct.float32,
             torch.int32: ct.int32, torch.int64: ct.int64, torch.bool: ct.bool_}
H100_SMS = 132
BOUND = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-3}


def _pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


def constraint(arg):
    """A launch argument as the JIT specialises it (read off the mangled names in profiles/: unit
    dimensions constant, shapes divisible by up to 16, strides by up to 8, unit last stride)."""
    if isinstance(arg, torch.Tensor):
        return ArrayConstraint(
            CT_DTYPES[arg.dtype], arg.dim(), index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
            may_alias_internally=False, stride_constant=(None,) * (arg.dim() - 1) + (1,),
            shape_constant=[1 if n == 1 else None for n in arg.shape],
            shape_divisible_by=[_pow2_divisor(n, 16) for n in arg.shape],
            stride_divisible_by=[_pow2_divisor(s, 8) for s in arg.stride()[:-1]] + [1],
            base_addr_divisible_by=16)
    return ScalarConstraint(ct.float32) if isinstance(arg, float) else arg


def cubin(dtype, K, has_state, store_state, block_v=None, B=1, T=8192, H=96, seqs=None, l2norm=False,
          state_v_first=False, state_dtype=torch.float32, beta_residual=False, pool=None, checkpoints=None,
          checkpoint_every=1, transition=False, sequences=0, checkpoint_first=False, ordered=False):
    """The launcher's specialisation (launch_config on meta tensors of the default shape),
    compiled for sm_90; block_v None takes the launcher's choice on an H100. seqs: (N, cu_seqlens
    dtype) packs N sequences into the one batch entry (B = 1). l2norm: with stage 2's norms
    [2, B, H, T]. state_dtype: the initial state's. beta_residual: with stage 2's β residual [B, H, T] fp32.
    pool: (slots, slot index dtype, has_initial_state given): both states one pool of state_dtype,
    rows padded, read and written at each sequence's slot. checkpoints: the dtype of a checkpoint
    buffer [B, NT, H, K, V] (packed: with its rows' offsets), written every checkpoint_every chunks.
    ordered (packed): the programs in the order of a [N] int32 permutation (kda_opt/seqs.longest_first)."""
    meta = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt, device="meta")
    q, k, v, o = (meta(B, T, H, K) for _ in range(4))
    cu_seqlens = None if seqs is None else meta(seqs[0] + 1, dt=seqs[1])
    N = B if seqs is None else seqs[0]
    gcum = meta(B, T, H, K, dt=torch.float32)
    block_v = block_v or block_v_for(N * H, K, H100_SMS, dtype)
    initial = meta(N, H, K, K, dt=state_dtype) if has_state else None
    final = meta(N, H, K, K, dt=torch.float32) if store_state else None
    slots = mask = None
    if pool:
        initial = final = torch.empty_strided((pool[0], H, K, K), (H * K * K + 64, K * K, K, 1), dtype=state_dtype,
                                              device="meta")
        slots = meta(N, dt=pool[1])
        mask = meta(N, dt=torch.bool) if pool[2] else None
    _, args = launch_config(q, k, v, gcum, meta(B, T, H, 64), meta(B, T, H, 64), K ** -0.5, block_v,
                            initial, o, final, cu_seqlens=cu_seqlens,
                            qk_rstd=meta(2, B, H, T, dt=torch.float32) if l2norm else None,
                            state_v_first=state_v_first,
                            beta_residual=meta(B, H, T, dt=torch.float32) if beta_residual else None,
                            slots=slots, read_slots=pool is not None, write_slots=pool is not None,
                            has_initial_state=mask,
                            checkpoints=None if checkpoints is None else meta(B, T // 64 + N, H, K, K, dt=checkpoints),
                            checkpoint_rows=None if checkpoints is None or seqs is None else meta(N, dt=torch.int32),
                            checkpoint_every=checkpoint_every, transition=transition,
                            sequences=sequences, checkpoint_first=meta(N, dt=torch.int64) if checkpoint_first else None,
                            order=meta(N, dt=torch.int32) if ordered else None)
    signature = KernelSignature([constraint(a) for a in args], CallingConvention.cutile_python_v2())
    buf = io.BytesIO()
    export_kernel(wuso_kernel, [signature], buf, gpu_code="sm_90", output_format="cubin")
    return buf.getvalue()


def assert_kernel_cubin(binary):
    assert binary[:4] == b"\x7fELF" and len(binary) > 10_000
    assert b"wuso_kernel" in binary


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [128, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_exports_sm90_cubin(dtype, K, with_state):
    assert_kernel_cubin(cubin(dtype, K, with_state, with_state))


@pytest.mark.parametrize("dtype,K,has_state,store_state,block_v,shape", [
    (torch.bfloat16, 128, True, False, 32, (1, 8192, 96)), (torch.bfloat16, 128, False, True, 64, (1, 8192, 96)),
    (torch.bfloat16, 128, True, True, 16, (1, 65536, 16)),
    (torch.float16, 128, True, True, None, (1, 8192, 96)), (torch.float16, 64, False, True, 32, (1, 8192, 96)),
    (torch.bfloat16, 128, True, True, None, (3, 1000, 4)), (torch.float32, 64, True, False, None, (3, 1000, 4))])
def test_exports_other_specialisations(dtype, K, has_state, store_state, block_v, shape):
    """Other dtypes, V blocks and state flags; B > 1 and T, H without large power-of-two factors."""
    B, T, H = shape
    assert_kernel_cubin(cubin(dtype, K, has_state, store_state, block_v, B, T, H))


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("l2norm", [False, True])
def test_exports_packed_and_l2norm(cu_dtype, l2norm):
    """Packed sequences (each read through a view of its rows) and in-kernel l2norm compile."""
    assert_kernel_cubin(cubin(torch.bfloat16, 128, True, True, T=8192, H=32, seqs=(64, cu_dtype), l2norm=l2norm))


def test_exports_l2norm_fixed_length():
    assert_kernel_cubin(cubin(torch.bfloat16, 128, True, True, l2norm=True))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_exports_state_layouts_and_dtypes(state_dtype):
    """States V before K (state_v_first), the initial state in bf16."""
    assert_kernel_cubin(cubin(torch.bfloat16, 128, True, True, state_v_first=True, state_dtype=state_dtype))
    assert_kernel_cubin(cubin(torch.bfloat16, 128, True, False, state_dtype=state_dtype))


@pytest.mark.parametrize("seqs", [None, (64, torch.int64)])
def test_exports_beta_residual(seqs):
    """FlashKDA's call (beta logits, l2norm, V-first states, bf16 initial state) with β's residual,
    fixed-length and packed."""
    assert_kernel_cubin(cubin(torch.bfloat16, 128, True, True, seqs=seqs, l2norm=True, state_v_first=True,
                              state_dtype=torch.bfloat16, beta_residual=True))


@pytest.mark.parametrize("sequences", [EVERY_SEQUENCE, HEADS])
@pytest.mark.parametrize("call", [dict(state_v_first=True, checkpoint_every=8),
                                  dict(l2norm=True, beta_residual=True, pool=(100, torch.int32, True))])
def test_checkpoint_offsets_keep_the_schedule(sequences, call):
    """Checkpoints at given offsets (checkpoint_first): the heads' launch and the chunks' launch keep
    the warp-specialised schedule (no spill; computed before the loop or in its first iteration, the
    head took 255 registers and spilled)."""
    registers, stack = resources(cubin(torch.bfloat16, 128, True, True, seqs=(64, torch.int32),
                                       checkpoints=torch.float32, checkpoint_first=True, sequences=sequences, **call))
    assert registers < 255 and (stack == 0 or sequences == HEADS and stack <= 64)


def cuobjdump(binary, option: str) -> str:
    """The report of the cuobjdump that Triton's NVIDIA backend ships on a cubin (-res-usage, -sass)."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(tool, os.X_OK):
        pytest.skip(f"no cuobjdump at {tool}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        return subprocess.run([tool, option, f.name], capture_output=True, text=True, check=True).stdout


def resources(binary) -> tuple[int, int]:
    """(registers, stack frame bytes) per thread of a cubin's kernel."""
    found = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(binary, "-res-usage"))
    return int(found[1]), int(found[2])


@pytest.mark.parametrize("call", [
    dict(), dict(state_v_first=True), dict(state_dtype=torch.bfloat16), dict(seqs=(64, torch.int32)),
    dict(l2norm=True, state_v_first=True, beta_residual=True), dict(seqs=(64, torch.int32), pool=(100, torch.int32, True)),
    dict(state_v_first=True, state_dtype=torch.bfloat16, pool=(3, torch.int64, False))])
def test_initial_state_costs_no_resources(call):
    """An initial state is one [K, BV] load per program: the kernel that reads it (from a state pool
    too) keeps the registers and stack frame of the kernel without it. (Loaded before the loop, the state had
    taken the compiler off its warp-specialised pipeline: 255 registers and spills, twice the time.)"""
    with_state = resources(cubin(torch.bfloat16, 128, True, True, **call))
    without = resources(cubin(torch.bfloat16, 128, False, True,
                              **{k: v for k, v in call.items() if k not in ("state_dtype", "pool")}))
    assert with_state[0] <= without[0] and with_state[1] <= without[1], (with_state, without)


@pytest.mark.parametrize("call", [dict(), dict(K=64), dict(state_v_first=True), dict(block_v=32), dict(block_v=128)])
def test_fp32_products_take_wgmma(call):
    """fp32 inputs (tf32 products; at the launcher's BV unless given): every product on wgmma, no
    stack. With q, k and Γ staged by TMA beside the other tiles they compiled to mma.sync with 104 B
    of stack at 32 columns; with q alone by plain loads, to mma.sync with 1.1–2.4 KB at 64 and 128."""
    K = call.pop("K", 128)
    binary = cubin(torch.float32, K, True, True, **call)
    sass = cuobjdump(binary, "-sass")
    assert resources(binary)[1] == 0 and "HGMMA" in sass and "HMMA" not in sass


@pytest.mark.parametrize("call", [
    dict(checkpoints=torch.float32), dict(checkpoints=torch.bfloat16), dict(checkpoints=torch.float32, block_v=64),
    dict(checkpoints=torch.float32, state_v_first=True), dict(checkpoints=torch.float32, state_v_first=True, block_v=32),
    dict(checkpoints=torch.bfloat16, state_v_first=True, seqs=(64, torch.int32), l2norm=True, beta_residual=True),
    dict(checkpoints=torch.float16, pool=(100, torch.int64, True), state_v_first=True, block_v=64),
    dict(checkpoints=torch.float32, state_v_first=True, checkpoint_every=8),
    dict(checkpoints=torch.bfloat16, seqs=(64, torch.int32), checkpoint_every=2)])
def test_checkpoints_cost_no_resources(call):
    """Storing the state after every chunk (or every few) keeps the registers and stack frame of the kernel
    without it, at either place kda_opt/wuso stores it (one transposed fp32 store in the loop took
    255 registers: an fp32 V-first state goes in quarters; a 16-bit V-first one stored before the
    state's update took 255 too, so it goes after)."""
    with_ck = resources(cubin(torch.bfloat16, 128, True, True, **call))
    without = resources(cubin(torch.bfloat16, 128, True, True,
                              **{k: v for k, v in call.items() if k not in ("checkpoints", "checkpoint_every")}))
    assert with_ck[0] <= without[0] and with_ck[1] <= without[1], (with_ck, without)


@pytest.mark.parametrize("call", [
    dict(seqs=(64, torch.int32)), dict(seqs=(260, torch.int64), l2norm=True, beta_residual=True, state_v_first=True,
                                       state_dtype=torch.bfloat16, pool=(300, torch.int32, True)),
    dict(seqs=(64, torch.int32), checkpoints=torch.float32, state_v_first=True, block_v=32)])
def test_short_sequences_launch_apart(call):
    """Packed sequences split into two launches (kda_opt/wuso short_sequences): the launch of those
    longer than a chunk keeps the registers and stack frame of the kernel over every sequence (one
    launch with both paths, a branch between them, took 255 registers and slowed long packed
    sequences by 40 %)."""
    every = resources(cubin(torch.bfloat16, 128, True, True, **call, sequences=EVERY_SEQUENCE))
    long_only = resources(cubin(torch.bfloat16, 128, True, True, **call, sequences=LONG_ONLY))
    assert long_only[0] <= every[0] and long_only[1] <= every[1], (long_only, every)
    short = cubin(torch.bfloat16, 128, True, True, **call, sequences=SHORT_ONLY)
    assert_kernel_cubin(short)
    assert resources(short)[0] <= 168, resources(short)


@pytest.mark.parametrize("call", [
    dict(seqs=(64, torch.int32)), dict(seqs=(260, torch.int64), l2norm=True, beta_residual=True, state_v_first=True,
                                       state_dtype=torch.bfloat16, pool=(300, torch.int32, True))])
def test_short_launch_without_one_token_sequences_keeps_its_resources(call):
    """The short launch that leaves sequences of one token to kda_opt/decode (SEVERAL_ONLY, a packed
    call with route_decodes) keeps the short launch's registers and stack frame."""
    short = resources(cubin(torch.bfloat16, 128, True, True, **call, sequences=SHORT_ONLY))
    several = resources(cubin(torch.bfloat16, 128, True, True, **call, sequences=SEVERAL_ONLY))
    assert several[0] <= short[0] and several[1] <= short[1], (several, short)


@pytest.mark.parametrize("call", [
    dict(seqs=(64, torch.int32), sequences=LONG_ONLY),
    dict(seqs=(260, torch.int64), sequences=LONG_ONLY, l2norm=True, beta_residual=True, state_v_first=True,
         pool=(300, torch.int32, True)),
    dict(seqs=(64, torch.int32), sequences=EVERY_SEQUENCE, checkpoints=torch.float32, checkpoint_first=True)])
def test_ordered_programs_keep_their_resources(call):
    """Programs in longest_first's order (ORDERED: one more index load per program) take no more
    registers than the launch in grid order, and no more stack than its frame varies between
    compiles (STACK_JITTER)."""
    ordered = resources(cubin(torch.bfloat16, 128, True, True, **call, ordered=True))
    plain = resources(cubin(torch.bfloat16, 128, True, True, **call))
    assert ordered[0] <= plain[0] and ordered[1] <= plain[1] + STACK_JITTER, (ordered, plain)


# Bytes by which one long-launch kernel's stack frame differs between compiles: tileiras 13.4 gave the
# second call above 48 or 56 B from one CI pass to the next, ordered or in grid order alike.
STACK_JITTER = 8


@pytest.mark.parametrize("call", [
    dict(sequences=EVERY_SEQUENCE), dict(sequences=LONG_ONLY, l2norm=True, beta_residual=True, state_v_first=True),
    dict(sequences=LONG_ONLY, ordered=True, pool=(300, torch.int32, False)), dict(sequences=SHORT_ONLY), dict(sequences=HEADS, checkpoints=torch.float32, checkpoint_first=True),
    dict(sequences=EVERY_SEQUENCE, checkpoints=torch.float32, checkpoint_every=8, checkpoint_first=True),
    dict(transition=True, block_v=128)])
def test_packed_sequences_write_no_descriptor(call):
    """No launch over packed sequences writes a TMA descriptor in the kernel (a view of a sequence's
    rows has each program write one per array, with atomic stores into a workspace the driver holds,
    which compute-sanitizer reports as accesses outside every allocation: docs/DESIGN.md, "Memory
    safety"); every tile is a box on the arrays' own descriptors, and the kernel keeps its registers."""
    binary = cubin(torch.bfloat16, 128, True, True, seqs=(64, torch.int32), **call)
    sass = cuobjdump(binary, "-sass")
    assert "UTMACCTL.IV" not in sass and "ATOMG" not in sass
    assert resources(binary)[0] <= 168, resources(binary)


def test_launch_arguments_are_the_kernels_parameters():
    """The launch record's fields are wuso_kernel's parameters, by name and in order (a launch hands
    the record to cuTile as the tuple it is)."""
    assert Arguments._fields == tuple(inspect.signature(wuso_kernel._pyfunc).parameters)


def test_an_edited_launch_changes_only_the_fields_it_names():
    args = Arguments._make(range(len(Arguments._fields)))
    edited = _edited(args, SHORT="short", ORDERED="no")
    assert type(edited) is Arguments and edited.SHORT == "short" and edited.ORDERED == "no"
    assert [x for n, x in zip(Arguments._fields, edited) if n not in ("SHORT", "ORDERED")] == \
        [x for n, x in zip(Arguments._fields, args) if n not in ("SHORT", "ORDERED")]


def test_block_v_fills_one_wave():
    assert block_v_for(96, 128, H100_SMS, torch.bfloat16) == 128    # 96 programs
    assert block_v_for(48, 128, H100_SMS, torch.bfloat16) == 64     # 96 programs, not 48
    assert block_v_for(16, 128, H100_SMS, torch.bfloat16) == 32     # 64 programs
    assert block_v_for(256, 128, H100_SMS, torch.bfloat16) == 128   # two waves at any width
    assert block_v_for(96, 64, H100_SMS, torch.bfloat16) == 64
    assert block_v_for(96, 128, H100_SMS, torch.float32) == 64     # at most 64 columns in fp32
    assert block_v_for(16, 128, H100_SMS, torch.float32) == 32



def test_long_single_entry_fits_int32_strides():
    """One sequence of 2^20 tokens at H = 16 (K = V = 128): q, k, v, Γ, o and a checkpoint buffer have
    a batch stride of 2^31 or more, past what cuTile takes; with B = 1 the launch passes them with
    that stride replaced (no index multiplies it), every other stride and every shape as they are."""
    meta = lambda *shape, dt=torch.bfloat16: torch.empty(*shape, dtype=dt, device="meta")
    B, T, H, K = 1, 2 ** 20, 16, 128
    q, k, v, o = (meta(B, T, H, K) for _ in range(4))
    tensors = (q, k, v, meta(B, T, H, K, dt=torch.float32), meta(B, T, H, 64), meta(B, T, H, 64))
    checkpoints = meta(B, T // 64, H, K, K, dt=torch.float32)
    _, args = launch_config(*tensors, K ** -0.5, 64, None, o, None, checkpoints=checkpoints)
    given = [*tensors, o, checkpoints]
    assert max(x.stride(0) for x in given) >= 2 ** 32
    for x, taken in zip(given, (args.Q, args.Kx, args.Vx, args.G, args.TM, args.AQK, args.O, args.CK)):
        assert taken.shape == x.shape and taken.stride()[1:] == x.stride()[1:] and max(taken.stride()) < 2 ** 31


def stage4_case(B, T, H, HV, K, dtype, with_state, gate="safe", seed=0, V=None, state_dtype=torch.float32,
                beta=None):
    """The kernel's inputs (Γ / ln 2 fp32, Tm in k's dtype, Aqk in q's dtype), the initial state (in
    state_dtype) or None, and the float64 state pass on the same q, k, v, Γ, initial state and the
    unrounded Tm, Aqk. beta [B, T, HV]: the β to use instead of stage_inputs' (which is in dtype)."""
    V = V or K
    x = stage_inputs(B, T, H, K, V=V, HV=HV, gate=gate, dtype=dtype, device="cuda", seed=seed)
    beta = x["beta"] if beta is None else beta
    scale = K ** -0.5
    Aqk, Akk = ref.intra_chunk(x["q"], x["k"], x["gamma"], beta, scale)
    Tm = ref.solve(Akk, beta)
    W, U = ref.wu(Tm, x["k"], x["v"], x["gamma"])
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.randn(B, HV, K, V, generator=gen).to("cuda", state_dtype) if with_state else None
    ref_o, ref_s = ref.state_pass(x["q"], x["k"], W, U, Aqk, x["gamma"], scale, h0)
    inputs = (x["q"], x["k"], x["v"], x["gcum"], Tm.to(dtype), Aqk.to(dtype), scale)
    return inputs, h0, ref_o, ref_s


def run_poisoned(inputs, h0, block_v=None, cu_seqlens=None, l2norm=False, state_v_first=False, beta_residual=None):
    """One launch into NaN-filled o and final state, so that any element the kernel skips fails.
    l2norm: q and k rows normalised with their norms (stage 2's, computed here: qk_rstd)."""
    q, v = inputs[0], inputs[2]
    B, _, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    block_v = block_v or block_v_for(N * HV, V, torch.cuda.get_device_properties(v.device).multi_processor_count,
                                     q.dtype)
    o = torch.full_like(v, float("nan"))
    final = torch.full((N, HV, V, K) if state_v_first else (N, HV, K, V), float("nan"), device=v.device)
    grid, args = launch_config(*inputs, block_v, h0, o, final, cu_seqlens=cu_seqlens,
                               qk_rstd=qk_rstd(*inputs[:2]).float().contiguous() if l2norm else None,
                               state_v_first=state_v_first, beta_residual=beta_residual)
    ct.launch(torch.cuda.current_stream(), grid, wuso_kernel, args)
    return o, final


@gpu
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("B,H,HV", [(1, 1, 1), (3, 4, 4), (1, 1, 2), (3, 4, 8)])
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("with_state", [False, True])
def test_wuso_bf16(T, B, H, HV, K, with_state):
    inputs, h0, ref_o, ref_s = stage4_case(B, T, H, HV, K, torch.bfloat16, with_state, seed=T + K + HV)
    o, s = run_poisoned(inputs, h0)
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-2


@gpu
def test_wuso_beta_residual():
    """β that is not a bf16 number (as from logits): Tm's bf16 diagonal rounds it once per token for
    every value column, and the state's error grows by half; stage 2's
    residual r = β − bf16(β) [B, HV, T], added back here, must take most of that growth away."""
    beta = torch.rand(2, 1000, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64).cuda()
    inputs, h0, ref_o, ref_s = stage4_case(2, 1000, 4, 4, 128, torch.bfloat16, True, seed=5, beta=beta)
    r = (beta - beta.to(torch.bfloat16).double()).float().transpose(1, 2).contiguous()
    o_plain, s_plain = run_poisoned(inputs, h0)
    o, s = run_poisoned(inputs, h0, beta_residual=r)
    assert rel_err(s, ref_s) < 0.85 * rel_err(s_plain, ref_s) and rel_err(o, ref_o) < 1.02 * rel_err(o_plain, ref_o)


@gpu
@pytest.mark.parametrize("block_v", [16, 32, 64, 128])
def test_wuso_every_block_v(block_v):
    inputs, h0, ref_o, ref_s = stage4_case(2, 200, 2, 4, 128, torch.bfloat16, True, gate="softplus")
    o, s = run_poisoned(inputs, h0, block_v)
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-2


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("B,T,H,HV,K", [(2, 200, 2, 4, 128), (1, 65, 1, 1, 64)])
def test_wuso_dtypes(dtype, gate, B, T, H, HV, K):
    inputs, h0, ref_o, ref_s = stage4_case(B, T, H, HV, K, dtype, True, gate=gate)
    o, s = run_poisoned(inputs, h0)
    assert rel_err(o, ref_o) < BOUND[dtype] and rel_err(s, ref_s) < BOUND[dtype]


@gpu
@pytest.mark.parametrize("K,V", [(128, 64), (64, 128)])
def test_wuso_key_and_value_dims_differ(K, V):
    inputs, h0, ref_o, ref_s = stage4_case(2, 130, 2, 2, K, torch.bfloat16, True, V=V)
    o, s = run_poisoned(inputs, h0)
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-2


@gpu
@pytest.mark.parametrize("with_state", [False, True])
def test_wuso_launcher(with_state):
    """The launcher: o in v's dtype, the final state written where one is given, and the kernel
    compiled with another worker-warp count (a tuning knob) computing the same function."""
    inputs, h0, ref_o, ref_s = stage4_case(3, 130, 2, 4, 128, torch.bfloat16, with_state)
    s = torch.full_like(ref_s, float("nan"), dtype=torch.float32)
    o = wuso(*inputs, 64, initial_state=h0, final_state=s)
    assert o.dtype == torch.bfloat16
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-2
    assert rel_err(wuso(*inputs, 64, initial_state=h0), ref_o) < 1e-2
    s4 = torch.full_like(s, float("nan"))
    o4 = wuso(*inputs, 64, initial_state=h0, final_state=s4, worker_warps=4)
    assert rel_err(o4, ref_o) < 1e-2 and rel_err(s4, ref_s) < 1e-2


def packed_case(lens, H, HV, K, with_state, l2norm, seed=0):
    """stage4_case for sequences of `lens` packed along T (B = 1), each chunked from its own first
    token and run from its own initial state; q and k are not unit-norm when l2norm."""
    T, N = sum(lens), len(lens)
    x = stage_inputs(1, T, H, K, HV=HV, gate="softplus", dtype=torch.bfloat16, device="cuda", seed=seed)
    if l2norm:
        x["k"] = 2 * x["k"] - 0.2
    rq, rk = (ref.l2norm(x["q"]), ref.l2norm(x["k"])) if l2norm else (x["q"], x["k"])
    cu = torch.tensor([0, *lens]).cumsum(0)
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.randn(N, HV, K, K, generator=gen).cuda() if with_state else None
    scale, parts, states = K ** -0.5, [], []
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        S0 = None if h0 is None else h0[n:n + 1]
        if a == b:
            states.append(torch.zeros(1, HV, K, K, dtype=torch.float64, device="cuda") if S0 is None else S0.double())
            continue
        gamma = ref.chunk_cumsum(x["a"][:, a:b])
        Aqk, Akk = ref.intra_chunk(rq[:, a:b], rk[:, a:b], gamma, x["beta"][:, a:b], scale)
        Tm = ref.solve(Akk, x["beta"][:, a:b])
        W, U = ref.wu(Tm, rk[:, a:b], x["v"][:, a:b], gamma)
        o, S = ref.state_pass(rq[:, a:b], rk[:, a:b], W, U, Aqk, gamma, scale, S0)
        parts.append((gamma, Tm, Aqk, o))
        states.append(S)
    cat = lambda i: torch.cat([p[i] for p in parts], dim=1)
    gcum = (cat(0) / math.log(2.0)).float()
    inputs = (x["q"], x["k"], x["v"], gcum, cat(1).to(torch.bfloat16), cat(2).to(torch.bfloat16), scale)
    return inputs, h0, cu.to(torch.int32).cuda(), cat(3), torch.cat(states)


@gpu
@pytest.mark.parametrize("lens", [[1, 63, 64, 65, 333, 0, 1000, 7], [64] * 40, [5000]])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
def test_wuso_packed(lens, with_state, l2norm):
    inputs, h0, cu, ref_o, ref_s = packed_case(lens, 2, 4, 128, with_state, l2norm, seed=len(lens))
    o, s = run_poisoned(inputs, h0, cu_seqlens=cu, l2norm=l2norm)
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-2


@gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_wuso_state_layout_and_dtype(state_dtype, state_v_first):
    """The initial state read as it comes (bf16 too), both states [N, HV, V, K] with state_v_first;
    K ≠ V, so that a transposed access cannot pass by symmetry."""
    inputs, h0, ref_o, ref_s = stage4_case(2, 130, 2, 4, 128, torch.bfloat16, True, V=64, state_dtype=state_dtype)
    o, s = run_poisoned(inputs, h0.transpose(-1, -2).contiguous() if state_v_first else h0,
                        state_v_first=state_v_first)
    if state_v_first:
        s = s.transpose(-1, -2)
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-2


def pool_of(slots, HV, K, V, dtype, state_v_first, pad=32, seed=0):
    """A state pool [slots, HV, K, V] ([slots, HV, V, K] V-first) of random rows, each padded by
    `pad` elements (stride(0) > HV·K·V), and the padded storage it views."""
    row = HV * K * V
    flat = torch.randn(slots, row + pad, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)
    return flat[:, :row].view((slots, HV, V, K) if state_v_first else (slots, HV, K, V)), flat


@gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("slots,mask", [([5, 1, 3], [True, False, True]), ([5, 7, -1], None)])
def test_wuso_state_pool(pool_dtype, state_v_first, slots, mask):
    """Sequence n reads and writes pool row slots[n] in place: the same numbers as the dense call
    on the gathered rows (zeros where has_initial_state is false or the slot lies outside the pool),
    its final state stored in the pool's dtype; no other row, and no padding, is written."""
    inputs, _, _, _ = stage4_case(3, 130, 2, 4, 128, torch.bfloat16, False, V=64, seed=9)
    pool, flat = pool_of(7, 4, 128, 64, pool_dtype, state_v_first)
    before = flat.clone()
    idx = torch.tensor(slots, dtype=torch.int32 if mask else torch.int64, device="cuda")
    use = torch.tensor([0 <= s < 7 for s in slots], device="cuda") & (torch.tensor(mask, device="cuda") if mask else True)
    dense = torch.where(use[:, None, None, None], pool[idx.clamp(0, 6)], 0).contiguous()
    final = torch.empty(dense.shape, device="cuda")
    o_ref = wuso(*inputs, 64, initial_state=dense, final_state=final, state_v_first=state_v_first)
    o = wuso(*inputs, 64, initial_state=pool, final_state=pool, slots=idx, read_slots=True, write_slots=True,
             has_initial_state=None if mask is None else torch.tensor(mask, device="cuda"), state_v_first=state_v_first)
    assert torch.equal(o, o_ref)
    written = [n for n, s in enumerate(slots) if 0 <= s < 7]
    assert torch.equal(pool[idx[written]], final[written].to(pool_dtype))
    untouched = [r for r in range(7) if r not in slots]
    assert torch.equal(flat[untouched], before[untouched]) and torch.equal(flat[:, -32:], before[:, -32:])
