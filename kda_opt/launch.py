"""Kernel launches at a small host cost: Triton kernels through their compiled handles, the current
stream's raw handle, and NVTX ranges only when asked for.

A Triton kernel launched as fn[grid](...) binds and specialises its arguments in Python on every call
(the JIT's run). A plan fixes everything a specialisation depends on: dtypes, strides and constants,
which inputs are absent, pointer alignment, the integers the kernel is specialised on (kda_opt/plan's
call signature; lengths that vary within one plan, a time segment's T, are marked do_not_specialize).
So kda_opt/forward gives each plan a `Kernels` table: a kernel's first launch under the plan goes
through the JIT (which compiles it, or finds it in its caches) and keeps the compiled kernel; later
launches hand the arguments straight to its launcher. Every launch, Triton's and cuTile's, is also
reported to the thread's recorder where one is set (kda_opt/replay records a call to replay it), and a
recorded cuTile launch is replayed through the CUDA driver (kda_opt/fastpath.CutileReplay). The
compiled launcher and the raw stream are private interfaces, taken only on the versions they were
tested on (kda_opt/fastpath.FAST); elsewhere every launch goes through the JIT.
"""
import math
import os
import threading
import weakref

import cuda.tile as ct
import nvtx
import torch
from triton import knobs

from . import fastpath
from .fastpath import current_stream

Kernels = dict  # JITFunction → its compiled kernel, for one plan


def triton_launch(fn, grid, kernels: Kernels | None, *params, num_warps: int = 4, num_stages: int | None = None,
                  **args):
    """fn[grid](...) through the compiled kernel held in `kernels` where it is there (None: always
    through the JIT). The kernel's parameters: `params`, every one in order (the cheaper on the
    host), or `args` by name; num_warps: its warps (Triton's default 4); num_stages: its software
    pipeline's stages (None: Triton's default)."""
    kernel = None if kernels is None or not fastpath.FAST else kernels.get(fn)
    jit = kernel is None or launch_hooks()
    if jit:
        # First launch under the plan, or a profiler's launch hook that wants the JIT's launch
        # metadata. Under TRITON_INTERPRET the launch returns no compiled kernel: every launch is here.
        stages = {} if num_stages is None else {"num_stages": num_stages}
        kernel = fn[grid](*params, **args, num_warps=num_warps, **stages)
        if kernels is not None and fastpath.FAST and hasattr(kernel, "packed_metadata"):
            kernels[fn] = kernel
    params = params or [args[name] for name in fn.arg_names]
    if not jit:
        g = tuple(grid) + (1,) * (3 - len(grid))
        # Tensors as their addresses: the launcher then neither calls data_ptr nor asks the driver
        # whether each address is a device one (the plan has checked every tensor's device).
        fastpath.run_compiled(kernel, g, current_stream(), [x.data_ptr() if isinstance(x, torch.Tensor) else x
                                                            for x in params])
    recorder = _thread.recorder
    if recorder is not None:
        recorder.launched("triton", kernel, grid, params, current_stream())


def cutile_launch(grid, kernel, args) -> None:
    """ct.launch of a cuTile kernel on the current stream (reported to the thread's recorder)."""
    stream = current_stream()
    recorder = _thread.recorder
    if recorder is not None:
        recorder.launched("cutile", kernel, grid, args, stream)
    cutile(stream, grid, kernel, args)


def wait(stream: torch.cuda.Stream, on: torch.cuda.Stream) -> None:
    """`stream` waits for the work `on` has so far (reported to the thread's recorder, which replays it)."""
    stream.wait_stream(on)
    recorder = _thread.recorder
    if recorder is not None:
        recorder.waited(stream, on)


cutile = ct.launch      # every cuTile launch of the package but the replayed ones (fastpath.CutileReplay)


class _Thread(threading.local):
    recorder = None     # kda_opt/replay's Recording of a call this thread runs, which is told each launch


_thread = _Thread()


def set_recorder(recorder) -> None:
    """Make `recorder` (None: none) the one this thread's launches are reported to (kda_opt/replay)."""
    _thread.recorder = recorder


# The package's constants, held weakly: a cache that drops one frees it, unless a replay that
# took it holds it (kda_opt/replay keeps a reference to each constant it replays).
_constants: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def constant(x: torch.Tensor) -> torch.Tensor:
    """x, marked as a tensor of the package's own, which a replay may take as it is
    (kda_opt/replay): it is never written; whoever holds it keeps it."""
    _constants[id(x)] = x
    return x


def is_constant(x: torch.Tensor) -> bool:
    """Whether x was marked by `constant`."""
    return _constants.get(id(x)) is x


def launch_hooks() -> bool:
    """Whether a launch hook is set (a HookChain with calls, or a hook itself in other Triton versions)."""
    hook = knobs.runtime.launch_enter_hook
    return bool(getattr(hook, "calls", hook))


# Each buffer of one_allocation starts on a multiple of this many bytes, as a fresh allocation does
# (the kernels are compiled for 16-byte aligned pointers, and cuTile may specialise on more).
BUFFER_ALIGN = 512


def one_allocation(device: torch.device, *buffers):
    """Contiguous tensors of the given (shape, dtype)s (None: None) as views of one allocation on
    `device`, each at a BUFFER_ALIGN boundary: one allocation costs the host what each would."""
    offsets, total = [], 0
    for buffer in buffers:
        offsets.append(total)
        if buffer is not None:
            shape, dtype = buffer
            total += -(-math.prod(shape) * dtype.itemsize // BUFFER_ALIGN) * BUFFER_ALIGN
    storage = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    typed = {}
    views = []
    for buffer, offset in zip(buffers, offsets):
        if buffer is None:
            views.append(None)
            continue
        shape, dtype = buffer
        if dtype not in typed:
            typed[dtype] = storage.view(dtype)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        views.append(typed[dtype].as_strided(shape, strides, offset // dtype.itemsize))
    return views


NVTX_VARIABLE = "KDA_OPT_NVTX"


def nvtx_enabled() -> bool:
    """Whether kda_forward marks its stages with NVTX ranges: KDA_OPT_NVTX=1 in the environment
    (scripts/profile.sh sets it); read on every call."""
    return os.environ.get(NVTX_VARIABLE, "0") not in ("", "0")


def annotated(name, launcher, *args, **kwargs):
    """A stage launch inside the NVTX range `kda_opt/<name>` of the `kda_opt` domain."""
    with nvtx.annotate(f"kda_opt/{name}", domain="kda_opt"):
        return launcher(*args, **kwargs)


def direct(name, launcher, *args, **kwargs):
    """A stage launch without a range."""
    return launcher(*args, **kwargs)
