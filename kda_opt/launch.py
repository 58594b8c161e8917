"""Kernel launches at a small host cost: Triton kernels through their compiled handles, the current
stream's raw handle, and NVTX ranges only when asked for.

A Triton kernel launched as fn[grid](...) binds and specialises its arguments in Python on every call
(the JIT's run). A plan fixes everything a specialisation depends on: dtypes, strides and constants,
which inputs are absent, pointer alignment, the integers the kernel is specialised on (kda_opt/plan's
call signature; lengths that vary within one plan, a time segment's T, are marked do_not_specialize).
So kda_opt/forward gives each plan a `Kernels` table: a kernel's first launch under the plan goes
through the JIT (which compiles it, or finds it in its caches) and keeps the compiled kernel; later
launches hand the arguments straight to its launcher. Every launch, Triton's and cuTile's, is also
reported to the thread's recorder where one is set (kda_opt/bound records a call to replay it), and a
recorded cuTile launch is replayed through the CUDA driver (CutileReplay).
"""
import ctypes
import io
import math
import os
import struct
import threading
import weakref
from collections import OrderedDict

import cuda.tile as ct
from cuda.tile.compilation import CallingConvention, ConstantConstraint, KernelSignature, ScalarConstraint, export_kernel
import nvtx
import torch
from triton import knobs

Kernels = dict  # JITFunction → its compiled kernel, for one plan


def triton_launch(fn, grid, kernels: Kernels | None, *params, num_warps: int = 4, num_stages: int | None = None,
                  **args):
    """fn[grid](...) through the compiled kernel held in `kernels` where it is there (None: always
    through the JIT). The kernel's parameters: `params`, every one in order (the cheaper on the
    host), or `args` by name; num_warps: its warps (Triton's default 4); num_stages: its software
    pipeline's stages (None: Triton's default)."""
    kernel = None if kernels is None else kernels.get(fn)
    jit = kernel is None or launch_hooks()
    if jit:
        # First launch under the plan, or a profiler's launch hook that wants the JIT's launch
        # metadata. Under TRITON_INTERPRET the launch returns no compiled kernel: every launch is here.
        stages = {} if num_stages is None else {"num_stages": num_stages}
        kernel = fn[grid](*params, **args, num_warps=num_warps, **stages)
        if kernels is not None and hasattr(kernel, "packed_metadata"):
            kernels[fn] = kernel
    params = params or [args[name] for name in fn.arg_names]
    if not jit:
        g = tuple(grid) + (1,) * (3 - len(grid))
        # Tensors as their addresses: the launcher then neither calls data_ptr nor asks the driver
        # whether each address is a device one (the plan has checked every tensor's device).
        kernel.run(g[0], g[1], g[2], current_stream(), kernel.function, kernel.packed_metadata, None, None, None,
                   *[x.data_ptr() if isinstance(x, torch.Tensor) else x for x in params])
    recorder = _thread.recorder
    if recorder is not None:
        recorder.launched("triton", kernel, grid, params)


def cutile_launch(grid, kernel, args) -> None:
    """ct.launch of a cuTile kernel on the current stream (reported to the thread's recorder)."""
    recorder = _thread.recorder
    if recorder is not None:
        recorder.launched("cutile", kernel, grid, args)
    cutile(current_stream(), grid, kernel, args)


cutile = ct.launch      # every cuTile launch of the package but the replayed ones (CutileReplay)


class ReplayError(Exception):
    """Why a cuTile launch cannot be replayed through the driver."""


class CutileReplay:
    """A recorded cuTile launch made again on other addresses through the CUDA driver (cuLaunchKernel),
    for kda_opt/bound's replays. ct.launch reads every array argument's metadata and finds the
    kernel's specialisation for it on each launch; here the specialisation of the recorded launch's
    arguments (what ct.launch compiled for them) is compiled once through cuda.tile.compilation's
    export, and its parameters packed once as the cutile_python_v2 calling convention lays them out
    (an array as its address, shape and strides; a scalar as itself; constants left out). A replay
    writes in the addresses of the arguments `replaced` names (their indices among the launch's
    arguments) and launches. Sound for arguments of the recorded specialisation: kda_opt/plan's
    signature fixes every shape, stride and dtype, and each input's alignment to 16 bytes (the
    alignment the specialisation assumes at most; the call's own buffers are aligned to more)."""

    def __init__(self, kernel, grid, arguments: tuple, replaced: tuple):
        from cuda.bindings import driver
        signature = KernelSignature.from_kernel_args(kernel, arguments, CallingConvention.cutile_python_v2())
        self.loaded = _driver_kernel(kernel, signature)        # held: its library stays loaded while this lives
        self.kernel, threads, layout = self.loaded.function, self.loaded.threads, self.loaded.layout
        formats, values, argument_of = _parameters(signature, arguments)
        if [size for _, size in layout] != [struct.calcsize(f) for f in formats]:
            raise ReplayError(f"{signature.symbol[:40]}…'s parameters are not as its calling convention lays them out")
        end = layout[-1][0] + layout[-1][1] if layout else 0
        self._buffer = bytearray(-(-end // 8) * 8 or 8)
        for f, value, (offset, _) in zip(formats, values, layout):
            struct.pack_into(f, self._buffer, offset, value)
        self._c_buffer = (ctypes.c_char * len(self._buffer)).from_buffer(self._buffer)
        base = ctypes.addressof(self._c_buffer)
        self._pointers = (ctypes.c_void_p * max(len(layout), 1))(*(base + offset for offset, _ in layout))
        self._parameters = ctypes.addressof(self._pointers)     # cuLaunchKernel's kernelParams
        self._words = memoryview(self._buffer).cast("Q")
        word = {n: offset // 8 for (offset, _), n in zip(layout, argument_of) if n is not None}
        self.words = tuple(word[n] for n in replaced)
        self.launch_dims = (*grid, *(1,) * (3 - len(grid)), threads, 1, 1, 0)    # grid, block, dynamic shared memory
        self._launch = driver.cuLaunchKernel
        self._lock = threading.Lock()   # one parameter buffer: concurrent replays fill and launch it in turn

    def __call__(self, stream: int, addresses) -> None:
        """The launch on `stream` with the replaced arguments at `addresses` (in `replaced`'s order)."""
        words = self._words
        with self._lock:
            for w, address in zip(self.words, addresses):
                words[w] = address
            error, = self._launch(self.kernel, *self.launch_dims, stream, self._parameters, 0)
        if error:
            raise RuntimeError(f"cuLaunchKernel failed: {error!r}")


# (kernel, specialisation's symbol, device) → its _Loaded specialisation, the DRIVER_KERNELS most recently
# used: each compiled and loaded once while it is here, and unloaded once neither this cache nor a
# replay (CutileReplay) holds it.
_driver_kernels: "OrderedDict[tuple, _Loaded]" = OrderedDict()
DRIVER_KERNELS = 64
ALIGNMENT_FIXED = 16    # the input alignment a plan's signature fixes (kda_opt/plan's key), in bytes
_SCALAR_FORMATS = {ct.float32: "f", ct.float64: "d", ct.int32: "i", ct.int64: "q", ct.bool_: "?"}


class _Loaded:
    """A cuTile specialisation loaded through the driver: its library, its CUfunction in the device's
    primary context (a function, not the context-free CUkernel: the driver launches it for less),
    threads per block and parameters' (offset, size)s. When this is freed the library is unloaded,
    after the device has finished what was launched from it (a synchronisation; during a graph
    capture, which forbids one, it stays loaded)."""

    def __init__(self, kernel, signature, device: int):
        from cuda.bindings import driver
        for c in signature.parameters:
            if getattr(c, "base_addr_divisible_by", 1) > ALIGNMENT_FIXED:
                raise ReplayError(f"the kernel assumes addresses aligned to {c.base_addr_divisible_by} bytes")
        major, minor = torch.cuda.get_device_capability()
        binary = io.BytesIO()
        export_kernel(kernel, [signature], binary, gpu_code=f"sm_{major}{minor}", output_format="cubin")
        self._unload = driver.cuLibraryUnload
        self.library = _checked(driver.cuLibraryLoadData(binary.getvalue(), None, None, 0, None, None, 0))
        handle = _checked(driver.cuLibraryGetKernel(self.library, signature.symbol.encode()))
        self.threads = _checked(driver.cuKernelGetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, handle, device))
        self.layout = []
        while (info := driver.cuKernelGetParamInfo(handle, len(self.layout)))[0] == driver.CUresult.CUDA_SUCCESS:
            self.layout.append((info[1], info[2]))
        self.function = _checked(driver.cuKernelGetFunction(handle))
        self.device = device

    def __del__(self):
        if getattr(self, "library", None) is None or torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.synchronize(self.device)
        self._unload(self.library)


def _driver_kernel(kernel, signature) -> _Loaded:
    """`kernel` compiled for `signature` and loaded on the current device, from the cache."""
    key = (kernel, signature.symbol, torch.cuda.current_device())
    loaded = _driver_kernels.pop(key, None) or _Loaded(kernel, signature, key[2])
    _driver_kernels[key] = loaded                       # the most recently used last
    while len(_driver_kernels) > DRIVER_KERNELS:
        _driver_kernels.popitem(last=False)
    return loaded


def _checked(result):
    """A driver call's value, or RuntimeError where it failed."""
    error, value = result
    if error:
        raise RuntimeError(f"CUDA driver: {error!r}")
    return value


def _parameters(signature, arguments):
    """The launch's parameters as the cutile_python_v2 convention passes them: (struct formats,
    values, the index of the argument whose address each is, or None)."""
    formats, values, argument_of = [], [], []
    for n, (c, x) in enumerate(zip(signature.parameters, arguments)):
        if isinstance(c, ConstantConstraint):
            continue
        if isinstance(c, ScalarConstraint):
            if c.dtype not in _SCALAR_FORMATS:
                raise ReplayError(f"no format for a {c.dtype} scalar")
            formats.append(_SCALAR_FORMATS[c.dtype])
            values.append(x)
            argument_of.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise ReplayError(f"argument {n} is neither a tensor, a scalar nor a constant")
        index = "q" if c.index_dtype == ct.int64 else "i"
        formats += ["Q"] + [index] * (2 * x.dim())
        values += [x.data_ptr(), *x.shape, *x.stride()]
        argument_of += [n] + [None] * (2 * x.dim())
    return formats, values, argument_of


class _Thread(threading.local):
    recorder = None     # kda_opt/bound's Recording of a call this thread runs, which is told each launch


_thread = _Thread()


def set_recorder(recorder) -> None:
    """Make `recorder` (None: none) the one this thread's launches are reported to (kda_opt/bound)."""
    _thread.recorder = recorder


# The package's constants, held weakly: a cache that drops one frees it, unless a bound call that
# took it holds it (kda_opt/bound keeps a reference to each constant it replays).
_constants: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def constant(x: torch.Tensor) -> torch.Tensor:
    """x, marked as a tensor of the package's own, which a bound call may take as it is
    (kda_opt/bound): it is never written; whoever holds it keeps it."""
    _constants[id(x)] = x
    return x


def is_constant(x: torch.Tensor) -> bool:
    """Whether x was marked by `constant`."""
    return _constants.get(id(x)) is x


def launch_hooks() -> bool:
    """Whether a launch hook is set (a HookChain with calls, or a hook itself in other Triton versions)."""
    hook = knobs.runtime.launch_enter_hook
    return bool(getattr(hook, "calls", hook))


def current_stream() -> int:
    """The current CUDA stream of the current device, as a raw handle (what Triton's JIT launches on)."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


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
