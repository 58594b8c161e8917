"""One small call of every launch path, for compute-sanitizer (tests/test_sanitizer.py runs this file
under each of its tools): `python tests/sanitizer_calls.py [--poisoned] [NAME ...]` makes the calls
named (all of them without names; each REPEATS times, its last replayed where it may be) and prints
`call NAME` before each, so that the sanitizer's report
shows which call an error came from. Run with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every tensor
is an allocation of its own and an access past one is outside it.

--zero-stage4-buffers (for initcheck, which does not see TMA stores): every buffer a stage-4 launch
writes zeroed before it, so that initcheck checks every other read.

--poisoned (no sanitizer; what initcheck cannot show, since it does not see TMA stores: docs/DESIGN.md,
"Memory safety"): every byte of the caching allocator's memory set to 0xFF (NaN in fp32, bf16 and
fp16) before the calls, and every element each call returns then read: one never written is a NaN."""
import inspect
import sys

import torch

from inputs import random_inputs
from kda_opt import kda_conv_decode, kda_decode, kda_forward
from kda_opt.decode_plan import EIGHT_COLUMNS_FROM
from kda_opt.forward import RUN_TENSORS, Prepared, run
from kda_opt.plan import Tuning, takes_ahead
from tests.stage_inputs import plan_of
from tests.test_conv_decode import step as conv_step
from tests.test_forward import run_tuned

H, K = 2, 128
MIXED = [1, 63, 64, 65, 7, 130, 0, 200]      # short and long packed sequences, an empty one
TIME_SEGMENTS = Tuning(segment_tokens=128)
PARALLEL = Tuning(parallel=True, parallel_tokens=128)
ON_STAGE4 = Tuning(route_decodes=False)
AHEAD = Tuning(ahead_from=65, ahead_segments=3)       # three segments, the last partial
ORDERED = [1, 300, 5, 64, 65, 0, 130, 1, 200, 17] * 10   # 200 stage-4 programs at H = 2: longest first
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
EIGHT_COLUMNS = -(-EIGHT_COLUMNS_FROM * SMS // H)   # one-token requests whose decode takes 8 columns


def pool_call(lens, slots, rows, v_first=False, dtype=torch.float32, has=None, **call):
    """A packed call on a pool of `rows` rows (each padded by 16 elements) at `slots`."""
    args = random_inputs(1, sum(lens), H, K, seqlens=lens, output_final_state=False, state_v_first=v_first, **call)
    pool = torch.randn(rows, H * K * K + 16, device="cuda").to(dtype)[:, :H * K * K].view(rows, H, K, K)
    args.update(initial_state=pool, initial_state_indices=torch.tensor(slots, device="cuda"))
    if has is not None:
        args["has_initial_state"] = torch.tensor(has, device="cuda")
    return args


def run_ahead(args):
    """The packed call with its longest sequence ahead (AHEAD: from 65 tokens), through the JIT."""
    plan = plan_of(**args, tuning=AHEAD)
    assert takes_ahead(plan, args["cu_seqlens_cpu"])
    return run(plan, **{n: args.get(n) for n in RUN_TENSORS}, ahead=True)


def decode_call(lens, slots, rows, v_first=False, dtype=torch.float32, **call):
    """kda_decode's keywords for Kimi's call on packed requests of `lens` tokens, a pool of `rows`
    rows (each padded by 16 elements) of `dtype` written in place at `slots` (None: no pool)."""
    args = random_inputs(1, sum(lens), H, K, seqlens=lens, output_final_state=False, l2norm=True, beta_logits=True)
    args = {n: args[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "lower_bound", "cu_seqlens",
                                 "use_gate_in_kernel", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel")}
    if slots is not None:
        pool = torch.randn(rows, H * K * K + 16, device="cuda").to(dtype)[:, :H * K * K].view(rows, H, K, K)
        args.update(initial_state=pool, ssm_state_indices=slots.to("cuda"), inplace_final_state=True)
    return {**args, "state_v_first": v_first, **call}


def one_token(args):
    """decode_call's keywords of one-token requests as N requests of one token: [N, 1, ·, ·] views
    of the packed tensors, no cu_seqlens."""
    N = args.pop("cu_seqlens").numel() - 1
    return {**args, **{n: args[n].view(N, 1, *args[n].shape[2:]) for n in ("q", "k", "v", "g", "beta")}}


def fused_decode(N):
    """kda_decode on N one-token requests whose q, k, v are [N, 1, H, K] views of one [N, 3·H·K]
    tensor (read in place), an fp32 V-first pool of N + 8 rows written at shuffled slots."""
    args = decode_call([1] * N, torch.randperm(N + 8)[:N], N + 8, v_first=True)
    mixed = torch.randn(N, 3 * H * K, device="cuda", dtype=args["q"].dtype)
    q, k, v = (x.unflatten(-1, (H, K)).unsqueeze(1) for x in mixed.split(H * K, dim=-1))
    batched = {n: args[n].view(N, 1, *args[n].shape[2:]) for n in ("g", "beta")}
    args.pop("cu_seqlens")
    return kda_decode(**{**args, **batched, "q": q, "k": k, "v": v})


def checkpointed(lens, every, ck_dtype=torch.float32, offsets=None, **call):
    args = random_inputs(1, sum(lens), H, K, seqlens=lens, initial_state=True, **call)
    rows = sum(-(-n // every) + 1 for n in lens)
    args.update(checkpoints=torch.empty(1, rows, H, K, K, device="cuda", dtype=ck_dtype), checkpoint_every=every)
    if offsets is not None:
        args["checkpoint_offsets"] = torch.tensor(offsets, device="cuda")
    return args


CALLS = {
    "dense": lambda: kda_forward(**random_inputs(2, 200, H, K, output_final_state=False)),
    "dense, a state": lambda: kda_forward(**random_inputs(2, 200, H, K, initial_state=True)),
    "dense, a V-first state": lambda: kda_forward(**random_inputs(2, 200, H, K, initial_state=True,
                                                                   state_v_first=True)),
    "packed short": lambda: kda_forward(**random_inputs(1, 135, H, K, seqlens=[1, 63, 7, 64], initial_state=True)),
    "packed long": lambda: kda_forward(**random_inputs(1, 395, H, K, seqlens=[130, 65, 200], initial_state=True)),
    "packed mixed, FlashKDA's call": lambda: kda_forward(**random_inputs(
        1, sum(MIXED), H, K, seqlens=MIXED, initial_state=True, l2norm=True, beta_logits=True, state_v_first=True)),
    "pool, −1 and out-of-range slots": lambda: kda_forward(**pool_call(
        MIXED, [5, -1, 0, 9, 2, 3, 1, -1], 6, has=[True, True, False, True, True, True, False, True])),
    "pool, a pad slot many rows name": lambda: kda_forward(**pool_call(MIXED, [5, 0, 0, 2, 0, 3, 1, 0], 6),
                                                          pad_slot=0),
    "pool, V-first bf16": lambda: kda_forward(**pool_call(MIXED, [5, -1, 0, 2, 4, 3, 1, 6], 7, v_first=True,
                                                          dtype=torch.bfloat16)),
    "pool of one row, slot 0": lambda: kda_forward(**pool_call([130], [0], 1)),
    "pool of one row, slot −1": lambda: kda_forward(**pool_call([130, 5], [-1, -1], 1, v_first=True)),
    "checkpoints every chunk": lambda: kda_forward(**checkpointed(MIXED, 64, state_v_first=True)),
    "checkpoints every 128 tokens, bf16": lambda: kda_forward(**checkpointed(MIXED, 128, torch.bfloat16)),
    "checkpoints every 512 tokens, V-first": lambda: kda_forward(**checkpointed([700, 30, 1100], 512,
                                                                                state_v_first=True)),
    "checkpoints at offsets": lambda: kda_forward(**checkpointed(MIXED, 128, offsets=[1, 5, 64, 100, 3, 128, 7, 70],
                                                                 state_v_first=True)),
    "time segments": lambda: run_tuned(random_inputs(1, 600, H, K, initial_state=True), TIME_SEGMENTS),
    "parallel segments": lambda: run_tuned(random_inputs(1, 1000, H, K, initial_state=True, state_v_first=True),
                                       PARALLEL),
    "parallel segments, packed": lambda: run_tuned(pool_call([700, 30, 0, 900, 5], [3, 0, -1, 1, 2], 4), PARALLEL),
    "the longest ahead, a pool": lambda: run_ahead(pool_call([200, 1, 700, 0, 65, 700], [3, 0, -1, 1, 2, 4], 5)),
    "the longest ahead as planned, a pool (replayed)": lambda: kda_forward(**pool_call(
        [300, 1, 4200, 64, 0, 700], [5, 0, -1, 2, 4, 1], 6, l2norm=True, beta_logits=True)),
    "parallel segments as planned, a pool slot (replayed)": lambda: kda_forward(**pool_call([8192], [2], 4, has=[True])),
    "context-parallel transition": lambda: (Prepared(**{n: x for n, x in random_inputs(
        1, 395, H, K, seqlens=[130, 65, 200]).items() if n != "output_final_state"}).transition(),),
    "fp16": lambda: kda_forward(**random_inputs(1, 200, H, K, dtype=torch.float16, initial_state=True)),
    "fp32": lambda: kda_forward(**random_inputs(1, 200, H, K, dtype=torch.float32, initial_state=True)),
    "fp32 packed": lambda: kda_forward(**random_inputs(1, 395, H, K, seqlens=[130, 65, 200], dtype=torch.float32,
                                                       initial_state=True)),
    "grouped value heads": lambda: kda_forward(**random_inputs(1, 200, H, K, HV=2 * H, initial_state=True)),
    "K = V = 64, packed": lambda: kda_forward(**random_inputs(1, sum(MIXED), H, 64, seqlens=MIXED,
                                                              initial_state=True, gate="softplus")),
    "packed, longest first (more stage-4 programs than SMs), a pool": lambda: kda_forward(**pool_call(
        ORDERED, [n if n % 9 else -1 for n in range(len(ORDERED))], len(ORDERED))),
    "checkpoints at offsets, longest first": lambda: kda_forward(**checkpointed(
        ORDERED, 128, offsets=[1 + (7 * n) % 128 for n in range(len(ORDERED))], state_v_first=True)),
    "packed mixed, one-token sequences on stage 4": lambda: run_tuned(pool_call(
        MIXED, [5, -1, 0, 9, 2, 3, 1, -1], 6, has=[True, True, False, True, True, True, False, True]), ON_STAGE4),
    "decode, a pool with −1, past-the-pool and pad slots": lambda: kda_decode(**decode_call(
        [1] * 6, torch.tensor([5, -1, 0, 9, 2, 0]), 6, pad_slot=0)),
    "decode, dense states, final states": lambda: kda_decode(**{
        **decode_call([1, 3, 0, 2], None, 0), "initial_state": torch.randn(4, H, K, K, device="cuda"),
        "output_final_state": True}),
    # kda_opt/decode_plan's decode_launch: 64 columns by 2 warps, K-first once every SM has a block of
    # 64; V-first fp32 states with a (request, head)'s V blocks first (DecodePlan.blocks_first), by 8
    # columns from EIGHT_COLUMNS_FROM pairs an SM.
    "decode, 64 columns by 2 warps: K-first, a bf16 pool": lambda: kda_decode(**decode_call(
        [1] * SMS, torch.randperm(SMS + 8)[:SMS], SMS + 8, dtype=torch.bfloat16)),
    "decode, V blocks first: V-first, an fp32 pool, many requests": lambda: kda_decode(**decode_call(
        [1] * 100, torch.randperm(108)[:100], 108, v_first=True)),
    "decode, V blocks first by 8 columns: V-first, an fp32 pool, more requests": lambda: kda_decode(**decode_call(
        [1] * EIGHT_COLUMNS, torch.randperm(EIGHT_COLUMNS + 8)[:EIGHT_COLUMNS], EIGHT_COLUMNS + 8, v_first=True)),
    "decode, batched views of one fused projection (SGLang's packed decode)": lambda: fused_decode(40),
    "verify, [N, S] slots, accepted counts": lambda: kda_decode(**decode_call(
        [4, 2, 3], torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]), 12,
        num_accepted_tokens=torch.tensor([4, 0, 2], device="cuda"), v_first=True)),
    # The streamed kernel (V-first 16-bit states, from plan.STREAMED_FROM programs an SM): one token a
    # request as [N, 1, ·, ·] views (its one-token form), and packed requests of 0–3 tokens.
    "decode, streamed: one token each, a bf16 pool with −1 and pad slots": lambda: kda_decode(**one_token(
        decode_call([1] * (2 * SMS + 8), torch.tensor([n if n % 7 else -1 for n in range(2 * SMS + 8)]),
                    2 * SMS + 16, v_first=True, dtype=torch.bfloat16, pad_slot=1))),
    "decode, streamed: packed requests of 0–3 tokens, an fp16 pool only read": lambda: kda_decode(**{
        **decode_call([1, 3, 0, 2] * (SMS // 2 + 2), torch.randperm(2 * SMS + 8)[:2 * SMS + 8], 2 * SMS + 8,
                      v_first=True, dtype=torch.float16), "inplace_final_state": False}),
    "verify into a buffer (SGLang's), the pool only read": lambda: kda_decode(**decode_call(
        [4, 2, 5], torch.tensor([3, -1, 0]), 6, v_first=True, inplace_final_state=False,
        intermediate_states_buffer=torch.randn(4, 5, H, K, K, device="cuda")[:, :4],
        intermediate_state_indices=torch.tensor([2, 0, -1], device="cuda"))),
    "the convolution and decode step, −1, past-the-pool and pad slots": lambda: kda_conv_decode(**conv_step(
        6, H, K, slots=6, indices=[3, -1, 0, 6, 1, 5], pad_slot=1)),
    "tree verify into a buffer (SGLang's), parents read back": lambda: kda_decode(**decode_call(
        [4, 2, 5], torch.tensor([3, -1, 0]), 6, v_first=True, inplace_final_state=False,
        intermediate_states_buffer=torch.randn(4, 5, H, K, K, device="cuda")[:, :4],
        intermediate_state_indices=torch.tensor([2, 0, -1], device="cuda"),
        retrieve_parent_token=torch.tensor([[-1, 0, 0, 1, 9], [-1, 0, 0, 0, 0], [-1, 0, 1, 1, 3]], device="cuda"))),
}


# Each call made this many times, on new inputs of one signature: the first compiles, the second is
# recorded and the third replayed (kda_opt/replay), so that every replayed launch is checked too.
REPEATS = 3


def poison_allocator(large_bytes=1 << 30, small_blocks=64):
    """Every byte of the caching allocator's memory 0xFF: one large segment (split for allocations
    over 1 MiB) and `small_blocks` blocks of 1 MiB (the small pool's 2 MiB segments), freed again, so
    that the calls' allocations come from them."""
    torch.cuda.empty_cache()
    blocks = [torch.full((large_bytes,), 255, dtype=torch.uint8, device="cuda")]
    blocks += [torch.full((1 << 20,), 255, dtype=torch.uint8, device="cuda") for _ in range(small_blocks)]
    torch.cuda.synchronize()
    del blocks


def zero_stage4_buffers():
    """From here on, each buffer a stage-4 launch writes (o, final states other than the initial
    states' own pool, checkpoints) is zeroed before the launch, so initcheck takes it for written:
    it does not see stage 4's TMA stores into them (tests/test_sanitizer.py)."""
    from kda_opt import wuso
    config = wuso.launch_config

    def zeroed(*args, **kwargs):
        given = inspect.signature(config).bind(*args, **kwargs).arguments
        source = given["initial_state"]
        for name in ("final_state", "checkpoints") + (() if given.get("transition") else ("o",)):
            x = given.get(name)                 # (transition: o is v, not written)
            if x is not None and (source is None or x.untyped_storage().data_ptr()
                                  != source.untyped_storage().data_ptr()):
                x.zero_()
        return config(*args, **kwargs)
    wuso.launch_config = zeroed


def main(names, poisoned=False, zeroed=False):
    if poisoned:
        poison_allocator()
    if zeroed:
        zero_stage4_buffers()
    for name in names or CALLS:
        print(f"call {name}", flush=True)
        for _ in range(REPEATS):
            outputs = CALLS[name]()
        if poisoned:
            unwritten = [int(torch.isnan(x).sum()) for x in outputs if x is not None]
            if any(unwritten):
                raise SystemExit(f"call {name}: elements never written (NaN) in what it returns: {unwritten}")
    torch.cuda.synchronize()
    print(f"calls done: {len(names or CALLS)}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if not a.startswith("--")], poisoned="--poisoned" in args,
         zeroed="--zero-stage4-buffers" in args)
