"""The host path's pieces (kda_opt/launch, the inputs as the stages read them), on the CPU: one
allocation's views, the compiled launcher's arguments, the gate parameters left in their dtype."""
import types

import pytest
import torch

from kda_opt import replay, fastpath, forward, launch
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
    monkeypatch.setattr(fastpath, "FAST", True)
    monkeypatch.setattr(launch, "current_stream", lambda: 7)
    x = torch.zeros(4)
    launch.triton_launch(fn, (2,), {fn: compiled}, x, None, 3, 0.5)
    (args,), = [runs]
    assert args[:9] == (2, 1, 1, 7, "f", "m", None, None, None)
    assert args[9:] == (x.data_ptr(), None, 3, 0.5) and type(args[9]) is int


@pytest.mark.parametrize("versions, fast", [
    ({"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda-tile": "1.7.0"}, True),
    ({"torch": "2.11.1", "triton": "3.6.2", "cuda-tile": "1.7.3"}, True),       # patch releases
    ({"torch": "2.14.1", "triton": "3.6.0", "cuda-tile": "1.7.0"}, False),
    ({"torch": "2.11.0", "triton": "3.8.0", "cuda-tile": "1.7.0"}, False),
    ({"torch": "2.11.0", "triton": "3.6.0", "cuda-tile": "1.8.0"}, False),
    ({"torch": "2.11.0", "triton": "3.6.0", "cuda-tile": None}, False),
])
def test_fast_path_only_on_tested_versions(versions, fast):
    assert fastpath.tested(versions) is fast


def test_untested_versions_take_the_public_launches(monkeypatch):
    """On versions the fast path was not tested on: each Triton launch through fn[grid](...) (the JIT),
    no compiled kernel kept or run, the public current stream, and no call bound."""
    monkeypatch.setattr(fastpath, "FAST", fastpath.tested({"torch": "2.99.0", "triton": "3.6.0", "cuda-tile": "1.7.0"}))
    compiled = types.SimpleNamespace(function="f", packed_metadata="m", run=lambda *a: pytest.fail("compiled launch"))
    jit = []

    class Fn:
        arg_names = ("x",)

        def __getitem__(self, grid):
            return lambda *params, **options: jit.append((grid, params)) or compiled
    fn, kernels = Fn(), {}
    launch.triton_launch(fn, (2,), kernels, 3)
    kernels[fn] = compiled                      # even a kernel kept before is not run
    launch.triton_launch(fn, (2,), kernels, 4)
    assert jit == [((2,), (3,)), ((2,), (4,))]
    streams = types.SimpleNamespace(current_stream=lambda: types.SimpleNamespace(cuda_stream=9))
    monkeypatch.setattr(fastpath.torch, "cuda", streams)
    assert fastpath.current_stream() == 9
    entry = types.SimpleNamespace(replay=None, not_replayed=None, runs=0)
    assert [replay.call(entry, (types.SimpleNamespace(is_cuda=True),), lambda: "ran") for _ in range(3)] == ["ran"] * 3
    assert "not tested on these versions" in entry.not_replayed


def test_gate_parameters_are_read_as_they_are():
    # A bf16 model's A_log and dt_bias reach stage 1 as they are (it reads them as fp32): no cast per call.
    plan = types.SimpleNamespace(copied=(), state_pool=False, gate=GateConfig(in_kernel=True))
    x = torch.zeros(1, 4, 2, 8)
    A_log, dt_bias = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)
    *_, A, b = forward._as_read(plan, x, x, x, x, x[..., 0], None, A_log, dt_bias)
    assert A is A_log and b is dt_bias


def test_constants_are_freed_when_their_cache_drops_them():
    """launch.constant marks a tensor without keeping it: dropped by whoever held it, it is freed."""
    import gc
    import weakref
    x = launch.constant(torch.zeros(3))
    kept = weakref.ref(x)
    assert launch.is_constant(x)
    del x
    gc.collect()
    assert kept() is None


def test_driver_kernels_keep_the_most_recent_and_free_the_dropped(monkeypatch):
    """The driver's specialisations: at most DRIVER_KERNELS cached, the least recently used dropped,
    each freed (its library unloaded) once neither the cache nor a replay holds it."""
    import gc
    import weakref

    class Loaded:
        def __init__(self, kernel, signature, device):
            self.key = (kernel, signature.symbol)
    monkeypatch.setattr(fastpath, "_Loaded", Loaded)
    monkeypatch.setattr(fastpath, "_driver_kernels", type(fastpath._driver_kernels)())
    monkeypatch.setattr(fastpath.torch.cuda, "current_device", lambda: 0)
    signature = lambda n: types.SimpleNamespace(symbol=f"s{n}")
    held = fastpath._driver_kernel("k", signature(0))           # as a CutileReplay holds it
    first = weakref.ref(fastpath._driver_kernel("k", signature(1)))
    assert fastpath._driver_kernel("k", signature(0)) is held   # found again, now the most recent
    for n in range(2, fastpath.DRIVER_KERNELS + 2):
        fastpath._driver_kernel("k", signature(n))
    gc.collect()
    assert len(fastpath._driver_kernels) == fastpath.DRIVER_KERNELS
    assert first() is None and held.key == ("k", "s0")
    assert all(key[1] != "s0" for key in fastpath._driver_kernels)   # dropped from the cache, alive while held
