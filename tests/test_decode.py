"""kda_opt/decode (kda_decode) and its kernels (kda_opt/recurrence): the kernel against the float64 decode reference (Triton's interpreter
in fp32 without a GPU), the padding rules, and the argument checks."""
import json
import subprocess
import sys

import pytest
import torch

from kda_opt.arguments import DecodeArguments
from kda_opt.decode import kda_decode, run
from kda_opt.decode_plan import EIGHT_COLUMNS_FROM, GRID_AXIS_MAX, STREAMED_FROM, DecodePlan, make_decode_plan
from kda_opt.reference import ERROR_FLOOR, reference_decode
from tests.conftest import HAS_CUDA, ROOT, compile_env, gpu, kernel_device, rel_err
from tests.stage_inputs import plan_of

DEVICE = kernel_device()
SMS = 132
# fp32 under the interpreter (its 16-bit arithmetic is not the GPU's); the decode kernel is fp32 inside.
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
TOLERANCE = 2e-2 if HAS_CUDA else 1e-5


def inputs(N, T, H, K, *, HV=None, lens=None, gate="safe", l2norm=False, beta_logits=False, neg_eigval=False,
           v_first=False, slots=None, indices=None, accepted=None, pool_dtype=torch.float32, pad_slot=None,
           inplace=False, output_final_state=False, state=True, buffer_rows=None, steps=None, parents=None, seed=0):
    """kda_decode's arguments: N requests of T tokens (packed with `lens`), a pool of `slots` rows (padded)
    at `indices`, or a dense state per request; with buffer_rows, a buffer of `steps` states a row (its
    rows padded: `steps` of `steps` + 1) at those rows, in the pool's dtype, and with parents a tree
    (retrieve_parent_token)."""
    gen = torch.Generator().manual_seed(seed)
    HV = HV or H
    B, T = (1, sum(lens)) if lens else (N, T)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    args = dict(q=rand(B, T, H, K), k=rand(B, T, H, K), v=rand(B, T, HV, K), g=rand(B, T, HV, K),
                beta=rand(B, T, HV) if beta_logits else torch.rand(B, T, HV, generator=gen))
    args = {n: x.to(DEVICE, DTYPE) for n, x in args.items()}
    if not l2norm:
        args["k"] = torch.nn.functional.normalize(args["k"], dim=-1)
    if gate == "safe":
        args.update(use_gate_in_kernel=True, lower_bound=-5.0, A_log=torch.rand(HV, generator=gen).mul(15).add(1).log(),
                    dt_bias=rand(HV * K))
    elif gate == "softplus":
        args.update(use_gate_in_kernel=True, A_log=torch.rand(HV, generator=gen).mul(15).add(1).log(),
                    dt_bias=rand(HV * K))
    else:
        args["g"] = torch.nn.functional.logsigmoid(args["g"].float()).to(DTYPE)
    for name in ("A_log", "dt_bias"):
        if name in args:
            args[name] = args[name].to(DEVICE)
    args.update(use_qk_l2norm_in_kernel=l2norm, use_beta_sigmoid_in_kernel=beta_logits, allow_neg_eigval=neg_eigval,
                state_v_first=v_first, inplace_final_state=inplace, output_final_state=output_final_state,
                pad_slot=pad_slot)
    if lens:
        args["cu_seqlens"] = torch.tensor([0, *lens], device=DEVICE).cumsum(0)
    if slots is not None:
        pool = rand(slots, HV * K * K + 8)[:, :HV * K * K].view(slots, HV, K, K)
        args.update(initial_state=pool.to(DEVICE, pool_dtype), ssm_state_indices=torch.tensor(indices, device=DEVICE))
        if accepted is not None:
            args["num_accepted_tokens"] = torch.tensor(accepted, device=DEVICE)
    elif state:
        args["initial_state"] = rand(N, HV, K, K).to(DEVICE)
    if buffer_rows is not None:
        buffer = rand(max(buffer_rows) + 2, steps + 1, HV, K, K)[:, :steps]
        args.update(intermediate_states_buffer=buffer.to(DEVICE, pool_dtype),
                    intermediate_state_indices=torch.tensor(buffer_rows, device=DEVICE))
    if parents is not None:
        args["retrieve_parent_token"] = torch.tensor(parents, device=DEVICE)
    return args


def decoded(args, sms=None):
    """kda_decode on the GPU; its plan's run under the interpreter without one (the plan made with an
    SM count, since make_decode_plan checks devices only on a GPU), or with `sms` (an SM count that
    picks a launch a small call would not get: the streamed kernel from plan.STREAMED_FROM programs
    an SM)."""
    if HAS_CUDA and sms is None:
        return kda_decode(**args)
    plan = make_decode_plan(DecodeArguments(**args), sms=sms or SMS)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens", "ssm_state_indices",
             "num_accepted_tokens", "out", "intermediate_states_buffer", "intermediate_state_indices",
             "retrieve_parent_token")
    return run(plan, **{n: args.get(n) for n in names})


def check(args, sms=None):
    """o and the states against reference_decode: written rows within TOLERANCE, every other row of
    the pool (or the buffer, which leaves the pool as it was) bit for bit as it was."""
    before = None if args.get("initial_state") is None else args["initial_state"].clone()
    buffer = args.get("intermediate_states_buffer")
    buffered = buffer is not None
    if buffered:   # (its rows' padding, the states past S, as a view of their own)
        pool, before = args["initial_state"], buffer.clone()
        padding = buffer.as_strided((buffer.shape[0], buffer.stride(0) // buffer.stride(1) - buffer.shape[1],
                                     *buffer.shape[2:]), buffer.stride(), buffer.storage_offset() + buffer.stride(1)
                                    * buffer.shape[1])
        padding_before = padding.clone()
    o, final = decoded(args, sms)
    ref_o, ref_final = reference_decode(**{**args, "initial_state": pool.clone() if buffered else before,
                                           "intermediate_states_buffer": before if buffered else None})
    assert rel_err(o, ref_o) < TOLERANCE
    if buffered:
        assert final is buffer and torch.equal(args["initial_state"], pool) and torch.equal(padding, padding_before)
    if ref_final is None:
        assert final is None
        return o, final
    if args.get("inplace_final_state") or buffered:
        changed = (ref_final != before.double()).flatten(1).any(1)
        assert torch.equal(final[~changed], before[~changed])
        if changed.any():   # (a 16-bit pool: within 3× its own rounding of the reference; the interpreter truncates)
            written = ref_final[changed]
            assert rel_err(final[changed], written) < max(TOLERANCE, 3 * rel_err(written.to(final.dtype), written))
    else:
        assert rel_err(final, ref_final) < TOLERANCE
    return o, final


CASES = {
    "decode, dense states": dict(N=3, T=1, H=2, K=64, output_final_state=True),
    "decode, no state": dict(N=2, T=1, H=2, K=64, state=False, output_final_state=True),
    "decode, dense states in place, V-first": dict(N=3, T=1, H=2, K=64, inplace=True, v_first=True),
    "decode, pool": dict(N=4, T=1, H=2, K=64, slots=6, indices=[5, 0, 3, 2], inplace=True),
    "decode, pool, softplus, l2norm, logits": dict(N=3, T=1, H=2, K=64, slots=4, indices=[1, 3, 0], inplace=True,
                                                   gate="softplus", l2norm=True, beta_logits=True, neg_eigval=True),
    "decode, pool, preactivated gate, grouped heads": dict(N=3, T=1, H=1, HV=2, K=64, slots=4, indices=[2, 0, 1],
                                                           inplace=True, gate="none"),
    "decode, bf16 V-first pool": dict(N=3, T=1, H=2, K=64, slots=4, indices=[2, 3, 0], inplace=True, v_first=True,
                                      pool_dtype=torch.bfloat16),
    "decode, pool read, new final states": dict(N=3, T=1, H=2, K=64, slots=5, indices=[4, 1, 2],
                                                output_final_state=True),
    "packed requests of 1, 3, 0, 2 tokens": dict(N=4, T=None, H=2, K=64, lens=[1, 3, 0, 2], slots=5,
                                                 indices=[0, 4, 2, 1], inplace=True),
    "verify, [N, S] slots, accepted": dict(N=3, T=4, H=2, K=64, slots=14, indices=[[0, 1, 2, 3], [4, 5, 6, 7],
                                                                                   [8, 9, 10, 11]],
                                           accepted=[1, 3, 4], inplace=True),
    "verify, packed, V-first": dict(N=3, T=None, H=2, K=64, lens=[2, 4, 1], slots=14, v_first=True,
                                    indices=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], accepted=[2, 1, 4],
                                    inplace=True),
    "K = V = 128": dict(N=2, T=2, H=1, K=128, slots=3, indices=[[2, 0], [1, -1]], inplace=True),
    # V-first 16-bit states: the streamed kernel (a program per request and head walks its rows).
    "streamed: packed requests of 1, 3, 0, 2 tokens, a bf16 pool with a −1 slot": dict(
        N=4, T=None, H=2, K=64, lens=[1, 3, 0, 2], slots=5, indices=[0, -1, 2, 4], inplace=True, v_first=True,
        pool_dtype=torch.bfloat16),
    "streamed: one token each, an fp16 pool, a pad slot, softplus, l2norm, logits": dict(
        N=4, T=1, H=2, K=64, slots=5, indices=[3, 0, 1, 0], pad_slot=0, inplace=True, v_first=True,
        pool_dtype=torch.float16, gate="softplus", l2norm=True, beta_logits=True),
    "streamed: grouped heads, preactivated gate, the pool only read": dict(
        N=3, T=2, H=1, HV=2, K=64, slots=4, indices=[2, 0, 1], v_first=True, pool_dtype=torch.bfloat16,
        gate="none"),
    # SGLang's verify: the pool only read, each token's state into the request's buffer row (a token
    # past its S, a negative row: not written; a −1 slot: a zero start).
    "verify into a buffer, packed, V-first": dict(N=4, T=None, H=2, K=64, lens=[2, 5, 1, 3], slots=6,
                                                  indices=[4, -1, 2, 0], buffer_rows=[3, 0, -1, 1], steps=4,
                                                  v_first=True),
    "verify into a bf16 buffer, softplus, l2norm, logits": dict(N=2, T=3, H=2, K=64, slots=3, indices=[1, 0],
                                                                buffer_rows=[1, 0], steps=3, gate="softplus",
                                                                l2norm=True, beta_logits=True,
                                                                pool_dtype=torch.bfloat16),
    # SGLang's tree verify: token t from the buffer's state after its parent (a parent not before t, or
    # not written, and a column past the parents' keep the chain).
    "tree verify into a buffer, packed, V-first": dict(
        N=4, T=None, H=2, K=64, lens=[4, 5, 1, 3], slots=6, indices=[4, -1, 2, 0], buffer_rows=[3, 0, -1, 1],
        steps=4, v_first=True, parents=[[-1, 0, 0, 2, 0], [-1, 0, 1, 1, 3], [-1, 5, 0, 0, 0], [-1, 0, 7, 1, 0]]),
    "tree verify, fewer parents than tokens, softplus": dict(
        N=2, T=3, H=2, K=64, slots=3, indices=[1, 0], buffer_rows=[1, 0], steps=3, gate="softplus",
        parents=[[-1, 0], [0, 0]]),
    # A 16-bit buffer's parent t − 1 is read back rounded, as SGLang's kernel reads it (fp16: the
    # interpreter truncates bf16, the reference rounds).
    "tree verify into an fp16 buffer, parents t - 1 among them": dict(
        N=2, T=4, H=2, K=64, slots=3, indices=[1, 0], buffer_rows=[1, 0], steps=4, pool_dtype=torch.float16,
        parents=[[-1, 0, 1, 2], [-1, 0, 0, 2]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_the_recurrence(case):
    # The streamed cases on one SM, where their few programs take the streamed kernel.
    check(inputs(**CASES[case]), sms=1 if case.startswith("streamed") else None)


def test_a_tree_token_continues_its_parents_path():
    """reference_decode's tree, as SGLang's verify means it: the state after a request's token t is that
    of the chain of t's path (its ancestors by retrieve_parent_token, in order, then t; a parent not
    before its token, the one before it) from the request's start (fp32 states: the buffer's rounding
    aside)."""
    args = inputs(**CASES["tree verify into a buffer, packed, V-first"])
    parents, bounds = args["retrieve_parent_token"].tolist(), args["cu_seqlens"].tolist()
    S = args["intermediate_states_buffer"].shape[1]
    _, buffer = reference_decode(**args)
    tokens = ("q", "k", "v", "g", "beta")
    checked = 0
    for n, (row, slot) in enumerate(zip(args["intermediate_state_indices"].tolist(),
                                        args["ssm_state_indices"].tolist())):
        for t in range(min(S, bounds[n + 1] - bounds[n])) if row >= 0 else ():
            path = [t]
            while path[0] > 0:      # a parent not before its token (or not written) stands for the chain's
                p = parents[n][path[0]]
                path.insert(0, p if 0 <= p < path[0] else path[0] - 1)
            start = args["initial_state"][slot] if slot >= 0 else torch.zeros_like(args["initial_state"][0])
            chain = {**args, **{x: args[x][:, [bounds[n] + p for p in path]] for x in tokens},
                     "initial_state": start[None], "ssm_state_indices": None, "intermediate_states_buffer": None,
                     "intermediate_state_indices": None, "retrieve_parent_token": None, "cu_seqlens": None,
                     "output_final_state": True}
            _, final = reference_decode(**chain)
            assert rel_err(buffer[row, t], final[0]) < 1e-6, (n, t, path)
            checked += len(path) > 1 and path[-2] != t - 1
    assert checked == 2      # tokens whose path leaves the chain


PADDED = {
    # The same three live requests, with padding rows: −1, past the pool, and the declared pad slot.
    "negative slots": (dict(indices=[3, -1, 1, -1, 4, -1]), None),
    "past the pool": (dict(indices=[3, 9, 1, 6, 4, 100]), None),
    "a pad slot many rows name": (dict(indices=[3, 0, 1, 0, 4, 0]), 0),
}


@pytest.mark.parametrize("case", list(PADDED))
def test_padding_leaves_live_rows_as_unpadded(case):
    """A padded batch writes every live row bit for bit as the same batch without its padding rows,
    and touches no other row (the pad slot's contents included)."""
    padded, pad_slot = PADDED[case]
    live = [0, 2, 4]
    args = inputs(N=6, T=1, H=2, K=64, slots=6, inplace=True, pad_slot=pad_slot, **padded)
    alone = {n: (x[live] if n in ("q", "k", "v", "g", "beta") else x) for n, x in args.items()}
    alone["ssm_state_indices"] = args["ssm_state_indices"][live]
    alone["initial_state"] = args["initial_state"].clone()
    before = args["initial_state"].clone()
    o, pool = decoded(args)
    o_alone, pool_alone = decoded(alone)
    assert torch.equal(pool, pool_alone)
    assert torch.equal(o[live], o_alone)
    untouched = [r for r in range(6) if r not in (3, 1, 4)]
    assert torch.equal(pool[untouched], before[untouched])


def test_one_token_views_of_a_fused_projection_are_read_in_place():
    """Batched decode (B = N, T = 1) on q, k, v split from one fused [N, 3·H·K] tensor (SGLang's
    mixed_qkv, whose size-1 token axis has a stride of H·K): read through their batch stride, no copy
    (kda_opt/decode._token_rows), the same o and pool as on contiguous copies."""
    from kda_opt.decode import _token_rows
    args = inputs(N=4, T=1, H=2, K=64, slots=6, indices=[5, 0, 3, 2], inplace=True)
    fused = torch.cat([args[n].flatten(1) for n in ("q", "k", "v")], dim=-1)
    views = {n: x.view(4, 1, 2, 64) for n, x in zip(("q", "k", "v"), fused.split(128, dim=-1))}
    assert all(_token_rows(x).data_ptr() == x.data_ptr() for x in views.values())
    copies = {**args, "initial_state": args["initial_state"].clone()}
    # β as a transposed [1, N, H] tensor (SGLang's decode β, handed on as N requests of one token):
    # torch calls it contiguous, its token stride N·H all the same.
    views["beta"] = args["beta"].view(1, 4, 2).transpose(0, 1)
    assert views["beta"].is_contiguous() and views["beta"].stride(1) == 4 * 2
    o_views, pool_views = decoded({**args, **views})
    o, pool = decoded(copies)
    assert torch.equal(o_views, o) and torch.equal(pool_views, pool)


def test_zero_accepted_tokens_is_a_pad_row():
    """A request whose num_accepted_tokens is 0 (or past its columns) starts from zeros and writes no
    row (vLLM nulls such rows; FLA's kernel reads column −1, the previous request's last slot)."""
    args = inputs(N=3, T=2, H=2, K=64, slots=6, indices=[[0, 1], [2, 3], [4, 5]], accepted=[1, 0, 3], inplace=True)
    before = args["initial_state"].clone()
    o, pool = check(args)
    assert torch.equal(pool[2:], before[2:])
    assert not torch.equal(pool[:2], before[:2])


def plan(**overrides) -> DecodePlan:
    args = inputs(**{**dict(N=4, T=1, H=2, K=64, slots=6, indices=[5, 0, 3, 2], inplace=True), **overrides})
    return make_decode_plan(DecodeArguments(**args), sms=SMS)


def test_plan_reads_and_writes():
    assert (plan().read, plan().write, plan().columns, plan().slots) == (2, 2, 1, 6)
    verify = plan(T=2, indices=[[0, 1], [2, 3], [4, 5], [1, 2]])
    assert (verify.write, verify.columns) == (3, 2)
    buffered = plan(T=2, inplace=False, buffer_rows=[0, 1, 2, 3], steps=3)
    assert (buffered.read, buffered.write, buffered.columns, buffered.slots) == (2, 4, 3, 6)
    dense = plan(slots=None, indices=None, inplace=False, output_final_state=True)
    assert (dense.read, dense.write, dense.output_final_state) == (1, 1, True)
    assert plan(slots=None, indices=None, inplace=False, state=False).read == 0
    # The streamed kernel: V-first 16-bit states written once (or only read), no [N, S] slots or buffer,
    # from STREAMED_FROM (request, value head) programs an SM.
    streamed = lambda N=SMS * STREAMED_FROM // 2, **changes: plan(**{"N": N, "slots": N, "indices": list(range(N)),
                                                                     **changes})
    assert streamed(v_first=True, pool_dtype=torch.bfloat16).streamed
    assert streamed(v_first=True, pool_dtype=torch.float16, inplace=False).streamed
    assert not streamed(N=SMS * STREAMED_FROM // 2 - 1, v_first=True, pool_dtype=torch.bfloat16).streamed
    assert not streamed(v_first=True).streamed and not streamed(pool_dtype=torch.bfloat16).streamed
    assert not streamed(v_first=True, pool_dtype=torch.bfloat16, T=2,
                        indices=[[n, n] for n in range(SMS * STREAMED_FROM // 2)]).streamed
    assert not streamed(v_first=True, pool_dtype=torch.bfloat16, slots=None, indices=None, inplace=False,
                        output_final_state=True).streamed
    assert not streamed(v_first=True, pool_dtype=torch.bfloat16, inplace=False,
                        buffer_rows=list(range(SMS * STREAMED_FROM // 2)), steps=1).streamed


def test_launch_follows_the_layout_and_the_batch():
    """16 columns by one warp for a small step and for V-first states, a V-first fp32 state's blocks
    first (up to GRID_AXIS_MAX requests, the grid's third axis) and then 8 columns from
    EIGHT_COLUMNS_FROM pairs an SM; 64 by two warps for K-first states once every SM has a program."""
    def launch(N, **changes):
        p = plan(N=N, indices=list(range(N)), slots=N, **changes)
        return p.block_v, p.num_warps, p.blocks_first
    # 2N (request, value head) pairs of one 64-column block each (H = 2, V = 64).
    assert launch(1) == (16, 1, False)
    assert launch(SMS // 2) == (64, 2, False) and launch(SMS // 2 - 1) == (16, 1, False)
    assert launch(SMS // 2, pool_dtype=torch.bfloat16) == (64, 2, False)
    # H = 2: EIGHT_COLUMNS_FROM · SMS pairs from half as many requests.
    assert launch(1, v_first=True) == launch(EIGHT_COLUMNS_FROM * SMS // 2 - 1, v_first=True) == (16, 1, True)
    assert launch(EIGHT_COLUMNS_FROM * SMS // 2, v_first=True) == (8, 1, True)
    assert launch(16 * SMS, v_first=True, pool_dtype=torch.bfloat16) == (16, 1, False)
    many = plan(N=GRID_AXIS_MAX + 1, T=1, slots=None, indices=None, inplace=False, state=False, v_first=True)
    assert (many.block_v, many.blocks_first) == (16, False)


def bad(**changes):
    args = inputs(N=2, T=1, H=2, K=64, slots=3, indices=[2, 0], inplace=True)
    args.update(changes)
    return args


BAD_INPUTS = {
    "both final-state options": (ValueError, "pass one of them", dict(output_final_state=True)),
    "in place without a state": (ValueError, "needs one", dict(initial_state=None, ssm_state_indices=None)),
    "indices without a pool": (ValueError, "needs initial_state", dict(initial_state=None, inplace_final_state=False)),
    "float indices": (TypeError, "int32 or int64", dict(ssm_state_indices=torch.tensor([2.0, 0.0]))),
    "indices of the wrong length": (ValueError, r"shape \[2\] or \[2, S\]", dict(ssm_state_indices=torch.tensor([2]))),
    "too few columns for T": (ValueError, "S must be at least", dict(
        ssm_state_indices=torch.tensor([[2], [0]]), **{n: inputs(N=2, T=2, H=2, K=64, state=False)[n]
                                                       for n in ("q", "k", "v", "g", "beta")})),
    "accepted without [N, S]": (ValueError, r"ssm_state_indices \[N, S\]", dict(num_accepted_tokens=torch.tensor([1, 1]))),
    "a pool row not dense": (ValueError, "each row dense", dict(initial_state=torch.zeros(2, 3, 64, 64).transpose(0, 1))),
    "an fp64 pool": (TypeError, "float32, bfloat16 or float16", dict(initial_state=torch.zeros(3, 2, 64, 64,
                                                                                                  dtype=torch.float64))),
    "out of the wrong dtype": (ValueError, "out must be", dict(out=torch.zeros(2, 1, 2, 64, dtype=torch.float16))),
    "a negative pad slot": (TypeError, "pad_slot", dict(pad_slot=-1)),
    "a pad slot without indices": (ValueError, "needs slot indices", dict(
        ssm_state_indices=None, initial_state=torch.zeros(2, 2, 64, 64), pad_slot=0)),
    "a NaN scale": (ValueError, "finite", dict(scale=float("nan"))),
    "a buffer without its rows": (ValueError, "needs intermediate_state_indices", dict(
        inplace_final_state=False, intermediate_states_buffer=torch.zeros(3, 1, 2, 64, 64))),
    "buffer rows without a buffer": (ValueError, "need one", dict(intermediate_state_indices=torch.tensor([0, 1]))),
    "a buffer and the pool written": (ValueError, "not with", dict(
        intermediate_states_buffer=torch.zeros(3, 1, 2, 64, 64), intermediate_state_indices=torch.tensor([0, 1]))),
    "a buffer of the wrong shape": (ValueError, r"\[rows, S, 2, 64, 64\]", dict(
        inplace_final_state=False, intermediate_states_buffer=torch.zeros(3, 1, 2, 64, 32),
        intermediate_state_indices=torch.tensor([0, 1]))),
    "a buffer too short for T": (ValueError, "S must be at least", dict(
        inplace_final_state=False, intermediate_states_buffer=torch.zeros(3, 1, 2, 64, 64),
        intermediate_state_indices=torch.tensor([0, 1]), **{n: inputs(N=2, T=2, H=2, K=64, state=False)[n]
                                                           for n in ("q", "k", "v", "g", "beta")})),
    "a buffer with [N, S] slots": (ValueError, r"ssm_state_indices \[N\]", dict(
        inplace_final_state=False, intermediate_states_buffer=torch.zeros(3, 1, 2, 64, 64),
        intermediate_state_indices=torch.tensor([0, 1]), ssm_state_indices=torch.tensor([[2], [0]]))),
    "buffer rows of the wrong length": (ValueError, r"intermediate_state_indices must have shape \[2\]", dict(
        inplace_final_state=False, intermediate_states_buffer=torch.zeros(3, 1, 2, 64, 64),
        intermediate_state_indices=torch.tensor([0]))),
    "parents without a buffer": (ValueError, "they need one", dict(retrieve_parent_token=torch.zeros(2, 1).long())),
    "parents of the wrong shape": (ValueError, r"retrieve_parent_token must have shape \[2, P\]", dict(
        inplace_final_state=False, intermediate_states_buffer=torch.zeros(3, 1, 2, 64, 64),
        intermediate_state_indices=torch.tensor([0, 1]), retrieve_parent_token=torch.zeros(2).long())),
    "float parents": (TypeError, "int32 or int64", dict(
        inplace_final_state=False, intermediate_states_buffer=torch.zeros(3, 1, 2, 64, 64),
        intermediate_state_indices=torch.tensor([0, 1]), retrieve_parent_token=torch.zeros(2, 1))),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise(case):
    error, message, changes = BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        make_decode_plan(DecodeArguments(**bad(**changes)), sms=SMS)


@gpu
@pytest.mark.parametrize("columns", [16, 8])
def test_decode_on_the_gpu_as_fla(columns):
    """kda_decode against FLA's fused_recurrent_kda_fwd on the same pool call, at both of a V-first fp32
    pool's launches (decode_launch: 16 columns, and 8 from EIGHT_COLUMNS_FROM pairs an SM): o and the
    pool rows within FLA's own error against the float64 recurrence (at most twice it, or the floor)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from kda_opt.reference import error_bound
    N = 64 if columns == 16 else -(-EIGHT_COLUMNS_FROM * torch.cuda.get_device_properties(0).multi_processor_count // 4)
    args = inputs(N=N, T=1, H=4, K=128, slots=2 * N + 32, indices=torch.randperm(2 * N + 32)[:N].tolist(), inplace=True,
                  l2norm=True, beta_logits=True, v_first=True)
    assert make_decode_plan(DecodeArguments(**args)).block_v == columns
    ref_o, ref_pool = reference_decode(**{**args, "initial_state": args["initial_state"].clone()})
    fla_pool = args["initial_state"].clone()
    fla_o, _ = fused_recurrent_kda_fwd(**{n: args[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias",
                                                              "lower_bound", "ssm_state_indices")},
                                       initial_state=fla_pool, inplace_final_state=True, state_v_first=True,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, cu_seqlens=None)
    o, pool = kda_decode(**args)
    rows = args["ssm_state_indices"]
    assert rel_err(o, ref_o) <= error_bound(rel_err(fla_o, ref_o))
    assert rel_err(pool[rows], ref_pool[rows]) <= error_bound(rel_err(fla_pool[rows], ref_pool[rows]))


# ---- the kernel compiled for sm_90 (no GPU needed: Triton's own ptxas) ----

POINTERS = dict(q="*bf16", k="*bf16", v="*bf16", g="*bf16", beta="*bf16", A_log="*fp32", dt_bias="*fp32", o="*bf16",
                s_in="*fp32", s_out="*fp32", cu_seqlens="*i64", indices="*i64", accepted="*i64", has_state="*i1",
                buffer_rows="*i32", parents="*i64")
KIMI_DECODE = dict(H=32, HV=32, K=128, V=128, BV=64, MODE=1, HAS_A=True, HAS_BIAS=True, L2NORM=True, BETA_SIGMOID=1.0,
                   V_FIRST=True, PACKED=True, READ=2, WRITE=2, COLUMNS=1, ACCEPTED=False, PAD=True, HAS_MASK=False,
                   SINGLE=False, BLOCKS_FIRST=False, TREE=False)
VARIANTS = [
    dict(), dict(BV=16, num_warps=1), dict(BV=16, num_warps=1, BLOCKS_FIRST=True), dict(BV=8, num_warps=1, BLOCKS_FIRST=True),
    dict(V_FIRST=False, WRITE=3, COLUMNS=4, ACCEPTED=True, num_warps=4),
    dict(BV=16, num_warps=1, WRITE=4, COLUMNS=4), dict(BV=16, num_warps=1, WRITE=4, COLUMNS=4, TREE=True),
    dict(WRITE=3, COLUMNS=2, PACKED=False), dict(SINGLE=True, HAS_MASK=True, PAD=False),
    dict(SINGLE=True, READ=1, WRITE=1, HAS_MASK=True, PAD=False),
    dict(READ=1, WRITE=1, PACKED=False, PAD=False, L2NORM=False, BETA_SIGMOID=0.0, MODE=0, HAS_A=False,
         HAS_BIAS=False), dict(READ=0, WRITE=0, MODE=2, K=64, V=64, BV=16, H=8, HV=16, num_warps=1),
    # streamed_decode_kernel: Kimi's packed decode on a bf16 pool; a dense fp16 state only read.
    dict(streamed=True, state="*bf16", BV=16, num_warps=1, ONE_TOKEN=False, IN_PLACE=True),
    dict(streamed=True, state="*bf16", BV=16, num_warps=1, PACKED=False, ONE_TOKEN=True, IN_PLACE=True),
    dict(streamed=True, state="*fp16", READ=1, WRITE=0, PACKED=False, MODE=0, K=64, V=64, BV=16, H=8, HV=16,
         num_warps=1, ONE_TOKEN=False, IN_PLACE=False)]


# The integer arguments of Kimi's decode call at H = HV = 32, K = V = 128 on [N] slots (packed tokens
# [1, N, heads, channels], a pool of dense rows). At a launch Triton specialises each integer it may
# (the kernel's do_not_specialize aside) by its value, 1 as a constant and a multiple of 16 as such,
# and each pointer as 16-byte aligned: what lets the state's loads and stores be 16-byte vectors.
STRIDES = dict(SQT=32 * 128, SQH=128, SKT=32 * 128, SKH=128, SVT=32 * 128, SVH=128, SGT=32 * 128, SGH=128, SBT=32,
               SBH=1, SOT=32 * 128, SOH=128, S_IN=32 * 128 * 128, S_OUT=32 * 128 * 128, S_IDX=1)


def sm90_cubin(num_warps=2, streamed=False, state="*fp32", **changes):
    """decode_kernel (streamed_decode_kernel where `streamed`) compiled for sm_90 with Kimi's decode
    call's constants, changed by `changes`, states of type `state`, specialised as a launch with
    STRIDES specialises it (Triton's JIT, not its interpreter: see sm90_resources)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kda_opt.recurrence import decode_kernel, streamed_decode_kernel
    fn = streamed_decode_kernel if streamed else decode_kernel
    params = fn.params
    names = {p.name for p in params}
    pointers = {**POINTERS, "s_in": state, "s_out": state}
    constants = {n: x for n, x in {**KIMI_DECODE, **changes, **{n: 1 for n, x in STRIDES.items() if x == 1}}.items()
                 if n in names}
    signature = {p.name: "constexpr" if p.is_constexpr or p.name in constants else pointers.get(p.name)
                 or ("fp32" if p.name in ("scale", "lower_bound") else "i64") for p in params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if signature[p.name] != "constexpr"
               and (p.name in pointers or STRIDES.get(p.name, 1) % 16 == 0)}
    kernel = triton.compile(ASTSource(fn, signature, constants, aligned),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    return kernel.asm["cubin"]


@pytest.fixture(scope="module")
def sm90_resources():
    """(registers, stack bytes) of each of VARIANTS' cubins, compiled in a process of its own where
    the kernels are Triton's JIT functions (here, without a GPU, they are the interpreter's)."""
    code = ("import json\nfrom tests.test_decode import VARIANTS, sm90_cubin\nfrom tests.test_wuso import resources\n"
            "print(json.dumps([resources(sm90_cubin(**v)) for v in VARIANTS]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=compile_env(), cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_kernel_compiles_for_sm90_without_spilling(sm90_resources, variant):
    """Every kind of launch compiles for sm_90 (the interpreter does not catch what only the compiler
    refuses, such as a global that is not constexpr) and keeps its state block in registers, no stack."""
    registers, stack = sm90_resources[variant]
    assert registers <= 255 and stack == 0, (VARIANTS[variant], registers, stack)


# ---- a packed kda_forward call's sequences of one token (Tuning.route_decodes; GPU) ----

def mixed_call(pool=True, **call):
    """kda_forward's keywords for a packed step of decodes beside prefills (and an empty request):
    Kimi's call on a pool at shuffled slots with has_initial_state, or dense states."""
    from inputs import random_inputs
    lens = [1, 130, 1, 64, 0, 1, 7, 1]
    args = random_inputs(1, sum(lens), 2, 128, seqlens=lens, initial_state=True, l2norm=True, beta_logits=True,
                         state_v_first=True, seed=4, **call)
    if pool:
        rows = torch.randn(20, 2, 128, 128, device="cuda")
        slots = torch.randperm(20, device="cuda")[:len(lens)]
        rows[slots] = args["initial_state"]
        args.update(initial_state=rows, initial_state_indices=slots, output_final_state=False,
                    has_initial_state=torch.tensor([True, True, False, True, True, True, False, True], device="cuda"))
    return args, lens


@gpu
def test_plan_routes_only_packed_one_pass_calls():
    """The prefill plan holds a DecodePlan for its one-token sequences where the call is packed, has
    no checkpoints and the tuning asks; it reads and writes where stage 4 would."""
    from inputs import random_inputs
    from kda_opt.plan import Tuning
    routed = Tuning()
    args, _ = mixed_call()
    plan = plan_of(**args, tuning=routed).decode
    assert (plan.single, plan.read, plan.write, plan.slots, plan.packed) == (True, 2, 2, 20, True)
    assert plan_of(**args, tuning=Tuning(route_decodes=False)).decode is None
    assert plan_of(**random_inputs(3, 1, 2, 128, initial_state=True)).decode is None   # dense: stage 4
    dense, _ = mixed_call(pool=False)
    assert (plan_of(**dense, tuning=routed).decode.read, plan_of(**dense, tuning=routed).decode.write) == (1, 1)
    ckpt = torch.zeros(1, 16, 2, 128, 128, device="cuda")
    assert plan_of(**args, checkpoints=ckpt, tuning=routed).decode is None


@gpu
@pytest.mark.parametrize("pool", [True, False])
def test_routed_decodes_equal_kda_decode(pool):
    """With route_decodes a packed call's sequences of one token go through kda_opt/decode: their o
    rows and states are kda_decode's on those requests bit for bit, the other rows and states those
    of the call without routing bit for bit, and its o within the error floor of that call's."""
    from kda_opt.plan import Tuning
    from tests.test_forward import run_tuned
    args, lens = mixed_call(pool=pool)
    original = args["initial_state"].clone()
    plain_args = {**args, "initial_state": args["initial_state"].clone()}
    o_plain, s_plain = run_tuned(plain_args, Tuning(route_decodes=False))
    o, s = run_tuned(args, Tuning())
    starts = torch.tensor([0, *lens]).cumsum(0)[:-1]
    ones = [n for n, length in enumerate(lens) if length == 1]
    tokens = starts[ones].tolist()
    rest = [t for t in range(sum(lens)) if t not in tokens]
    assert torch.equal(o[:, rest], o_plain[:, rest]) and rel_err(o, o_plain) <= ERROR_FLOOR
    # kda_decode on the one-token requests alone, from the same states.
    pick = lambda x: x[:, tokens]
    one = dict(q=pick(args["q"]), k=pick(args["k"]), v=pick(args["v"]), g=pick(args["g"]), beta=pick(args["beta"]),
               A_log=args["A_log"], dt_bias=args["dt_bias"], lower_bound=args["lower_bound"], use_gate_in_kernel=True,
               use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
               cu_seqlens=torch.arange(len(ones) + 1, device="cuda"))
    if pool:
        slots = args["initial_state_indices"][ones]
        use = args["has_initial_state"][ones].view(-1, 1, 1, 1)
        o_one, s_one = kda_decode(**one, initial_state=torch.where(use, original[slots], 0.0), output_final_state=True)
        pool_after = args["initial_state"]
        assert torch.equal(pool_after[slots], s_one)
        others = args["initial_state_indices"][[n for n in range(len(lens)) if n not in ones]]
        assert torch.equal(pool_after[others], plain_args["initial_state"][others])
    else:
        o_one, s_one = kda_decode(**one, initial_state=original[ones], output_final_state=True)
        assert torch.equal(s[ones], s_one)
        others = [n for n in range(len(lens)) if n not in ones]
        assert torch.equal(s[others], s_plain[others])
    assert torch.equal(o[:, tokens], o_one)


FLA_CALLS = {
    "decode, pool, Kimi's options": dict(N=4, T=None, H=2, K=64, lens=[1, 1, 1, 1], slots=7, indices=[5, 0, 3, 2],
                                         inplace=True, l2norm=True, beta_logits=True, v_first=True),
    "verify, [N, S] slots, accepted": dict(N=3, T=3, H=2, K=64, slots=10, indices=[[0, 1, 2], [3, 4, 5], [6, 7, 8]],
                                           accepted=[1, 3, 2], inplace=True, gate="softplus"),
    "dense states, final states, grouped heads": dict(N=2, T=2, H=1, HV=2, K=64, output_final_state=True,
                                                      gate="none"),
}


@pytest.mark.parametrize("case", list(FLA_CALLS))
def test_decode_is_flas_decode_kernel(case):
    """kda_decode and FLA 0.6.0's fused_recurrent_kda_fwd (its kernel: under the interpreter without a
    GPU) on the same call where both define it: the same o and states."""
    fused = pytest.importorskip("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd
    args = inputs(**FLA_CALLS[case])
    theirs = {**args, "initial_state": None if args.get("initial_state") is None else args["initial_state"].clone()}
    theirs.pop("pad_slot")
    fla_o, fla_state = fused(**theirs)
    o, state = decoded(args)
    assert rel_err(o, fla_o) < TOLERANCE and rel_err(state, fla_state) < TOLERANCE
