"""Parallel segments on one GPU (kda_opt/forward, "Parallel segments"): a lone sequence cut into
segments that run at once, their starts merged from each one's transition, against one pass and the
float64 recurrence; with a state pool, has_initial_state and checkpoints. GPU; the choice of
segments is in tests/test_plan.py."""
import pytest
import torch

from inputs import random_inputs
from kda_opt import kda_forward, merge
from kda_opt.plan import Tuning, cut_sequences
from kda_opt.reference import ERROR_FLOOR, reference_forward
from tests.conftest import compile_env, gpu, rel_err
from tests.stage_inputs import plan_of
from tests.test_forward import run_tuned

PARALLEL = Tuning(parallel=True, parallel_tokens=128)


def slow(args, seed=0):
    """args with a log-decay in (−0.01, 0] per token (preactivated gate): a state then lives through
    every segment, so that a wrong start or transition shows in o and the final state (at the
    benchmark's decays it is gone within a segment)."""
    g = -0.01 * torch.rand(args["g"].shape, generator=torch.Generator().manual_seed(seed))
    out = {n: x for n, x in args.items() if n not in ("A_log", "dt_bias", "lower_bound", "safe_gate",
                                                       "use_gate_in_kernel")}
    return {**out, "g": g.to(args["g"].device, args["g"].dtype)}
CALLS = {
    "default": dict(),
    "a state": dict(initial_state=True),
    "flashkda": dict(l2norm=True, beta_logits=True, state_v_first=True, initial_state=True),
    "K ≠ V, GVA, V-first": dict(V=64, HV=4, initial_state=True, state_v_first=True),
    "fp16": dict(dtype=torch.float16, initial_state=True),
}


def assert_parallel_equals_one_pass(args):
    """The call in parallel segments (PARALLEL): o and the final states within one pass's error
    against the float64 recurrence, and close to kda_forward's own numbers (one pass there)."""
    o, s = kda_forward(**args)
    o_par, s_par = run_tuned(args, PARALLEL)
    ref_o, ref_s = reference_forward(**args, method="chunked")
    assert rel_err(o_par, ref_o) <= ERROR_FLOOR and rel_err(s_par, ref_s) <= ERROR_FLOOR
    assert rel_err(o_par, o) <= ERROR_FLOOR and rel_err(s_par, s) <= ERROR_FLOOR


@gpu
@pytest.mark.parametrize("call", list(CALLS))
def test_parallel_segments_equal_one_pass(call):
    """Six segments of 192 tokens (a tail in the last): o and the final state within the error of
    one pass against the float64 recurrence, and close to one pass's numbers."""
    args = slow(random_inputs(1, 1000, 2, 128, seed=51, **CALLS[call]))
    plan = plan_of(**args, tuning=PARALLEL)
    assert plan.parallel and plan.segments == tuple((t, min(t + 192, 1000)) for t in range(0, 1000, 192))
    assert_parallel_equals_one_pass(args)


SM90_SPECIALISATIONS = {
    f"merge, K={K}, V={V}, {'V' if v_first else 'K'}-first, {stages} stages": (
        "merge_kernel", dict(h="*fp32", M="*fp32", out="*fp32", n="i32"),
        dict(K=K, V=V, BV=merge.MERGE_BLOCK_V, CHAINS=16, V_FIRST=v_first),
        dict(num_warps=merge.MERGE_WARPS, num_stages=stages))
    for K, V, v_first in ((128, 128, False), (128, 128, True), (128, 64, True), (64, 128, False))
    for stages in (merge.MERGE_STAGES, merge.MERGE_STAGES_SPREAD)
}
SM90_SHARED = 232448          # bytes of shared memory one program may take on sm_90


# Compiles one specialisation (argv: kernel, signature, constants, options as JSON) and writes its cubin
# to stdout; run in a process of its own without TRITON_INTERPRET, which Triton 3.9 applies to every
# compile in a process that has it.
COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kda_opt import merge
kernel, signature, constants, options = json.loads(sys.argv[1])
source = ASTSource(getattr(merge, kernel), {**signature, **{n: "constexpr" for n in constants}}, constexprs=constants)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
print(json.dumps(dict(cubin=compiled.asm["cubin"].hex(), shared=compiled.metadata.shared)))
"""


@pytest.mark.parametrize("name", list(SM90_SPECIALISATIONS))
def test_merge_compiles_for_sm90_without_spills(name):
    """The merge kernel as launched, at both its stage counts, compiled for sm_90 here (Triton's own
    ptxas; no GPU needed): no stack frame (its "ieee" products, or its whole [K, K] tiles, spilled
    kilobytes a thread), and the shared memory of its deeper pipeline within what a program may take."""
    import json
    import subprocess
    import sys
    from tests.test_wuso import resources
    compiled = json.loads(subprocess.run([sys.executable, "-c", COMPILE, json.dumps(SM90_SPECIALISATIONS[name])],
                                         env=compile_env(), capture_output=True, check=True).stdout)
    registers, stack = resources(bytes.fromhex(compiled["cubin"]))
    assert stack == 0 and registers <= 255 and compiled["shared"] <= SM90_SHARED, (registers, stack, compiled["shared"])


@pytest.mark.parametrize("chains, sms, stages", [(16, 128, merge.MERGE_STAGES_SPREAD), (17, 128, merge.MERGE_STAGES),
                                                 (16, None, merge.MERGE_STAGES)])
def test_merge_loads_run_further_ahead_where_each_program_has_an_sm(monkeypatch, chains, sms, stages):
    """merge's launch: M's loads three stages deep where its (chain, V block) programs number no more
    than the SMs, else two (two programs an SM fit only at two)."""
    launched = {}
    monkeypatch.setattr(merge, "triton_launch", lambda *a, num_stages, **k: launched.setdefault("stages", num_stages))
    merge.merge(torch.zeros(2, chains, 64, 64), torch.zeros(1, chains, 64, 64), sms=sms)
    assert launched["stages"] == stages


@gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_parallel_segments_with_a_pool_and_checkpoints(state_v_first):
    """The serving call on a lone long request: its pool slot read (or zeros where has_initial_state
    is false) and written, checkpoints every 128 tokens, as one pass writes them."""
    args = slow(random_inputs(1, 1000, 2, 128, seed=52, initial_state=True, state_v_first=state_v_first,
                              output_final_state=False))
    start = torch.randn(3, *args["initial_state"].shape[1:], device="cuda")
    start[1] = args["initial_state"][0]
    for has in (True, False):
        pools, cks = [], []
        for tuning in (Tuning(), PARALLEL):
            pool = start.clone()
            ck = torch.full((1, 8, *pool.shape[1:]), 7.0, device="cuda")
            call = {**args, "initial_state": pool, "initial_state_indices": torch.tensor([1], device="cuda"),
                    "has_initial_state": torch.tensor([has], device="cuda"), "checkpoints": ck,
                    "checkpoint_every": 128}
            assert plan_of(**call, tuning=tuning).parallel == bool(tuning.parallel)
            run_tuned(call, tuning)
            pools.append(pool)
            cks.append(ck)
        assert torch.equal(pools[0][[0, 2]], pools[1][[0, 2]])          # other rows untouched
        assert rel_err(pools[1][1], pools[0][1]) <= ERROR_FLOOR
        assert rel_err(cks[1], cks[0]) <= ERROR_FLOOR


@gpu
@pytest.mark.parametrize("call", ["a state", "flashkda"])
def test_slices_by_kda_opt_merged_equal_one_pass(call):
    """kda_opt/distributed's steps on one GPU without a collective: three slices of one sequence (not
    multiples of 64), each slice's stages 1–3 once (forward.Prepared), its final state from zero and transition
    by kda_opt, merged (kda_opt/merge), each slice from its start: one pass's o and final state within
    its error bound; the transition against the float64 reference's (v = 0 from I)."""
    from kda_opt.distributed import ReferenceEngine
    from kda_opt.forward import Prepared
    from kda_opt.merge import merge
    args = slow(random_inputs(1, 1000, 2, 128, seed=53, **CALLS[call]))
    initial = args.pop("initial_state")
    args.pop("output_final_state")
    o, s = kda_forward(**args, initial_state=initial, output_final_state=True)
    cut = lambda a, b: {n: x[:, a:b] if n in ("q", "k", "v", "g", "beta") else x for n, x in args.items()}
    slices = [cut(0, 300), cut(300, 577), cut(577, 1000)]
    prepared = [Prepared(**x) for x in slices]
    hs = [prepared[0].ends(initial)[1]] + [x.ends()[1] for x in prepared[1:]]
    M = prepared[1].transition()
    starts = merge(torch.cat(hs[:2]), M, bool(args.get("state_v_first")))
    outs = [prepared[0].ends(initial)] + [x.ends(starts[j:j + 1]) for j, x in enumerate(prepared[1:])]
    assert rel_err(torch.cat([x for x, _ in outs], dim=1), o) <= ERROR_FLOOR
    assert rel_err(outs[-1][1], s) <= ERROR_FLOOR
    assert rel_err(M, ReferenceEngine().prepare(slices[1]).transition()) <= ERROR_FLOOR


@gpu
def test_prepared_packed_sequences():
    """forward.Prepared over packed sequences (a rank's part of a packed call, kda_opt/distributed):
    ends(S0) is kda_forward's call from S0 bit for bit, and transition() each sequence's transition
    (an empty one's I) within one pass's error of the float64 reference's."""
    from kda_opt.distributed import ReferenceEngine
    from kda_opt.forward import Prepared
    args = slow(random_inputs(1, 700, 2, 128, seed=60, seqlens=(300, 0, 64, 336), initial_state=True))
    initial = args.pop("initial_state")
    args.pop("output_final_state")
    prepared = Prepared(**args)
    o, s = prepared.ends(initial)
    o_one, s_one = kda_forward(**args, initial_state=initial, output_final_state=True)
    assert torch.equal(o, o_one) and torch.equal(s, s_one)
    M = prepared.transition()
    assert M.shape[0] == 4 and rel_err(M, ReferenceEngine().prepare(args).transition()) <= ERROR_FLOOR


@gpu
def test_lone_packed_sequence_runs_as_fixed_length():
    """One packed sequence (cu_seqlens [0, T]) with its host copy: the plan of the B = 1 call
    (parallel segments at T = 65536, H = 2) and its numbers bit for bit, with a state pool,
    has_initial_state and checkpoints; without the host copy the packed path (one pass), within
    one pass's error floor of it."""
    T = 65536
    args = random_inputs(1, T, 2, 128, seed=57, initial_state=True, state_v_first=True)
    args.pop("output_final_state")
    pool = torch.randn(3, *args.pop("initial_state").shape[1:], device="cuda")
    cu = torch.tensor([0, T])
    serving = dict(initial_state_indices=torch.tensor([2], device="cuda"),
                   has_initial_state=torch.tensor([True], device="cuda"))
    runs = {}
    for name, extra in {"fixed": {}, "lone": dict(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu),
                        "packed": dict(cu_seqlens=cu.cuda())}.items():
        plan = plan_of(**args, **extra, initial_state=pool, **serving)
        assert (plan.parallel, plan.packed) == ((True, False) if name != "packed" else (False, True)), name
        state, checkpoints = pool.clone(), torch.zeros(1, T // 512, 2, 128, 128, device="cuda")
        o, _ = kda_forward(**args, **extra, initial_state=state, **serving, checkpoints=checkpoints,
                           checkpoint_every=512)
        runs[name] = o, state, checkpoints
    assert all(torch.equal(x, y) for x, y in zip(runs["lone"], runs["fixed"]))
    assert all(rel_err(x, y) <= ERROR_FLOOR for x, y in zip(runs["lone"], runs["packed"]))


PACKED_LENGTHS = (50, 1000, 0, 64, 700, 1)     # the longest in segments of 192 tokens, 700 in four


@gpu
@pytest.mark.parametrize("call", ["a state", "flashkda", "K ≠ V, GVA, V-first"])
def test_packed_long_sequences_cut_equal_one_pass(call):
    """Packed sequences with their host copy: those longer than the longest's segment run as parallel
    segments beside the others (empty and one-token ones among them), o and the final states within
    one pass's error against the float64 recurrence and close to the packed path's numbers."""
    args = slow(random_inputs(1, sum(PACKED_LENGTHS), 2, 128, seed=58, seqlens=PACKED_LENGTHS, **CALLS[call]))
    plan = plan_of(**args, tuning=PARALLEL)
    assert plan.packed and not plan.parallel and plan.parallel_cut is not None
    pieces = cut_sequences(args["cu_seqlens_cpu"].tolist(), plan.HV, plan.parallel_cut, plan.sms)
    assert [n for n, _, _ in pieces] == \
        [0] + [1] * 6 + [2, 3] + [4] * 4 + [5]
    assert_parallel_equals_one_pass(args)


@gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_packed_long_sequences_cut_with_a_pool_and_checkpoints(state_v_first):
    """The serving call with long requests among short ones: pool slots read (zeros where
    has_initial_state is false or the slot is −1) and written (not at −1), checkpoints every 128
    tokens, as the packed path writes them; the pool's other rows untouched."""
    args = slow(random_inputs(1, sum(PACKED_LENGTHS), 2, 128, seed=59, seqlens=PACKED_LENGTHS, initial_state=True,
                              state_v_first=state_v_first, output_final_state=False))
    N = len(PACKED_LENGTHS)
    start = torch.randn(N + 2, *args["initial_state"].shape[1:], device="cuda")
    slots = torch.tensor([3, 7, 0, -1, 5, 1], device="cuda")
    rows = sum(-(-n // 128) for n in PACKED_LENGTHS)
    pools, cks = [], []
    for tuning in (Tuning(parallel=False), PARALLEL):
        pool = start.clone()
        ck = torch.full((1, rows, *pool.shape[1:]), 7.0, device="cuda")
        call = {**args, "initial_state": pool, "initial_state_indices": slots, "checkpoints": ck,
                "has_initial_state": torch.tensor([True, True, True, True, False, True], device="cuda"),
                "checkpoint_every": 128}
        assert (plan_of(**call, tuning=tuning).parallel_cut is not None) == bool(tuning.parallel)
        run_tuned(call, tuning)
        pools.append(pool)
        cks.append(ck)
    assert torch.equal(pools[0][[2, 4, 6]], start[[2, 4, 6]]) and torch.equal(pools[1][[2, 4, 6]], start[[2, 4, 6]])
    assert rel_err(pools[1], pools[0]) <= ERROR_FLOOR
    assert rel_err(cks[1], cks[0]) <= ERROR_FLOOR
