"""A call recorded once per signature and replayed (kda_opt/replay): on the CPU with stand-in kernels, what a
recording keeps and how a replay fills in new addresses, and every reason a call is not replayed; on the GPU,
kda_forward's and kda_decode's replayed calls bit for bit those the stages make."""
import types

import pytest
import torch

from kda_opt import replay, fastpath, launch
from tests.conftest import gpu


class Compiled:
    """A stand-in for a Triton kernel compiled under a plan: it keeps each launch's arguments."""
    function, packed_metadata = "f", "m"

    def __init__(self):
        self.runs = []

    def run(self, *arguments):
        self.runs.append(arguments[9:])     # after the grid, stream, function, metadata and hooks


class Replayed:
    """A stand-in for a cuTile launch replayed through the driver (fastpath.CutileReplay): it keeps
    what the real one keeps, not the recorded tensors, and each replay's addresses."""
    made = []

    def __init__(self, kernel, grid, arguments, replaced):
        self.kernel, self.grid, self.replaced = kernel, grid, replaced
        self.scalars = tuple(x for x in arguments if not isinstance(x, torch.Tensor))
        self.calls = []
        Replayed.made.append(self)

    def __call__(self, stream, addresses):
        self.calls.append(tuple(addresses))


@pytest.fixture
def stand_ins(monkeypatch):
    """A compiled Triton stand-in and the cuTile launches, recorded instead of launched (CPU); the
    cuTile replays in Replayed.made."""
    tiles = []
    Replayed.made = []
    monkeypatch.setattr(fastpath, "FAST", True)
    monkeypatch.setattr(launch, "current_stream", lambda: 0)
    monkeypatch.setattr(launch, "cutile", lambda stream, grid, kernel, args: tiles.append((grid, kernel, args)))
    monkeypatch.setattr(fastpath, "CutileReplay", Replayed)
    return Compiled(), tiles


def a_call(compiled, a, b, extra=None):
    """Two launches as the stages make them: a workspace of two buffers, o like b (returned)."""
    x, y = launch.one_allocation(a.device, ((8,), torch.float32), ((2, 4), torch.bfloat16))
    o = torch.empty_like(b)
    launch.triton_launch("fn", (3,), {"fn": compiled}, a, y, 5, o, extra)
    launch.cutile_launch((1, 2, 1), "kernel", (a, x, o, CONSTANT, 1.5))
    return o, None


CONSTANT = launch.constant(torch.zeros(1))


def test_replay_fills_in_the_new_addresses(stand_ins):
    compiled, tiles = stand_ins
    a, b = torch.randn(3), torch.randn(2, 2)
    (o, none), recording = replay.record(lambda: a_call(compiled, a, b), (a, b, None))
    replayed = recording.replay((o, none))
    y_offset = compiled.runs[0][1] - recording.buffers[0].data_ptr()    # y's place in the workspace
    compiled.runs.clear(), tiles.clear()
    a2, b2 = torch.randn(3), torch.randn(2, 2)
    o2, none2 = replayed((a2, b2, None))
    assert none2 is None and o2.shape == b.shape and o2.dtype == b.dtype and o2.data_ptr() != o.data_ptr()
    (args,), (replayed,) = compiled.runs, Replayed.made
    assert not tiles        # the cuTile launch replayed through the driver, not ct.launch
    assert args[0] == a2.data_ptr() and args[2:] == (5, o2.data_ptr(), None) and type(args[1]) is int
    # The cuTile launch's tensors replaced by their new addresses but the constant, kept as recorded.
    assert replayed.grid == (1, 2, 1) and replayed.kernel == "kernel" and replayed.replaced == (0, 1, 2)
    assert replayed.scalars == (1.5,)
    (addresses,) = replayed.calls
    assert addresses[0] == a2.data_ptr() and addresses[2] == o2.data_ptr() and args[1] - addresses[1] == y_offset
    # o is an allocation of its own; the workspace holds the rest.
    assert not o2.data_ptr() <= addresses[1] < o2.data_ptr() + o2.untyped_storage().nbytes()
    assert o2.untyped_storage().nbytes() == o.untyped_storage().nbytes()


def test_bound_keeps_no_tensor_of_the_recorded_call(stand_ins):
    """A Replay holds none of the recorded call's inputs, buffers or results (a plan's entry would
    otherwise keep their memory for as long as the plan is cached), only the package's constants."""
    import gc
    import weakref
    compiled, tiles = stand_ins
    a, b = torch.randn(3), torch.randn(2, 2)
    (o, _), recording = replay.record(lambda: a_call(compiled, a, b), (a, b, None))
    replayed = recording.replay((o, None))
    kept = [weakref.ref(x) for x in (a, b, o, *recording.buffers)]
    del a, b, o, recording
    tiles.clear()                                   # the stand-in cuTile launch's own record of them
    gc.collect()
    assert all(ref() is None for ref in kept) and replayed is not None


def test_a_bound_call_holds_the_constants_it_replays(stand_ins):
    """The package holds its constants weakly (a cache that drops one frees it); a Replay that takes
    one as it is (its address baked into a launch) holds it until the Replay itself is dropped."""
    import gc
    import weakref
    compiled, tiles = stand_ins
    table = launch.constant(torch.ones(4))

    def call(a, b):
        o, _ = a_call(compiled, a, b)
        launch.triton_launch("fn", (1,), {"fn": compiled}, table, o, 0, o, None)
        return o, None
    a, b = torch.randn(3), torch.randn(2, 2)
    (o, _), recording = replay.record(lambda: call(a, b), (a, b))
    replayed = recording.replay((o, None))
    kept = weakref.ref(table)
    del table, recording, o, call
    tiles.clear()
    gc.collect()
    assert kept() is not None and launch.is_constant(kept())
    del replayed
    gc.collect()
    assert kept() is None


@pytest.mark.parametrize("source", ["an input", "a constant"])
def test_a_copy_is_replayed_in_its_place(stand_ins, source):
    """A copy into a buffer of the call, from one of its inputs (a parallel call's final state out of
    its segments' buffer) or from a package constant (a slot table beside the call's slot), is
    recorded among the launches and replayed from the new input, or from the constant itself."""
    compiled, _ = stand_ins
    table = launch.constant(torch.tensor([-1.0, -2.0, -3.0]))

    def call(a, b):
        o, _ = a_call(compiled, a, b)
        o.view(-1)[:3].copy_(a if source == "an input" else table)
        return o, None
    a, b = torch.randn(3), torch.randn(2, 2)
    (o, _), recording = replay.record(lambda: call(a, b), (a, b))
    assert [kind for kind, *_ in recording.launches] == ["triton", "cutile", "copy"]
    a2 = torch.randn(3)
    o2, _ = recording.replay((o, None))((a2, torch.randn(2, 2)))
    assert torch.equal(o2.view(-1)[:3], a2 if source == "an input" else table)


UNBOUND = {
    "a copy from outside": (lambda c, a, b: (r := a_call(c, a, b), r[0].view(-1)[:2].copy_(OUTSIDE))[0],
                            "neither an input"),
    "a torch operation": (lambda c, a, b: (a_call(c, a, b), b.add_(1)), "aten.add_"),
    "a copy by contiguous": (lambda c, a, b: a_call(c, a, b.t().contiguous()), "clone|contiguous"),
    "a tensor from outside": (lambda c, a, b: a_call(c, a, b, extra=OUTSIDE), "neither an input"),
    "one tensor as two inputs": (lambda c, a, b: a_call(c, a, b), "two inputs"),
    "no compiled kernel": (lambda c, a, b: a_call(None, a, b), "no compiled kernel"),
    "a buffer on another device": (lambda c, a, b: (a_call(c, a, b), torch.empty(2, device="meta")), "aten.empty"),
}
OUTSIDE = torch.zeros(2)


@pytest.mark.parametrize("case", list(UNBOUND))
def test_unbound_calls_say_why(stand_ins, monkeypatch, case):
    compiled, _ = stand_ins
    call, words = UNBOUND[case]
    a, b = torch.randn(3), torch.randn(2, 2)
    inputs = (a, b, a) if case == "one tensor as two inputs" else (a, b)
    if case == "no compiled kernel":       # the interpreter's launch: the JIT, which gives no compiled kernel
        monkeypatch.setattr(launch, "triton_launch", _jit_launch)
    result, recording = replay.record(lambda: call(compiled, a, b), inputs)
    with pytest.raises(replay.NotReplayable, match=words):
        recording.replay(result[0] if isinstance(result[0], tuple) else result)


def test_a_cutile_launch_the_driver_cannot_replay_leaves_the_call_not_replayed(stand_ins, monkeypatch):
    compiled, _ = stand_ins

    def unreplayable(*args):
        raise fastpath.ReplayError("no format for a float16 scalar")
    monkeypatch.setattr(fastpath, "CutileReplay", unreplayable)
    a, b = torch.randn(3), torch.randn(2, 2)
    result, recording = replay.record(lambda: a_call(compiled, a, b), (a, b))
    with pytest.raises(replay.NotReplayable, match="cuTile launch cannot be replayed: no format"):
        recording.replay(result)


def _jit_launch(fn, grid, kernels, *params, **args):
    launch._thread.recorder.launched("triton", None, grid, params, launch.current_stream())


def test_call_records_the_second_run_and_replays_later_ones(monkeypatch):
    """replay.call: the first run plain, the second recorded into the entry, later ones replayed;
    a plan that is not replayable, replays turned off (KDA_OPT_REPLAY=0), NVTX ranges and launch
    hooks run plain."""
    entry = types.SimpleNamespace(replay=None, not_replayed=None, runs=0)
    x = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(fastpath, "FAST", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    recorded = []
    monkeypatch.setattr(replay, "record", lambda run, inputs: (recorded.append(inputs) or run(), _Recording()))
    runs = []
    run = lambda: runs.append(1) or "ran"
    assert [replay.call(entry, (x,), run) for _ in range(3)] == ["ran", "ran", "replayed"]
    assert len(runs) == 2 and len(recorded) == 1
    monkeypatch.setenv(launch.NVTX_VARIABLE, "1")
    assert replay.call(entry, (x,), run) == "ran"
    monkeypatch.setenv(launch.NVTX_VARIABLE, "0")
    monkeypatch.setattr(replay, "ENABLED", False)
    assert replay.call(entry, (x,), run) == "ran"
    fresh = types.SimpleNamespace(replay=None, not_replayed=None, runs=0)
    assert [replay.call(fresh, (x,), run) for _ in range(3)] == ["ran"] * 3 and len(recorded) == 1
    monkeypatch.setattr(replay, "ENABLED", True)
    plain = types.SimpleNamespace(replay=None, not_replayed=None, runs=0)
    assert [replay.call(plain, (x,), run, "it runs in time segments") for _ in range(3)] == ["ran"] * 3
    assert plain.not_replayed == "it runs in time segments" and len(recorded) == 1


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False)])
def test_replay_switch_is_read_from_the_environment(value, enabled):
    """KDA_OPT_REPLAY=0 in the environment when kda_opt is imported turns replays off; unset or any
    other value leaves them on."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != replay.REPLAY_VARIABLE}
    if value is not None:
        env[replay.REPLAY_VARIABLE] = value
    out = subprocess.run([sys.executable, "-c", "import kda_opt.replay as r; print(r.ENABLED)"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(enabled)


def test_plans_that_launch_by_more_than_their_signature_are_not_replayable():
    """Plan.not_replayable: time segments (two streams) and launches sized from cu_seqlens_cpu's lengths
    (sized launches, parallel cuts) give a reason; a one-pass plan none, nor parallel segments (their
    launches follow the plan; what they run besides is the recording's to judge)."""
    from kda_opt.plan import Plan
    plan = lambda **over: types.SimpleNamespace(**{**dict(parallel=False, segments=((0, 64),), parallel_cut=None,
                                                            sized_launches=False), **over})
    reason = Plan.not_replayable.fget
    assert reason(plan()) is None
    assert reason(plan(segments=((0, 64), (64, 128)))) == "it runs in time segments"
    assert reason(plan(parallel=True, segments=((0, 64), (64, 128), (128, 192)))) is None
    assert "cu_seqlens_cpu" in reason(plan(sized_launches=True)) and "cu_seqlens_cpu" in reason(plan(parallel_cut=1))


class _Recording:
    def replay(self, result):
        return lambda inputs: "replayed"


# ---- on the GPU: replays bit for bit the stages' calls ----

def _calls():
    """({name: kda_forward's arguments}, {name: kda_decode's}), each drawn anew on every call."""
    from tests.sanitizer_calls import H, K, MIXED, checkpointed, decode_call, pool_call
    from inputs import random_inputs
    no_host_copy = lambda a: {n: x for n, x in a.items() if n != "cu_seqlens_cpu"}
    return {
        "dense": lambda: random_inputs(2, 200, H, K, output_final_state=False),
        "FlashKDA's call": lambda: random_inputs(1, 300, H, K, initial_state=True, l2norm=True, beta_logits=True,
                                                 state_v_first=True),
        "softplus, bf16 gate parameters": lambda: {**(a := random_inputs(1, 130, H, K, gate="softplus")),
                                                   "A_log": a["A_log"].bfloat16(), "dt_bias": a["dt_bias"].bfloat16()},
        "packed, one-token sequences routed": lambda: no_host_copy(random_inputs(
            1, sum(MIXED), H, K, seqlens=MIXED, initial_state=True, l2norm=True, beta_logits=True)),
        "a pool": lambda: no_host_copy(pool_call(MIXED, [5, -1, 0, 9, 2, 3, 1, -1], 10,
                                                 has=[True, True, False, True, True, True, False, True])),
        "checkpoints": lambda: no_host_copy(checkpointed(MIXED, 128, state_v_first=True)),
        "fp32": lambda: random_inputs(1, 200, H, K, dtype=torch.float32, initial_state=True),
        "parallel segments, FlashKDA's call": lambda: random_inputs(1, 8192, H, K, initial_state=True, l2norm=True,
                                                                    beta_logits=True, state_v_first=True),
        # One packed sequence with its host copy runs as B = 1: parallel segments, a pool slot or a mask.
        "parallel segments, a pool slot": lambda: pool_call([8192], [2], 4, has=[True]),
        "parallel segments, has_initial_state": lambda: {
            **random_inputs(1, 8192, H, K, seqlens=[8192], initial_state=True),
            "has_initial_state": torch.tensor([False], device="cuda")},
        # A long request among others with the host copy: the longest ahead, on a side stream.
        "the longest ahead, a pool": lambda: pool_call([300, 1, 4200, 64, 0, 700], [5, 0, -1, 2, 4, 1], 6,
                                                       l2norm=True, beta_logits=True),
    }, {
        "decode, dense states": lambda: {**decode_call([1, 3, 0, 2], None, 0),
                                         "initial_state": torch.randn(4, H, K, K, device="cuda"),
                                         "output_final_state": True},
        "decode, a pool in place": lambda: decode_call([1] * 6, torch.tensor([5, -1, 0, 9, 2, 4]), 8),
    }


CALL_NAMES = ["dense", "FlashKDA's call", "softplus, bf16 gate parameters", "packed, one-token sequences routed",
              "a pool", "checkpoints", "fp32", "parallel segments, FlashKDA's call", "parallel segments, a pool slot",
              "parallel segments, has_initial_state", "the longest ahead, a pool", "decode, dense states",
              "decode, a pool in place"]


# Packed sequences whose longest is cut into parallel pieces on each call (plan.CUT_FROM tokens, half
# the call's): launches sized from the host lengths, so never replayed.
PIECES = [33000, 300, 100]


@gpu
@pytest.mark.parametrize("name", CALL_NAMES + ["pieces of packed sequences (not replayed)"])
def test_replayed_and_plain_calls_agree(name, monkeypatch):
    """The replay switch (kda_opt/replay.ENABLED, KDA_OPT_REPLAY=0): a signature's third call,
    replayed, and the same call with replays off (the stages' Python on every call) give the same
    outputs, pools and checkpoints bit for bit, on every schedule; with replays off no call of a
    fresh signature is recorded or replayed, with them on a replayable one is."""
    import kda_opt.decode as decode
    import kda_opt.forward as forward
    import kda_opt.plan_cache as plan_cache
    from inputs import random_inputs
    from kda_opt.arguments import DecodeArguments, ForwardArguments
    from kda_opt.decode_plan import decode_plan_for
    from kda_opt.plan import plan_for, takes_ahead
    forward_calls, decode_calls = _calls()
    forward_calls["pieces of packed sequences (not replayed)"] = lambda: random_inputs(
        1, sum(PIECES), 8, 128, seqlens=PIECES, initial_state=True)
    is_decode = name in decode_calls
    make = (decode_calls if is_decode else forward_calls)[name]
    function = decode.kda_decode if is_decode else forward.kda_forward

    def entry_of(args):
        if is_decode:
            return decode_plan_for(DecodeArguments(**args))
        entry = plan_for(ForwardArguments(**args))
        return entry.ahead if takes_ahead(entry.plan, args.get("cu_seqlens_cpu")) else entry

    def fresh(enabled):
        """A fresh plan cache, replays on or off, and a signature's first two calls made."""
        monkeypatch.setattr(plan_cache, "_plans", {})
        monkeypatch.setattr(replay, "ENABLED", enabled)
        for _ in range(2):
            function(**make())

    fresh(True)
    args = make()
    written = [n for n in ("initial_state", "checkpoints") if n in args and (
        "initial_state_indices" in args or "ssm_state_indices" in args or n == "checkpoints")]
    again = {**args, **{n: args[n].new_empty_strided(args[n].shape, args[n].stride()).copy_(args[n]) for n in written}}
    replayed, entry = function(**args), entry_of(args)
    if "not replayed" in name:
        assert entry.replay is None and "cu_seqlens_cpu" in entry.not_replayed
    else:
        assert entry.replay is not None, entry.not_replayed
    fresh(False)
    plain, plain_entry = function(**again), entry_of(again)     # the same inputs, the stages' Python
    assert plain_entry.replay is None and plain_entry.runs == 0
    for x, y in zip(replayed, plain):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    for n in written:       # bit for bit: rows no call writes hold what the allocation held, NaNs among it
        assert torch.equal(args[n].view(torch.uint8), again[n].view(torch.uint8)), n
