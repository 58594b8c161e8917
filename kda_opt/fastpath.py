"""The private interfaces of torch, Triton and cuTile that kda_opt's host fast path takes, in one place,
each taken only on the versions the GPU suite ran on (TESTED, their major.minor); on any other the
public call stands in, at the host time of the public call (docs/USAGE.md, "What a call resolves to"):

    private (tested versions)                          public stand-in (any other)
    torch._C's raw current stream                      torch.cuda.current_stream().cuda_stream
    Triton's compiled kernel's launcher (run's         fn[grid](...) through the JIT on every launch
    argument list), kernels kept per plan
    cuTile's calling convention, a specialisation      ct.launch; calls are not replayed (kda_opt/replay
    exported and launched through the CUDA driver      replays through this and Triton's launcher)
    (CutileReplay)

FAST says which (read on each launch, so a test may set it). A newer release that changes one of these
would otherwise pass the CPU tests (Triton's interpreter never takes this path) and break every GPU
call.
"""
import ctypes
import io
import struct
import threading
from collections import OrderedDict
from importlib import metadata

import cuda.tile as ct
from cuda.tile.compilation import CallingConvention, ConstantConstraint, KernelSignature, ScalarConstraint, export_kernel
import torch

# The major.minor versions the fast path was tested on (the GPU image's), by distribution name;
# pyproject.toml states the same range.
TESTED = {"torch": "2.11", "triton": "3.6", "cuda-tile": "1.7"}


def installed() -> dict[str, str]:
    """The installed versions of TESTED's distributions (None where one is not installed)."""
    versions = {}
    for name in TESTED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def tested(versions: dict[str, str | None]) -> bool:
    """Whether every one of `versions` (distribution → version) has a major.minor that TESTED names."""
    return all(v is not None and ".".join(v.split("+")[0].split(".")[:2]) == TESTED[name] for name, v in versions.items())


FAST = tested(installed())


def current_stream() -> int:
    """The current CUDA stream of the current device, as a raw handle (what Triton's JIT launches on)."""
    if FAST:
        return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    return torch.cuda.current_stream().cuda_stream


def run_compiled(kernel, grid: tuple, stream: int, arguments) -> None:
    """A Triton kernel compiled by its JIT (a CompiledKernel) launched on `stream` over the 3-d `grid`,
    its parameters `arguments` in order, tensors as their addresses (FAST only)."""
    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *arguments)


# Inputs' alignment that a plan's signature fixes (kda_opt/plan's key), in bytes: at most what a
# replayed specialisation may assume.
ALIGNMENT_FIXED = 16


class ReplayError(Exception):
    """Why a cuTile launch cannot be replayed through the driver."""


class CutileReplay:
    """A recorded cuTile launch made again on other addresses through the CUDA driver (cuLaunchKernel),
    for kda_opt/replay's replays. ct.launch reads every array argument's metadata and finds the
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
