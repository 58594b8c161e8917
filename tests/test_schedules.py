"""kda_forward's orchestration on the CPU: `forward.run` through every schedule (one pass, time
segments, parallel segments, packed sequences cut into pieces), with a state pool, has_initial_state,
checkpoints (every chunk, every two, from offsets), routed decodes and a longest-first order, against
the float64 recurrence (kda_opt/reference).

Stage 4 is stood in for by `Stage4`, its contract (kda_opt/wuso's docstring) in float64 over the call's
raw inputs: each program's token range, where it reads its start and writes its end and checkpoints,
transitions from I with v = 0. Stages 1–3, whose outputs the stand-in does not read, are not run; every
other launch (the packed tables, the order, the merge, routed decodes) runs as it is, its Triton kernels
under the interpreter. What these tests check is what the schedules hand stage 4 and do with its
results; the stages themselves have their own tests."""
import inspect

import pytest
import torch

from kda_opt import forward
from kda_opt.options import CHUNK
from kda_opt.plan import OnePass, ParallelSegments, Pieces, TimeSegments, Tuning, schedule_of, takes_ahead
from kda_opt.reference import recurrent_kda
from tests.conftest import kernel_device, rel_err
from tests.stage_inputs import plan_of

H, HV, K, V = 1, 2, 16 * 4, 64
SMS = 8                                  # a small GPU's count, so that few heads already fill it
D = kernel_device()                      # the GPU, or the CPU (the Triton kernels under the interpreter)
TOL = 1e-5                               # fp32 inputs and outputs, the merge's products in fp32


class Stage4:
    """kda_opt/wuso.wuso's contract in float64, reading q, k, v, the log-decay a and β of the whole
    call (B = 1 or B rows of T tokens) from this object; `calls` keeps each launch's mode (transition
    or not, ordered or not) and its programs' token ranges."""

    def __init__(self, q, k, v, a, beta):
        self.base = q
        self.q, self.k, self.v, self.a, self.beta = (x.double() for x in (q, k, v, a, beta))
        self.calls = []

    def __call__(self, q, k, v, gcum, Tm, Aqk, scale, block_v, *, initial_state=None, final_state=None, slots=None,
                 read_slots=False, write_slots=False, has_initial_state=None, checkpoints=None, checkpoint_rows=None,
                 checkpoint_every=1, checkpoint_first=None, cu_seqlens=None, state_v_first=False, transition=False,
                 short_sequences=False, decoded=False, order=None, sequence_counts=None, out=None, **_):
        first = (q.data_ptr() - self.base.data_ptr()) // (self.base.stride(1) * self.base.element_size())
        B, T = q.shape[:2]
        bounds = [(0, b, e) for b, e in zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())] \
            if cu_seqlens is not None else [(b, 0, T) for b in range(B)]
        W = K if transition else V
        o = None if transition else torch.empty_like(v) if out is None else out
        every = CHUNK * checkpoint_every
        self.calls.append(dict(transition=transition, ordered=order is not None,
                               ranges=[(first + b0, first + e0) for _, b0, e0 in bounds]))
        for n in _programs(bounds, order, short_sequences and cu_seqlens is not None, decoded, sequence_counts):
            b, bos, eos = bounds[n]
            S = torch.zeros(HV, K, W, dtype=torch.float64, device=self.q.device)
            if initial_state is not None:
                row, use = n, True
                if read_slots:
                    row = int(slots[n])
                    use = 0 <= row < initial_state.shape[0]
                if has_initial_state is not None:
                    use = use and bool(has_initial_state[n])
                if use:
                    S = _layout(initial_state[row].double(), state_v_first and not transition)
            # The checkpoint ends (tokens after bos) and the chunk groups between them.
            ends = []
            if checkpoints is not None and eos > bos:
                f = every if checkpoint_first is None else min(max(int(checkpoint_first[n]), 1), every)
                ends = sorted({min(e, eos - bos) for e in range(f, eos - bos + every, every)})
            row0 = int(checkpoint_rows[n]) if cu_seqlens is not None and checkpoints is not None else 0
            done = 0
            for j, end in enumerate(ends or [eos - bos]):
                t0, t1 = first + bos + done, first + bos + end
                values = torch.zeros(1, t1 - t0, HV, W, dtype=torch.float64, device=self.q.device) if transition else self.v[b:b + 1, t0:t1]
                part, S = recurrent_kda(self.q[b:b + 1, t0:t1], self.k[b:b + 1, t0:t1], values,
                                        self.a[b:b + 1, t0:t1], self.beta[b:b + 1, t0:t1], scale, S[None])
                S = S[0]
                if o is not None:
                    o[b, bos + done:bos + end] = part[0].to(o.dtype)
                if ends and row0 + j < checkpoints.shape[1]:
                    checkpoints[0 if cu_seqlens is not None else b, row0 + j] = _layout(S, state_v_first)
                done = end
            if final_state is not None:
                row = int(slots[n]) if write_slots else n
                if 0 <= row < final_state.shape[0]:
                    final_state[row] = _layout(S, state_v_first and not transition)
        return o


def _programs(bounds, order, short_sequences, decoded, counts):
    """The sequences a wuso call computes, as its launches cover them: program i computes sequence
    order[i] (or i); with short_sequences, a long launch over the first counts.long of the order (all
    without counts) computing those longer than a chunk, and a short launch in grid order computing
    the others (but sequences of one token where decoded: kda_opt/decode's); with counts, a launch
    whose count is zero is not made."""
    every = list(range(len(bounds))) if order is None else order.tolist()
    if not short_sequences:
        return every
    length = lambda n: bounds[n][2] - bounds[n][1]
    long = [n for n in (every if counts is None else every[:counts.long]) if length(n) > CHUNK]
    short = [n for n in range(len(bounds)) if length(n) <= CHUNK and not (decoded and length(n) == 1)]
    return long + (short if counts is None or counts.short else [])


def _layout(S, v_first):
    return S.transpose(-1, -2) if v_first else S


def inputs(T, B=1, seed=0):
    """fp32 q, k (unit rows), v [B, T, ...], a log-decay in (−0.05, 0] (a state lives through every
    segment, so a wrong start shows), β in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -0.05 * torch.rand(B, T, HV, K, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    return {n: x.to(D) for n, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}


def run(call, tuning=Tuning(), ahead=False):
    """forward.run of the call's plan (on SMS SMs) with stage 4 stood in for (ahead: its longest
    sequence ahead): (o, final state, the stand-in)."""
    plan = plan_of(**call, tuning=tuning, sms=SMS)
    stage4 = Stage4(call["q"], call["k"], call["v"], call["g"], call["beta"])

    def launch(name, launcher, *args, **kwargs):
        if name == "wuso":
            return stage4(*args, **kwargs)
        if name in ("gate", "intra"):
            return None
        return launcher(*args, **kwargs)
    tensors = {n: call.get(n) for n in forward.RUN_TENSORS}
    o, final = forward.run(plan, **tensors, launch=launch, ahead=ahead)
    return plan, o, final, stage4


def truth(call, lens, starts):
    """Each sequence's o rows (concatenated) and its states after each of `ends[n]` tokens, by the
    float64 recurrence from `starts[n]` (K-first, or None)."""
    outs, finals, bos = [], [], 0
    for n, length in enumerate(lens):
        x = [call[name][:, bos:bos + length] if call["q"].shape[0] == 1 else call[name][n:n + 1]
             for name in ("q", "k", "v", "g", "beta")]
        o, S = recurrent_kda(*x, None, None if starts[n] is None else starts[n][None])
        outs.append(o)
        finals.append(S[0])
        bos += length
    return torch.cat(outs, 1), torch.stack(finals)


def state_after(call, bos, end, start):
    x = [call[name][:, bos:end] for name in ("q", "k", "v", "g", "beta")]
    return recurrent_kda(*x, None, None if start is None else start[None])[1][0]


def packed(lens, **extra):
    call = inputs(sum(lens))
    cu = torch.tensor([0, *lens]).cumsum(0)
    return {**call, "cu_seqlens": cu.int().to(D), **extra}


def test_one_pass_of_a_batch_with_a_dense_state():
    call = inputs(150, B=2)
    h0 = torch.randn(2, HV, K, V, generator=torch.Generator().manual_seed(1)).to(D)
    call.update(initial_state=h0, output_final_state=True)
    plan, o, final, stage4 = run(call)
    assert plan.segments == ((0, 150),) and not plan.parallel and len(stage4.calls) == 1
    ref_o, ref_s = zip(*(recurrent_kda(*(call[n][b:b + 1] for n in ("q", "k", "v", "g", "beta")), None, h0[b:b + 1])
                         for b in range(2)))
    assert rel_err(o, torch.cat(ref_o)) <= TOL and rel_err(final, torch.cat(ref_s)) <= TOL


@pytest.mark.parametrize("v_first", [False, True])
def test_one_pass_packed_with_a_pool_and_routed_decodes(v_first):
    """Sequences of one token go through kda_opt/recurrence (its kernel under the interpreter), the
    others through stage 4: a padding slot (−1) starts from zeros and writes nothing, a slot past
    the pool reads zeros, has_initial_state false starts from zeros and still writes."""
    lens = [70, 1, 130, 1, 20]
    pool = torch.randn(8, HV, *((V, K) if v_first else (K, V)), generator=torch.Generator().manual_seed(2)).to(D)
    slots = torch.tensor([3, 5, -1, 0, 6], dtype=torch.int32, device=D)
    mask = torch.tensor([True, True, True, True, False], device=D)
    call = packed(lens, initial_state=pool.clone(), initial_state_indices=slots, has_initial_state=mask,
                  state_v_first=v_first)
    plan, o, final, stage4 = run(call)
    assert plan.decode is not None and final is None
    starts = [None if s < 0 or not m else _layout(pool[s], v_first) for s, m in zip(slots.tolist(), mask.tolist())]
    ref_o, ref_s = truth(call, lens, starts)
    assert rel_err(o, ref_o) <= TOL
    after = call["initial_state"]
    for n, s in enumerate(slots.tolist()):
        if s >= 0:
            assert rel_err(after[s], _layout(ref_s[n], v_first)) <= TOL
    untouched = [r for r in range(8) if r not in slots.tolist()]
    assert torch.equal(after[untouched], pool[untouched])


def checkpoint_truth(call, lens, starts, ends):
    """The packed checkpoint rows: sequence n's state after each of ends[n] tokens, in order."""
    rows, bos = [], 0
    for n, length in enumerate(lens):
        rows += [state_after(call, bos, bos + e, starts[n]) for e in ends[n]]
        bos += length
    return torch.stack(rows)


@pytest.mark.parametrize("every, offsets", [(64, None), (128, None), (128, [30, 128, 1])])
def test_one_pass_packed_checkpoints(every, offsets):
    """The state after every `every` tokens and after the last, packed rows in order; with offsets,
    the first after f_n tokens and the next every `every` after it."""
    lens = [200, 64, 90]
    h0 = torch.randn(3, HV, K, V, generator=torch.Generator().manual_seed(3)).to(D)
    ends = [sorted({min(e, n) for e in range(every if f is None else f, n + every, every)})
            for n, f in zip(lens, offsets or [None] * 3)]
    rows = sum(map(len, ends))
    ck = torch.full((1, rows + 2, HV, K, V), 7.0, device=D)
    call = packed(lens, initial_state=h0, output_final_state=True, checkpoints=ck, checkpoint_every=every,
                  **({} if offsets is None else {"checkpoint_offsets": torch.tensor(offsets, dtype=torch.int32, device=D)}))
    plan, o, final, _ = run(call)
    ref_o, ref_s = truth(call, lens, list(h0))
    assert rel_err(o, ref_o) <= TOL and rel_err(final, ref_s) <= TOL
    assert rel_err(ck[0, :rows], checkpoint_truth(call, lens, list(h0), ends)) <= TOL
    assert (ck[0, rows:] == 7.0).all()                      # rows no chunk maps to: as they were


@pytest.mark.parametrize("pool", [False, True])
def test_time_segments_hand_the_state_on(pool):
    """One sequence in three time segments (128, 128, 44 tokens): each starts from the state the one
    before left, the first from the call's (a pool slot), the last writes the final state;
    checkpoints of every segment in their rows."""
    T = 300
    h0 = torch.randn(4 if pool else 1, HV, K, V, generator=torch.Generator().manual_seed(4)).to(D)
    ck = torch.zeros(1, 5, HV, K, V, device=D)
    call = inputs(T)
    call.update(initial_state=h0.clone(), checkpoints=ck)
    if pool:
        call["initial_state_indices"] = torch.tensor([2], dtype=torch.int32, device=D)
    else:
        call["output_final_state"] = True
    plan, o, final, stage4 = run(call, Tuning(segment_tokens=64, max_segments=3))
    assert schedule_of(plan, torch.device(D)) == TimeSegments(((0, 128), (128, 256), (256, 300)))
    assert [c["ranges"] for c in stage4.calls] == [[(0, 128)], [(128, 256)], [(256, 300)]]
    start = h0[2 if pool else 0]
    ref_o, ref_s = truth(call, [T], [start])
    assert rel_err(o, ref_o) <= TOL
    assert rel_err(call["initial_state"][2] if pool else final[0], ref_s[0]) <= TOL
    assert rel_err(ck[0], torch.stack([state_after(call, 0, e, start) for e in (64, 128, 192, 256, 300)])) <= TOL


@pytest.mark.parametrize("state", ["none", "dense", "pool", "pool, has_initial_state false"])
def test_parallel_segments_merge_their_transitions(state):
    """One sequence in five parallel segments of 64 tokens: pass 1 from zero (segment 0 from the
    call's state), the middle segments' transitions, the merge, pass 2 from the merged starts; o, the
    final state (a pool slot) and a checkpoint per chunk against the recurrence."""
    T = 320
    call = inputs(T)
    h0 = torch.randn(3, HV, K, V, generator=torch.Generator().manual_seed(5)).to(D)
    ck = torch.zeros(1, 5, HV, K, V, device=D)
    call["checkpoints"] = ck
    start = None
    if state == "dense":
        call.update(initial_state=h0[:1].clone(), output_final_state=True)
        start = h0[0]
    elif state.startswith("pool"):
        call.update(initial_state=h0.clone(), initial_state_indices=torch.tensor([1], dtype=torch.int32, device=D))
        start = h0[1]
        if state.endswith("false"):
            call["has_initial_state"] = torch.tensor([False], device=D)
            start = None
    else:
        call["output_final_state"] = True
    plan, o, final, stage4 = run(call, Tuning(parallel=True, parallel_tokens=64))
    assert schedule_of(plan, torch.device(D)).segments == tuple((t, t + 64) for t in range(0, T, 64))
    assert isinstance(schedule_of(plan, torch.device(D)), ParallelSegments)
    assert [c["transition"] for c in stage4.calls] == [False, True, False]
    ref_o, ref_s = truth(call, [T], [start])
    assert rel_err(o, ref_o) <= TOL
    assert rel_err(call["initial_state"][1] if state.startswith("pool") else final[0], ref_s[0]) <= TOL
    assert rel_err(ck[0], torch.stack([state_after(call, 0, e, start) for e in range(64, T + 1, 64)])) <= TOL


@pytest.mark.parametrize("pool", [False, True])
def test_packed_sequences_cut_into_pieces(pool):
    """Packed sequences with their host lengths, the long ones cut into 64-token pieces (the longest
    in five) and the short one whole: o, each sequence's final state (a pool slot, −1 writing nothing)
    and the checkpoints of every chunk against the recurrence."""
    lens = [320, 30, 150]
    h0 = torch.randn(6, HV, K, V, generator=torch.Generator().manual_seed(6)).to(D)
    rows = sum(-(-n // CHUNK) for n in lens)
    ck = torch.zeros(1, rows, HV, K, V, device=D)
    call = packed(lens, cu_seqlens_cpu=torch.tensor([0, *lens]).cumsum(0), checkpoints=ck)
    slots = [4, -1, 0]
    if pool:
        call.update(initial_state=h0.clone(), initial_state_indices=torch.tensor(slots, dtype=torch.int32, device=D))
        starts = [h0[4], None, h0[0]]
    else:
        call.update(initial_state=h0[:3].clone(), output_final_state=True)
        starts = list(h0[:3])
    plan, o, final, stage4 = run(call, Tuning(parallel=True, parallel_tokens=64))
    schedule = schedule_of(plan, torch.device(D), call["cu_seqlens_cpu"])
    assert isinstance(schedule, Pieces) and len(schedule.pieces) == 5 + 1 + 3
    assert [c["transition"] for c in stage4.calls] == [False, True, False]
    pieces = {r for c in stage4.calls for r in c["ranges"]}
    assert (0, 64) in pieces and (320, 350) in pieces and (350, 414) in pieces
    ref_o, ref_s = truth(call, lens, starts)
    assert rel_err(o, ref_o) <= TOL
    if pool:
        after = call["initial_state"]
        assert rel_err(after[4], ref_s[0]) <= TOL and rel_err(after[0], ref_s[2]) <= TOL
        assert torch.equal(after[[1, 2, 3, 5]], h0[[1, 2, 3, 5]])
    else:
        assert rel_err(final, ref_s) <= TOL
    ends = [sorted({min(e, n) for e in range(64, n + 64, 64)}) for n in lens]
    assert rel_err(ck[0], checkpoint_truth(call, lens, starts, ends)) <= TOL


def test_sized_launches_and_longest_first():
    """Packed sequences with their host lengths, too short to cut: stage 4 launched as the host
    counts say, its programs longest first (more programs than SMs)."""
    lens = [40, 200, 1, 100, 70, 1]
    call = packed(lens, cu_seqlens_cpu=torch.tensor([0, *lens]).cumsum(0), output_final_state=True)
    plan, o, final, stage4 = run(call)
    schedule = schedule_of(plan, torch.device(D), call["cu_seqlens_cpu"])
    assert isinstance(schedule, OnePass) and schedule.routed and schedule.ordered
    assert schedule.counts.long == 3 and schedule.counts.short == 1      # the two one-token ones decoded
    assert schedule_of(plan, torch.device(D), call["cu_seqlens_cpu"], capturing=lambda: True).counts is None
    assert stage4.calls[0]["ordered"]
    ref_o, ref_s = truth(call, lens, [None] * len(lens))
    assert rel_err(o, ref_o) <= TOL and rel_err(final, ref_s) <= TOL


@pytest.mark.parametrize("pool", [False, True])
def test_longest_ahead(pool):
    """Packed sequences with their host lengths, the longest (the first of two of 330 tokens) ahead in
    three time segments made on the device (its state handed on twice), the others' stage 4 over
    them longest first, the one-token ones decoded: o and each sequence's final state (a pool slot,
    −1 writing nothing) against the recurrence."""
    lens = [40, 330, 1, 330, 0, 100]
    h0 = torch.randn(8, HV, K, V, generator=torch.Generator().manual_seed(7)).to(D)
    call = packed(lens, cu_seqlens_cpu=torch.tensor([0, *lens]).cumsum(0))
    slots = [4, 7, 1, -1, 2, 0]
    if pool:
        call.update(initial_state=h0.clone(), initial_state_indices=torch.tensor(slots, dtype=torch.int32, device=D))
        starts = [None if s < 0 else h0[s] for s in slots]
    else:
        call.update(initial_state=h0[:6].clone(), output_final_state=True)
        starts = list(h0[:6])
    tuning = Tuning(ahead_from=65, ahead_segments=3)
    assert takes_ahead(plan_of(**call, tuning=tuning, sms=SMS), call["cu_seqlens_cpu"])
    plan, o, final, stage4 = run(call, tuning, ahead=True)
    assert [c["ranges"] for c in stage4.calls[:3]] == [[(40, 168)], [(168, 296)], [(296, 370)]]
    assert stage4.calls[3]["ordered"] and stage4.calls[3]["ranges"][1] == (40, 370)
    ref_o, ref_s = truth(call, lens, starts)
    assert rel_err(o, ref_o) <= TOL
    if pool:
        after = call["initial_state"]
        for n, s in enumerate(slots):
            if s >= 0:
                assert rel_err(after[s], ref_s[n]) <= TOL, n
        assert torch.equal(after[[3, 5, 6]], h0[[3, 5, 6]])
    else:
        assert rel_err(final, ref_s) <= TOL


def test_takes_ahead():
    """A call takes the longest ahead from its host lengths: one of ahead_from tokens among others,
    its chain ahead_chain times the stage-4 work an SM; not below either, not alone, not without the
    host copy, not with Tuning(ahead=False), not where the plan cuts the call into pieces."""
    lens = [40, 330, 1, 330, 0, 100]
    call = packed(lens, cu_seqlens_cpu=torch.tensor([0, *lens]).cumsum(0))
    takes = lambda tuning=Tuning(ahead_from=330), **over: takes_ahead(plan_of(**{**call, **over}, tuning=tuning,
                                                                                sms=SMS), call["cu_seqlens_cpu"])
    assert takes() and not takes(Tuning(ahead_from=331)) and not takes(Tuning(ahead_from=330, ahead=False))
    assert not takes(Tuning(ahead_from=330, parallel=True, parallel_tokens=64))
    # Its chain (6 chunks) against the stage-4 work an SM: 16 chunks x 2 heads over 8 SMs, 4; over 4, 8.
    assert takes(Tuning(ahead_from=330, ahead_chain=1.5)) and not takes(Tuning(ahead_from=330, ahead_chain=1.6))
    assert not takes_ahead(plan_of(**call, tuning=Tuning(ahead_from=330), sms=4), call["cu_seqlens_cpu"])
    assert not takes_ahead(plan_of(**{**call, "cu_seqlens_cpu": None}, sms=SMS), None)
    alone = packed([330], cu_seqlens_cpu=torch.tensor([0, 330]))
    assert not takes_ahead(plan_of(**{**alone, "cu_seqlens": torch.tensor([0, 330], device=D)}, sms=SMS),
                           torch.tensor([0, 330]))


def test_run_takes_the_call_tensors_first():
    """kda_forward hands run its tensors by position (forward._run): RUN_TENSORS are run's parameters
    right after the plan, in their order."""
    assert list(inspect.signature(forward.run).parameters)[1:1 + len(forward.RUN_TENSORS)] == list(forward.RUN_TENSORS)
