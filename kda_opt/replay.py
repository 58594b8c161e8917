"""Record and replay: a call's launches recorded once per signature, then replayed without the
stages' Python.

Under one plan (kda_opt/plan's call signature: every tensor's shape, strides, dtype, device and
alignment, every option) a call makes the same launches every time but for addresses: the same
kernels, grids and integer arguments, buffers of the same sizes. So a signature's second call runs
as ever under a Recording, which keeps each launch with its arguments, each buffer the call
allocates, and which tensors are the call's inputs. Its later calls replay that (Replay): one
allocation per buffer the call returns and one for all the others, then the recorded launches with
the new addresses, without the stages' Python: Triton's through their compiled launchers, cuTile's
through the CUDA driver with their parameters packed once (kda_opt/fastpath.CutileReplay). (The first
call is left unrecorded: it compiles.) A replay computes what the recorded Python would, bit for bit
(tests/test_replay.py checks it on every schedule); KDA_OPT_REPLAY=0 in the environment turns it
off (read when kda_opt is imported): every call then runs the stages' Python.

A call is recorded only where replaying it is sound, and otherwise runs as ever (Entry.not_replayed
says why): every tensor a launch takes is one of the call's inputs, a buffer the call allocated or a
constant of the package (kda_opt/launch.constant); the call runs no torch operation but allocations,
views and copies from one of those tensors into another (replayed in their place among the launches;
a fill, a cast or a concatenation made outside the launches would not be); and its launches depend
on nothing outside the signature (kda_opt/plan's Plan.not_replayable: no launch sized from a host
copy's lengths, no time segments on two streams), and the versions installed are those the replay's
private launch interfaces were tested on (kda_opt/fastpath.FAST). A call that runs work on a side
stream (kda_opt/schedules' longest ahead) is replayed on the same side stream, each launch on the
stream it ran on and each wait between the streams (kda_opt/launch.wait) where it was made. Nothing
invalidates a replay but its signature: a new signature (any shape, stride, dtype, alignment or
option) is planned and recorded anew.
"""
import contextlib
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import fastpath, launch

aten = torch.ops.aten
ALLOCATIONS = (aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided)
ALIGN = launch.BUFFER_ALIGN     # the buffers' offsets in the one workspace allocation


class NotReplayable(Exception):
    """Why a recorded call cannot be replayed."""


class Recording(TorchDispatchMode):
    """One run of a call: its launches (kda_opt/launch reports them while it is the thread's
    recorder) and its copies between tensors among them, the buffers it allocated, and the first
    torch operation it ran that is neither an allocation, a view nor such a copy (`reason`)."""

    def __init__(self, inputs: tuple):
        super().__init__()
        self.inputs = inputs
        self.buffers: list[torch.Tensor] = []
        # ("triton" | "cutile" | "copy" | "wait", kernel, grid, arguments, stream): each launch and copy
        # with the stream it ran on, each wait as (waiting stream, stream waited on) in its arguments;
        # a stream as its index in `streams` (raw handles, the call's own stream first), those it
        # waited on or for in `waited_on` (by index, as torch streams).
        self.launches: list[tuple] = []
        self.streams: list[int] = [launch.current_stream()]
        self.waited_on: dict[int, torch.cuda.Stream] = {}
        self.reason: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in ALLOCATIONS and out.device == self.inputs[0].device:
            self.buffers.append(out)
        elif func is aten.copy_.default and len(args) == 2 and not kwargs:
            self.launches.append(("copy", None, None, tuple(args), self._index(launch.current_stream())))
        elif not (func.is_view and args and _same_storage(out, args[0])) and self.reason is None:
            self.reason = f"it runs {func} outside its launches"     # (contiguous counts as a view: it may copy)
        return out

    def launched(self, kind: str, kernel, grid, arguments, stream: int) -> None:
        """A launch of the call on `stream` (a raw handle): Triton's compiled kernel (anything else, the
        interpreter's None included, cannot be replayed) or a cuTile kernel, with its grid and arguments."""
        if kind == "triton" and not hasattr(kernel, "packed_metadata"):
            self.reason = self.reason or "a Triton launch gave no compiled kernel"
        self.launches.append((kind, kernel, tuple(grid) + (1,) * (3 - len(grid)), tuple(arguments),
                              self._index(stream)))

    def waited(self, stream: torch.cuda.Stream, on: torch.cuda.Stream) -> None:
        """`stream` waited for `on` (kda_opt/launch.wait): replayed as such, between the same launches."""
        pair = []
        for x in (stream, on):
            pair.append(self._index(x.cuda_stream, known=False))
            self.waited_on[pair[-1]] = x
        self.launches.append(("wait", None, None, tuple(pair), None))

    def _index(self, stream: int, known: bool = True) -> int:
        """The index of the raw stream handle `stream` in self.streams (appended where new: a stream
        the call runs work on must be its own or one it waited on or for, unless not `known`)."""
        if stream in self.streams:
            return self.streams.index(stream)
        if known:
            self.reason = self.reason or "a launch runs on a stream the call neither runs on nor waits on"
        self.streams.append(stream)
        return len(self.streams) - 1

    def replay(self, outputs: tuple) -> "Replay":
        """The Replay of this run, whose results were `outputs` (tensors or None); raises
        NotReplayable."""
        if self.reason:
            raise NotReplayable(self.reason)
        return Replay(self, outputs)


def _same_storage(out, x) -> bool:
    """Whether x is a tensor and every tensor `out` holds a view of its storage."""
    if not isinstance(x, torch.Tensor):
        return False
    outs = out if isinstance(out, (tuple, list)) else (out,)
    base = x.untyped_storage().data_ptr()
    return all(isinstance(y, torch.Tensor) and y.untyped_storage().data_ptr() == base for y in outs)


def record(call, inputs: tuple):
    """call() run under a Recording of `inputs` (the call's tensors, None where absent): (its
    result, the Recording)."""
    recording = Recording(inputs)
    launch.set_recorder(recording)
    try:
        with recording:
            result = call()
    finally:
        launch.set_recorder(None)
    return result, recording


class Replay:
    """A recorded call, replayed on new inputs of its signature: replay(inputs) → the call's result."""

    def __init__(self, recording: Recording, outputs: tuple):
        inputs, buffers = recording.inputs, recording.buffers
        returned = {_buffer_of(y, buffers) for y in outputs if y is not None and _input_of(y, inputs) is None}
        returned.discard(None)
        # Each returned buffer allocated as it was (so a result holds no other buffer's memory); the
        # others as views of one workspace at ALIGN boundaries.
        self.returned = [(tuple(buffers[j].shape), buffers[j].stride(), buffers[j].dtype) for j in sorted(returned)]
        place, workspace = {}, 0
        for j in sorted(returned):
            place[j] = (len(place), 0)
        for j, b in enumerate(buffers):
            if j not in returned:
                place[j] = (len(self.returned), workspace)
                workspace += -(-b.untyped_storage().nbytes() // ALIGN) * ALIGN
        self.workspace = workspace
        # What a replay computes once per call, launches then index: the addresses the launches take,
        # (None, input i) or (allocation, byte offset); the tensors the copies take and the call
        # returns, (None, input i) or (allocation, dtype, shape, stride, element offset, whole).
        self.addresses: list[tuple] = []
        self.tensors: list[tuple] = []
        self.constants: list[torch.Tensor] = []     # the constants the launches take, held while this lives
        index: dict[tuple, int] = {}

        def source(x, as_tensor: bool):
            """The index of tensor x in a replay's addresses (as_tensor False) or tensors, or
            ("constant", x)."""
            found = self.tensors if as_tensor else self.addresses
            i = _input_of(x, inputs)
            if i is not None:
                how = (None, i)
            else:
                j = _buffer_of(x, buffers)
                if j is None:
                    if launch.is_constant(x):
                        self.constants.append(x)
                        return ("constant", x)
                    raise NotReplayable(f"a launch takes a {list(x.shape)} {x.dtype} tensor that is neither an "
                                     "input, a buffer of the call nor a constant")
                allocation, offset = place[j]
                offset += x.data_ptr() - buffers[j].data_ptr()
                if not as_tensor:
                    how = (allocation, offset)
                elif offset % x.element_size():
                    raise NotReplayable("a buffer's view starts inside an element")
                else:
                    whole = (j in returned and offset == 0 and x.dtype == buffers[j].dtype
                             and x.shape == buffers[j].shape and x.stride() == buffers[j].stride())
                    how = (allocation, x.dtype, tuple(x.shape), x.stride(), offset // x.element_size(), whole)
            key = (as_tensor, *how)
            if key not in index:
                index[key] = len(found)
                found.append(how)
            return index[key]

        # Each launch: (kind, what launches it, grid, arguments, fills): a Triton launch's arguments
        # with None where fills [(n, address index)] put the replay's addresses; a cuTile launch
        # replayed through the driver (fastpath.CutileReplay), its fills the address indices of the
        # tensors it replaces in order; a copy's fills its two tensors' indices (a constant source as itself).
        self.launches = []
        # The streams a replay runs on: the caller's current one (then) in place of the recorded call's,
        # the others (the package's side streams) as they were.
        self.side_streams = [recording.waited_on[i] for i in range(1, len(recording.streams))]
        for kind, kernel, grid, arguments, stream in recording.launches:
            fills = []
            if kind == "wait":
                self.launches.append((kind, None, None, arguments, None, None))
                continue
            if kind == "triton":
                template = list(arguments)
                for n, x in enumerate(arguments):
                    if isinstance(x, torch.Tensor):
                        how = source(x, False)
                        if isinstance(how, tuple):      # a constant, in place
                            template[n] = x.data_ptr()
                        else:                           # filled in on each replay: the recorded call's
                            template[n] = None          # tensor is not kept (nor its memory)
                            fills.append((n, how))
                self.launches.append((kind, kernel, grid, template, fills, stream))
            elif kind == "cutile":
                replaced = []
                for n, x in enumerate(arguments):
                    if isinstance(x, torch.Tensor) and not isinstance(how := source(x, False), tuple):
                        replaced.append(n)
                        fills.append(how)
                try:
                    replay = fastpath.CutileReplay(kernel, grid, arguments, tuple(replaced))
                except fastpath.ReplayError as e:
                    raise NotReplayable(f"its cuTile launch cannot be replayed: {e}") from None
                self.launches.append((kind, replay, None, None, fills, stream))
            else:
                self.launches.append((kind, None, None, None, [source(x, True) for x in arguments], stream))
        self.outputs = tuple(None if y is None else source(y, True) for y in outputs)

    def __call__(self, inputs: tuple):
        device = inputs[0].device
        allocations = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                       for shape, stride, dtype in self.returned]
        if self.workspace:
            allocations.append(torch.empty(self.workspace, dtype=torch.uint8, device=device))
        addresses = [inputs[i].data_ptr() if a is None else allocations[a].data_ptr() + i for a, i in self.addresses]
        typed = {}
        tensors = []
        for how in self.tensors:
            if how[0] is None:
                tensors.append(inputs[how[1]])
                continue
            a, dtype, shape, stride, offset, whole = how
            if whole:
                tensors.append(allocations[a])
                continue
            if (a, dtype) not in typed:
                typed[a, dtype] = allocations[a].view(torch.uint8).view(dtype)
            tensors.append(typed[a, dtype].as_strided(shape, stride, offset))
        streams = [torch.cuda.current_stream(device), *self.side_streams] if self.side_streams else None
        handles = [launch.current_stream(), *(x.cuda_stream for x in self.side_streams)]
        for kind, kernel, grid, template, fills, stream in self.launches:
            if kind == "triton":
                arguments = template.copy()
                for n, p in fills:
                    arguments[n] = addresses[p]
                fastpath.run_compiled(kernel, grid, handles[stream], arguments)
            elif kind == "cutile":
                kernel(handles[stream], [addresses[p] for p in fills])
            elif kind == "wait":
                streams[template[0]].wait_stream(streams[template[1]])
            else:
                source = fills[1]
                with torch.cuda.stream(streams[stream]) if stream else contextlib.nullcontext():
                    tensors[fills[0]].copy_(source[1] if isinstance(source, tuple) else tensors[source])
        return tuple(None if t is None else tensors[t] for t in self.outputs)


def _input_of(x: torch.Tensor, inputs: tuple) -> int | None:
    """The index of the input x is (itself, or a view with its address, shape, strides and dtype),
    or None; NotReplayable where that names more than one input (one tensor passed twice)."""
    same = [i for i, y in enumerate(inputs) if y is x]
    if not same:
        same = [i for i, y in enumerate(inputs) if y is not None and y.data_ptr() == x.data_ptr()
                and y.dtype == x.dtype and y.shape == x.shape and y.stride() == x.stride()]
    if len(same) > 1:
        raise NotReplayable("one tensor is given as two inputs")
    return same[0] if same else None


def _buffer_of(x: torch.Tensor, buffers: list) -> int | None:
    """The index of the buffer x is a view of (by address), or None."""
    address = x.data_ptr()
    for j, b in enumerate(buffers):
        if b.data_ptr() <= address < b.data_ptr() + max(b.untyped_storage().nbytes(), 1):
            return j
    return None


# Whether calls are recorded and replayed: not where KDA_OPT_REPLAY=0 is in the environment when
# kda_opt is imported (a test may set it).
REPLAY_VARIABLE = "KDA_OPT_REPLAY"
ENABLED = os.environ.get(REPLAY_VARIABLE, "1") != "0"


def call(entry, inputs: tuple, run, not_replayable: str | None = None):
    """run(), the call of entry's plan (kda_opt/plan_cache.Entry) on `inputs` (its tensors in a fixed
    order, None where absent): replayed where the entry holds a replay; else run, and on the
    signature's second run recorded into the entry where it may be replayed (`not_replayable`: the
    plan's reason why not, or None). Every call runs as it is (no replay, no recording) where
    KDA_OPT_REPLAY=0 turns replays off, or while NVTX ranges or a launch hook ask for each stage's
    launch (kda_opt/launch); a recording waits for a CUDA call outside graph capture."""
    if not ENABLED or launch.nvtx_enabled() or launch.launch_hooks():
        return run()
    if entry.replay is not None:
        return entry.replay(inputs)
    if entry.not_replayed is None:
        if not fastpath.FAST:
            entry.not_replayed = "a replay takes private launch interfaces not tested on these versions (kda_opt/fastpath)"
        elif not_replayable is not None:
            entry.not_replayed = not_replayable
        elif inputs[0].is_cuda and not torch.cuda.is_current_stream_capturing():
            entry.runs += 1
            if entry.runs > 1:
                result, recording = record(run, inputs)
                try:
                    entry.replay = recording.replay(result)
                except NotReplayable as e:
                    entry.not_replayed = str(e)
                return result
    return run()
