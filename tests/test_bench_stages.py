"""scripts/bench_stages.py: its list options parse, and it records kda_forward's stage launches
with their own arguments (CPU: the Triton stages under the interpreter)."""
import bench_stages as bs
import torch

from kda_opt.gate import gate_cumsum
from kda_opt.intra import intra_chunk
from kda_opt.options import GateConfig
from tests.conftest import kernel_device
from tests.stage_inputs import stage_inputs


def test_int_lists():
    assert bs.ints("32,64,128") == [32, 64, 128]
    assert bs.ints("") == [None]


def test_parallel_tokens_plan_parallel_segments():
    """--parallel-tokens N: the plan's own knobs but parallel segments of at least N tokens."""
    assert bs.tuning_for(None) == bs.Tuning()
    assert bs.tuning_for(768) == bs.Tuning(parallel=True, parallel_tokens=768)


def test_record_stages_keeps_each_launch():
    x = stage_inputs(1, 70, 1, 64, HV=2, device=kernel_device())
    g = -torch.rand(1, 70, 2, 64, device=kernel_device())

    def two_stages_twice(launch):   # as kda_opt.forward.run over two time segments
        for part in (slice(0, 64), slice(64, 70)):
            gcum = launch("gate", gate_cumsum, g[:, part], GateConfig(), None, None)
            launch("intra", intra_chunk, x["q"][:, part], x["k"][:, part], gcum, x["beta"][:, part], 0.125,
                   gate_bounded=True)

    calls = bs.record_stages(two_stages_twice)
    assert set(calls) == {"gate", "intra"} and len(calls["intra"]) == 2
    launcher, args, kwargs, gcum = calls["gate"][1]
    assert launcher is gate_cumsum and args[0].shape == (1, 6, 2, 64) and gcum.shape == args[0].shape
    launcher, args, kwargs, (Aqk, Tm) = calls["intra"][1]
    assert kwargs == {"gate_bounded": True} and args[2] is gcum and Aqk.shape == (1, 6, 2, 64)
    assert torch.equal(launcher(*args, **kwargs)[1], Tm)        # re-running a record: the same stage


def test_stage_rows_each_call_their_own_stage():
    ran = []

    def launcher(name):
        return lambda *args, **kwargs: ran.append((name, args, kwargs))
    x = torch.zeros(2)
    stages = {"gate": [(launcher("gate"), (x,), {}, x)],
              "intra": [(launcher("intra"), (x, x, x, x), {"gate_bounded": True}, (x, x))],
              "wuso": [(launcher("wuso"), (x,) * 6, {"block_v": 128}, x)] * 2}   # two segments
    rows = bs.stage_rows(stages, [None, 8], [0, 32], [0, 4])     # None or 0: the plan's own
    labels = [label for label, _, _ in rows]
    assert labels == ["gate", "intra warps=default", "intra warps=8", f"wuso bv=auto warps={bs.WORKER_WARPS}",
                      "wuso bv=auto warps=4", f"wuso bv=32 warps={bs.WORKER_WARPS}", "wuso bv=32 warps=4"]
    assert [n for *_, n in rows] == [16] + [48] * 2 + [2 * 56] * 4    # every launch's bytes, 8 per x
    for _, call, _ in rows:
        call()
    assert [name for name, *_ in ran] == ["gate"] + ["intra"] * 2 + ["wuso"] * 8
    assert [kw for *_, kw in ran[1:3]] == [{"gate_bounded": True}, {"gate_bounded": True, "num_warps": 8}]
    assert [kw for *_, kw in ran[3::2]] == [{"block_v": 128}, {"block_v": 128, "worker_warps": 4},
                                           {"block_v": 32}, {"block_v": 32, "worker_warps": 4}]
