"""The host path's pieces (kda_opt/launch, the inputs as the stages read them), on the CPU: one
allocation's views, the compiled launcher's arguments, the gate parameters left in their dtype."""
import types

import torch

from kda_opt import forward, launch
from kda_opt.options import GateConfig


def test_one_allocation_gives_aligned_disjoint_views_of_one_storage():
    shapes = [((1, 5, 3, 7), torch.float32), None, ((1, 5, 3, 64), torch.bfloat16), ((2, 1, 3, 5), torch.float32)]
    views = launch.one_allocation(torch.device("cpu"), *shapes)
    assert views[1] is None
    given = [v for v in views if v is not None]
    assert [(tuple(v.shape), v.dtype) for v in given] == [s for s in shapes if s is not None]
    assert all(v.is_contiguous() for v in given)
    assert len({v.untyped_storage().data_ptr() for v in given}) == 1
    starts = [v.data_ptr() - given[0].data_ptr() for v in given]
    assert all(s % launch.BUFFER_ALIGN == 0 for s in starts)
    ends = [s + v.numel() * v.element_size() for s, v in zip(starts, given)]
    assert all(end <= start for end, start in zip(ends, starts[1:]))      # in order, none overlapping
    for i, v in enumerate(given):                                         # each written alone
        v.fill_(i + 1)
    assert [int(v.flatten()[0]) for v in given] == [1, 2, 3] and all(bool((v == i + 1).all()) for i, v in enumerate(given))


def test_compiled_launcher_gets_tensors_as_addresses(monkeypatch):
    runs = []
    compiled = types.SimpleNamespace(function="f", packed_metadata="m", run=lambda *a: runs.append(a))
    fn = object()
    monkeypatch.setattr(launch, "current_stream", lambda: 7)
    x = torch.zeros(4)
    launch.triton_launch(fn, (2,), {fn: compiled}, x, None, 3, 0.5)
    (args,), = [runs]
    assert args[:9] == (2, 1, 1, 7, "f", "m", None, None, None)
    assert args[9:] == (x.data_ptr(), None, 3, 0.5) and type(args[9]) is int


def test_gate_parameters_are_read_as_they_are():
    # A bf16 model's A_log and dt_bias reach stage 1 as they are (it reads them as fp32): no cast per call.
    plan = types.SimpleNamespace(copied=(), state_pool=False, gate=GateConfig(in_kernel=True))
    x = torch.zeros(1, 4, 2, 8)
    A_log, dt_bias = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)
    *_, A, b = forward._as_read(plan, x, x, x, x, x[..., 0], None, A_log, dt_bias)
    assert A is A_log and b is dt_bias
