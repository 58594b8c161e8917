"""kda_forward as serving engines call it (docs/USAGE.md, "Serving"): a state pool read and written in
place at initial_state_indices, has_initial_state, checkpoints after every chunk or interval, and the in-place
custom op under torch.compile and in CUDA graphs. GPU; validation is in tests/test_plan.py."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kda_opt  # noqa: F401  registers the ops
from inputs import random_inputs
from kda_opt import kda_forward
from kda_opt.arguments import ForwardArguments
from kda_opt.forward import RUN_TENSORS, run
from kda_opt.plan import Pieces, Tuning, plan_for, schedule_of, takes_ahead
from kda_opt.reference import ERROR_FLOOR, reference_forward
from tests.conftest import gpu, rel_err
from tests.stage_inputs import plan_of
from tests.test_op import DEFAULTS

LENS = [130, 1, 64, 0, 257]   # packed: a tail chunk, one token, one whole chunk, an empty sequence
CALLS = {
    "safe": dict(),
    "softplus l2norm": dict(gate="softplus", l2norm=True),
    "flashkda": dict(l2norm=True, beta_logits=True, state_v_first=True),
}


def tuned(args, tuning=Tuning(block_v=64)):
    """kda_forward's numbers with stage 4's V block fixed, so that calls over different numbers of
    sequences (which kda_opt/plan would give different blocks) compare bit for bit."""
    return run(plan_of(**args, tuning=tuning), **{n: args.get(n) for n in RUN_TENSORS})


def padded_pool(slots, HV, K, V, dtype, v_first, pad=48, seed=5):
    """A pool [slots, HV, K, V] ([…, V, K] V-first) of random rows padded by `pad` elements, and its storage."""
    flat = torch.randn(slots, HV * K * V + pad, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)
    return flat[:, :HV * K * V].view((slots, HV, V, K) if v_first else (slots, HV, K, V)), flat


def gathered(pool, idx, use):
    """The dense initial states a pool call starts from: pool[idx[n]] where use[n], else zeros."""
    rows = pool[idx.clamp(0, pool.shape[0] - 1)].float()
    return torch.where(use[:, None, None, None], rows, 0.0).contiguous()


@gpu
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_pool_equals_dense_call(call, pool_dtype, index_dtype):
    """Packed sequences read their pool rows and write their final states back in place: o equals the
    dense call's on the gathered states bit for bit, each written row is its final state in the
    pool's dtype; a −1 slot and a false has_initial_state start from zeros, −1 writes nothing, and no
    other row nor the padding changes. The call returns (o, None)."""
    args = random_inputs(1, sum(LENS), 2, 128, seqlens=LENS, seed=7, output_final_state=False, **CALLS[call])
    HV, K = 2, 128
    pool, flat = padded_pool(9, HV, K, K, pool_dtype, args.get("state_v_first", False))
    before = flat.clone()
    idx = torch.tensor([4, -1, 0, 8, 2], dtype=index_dtype, device="cuda")
    mask = torch.tensor([True, True, False, True, True], device="cuda")
    dense = gathered(pool, idx, mask & (idx >= 0))
    o_ref, s_ref = kda_forward(**{**args, "initial_state": dense, "output_final_state": True})
    o, none = kda_forward(**args, initial_state=pool, initial_state_indices=idx, has_initial_state=mask,
                          initial_state_indices_cpu=idx.cpu())
    assert none is None and torch.equal(o, o_ref)
    written = [n for n, s in enumerate(idx.tolist()) if s >= 0]
    assert torch.equal(pool[idx[written]], s_ref[written].to(pool_dtype))
    untouched = [r for r in range(9) if r not in idx.tolist()]
    assert torch.equal(flat[untouched], before[untouched]) and torch.equal(flat[:, -48:], before[:, -48:])


@gpu
def test_pool_of_one_sequence_cut_into_time_segments():
    """A lone long sequence cut into time segments: the first segment reads the pool row, the last
    writes it; the same numbers as one pass."""
    args = random_inputs(1, 1000, 2, 128, seed=8, output_final_state=False)
    pool, _ = padded_pool(3, 2, 128, 128, torch.float32, False)
    idx = torch.tensor([1], device="cuda")
    one_pass, segmented = pool.clone(), pool.clone()
    o = tuned({**args, "initial_state": one_pass, "initial_state_indices": idx})[0]
    tuning = Tuning(block_v=64, segment_tokens=128)
    pooled = {**args, "initial_state": segmented, "initial_state_indices": idx}
    assert len(plan_of(**pooled, tuning=tuning).segments) > 1
    o_seg = tuned(pooled, tuning)[0]
    assert torch.equal(o_seg, o) and torch.equal(segmented, one_pass) and not torch.equal(one_pass, pool)


@gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_pool_of_one_slot_left_alone_by_slot_minus_one(state_v_first):
    """A pool of a single row and a request with slot −1 (a new request that keeps no state): the row
    is neither read nor written, also where the row past the pool's end is its only other row."""
    args = random_inputs(1, 200, 2, 128, seed=12, output_final_state=False, state_v_first=state_v_first)
    pool, _ = padded_pool(1, 2, 128, 128, torch.float32, state_v_first)
    before = pool.clone()
    o = kda_forward(**{**args, "initial_state": pool, "initial_state_indices": torch.tensor([-1], device="cuda")})[0]
    assert torch.equal(pool, before)
    assert torch.equal(o, kda_forward(**{**args, "initial_state": None})[0])


@gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_pool_of_one_slot_written_at_slot_zero(state_v_first):
    """The same pool and a request with slot 0: the row is read and written as in a larger pool."""
    args = random_inputs(1, 200, 2, 128, seed=12, output_final_state=False, state_v_first=state_v_first)
    pool, _ = padded_pool(1, 2, 128, 128, torch.float32, state_v_first)
    o_ref, s_ref = kda_forward(**{**args, "initial_state": pool.clone(), "output_final_state": True})
    o = kda_forward(**{**args, "initial_state": pool, "initial_state_indices": torch.tensor([0], device="cuda")})[0]
    assert torch.equal(o, o_ref) and torch.equal(pool, s_ref)


SEGMENTED = {"one pass": Tuning(), "time segments": Tuning(segment_tokens=128),
             "parallel segments": Tuning(parallel=True, parallel_tokens=128)}


@gpu
@pytest.mark.parametrize("how", list(SEGMENTED))
@pytest.mark.parametrize("slot", [-1, 0])
def test_pool_of_one_slot_through_segments(how, slot):
    """A pool of one row, with slot −1 or 0, where a lone sequence runs in time or parallel segments
    (the pool written by a later launch than the first): left as it was, or holding the final state
    of the same call with a dense state."""
    args = random_inputs(1, 600, 2, 128, seed=13, output_final_state=False, state_v_first=True)
    pool, _ = padded_pool(1, 2, 128, 128, torch.float32, True)
    before = pool.clone()
    call = {**args, "initial_state": pool, "initial_state_indices": torch.tensor([slot], device="cuda")}
    plan = plan_of(**call, tuning=SEGMENTED[how])
    assert (len(plan.segments) > 1) == (how != "one pass") and plan.parallel == (how == "parallel segments")
    o = tuned(call, SEGMENTED[how])[0]
    if slot < 0:
        assert torch.equal(pool, before)
        assert torch.equal(o, tuned({**args, "initial_state": None}, SEGMENTED[how])[0])
    else:
        o_ref, s_ref = tuned({**args, "initial_state": before.clone(), "output_final_state": True}, SEGMENTED[how])
        assert torch.equal(o, o_ref) and torch.equal(pool, s_ref)


@gpu
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("every", [64, 128])
def test_checkpoints_of_one_row(state_v_first, every):
    """A buffer of one checkpoint row under packed sequences with more intervals (no host copy of
    cu_seqlens to check it against): the row is the first sequence's state after its first
    interval; every later one is past the buffer, not written (into row 0)."""
    lens = [300, 200]
    args = random_inputs(1, 500, 2, 128, seqlens=lens, seed=14, initial_state=True, state_v_first=state_v_first)
    del args["cu_seqlens_cpu"]
    ck = torch.zeros(1, 1, 2, 128, 128, device="cuda")
    kda_forward(**args, checkpoints=ck, checkpoint_every=every)
    assert torch.equal(ck[0, 0], kda_forward(**truncated(args, lens, 0, every))[1][0])


SHORT_LENS = [1, 63, 300, 64, 0, 65, 2, 129]   # of at most one chunk (stage 4's _one_chunk) among longer ones


@gpu
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("state", ["none", "dense", "pool"])
@pytest.mark.parametrize("every", [64, 128])
def test_short_sequences_equal_their_views(call, state, every):
    """Packed sequences of at most one chunk, read and written by element offsets (Tuning's
    short_sequences, the default), give the numbers of the path that views their rows, bit for
    bit: o, final states (dense, or pool rows with slot −1 and has_initial_state), checkpoints;
    beside empty and longer sequences, with grouped value heads."""
    lens = SHORT_LENS
    args = random_inputs(1, sum(lens), 2, 128, HV=4, seqlens=lens, seed=15, initial_state=state == "dense",
                         **CALLS[call])
    pool = None
    if state == "pool":
        pool, _ = padded_pool(12, 4, 128, 128, torch.bfloat16, call == "flashkda")
        args.update(initial_state=pool, output_final_state=False,
                    initial_state_indices=torch.tensor([3, -1, 0, 7, 5, 11, 2, 9], device="cuda"),
                    has_initial_state=torch.arange(len(lens), device="cuda") % 3 != 1)
    rows = sum(-(-n // every) for n in lens)
    results = []
    for short in (True, False):
        ck = torch.full((1, rows + 1, 4, 128, 128), 7.0, device="cuda")
        call_args = {**args, "checkpoints": ck, "checkpoint_every": every}
        if pool is not None:
            call_args["initial_state"] = pool.clone()
        plan = plan_of(**call_args, tuning=Tuning(block_v=64, short_sequences=short))
        assert plan.short_sequences == short
        o, s = run(plan, **{n: call_args.get(n) for n in RUN_TENSORS})
        results.append((o, s, ck, call_args.get("initial_state")))
    (o1, s1, ck1, p1), (o0, s0, ck0, p0) = results
    assert torch.equal(o1, o0) and torch.equal(ck1, ck0) and (s0 is None or torch.equal(s1, s0))
    assert p0 is None or torch.equal(p1, p0)
    assert state != "pool" or not torch.equal(p1, pool)


def truncated(args, lens, n, stop):
    """Sequence n of a packed call, alone and cut after its first `stop` tokens (B = 1, T = stop)."""
    a = sum(lens[:n])
    one = {name: x[:, a:a + stop] if name in ("q", "k", "v", "g", "beta") else x for name, x in args.items()}
    one.pop("cu_seqlens"), one.pop("cu_seqlens_cpu", None)
    if "initial_state" in one:
        one["initial_state"] = args["initial_state"][n:n + 1]
    return one


@gpu
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_v", [64, 128])
def test_checkpoints_are_final_states_of_shorter_calls(call, ck_dtype, block_v):
    """checkpoints[0, Σ_{m<n} cdiv(len_m, 64) + j] is sequence n's state after min(64(j + 1), len_n)
    tokens: the final state of a call that stops there, bit for bit (in the buffer's dtype); the
    rows past the chunks and o are untouched by asking. Both V blocks: kda_opt/wuso stores a
    K-first buffer at the end of each chunk with one, at the start of the next with the other."""
    args = random_inputs(1, sum(LENS), 2, 128, seqlens=LENS, seed=9, initial_state=True, **CALLS[call])
    chunks = [-(-n // 64) for n in LENS]
    shape = (1, sum(chunks) + 2, 2, 128, 128)
    ck = torch.full(shape, 7.0, device="cuda", dtype=ck_dtype)
    tuning = Tuning(block_v=block_v, route_decodes=False)   # a call with checkpoints keeps its
    o, s = tuned(args, tuning)                                # one-token sequences on stage 4
    o_ck, s_ck = tuned({**args, "checkpoints": ck}, tuning)
    assert torch.equal(o_ck, o) and torch.equal(s_ck, s)
    row = 0
    for n, length in enumerate(LENS):
        for j in range(chunks[n]):
            _, s_j = tuned(truncated(args, LENS, n, min(64 * (j + 1), length)), tuning)
            assert torch.equal(ck[0, row], s_j[0].to(ck_dtype)), (n, j)
            row += 1
    assert torch.equal(ck[0, row:], torch.full_like(ck[0, row:], 7.0))


@gpu
@pytest.mark.parametrize("segment_tokens", [None, 128])
def test_checkpoints_of_a_batch(segment_tokens):
    """B sequences of T tokens: checkpoints[b, j] after chunk j of sequence b, with a pool too (and
    one lone sequence cut into time segments, each writing its own rows)."""
    B = 1 if segment_tokens else 3
    args = random_inputs(B, 300, 2, 128, seed=10, initial_state=True, state_v_first=True)
    ck = torch.zeros(B, 5, 2, 128, 128, device="cuda")
    tuning = Tuning(block_v=64, segment_tokens=segment_tokens or Tuning.segment_tokens)
    _, s = tuned({**args, "checkpoints": ck}, tuning)
    for j, stop in enumerate([64, 128, 192, 256, 300]):
        cut = {n: x[:, :stop] if n in ("q", "k", "v", "g", "beta") else x for n, x in args.items()}
        assert torch.equal(ck[:, j], tuned(cut)[1]), j
    assert torch.equal(ck[:, -1], s)


@gpu
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_v", [64, 128])
@pytest.mark.parametrize("every", [128, 512])
def test_checkpoints_every_interval(call, ck_dtype, block_v, every):
    """checkpoint_every = E tokens: row Σ_{m<n} cdiv(len_m, E) + j of a packed call holds sequence n's
    state after min(E(j + 1), len_n) tokens, bit for bit the every-chunk buffer's row of that chunk
    (the final state of a call that stops there: above); o, the final states and the rows past the
    intervals are as without."""
    lens = LENS + [600, 1000]
    args = random_inputs(1, sum(lens), 2, 128, seqlens=lens, seed=11, initial_state=True, **CALLS[call])
    chunks = [-(-n // 64) for n in lens]
    intervals = [-(-n // every) for n in lens]
    each = torch.zeros((1, sum(chunks), 2, 128, 128), device="cuda", dtype=ck_dtype)
    spaced = torch.full((1, sum(intervals) + 2, 2, 128, 128), 7.0, device="cuda", dtype=ck_dtype)
    tuning = Tuning(block_v=block_v)
    o, s = tuned({**args, "checkpoints": each}, tuning)
    o_sp, s_sp = tuned({**args, "checkpoints": spaced, "checkpoint_every": every}, tuning)
    assert torch.equal(o_sp, o) and torch.equal(s_sp, s)
    row = first = 0
    for n in range(len(lens)):
        for j in range(intervals[n]):
            assert torch.equal(spaced[0, row], each[0, first + min(every // 64 * (j + 1), chunks[n]) - 1]), (n, j)
            row += 1
        first += chunks[n]
    assert torch.equal(spaced[0, row:], torch.full_like(spaced[0, row:], 7.0))


OFFSET_LENS = [130, 1, 64, 0, 257, 600, 20]


def offset_cut(args, lens, n, stop, first, every):
    """Sequence n of a packed call, alone (packed, N = 1) and cut after its first `stop` tokens, with
    its checkpoint offset: the call whose final state the offset checkpoint ending there must be."""
    one = truncated(args, lens, n, stop)
    one.update(cu_seqlens=torch.tensor([0, stop], dtype=torch.int32, device="cuda"), output_final_state=True,
               checkpoint_offsets=torch.tensor([first], device="cuda"), checkpoint_every=every,
               checkpoints=torch.zeros(1, -(-stop // every) + 2, *args["checkpoints"].shape[2:], device="cuda"))
    return one


@gpu
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("ck_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("every", [64, 256])
def test_checkpoint_offsets(call, ck_dtype, every):
    """checkpoint_offsets f_n: row Σ_{m<n} rows_m + j of a packed call holds sequence n's state after
    min(f_n + E·j, len_n) tokens (E = checkpoint_every), bit for bit the final state of the same call
    that stops there; offsets inside the first chunk, at chunk ends, past a short sequence's end and
    E itself; the rows past them untouched; o and the final states as accurate against float64 as
    the call without them."""
    lens = OFFSET_LENS
    firsts = [min(f, every) for f in (37, 5, 64, 10, every, 100, 63)]
    args = random_inputs(1, sum(lens), 2, 128, seqlens=lens, seed=15, initial_state=True, **CALLS[call])
    rows = [0 if n == 0 else 1 + -(-max(n - f, 0) // every) for n, f in zip(lens, firsts)]
    ck = torch.full((1, sum(rows) + 2, 2, 128, 128), 7.0, device="cuda", dtype=ck_dtype)
    offsets = torch.tensor(firsts, device="cuda")
    o, s = tuned({**args, "checkpoints": ck, "checkpoint_every": every, "checkpoint_offsets": offsets})
    row = 0
    for n, (length, f) in enumerate(zip(lens, firsts)):
        for j in range(rows[n]):
            cut = offset_cut({**args, "checkpoints": ck}, lens, n, min(f + every * j, length), f, every)
            assert torch.equal(ck[0, row], tuned(cut)[1][0].to(ck_dtype)), (n, j)
            row += 1
    assert torch.equal(ck[0, row:], torch.full_like(ck[0, row:], 7.0))
    o_plain, s_plain = tuned(args, Tuning(block_v=64, route_decodes=False))   # the same path, without them
    ro, rs = reference_forward(**args, method="chunked")
    assert rel_err(o, ro) < 1.1 * rel_err(o_plain, ro) and rel_err(s, rs) < 1.1 * rel_err(s_plain, rs)


# 100 sequences at H = 2: 200 stage-4 programs at V = 128, more than an H100's or H200's SMs.
ORDERED_LENS = [1, 300, 5, 64, 65, 0, 130, 1, 200, 17] * 10


def on_a_pool(args, rows, holes=0, index_dtype=torch.int64):
    """args (H = 2, K = V = 128) made a pool call: an fp32 pool of `rows` random rows at shuffled
    slots, every `holes`-th slot −1 (0: none), written in place (no final states returned)."""
    N = args["cu_seqlens"].shape[0] - 1
    slots = torch.randperm(rows, device="cuda")[:N].to(index_dtype)
    if holes:
        slots[::holes] = -1
    args.update(initial_state=torch.randn(rows, 2, 128, 128, device="cuda"), initial_state_indices=slots,
                output_final_state=False)
    return args


def assert_knob_changes_nothing(knob, args, checkpoint_rows=None):
    """The call under Tuning(knob=True) and Tuning(knob=False), each plan asserted to take it, each
    run on its own copy of the initial state (a pool: written) and, with checkpoint_rows, on its own
    checkpoint buffer of that many rows and one more, filled with 7: o, the final states, the state
    and the checkpoints equal bit for bit."""
    results = []
    for on in (True, False):
        call = {**args, "initial_state": args["initial_state"].clone()}
        if checkpoint_rows is not None:
            call["checkpoints"] = torch.full((1, checkpoint_rows + 1, 2, 128, 128), 7.0, device="cuda")
        plan = plan_of(**call, tuning=Tuning(**{knob: on}))
        assert getattr(plan, knob) == on
        o, s = run(plan, **{n: call.get(n) for n in RUN_TENSORS})
        results.append((o, s, call["initial_state"], call.get("checkpoints")))
    (o1, s1, p1, c1), (o0, s0, p0, c0) = results
    assert torch.equal(o1, o0) and torch.equal(p1, p0)
    assert s0 is None or torch.equal(s1, s0)
    assert c0 is None or torch.equal(c1, c0)


@gpu
@pytest.mark.parametrize("how", ["pool", "checkpoint offsets"])
def test_longest_first_equals_grid_order(how):
    """Stage 4's programs longest first (Plan.longest_first, where they outnumber the SMs) give the
    grid order's numbers bit for bit: o and a pool at shuffled slots with −1 among them (the
    one-token sequences routed), or o, the final states and checkpoints at offsets (each sequence's
    head in a launch of its own, the rest ordered)."""
    lens = ORDERED_LENS
    args = random_inputs(1, sum(lens), 2, 128, seqlens=lens, seed=16, initial_state=how != "pool",
                         **CALLS["flashkda"])
    if how == "pool":
        assert_knob_changes_nothing("longest_first", on_a_pool(args, 120, holes=9))
        return
    firsts = [1 + (7 * n) % 128 for n in range(len(lens))]
    args.update(checkpoint_every=128, checkpoint_offsets=torch.tensor(firsts, device="cuda"))
    rows = sum(0 if n == 0 else 1 + -(-max(n - f, 0) // 128) for n, f in zip(lens, firsts))
    assert_knob_changes_nothing("longest_first", args, checkpoint_rows=rows)


SIZED_MIXES = {"both launches, ordered": ORDERED_LENS, "no short one": [1] * 150 + [300, 200],
               "no long one": [5, 64, 0, 17, 1] * 30, "grid order, no short one": [1, 100]}


@gpu
@pytest.mark.parametrize("mix", SIZED_MIXES)
@pytest.mark.parametrize("pool", [False, True])
def test_sized_launches_equal_full_ones(mix, pool):
    """Stage 4's launches sized from the host lengths (Plan.sized_launches: an empty launch not made,
    the ordered long launch over the long sequences only) give the full launches' numbers bit for
    bit: o, and the final states or a pool at shuffled slots with −1 among them (one-token
    sequences routed)."""
    lens = SIZED_MIXES[mix]
    args = random_inputs(1, sum(lens), 2, 128, seqlens=lens, seed=17, initial_state=not pool, **CALLS["flashkda"])
    if pool:
        on_a_pool(args, len(lens) + 40, holes=7)
    assert plan_of(**args).longest_first == (mix != "grid order, no short one")
    assert_knob_changes_nothing("sized_launches", args)


@gpu
def test_sized_launches_are_full_in_a_cuda_graph():
    """A call with its host lengths captured in a CUDA graph launches stage 4 over every sequence: a
    replay on other lengths (sequences of two tokens where the captured call had none, three long
    ones where it had two) equals the eager call on them."""
    def call(lens, seed):
        args = random_inputs(1, sum(lens), 2, 128, seqlens=lens, seed=seed, **CALLS["flashkda"])
        return on_a_pool(args, 200, index_dtype=torch.int32)
    static, new = call([1] * 150 + [300, 200], 18), call([1] * 147 + [2, 2, 100, 200, 199], 19)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kda_forward(**{**static, "initial_state": static["initial_state"].clone()})  # JIT outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = kda_forward(**static)
    for name, x in new.items():
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":
            static[name].copy_(x)
    graph.replay()
    o_eager, _ = kda_forward(**new)
    assert torch.equal(o, o_eager) and torch.equal(static["initial_state"], new["initial_state"])


AHEAD_LENS = [300, 1, 1000, 64, 0, 700, 1000, 1]   # the longest: the first of two of 1000 tokens


@gpu
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("pool", [False, True])
def test_longest_ahead_equals_one_pass(call, pool):
    """The longest sequence ahead (its layouts made on the device, three time segments, each one's
    stage 4 on the side stream) gives one pass's numbers bit for bit at one V block: o, and the
    final states or a pool at shuffled slots with −1 among them (one-token sequences routed)."""
    args = random_inputs(1, sum(AHEAD_LENS), 2, 128, seqlens=AHEAD_LENS, seed=21, initial_state=not pool,
                         **CALLS[call])
    if pool:
        on_a_pool(args, 20, holes=3)
    results = []
    for ahead in (True, False):
        c = {**args, "initial_state": args["initial_state"].clone()}
        plan = plan_of(**c, tuning=Tuning(block_v=64, ahead_from=65, ahead_segments=3))
        assert takes_ahead(plan, c["cu_seqlens_cpu"])
        o, s = run(plan, **{n: c.get(n) for n in RUN_TENSORS}, ahead=ahead)
        results.append((o, s, c["initial_state"]))
    (o1, s1, p1), (o0, s0, p0) = results
    assert torch.equal(o1, o0) and torch.equal(p1, p0) and (s0 is None or torch.equal(s1, s0))


@gpu
def test_kda_forward_takes_the_longest_ahead_bound():
    """kda_forward with the host lengths of a call whose longest request has ahead_from tokens runs it
    ahead, bound: its third call is replayed (the side stream's launches and waits included) and
    gives, on new inputs, what its stages give bit for bit; within one pass's error of the call
    without the host lengths; the rows of no request's slot untouched."""
    lens = [500, 1, 4200, 64, 1300]

    def call(seed):
        args = random_inputs(1, sum(lens), 2, 128, seqlens=lens, seed=seed, **CALLS["flashkda"])
        return on_a_pool(args, 12, holes=4)
    for seed in (22, 23):
        kda_forward(**call(seed))
    args = call(24)
    entry = plan_for(ForwardArguments(**args))
    assert takes_ahead(entry.plan, args["cu_seqlens_cpu"]) and entry.ahead.replay is not None, entry.ahead.not_replayed
    pool = args["initial_state"]
    replayed = {**args, "initial_state": pool.clone()}
    o, _ = kda_forward(**replayed)
    stages = {**args, "initial_state": pool.clone()}
    o_stages, _ = run(entry.plan, **{n: stages.get(n) for n in RUN_TENSORS}, kernels=entry.ahead.kernels, ahead=True)
    assert torch.equal(o, o_stages) and torch.equal(replayed["initial_state"], stages["initial_state"])
    one_pass = {**args, "initial_state": pool.clone(), "cu_seqlens_cpu": None}
    o0, _ = kda_forward(**one_pass)
    assert rel_err(o, o0) <= ERROR_FLOOR
    assert rel_err(replayed["initial_state"], one_pass["initial_state"]) <= ERROR_FLOOR
    untouched = [r for r in range(12) if r not in args["initial_state_indices"].tolist()]
    assert torch.equal(replayed["initial_state"][untouched], pool[untouched])


@gpu
@pytest.mark.parametrize("first", ["cut", "one pass"])
def test_calls_of_one_plan_cut_and_not(first):
    """One plan's calls (kda_forward's plan and compiled kernels, made once per signature), one with
    a sequence long enough for the parallel cut (its one-token sequences on stage 4) and one
    without (routed to the decode kernel, left out of stages 1–3's table), in either order: each
    equal bit for bit to its call on a plan of its own, through the JIT."""
    extra = first == "one pass"             # another T: another signature, another plan
    calls = {"cut": [1, 65600, 1, 100 + extra], "one pass": [1, 21900, 21900, 21901 + extra]}  # longest below CUT_FROM
    calls = {name: random_inputs(1, sum(lens), 2, 128, seqlens=lens, seed=20, initial_state=True,
                                 **CALLS["flashkda"]) for name, lens in calls.items()}
    for name, call in calls.items():
        plan = plan_of(**call)
        assert isinstance(schedule_of(plan, call["q"].device, call["cu_seqlens_cpu"]), Pieces) == (name == "cut") and plan.decode
    alone = {name: run(plan_of(**call), **{n: call.get(n) for n in RUN_TENSORS}) for name, call in calls.items()}
    for name in (first, *(n for n in calls if n != first)):
        o, s = kda_forward(**calls[name])
        assert torch.equal(o, alone[name][0]) and torch.equal(s, alone[name][1]), name


@gpu
@pytest.mark.parametrize("pool", [False, True])
def test_checkpoint_offsets_of_a_whole_interval(pool):
    """checkpoint_offsets equal to checkpoint_every: the call without them, bit for bit (o, rows, the
    final states; a pool with slot −1 and has_initial_state too)."""
    lens = OFFSET_LENS
    args = random_inputs(1, sum(lens), 2, 128, seqlens=lens, seed=16, initial_state=True, state_v_first=True)
    if pool:
        N = len(lens)
        args.update(initial_state=torch.cat((args["initial_state"], args["initial_state"][:1])),
                    initial_state_indices=torch.tensor([0, -1, 2, 3, 4, 5, 6], device="cuda"),
                    has_initial_state=torch.tensor([True, True, False, True, True, True, False], device="cuda"),
                    output_final_state=False)
        assert args["initial_state"].shape[0] == N + 1
    runs = []
    for offsets in (None, torch.full((len(lens),), 128, device="cuda")):
        call = {n: x.clone() if n == "initial_state" else x for n, x in args.items()}
        call.update(checkpoints=torch.full((1, 16, 2, 128, 128), 7.0, device="cuda"), checkpoint_every=128,
                    checkpoint_offsets=offsets)
        o, s = tuned(call)
        runs.append((o, s, call["checkpoints"], call["initial_state"]))
    for a, b in zip(*runs):
        assert (a is None and b is None) or torch.equal(a, b)


@gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_checkpoints_every_interval_in_time_segments(state_v_first):
    """A lone sequence cut into time segments writes the same rows of a spaced buffer as one pass
    (kda_opt/plan cuts it at whole intervals), and the same numbers as the every-chunk buffer."""
    args = random_inputs(1, 1000, 2, 128, seed=12, initial_state=True, state_v_first=state_v_first)
    each = torch.zeros((1, 16, 2, 128, 128), device="cuda")
    tuned({**args, "checkpoints": each})
    for tokens in (128, Tuning.segment_tokens):
        spaced = torch.full((1, 5, 2, 128, 128), 7.0, device="cuda")
        call = {**args, "checkpoints": spaced, "checkpoint_every": 256}
        plan = plan_of(**call, tuning=Tuning(block_v=64, segment_tokens=tokens))
        assert len(plan.segments) == (4 if tokens == 128 else 1)
        run(plan, **{n: call.get(n) for n in RUN_TENSORS})
        assert torch.equal(spaced[0, :4], each[0, [3, 7, 11, 15]]), tokens
        assert torch.equal(spaced[0, 4], torch.full_like(spaced[0, 4], 7.0))


def op_arguments(**a):
    """The ops' arguments: kda_forward's defaults (tests/test_op.py), then `a`."""
    return {**DEFAULTS, **a}


def test_in_place_op_declares_what_it_writes():
    """forward_in_place's schema marks the pool and the checkpoints written (the compiler then orders
    every later read after it); forward writes nothing. Its fake gives o like v and no final state."""
    written = lambda op: {a.name for a in op.default._schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written(torch.ops.kda_opt.forward_in_place) == {"initial_state", "checkpoints"}
    assert written(torch.ops.kda_opt.forward) == set()
    with FakeTensorMode():
        t = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, device="cuda", dtype=dtype)
        o, final = torch.ops.kda_opt.forward_in_place(**op_arguments(
            q=t(1, 300, 2, 128), k=t(1, 300, 2, 128), v=t(1, 300, 2, 64), g=t(1, 300, 2, 128), beta=t(1, 300, 2),
            initial_state=t(9, 2, 64, 128, dtype=torch.float32), state_v_first=True,
            initial_state_indices=t(3, dtype=torch.int32), cu_seqlens=t(4, dtype=torch.int32),
            checkpoints=t(1, 8, 2, 64, 128, dtype=torch.float32)))
    assert o.shape == (1, 300, 2, 64) and final.shape == (0,)


def serving_call(seed):
    """A packed Kimi-style call with a V-first fp32 pool (slot −1: a new request), its checkpoints,
    and the pool and buffer it writes."""
    args = random_inputs(1, sum(LENS), 2, 128, seqlens=LENS, seed=seed, output_final_state=False,
                         **CALLS["flashkda"])
    args.pop("cu_seqlens_cpu")
    pool, _ = padded_pool(9, 2, 128, 128, torch.float32, True, seed=seed)
    args.update(initial_state=pool, initial_state_indices=torch.tensor([4, -1, 0, 8, 2], device="cuda"),
                has_initial_state=torch.tensor([True, True, False, True, True], device="cuda"),
                checkpoints=torch.zeros(1, 9, 2, 128, 128, device="cuda"))
    return args


@gpu
@pytest.mark.parametrize("checkpoints", [True, False])
def test_compiled_pool_call_equals_eager(checkpoints):
    """Under torch.compile(fullgraph=True) the pool and checkpoints are written as in the eager call,
    bit for bit, and o is the same; opcheck passes on the in-place op. Without checkpoints: a server's
    compiled extend step (the in-place op then hands no checkpoints)."""
    without = {} if checkpoints else {"checkpoints": None}
    eager, compiled = ({**serving_call(11), **without} for _ in range(2))
    step = lambda a: kda_forward(**a)[0]
    o = step(eager)
    oc = torch.compile(step, fullgraph=True)(compiled)
    assert torch.equal(oc, o)
    assert torch.equal(compiled["initial_state"], eager["initial_state"])
    assert not checkpoints or torch.equal(compiled["checkpoints"], eager["checkpoints"])
    torch.library.opcheck(torch.ops.kda_opt.forward_in_place.default, (),
                          op_arguments(**{**serving_call(12), **without}))


@gpu
def test_reduce_overhead_mode_equals_eager():
    """torch.compile(mode="reduce-overhead"): the same pool, checkpoints and o as eager over repeated
    steps on the same buffers, as a server runs them (torch's CUDA graph trees run a function that
    writes its inputs without a graph; docs/USAGE.md)."""
    eager = serving_call(14)
    o = kda_forward(**eager)[0]
    step = torch.compile(lambda a: kda_forward(**a)[0], fullgraph=True, mode="reduce-overhead")
    run = serving_call(14)
    pool, ck = run["initial_state"].clone(), run["checkpoints"].clone()
    for _ in range(3):
        run["initial_state"].copy_(pool)
        run["checkpoints"].copy_(ck)
        oc = step(run).clone()
        assert torch.equal(oc, o)
        assert torch.equal(run["initial_state"], eager["initial_state"])
        assert torch.equal(run["checkpoints"], eager["checkpoints"])


@gpu
def test_pool_call_in_a_cuda_graph():
    """Captured once, replayed on new inputs, slots and mask copied into the captured ones: the pool
    and checkpoints as the eager call writes them."""
    static = serving_call(13)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kda_forward(**static)                  # JIT compiles stay out of the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = kda_forward(**static)
    new = serving_call(14)
    new["initial_state_indices"] = torch.tensor([1, 3, -1, 7, 5], device="cuda")
    for name, x in new.items():
        if isinstance(x, torch.Tensor):
            static[name].copy_(x)
    graph.replay()
    o_eager, _ = kda_forward(**new)
    assert torch.equal(o, o_eager)
    assert torch.equal(static["initial_state"], new["initial_state"])
    assert torch.equal(static["checkpoints"], new["checkpoints"])


@gpu
def test_serving_step_example():
    """examples/serving_step.py: each request as run alone, and the compiled step and a CUDA graph
    replay equal to the eager step, bit for bit."""
    from examples import serving_step
    step = serving_step.make_step()
    assert serving_step.worst_difference(step) < 2e-3
    (o, pool, ck), *others = serving_step.compiled_and_graphed(step)
    for o2, pool2, ck2 in others:
        assert torch.equal(o, o2) and torch.equal(pool, pool2) and torch.equal(ck, ck2)


def fused_views(args):
    """q, k, v and beta of `args` as views of one [B, T, 2HK + HV·V + HV + pad] projection (as an
    engine splits a fused output; beta's HV columns padded to a multiple of 8, so that rows stay
    16-byte aligned), and the projection."""
    beta = args["beta"]
    pad = beta.new_zeros(*beta.shape[:2], -beta.shape[2] % 8)
    parts = [args[n].flatten(2) for n in ("q", "k", "v")] + [beta, pad]
    fused = torch.cat([p.to(args["q"].dtype) for p in parts], dim=-1)
    views = dict(zip(("q", "k", "v", "beta"), fused.split([p.shape[-1] for p in parts], dim=-1)))
    for n in ("q", "k", "v"):
        views[n] = views[n].unflatten(-1, args[n].shape[2:])
    return views, fused


def test_rows_readable_takes_views_and_copies_the_rest():
    """Views of a fused projection are read through their strides; a transposed or misaligned
    tensor, or a batch whose entries are not evenly spaced, is copied (the plan's `copied`)."""
    from kda_opt.checks import rows_readable
    args = random_inputs(2, 16, 2, 64, device="cpu", dtype=torch.float32)
    views, _ = fused_views(args)
    for n, x in views.items():
        assert rows_readable(x) and not x.is_contiguous(), n
    q = args["q"]
    assert not rows_readable(q.transpose(2, 3).contiguous().transpose(2, 3))
    odd = torch.randn(2, 16, 2 * 64 + 1)[..., 1:].unflatten(-1, (2, 64))      # rows 4 bytes off 16
    assert not rows_readable(odd)
    uneven = torch.randn(2, 20, 2, 64)[:, :16]                                 # batch stride ≠ T · token stride
    assert not rows_readable(uneven)


@gpu
@pytest.mark.parametrize("call", ["safe", "flashkda"])
def test_views_of_a_fused_projection(call):
    """q, k, v and beta as views of one fused projection give the contiguous call's numbers bit for
    bit, fixed-length (B = 2) and packed."""
    for shape, lens in (((2, 300), None), ((1, sum(LENS)), LENS)):
        args = random_inputs(shape[0], shape[1], 2, 128, seqlens=lens, seed=15, initial_state=True, **CALLS[call])
        views, _ = fused_views(args)
        o, s = kda_forward(**args)
        o_v, s_v = kda_forward(**{**args, **views})
        assert torch.equal(o_v, o) and torch.equal(s_v, s)


SENTINEL = -1234.5


def guarded(rows, row_shape, dtype, gen, margin=4096):
    """A buffer [rows, *row_shape] of random rows, each padded by 16 elements, inside a larger
    allocation whose first and last `margin` elements hold SENTINEL: (buffer, allocation)."""
    row = row_shape.numel() + 16
    alloc = torch.full((2 * margin + rows * row,), SENTINEL, dtype=dtype, device="cuda")
    body = alloc[margin:margin + rows * row].view(rows, row)
    body.copy_(torch.randn(rows, row, generator=gen).to(dtype))
    return body[:, :row_shape.numel()].view(rows, *row_shape), alloc


def bits(x):
    """x's bits, so that equal means bit-identical (NaN too)."""
    return x.view({4: torch.int32, 2: torch.int16}[x.element_size()])


@gpu
@pytest.mark.parametrize("seed", range(6))
def test_guard_bands(seed):
    """Every buffer a call writes in place (the state pool, the checkpoint buffer) inside a larger
    allocation with sentinel margins: random calls over the launch paths (packed mixes with short,
    long and empty sequences; −1 and out-of-range slots; pools of one row; both layouts, fp32 and bf16;
    has_initial_state; checkpoints every chunk, every few chunks and at offsets; one pass, time
    segments, parallel segments) leave the margins, the rows' padding, every pool row not named and
    every checkpoint row past those of the call bit for bit as they were."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda options: options[torch.randint(len(options), (1,), generator=gen).item()]
    H, K = 2, 128
    for call in range(4):
        lens = [pick([0, 1, 17, 63, 64, 65, 130, 200, 400]) for _ in range(pick([1, 2, 5]))]
        if sum(lens) == 0:
            lens[0] = 70
        config = CALLS[pick(list(CALLS))]
        N, v_first = len(lens), config.get("state_v_first", pick([False, True]))
        args = random_inputs(1, sum(lens), H, K, seqlens=lens, seed=100 * seed + call, output_final_state=False,
                             **{**config, "state_v_first": v_first})
        rows = pick([1, N + 3])
        state_shape = torch.Size((H, K, K))
        pool, pool_alloc = guarded(rows, state_shape, pick([torch.float32, torch.bfloat16]), gen)
        slots = torch.randperm(rows, generator=gen).tolist()[:N] + [-1] * N
        slots = [pick([s, -1, rows + 2]) for s in slots[:N]]
        call_args = {**args, "initial_state": pool, "initial_state_indices": torch.tensor(slots, device="cuda"),
                     "has_initial_state": torch.rand(N, generator=gen).lt(0.7).to("cuda")}
        tuning = pick([Tuning(), Tuning(segment_tokens=128), Tuning(parallel=True, parallel_tokens=128)])
        every = pick([None, 64, 128, 256])
        ck_alloc = None
        if every is not None:
            offsets = pick([None, [int(torch.randint(1, every + 1, (1,), generator=gen)) for _ in lens]])
            if offsets is None:
                used = sum(-(-n // every) for n in lens)
            else:
                used = sum(0 if n == 0 else 1 + -(-max(n - f, 0) // every) for n, f in zip(lens, offsets))
                call_args["checkpoint_offsets"] = torch.tensor(offsets, device="cuda")
                tuning = Tuning()
            ck, ck_alloc = guarded(used + 3, state_shape, pick([torch.float32, torch.bfloat16]), gen)
            call_args.update(checkpoints=ck.unsqueeze(0), checkpoint_every=every)
        before = {"pool": bits(pool_alloc).clone(), "ck": None if ck_alloc is None else bits(ck_alloc).clone()}
        tuned(call_args, tuning)
        torch.cuda.synchronize()
        kept = [r for r in range(rows) if r not in slots]
        row_elems = state_shape.numel() + 16
        after = bits(pool_alloc)
        body = lambda x: x[4096:-4096].view(rows, row_elems)
        assert torch.equal(after[:4096], before["pool"][:4096]) and torch.equal(after[-4096:], before["pool"][-4096:])
        assert torch.equal(body(after)[kept], body(before["pool"])[kept]), (lens, slots)
        assert torch.equal(body(after)[:, -16:], body(before["pool"])[:, -16:])
        if ck_alloc is not None:
            after, old = bits(ck_alloc), before["ck"]
            assert torch.equal(after[:4096], old[:4096]) and torch.equal(after[-4096:], old[-4096:])
            ck_rows = lambda x: x[4096:-4096].view(-1, row_elems)
            assert torch.equal(ck_rows(after)[-3:], ck_rows(old)[-3:]) and torch.equal(ck_rows(after)[:, -16:],
                                                                                        ck_rows(old)[:, -16:])


@gpu
@pytest.mark.parametrize("pad", ["negative slots", "a pad slot many rows name"])
def test_padded_prefill_leaves_live_rows_as_unpadded(pad):
    """A packed prefill batch with padding sequences (−1, or the declared pad_slot that vLLM pads with)
    writes every live request's o rows and pool row bit for bit as the batch without them, and no
    other row of the pool (the pad slot's included)."""
    live_lens, pad_lens = [130, 1, 64, 7], [1, 1, 5]
    lens = live_lens[:2] + pad_lens[:2] + live_lens[2:] + pad_lens[2:]
    args = random_inputs(1, sum(lens), 2, 128, seqlens=lens, l2norm=True, beta_logits=True, state_v_first=True, seed=2)
    pool = torch.randn(9, 2, 128, 128, device="cuda")
    live_slots, pad_slot = [3, 7, 1, 5], (-1 if pad == "negative slots" else 0)
    slots = torch.tensor(live_slots[:2] + [pad_slot] * 2 + live_slots[2:] + [pad_slot], device="cuda")
    padded = {**args, "initial_state": pool.clone(), "initial_state_indices": slots, "output_final_state": False,
              "initial_state_indices_cpu": slots.cpu(), **({"pad_slot": 0} if pad_slot == 0 else {})}
    o, _ = tuned(padded)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    keep = [n for n in range(len(lens)) if slots[n] != pad_slot]
    tokens = [t for n in keep for t in range(starts[n], starts[n + 1])]
    alone = {**{n: (x[:, tokens] if n in ("q", "k", "v", "g", "beta") else x) for n, x in args.items()},
             "cu_seqlens": torch.tensor([0, *live_lens], device="cuda").cumsum(0),
             "cu_seqlens_cpu": torch.tensor([0, *live_lens]).cumsum(0), "initial_state": pool.clone(),
             "initial_state_indices": torch.tensor(live_slots, device="cuda"), "output_final_state": False}
    o_alone, _ = tuned(alone)
    assert torch.equal(o[:, tokens], o_alone)
    assert torch.equal(padded["initial_state"], alone["initial_state"])     # live rows alike, every other row untouched
    untouched = [r for r in range(9) if r not in live_slots]
    assert torch.equal(padded["initial_state"][untouched], pool[untouched])
