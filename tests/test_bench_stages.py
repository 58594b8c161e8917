"""scripts/bench_stages.py: its list options parse, and it records kda_forward's stage launches
with their own arguments (CPU: the Triton stages under the interpreter)."""
import bench_stages as bs
import torch

from kda_opt import forward
from kda_opt.options import GateConfig
from tests.conftest import kernel_device
from tests.stage_inputs import stage_inputs


def test_int_lists():
    assert bs.ints("32,64,128") == [32, 64, 128]
    assert bs.ints("") == [None]


def test_record_stages_keeps_each_launch_and_restores_the_launchers():
    x = stage_inputs(1, 70, 1, 64, HV=2, device=kernel_device())
    g = -torch.rand(1, 70, 2, 64, device=kernel_device())
    launchers = {name: getattr(forward, name) for name in bs.STAGES}

    def two_stages_twice():   # as over two time segments
        for part in (slice(0, 64), slice(64, 70)):
            gcum = forward.gate_cumsum(g[:, part], GateConfig(), None, None, 64)
            forward.intra_chunk(x["q"][:, part], x["k"][:, part], gcum, x["beta"][:, part], 0.125, 64,
                                gate_bounded=True)

    calls = bs.record_stages(two_stages_twice)
    assert set(calls) == {"gate_cumsum", "intra_chunk"} and len(calls["intra_chunk"]) == 2
    launcher, args, kwargs, gcum = calls["gate_cumsum"][1]
    assert launcher is launchers["gate_cumsum"] and args[0].shape == (1, 6, 2, 64) and gcum.shape == args[0].shape
    launcher, args, kwargs, (Aqk, Tm) = calls["intra_chunk"][1]
    assert kwargs == {"gate_bounded": True} and args[2] is gcum and Aqk.shape == (1, 6, 2, 64)
    assert torch.equal(launcher(*args, **kwargs)[1], Tm)        # re-running a record: the same stage
    assert all(getattr(forward, name) is fn for name, fn in launchers.items())


def test_stage_rows_each_call_their_own_stage(monkeypatch):
    ran = []

    def launcher(name):
        return lambda *args, **kwargs: ran.append((name, args, kwargs, bs.stage4.wuso_kernel))
    x = torch.zeros(2)
    stages = {"gate_cumsum": [(launcher("gate"), (x,), {}, x)],
              "intra_chunk": [(launcher("intra"), (x, x, x, x), {"gate_bounded": True}, (x, x))],
              "wuso": [(launcher("wuso"), (x,) * 6, {"block_v": None}, (x, None))] * 2}   # two segments
    kernel = bs.stage4.wuso_kernel
    monkeypatch.setattr(kernel, "replace_hints", lambda **hints: hints, raising=False)
    rows = bs.stage_rows(stages, [None, 8], [0, 32], [0, 4])     # None or 0: the default
    labels = [label for label, _, _ in rows]
    assert labels == ["gate", "intra warps=default", "intra warps=8", "wuso bv=auto warps=8", "wuso bv=auto warps=4",
                      "wuso bv=32 warps=8", "wuso bv=32 warps=4"]
    assert [n for *_, n in rows] == [16] + [48] * 2 + [2 * 56] * 4    # every launch's bytes, 8 per x
    for _, call, _ in rows:
        call()
    assert [name for name, *_ in ran] == ["gate"] + ["intra"] * 2 + ["wuso"] * 8
    assert [kw for _, _, kw, _ in ran[1:3]] == [{"gate_bounded": True}, {"gate_bounded": True, "num_warps": 8}]
    assert [kw["block_v"] for _, _, kw, _ in ran[3:]] == [None] * 4 + [32] * 4
    assert [k for *_, k in ran[3:]] == [kernel, kernel, {"num_worker_warps": 4}, {"num_worker_warps": 4}] * 2
    assert bs.stage4.wuso_kernel is kernel                    # the worker-warp variants are put back
