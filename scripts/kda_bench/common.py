"""What the benchmark's modes share (scripts/test.py: the sweep in bench, --test host, decode, model and cp):
the case a row measures (Case, its dtypes and call configurations), the timings (medians_in_turns,
planned_call, host_ms, graph_ms), the rows as printed (show, echo) and as CSV files (write_rows,
write_table, read_csv, gpu_tag), and the progress bar over a mode's rows (progress).
"""
import contextlib
import csv
import dataclasses
import itertools
import os
import statistics
import sys
import time

import torch

from .inputs import draw_call

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}
# Call configurations (--config) → the layout of the arguments every system gets (inputs.LAYOUTS).
CONFIGS = {
    "default": "default",
    "l2norm": "l2norm",         # Kimi-Linear's layer
    "flashkda": "kimi",         # FlashKDA's only one
    "serving": "kimi",          # Kimi-Linear's call with a state pool: the serving step (kda_bench/serving)
}
NOT_RUN = "n/a"  # a cell with no measurement: a system that cannot make the call, a time the row does not take
# host_ms: calls per timed run of a system, and runs per system (the median kept).
CALLS, REPEATS = 200, 7


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    T: int               # tokens: with seqlens, their sum
    H: int
    K: int
    gate: str            # "safe", "softplus" or "preactivated" (see inputs.GATES)
    lower_bound: float
    dtype: torch.dtype
    seed: int
    seqlens: tuple | None = None   # sequences packed along T (cu_seqlens; B = 1)
    config: str = "default"        # a key of CONFIGS
    initial_state: bool = True     # the call a server makes passes one
    decay: str = "fast"            # a value of inputs.DECAYS

    @property
    def label(self):
        extra = (f" varlen({len(self.seqlens)} seqs)" if self.seqlens else "")
        extra += f" {self.config}" if self.config != "default" else ""
        extra += "" if self.initial_state else " no-initial-state"
        extra += f" decay={self.decay}" if self.decay != "fast" else ""
        extra += f" {DTYPE_NAMES[self.dtype]}" if self.dtype != torch.bfloat16 else ""
        return f"B={self.B} T={self.T} H={self.H} K=V={self.K} {self.gate}{extra}"

    @property
    def tag(self):
        """The case in file names: b1_t8192_h96_k128_safe[_varlen64][_config][_nostate][_layer]."""
        return (f"b{self.B}_t{self.T}_h{self.H}_k{self.K}_{self.gate}"
                + (f"_varlen{len(self.seqlens)}" if self.seqlens else "")
                + (f"_{self.config}" if self.config != "default" else "")
                + ("" if self.initial_state else "_nostate")
                + (f"_{self.decay}" if self.decay != "fast" else "")
                + (f"_{DTYPE_NAMES[self.dtype]}" if self.dtype != torch.bfloat16 else ""))

    @property
    def columns(self):
        """The case as its sweep row names it (the CSV's first columns, ROW_KEY among them)."""
        return dict(B=self.B, T=self.T, H=self.H, K=self.K, V=self.K, mode=self.gate, varlen=len(self.seqlens or ()),
                    config=self.config, initial_state=int(self.initial_state), decay=self.decay,
                    dtype=DTYPE_NAMES[self.dtype])

    def trimmed(self, T):
        """The case cut to its first T tokens (packed: the first sequences, the last one cut)."""
        if T >= self.T:
            return self
        seqlens = self.seqlens
        if seqlens:
            ends = [e for e in itertools.accumulate(seqlens) if e < T]
            seqlens = tuple(b - a for a, b in zip([0, *ends], [*ends, T]))
        return dataclasses.replace(self, T=T, seqlens=seqlens)

    def inputs(self, **kw):
        """kda_forward's keyword arguments for this case; kw overrides draw_call's (e.g. initial_state)."""
        kw = {"initial_state": self.initial_state, "decay": self.decay, "layout": CONFIGS[self.config], **kw}
        args = draw_call(self.B, self.T, self.H, self.K, gate=self.gate, dtype=self.dtype, seed=self.seed,
                         seqlens=self.seqlens, **kw)
        if "lower_bound" in args:
            args["lower_bound"] = self.lower_bound
        return args


def planned_call(args, tuning):
    """kda_forward's call on its keyword arguments `args` under a plan made once, now, with other
    launch knobs (kda_opt/plan.Tuning): a function of no arguments, timed without the planning."""
    from kda_opt import kda_forward
    from kda_opt.arguments import ForwardArguments
    from kda_opt.forward import RUN_TENSORS, run
    from kda_opt.plan import make_plan
    plan, tensors = make_plan(ForwardArguments(**args), tuning=tuning), {n: args.get(n) for n in RUN_TENSORS}
    return lambda: run(plan, **tensors)


def medians_in_turns(runs, warmup, rep):
    """{name: ms} for {name: call}: each called once first (JIT and FLA's autotuning stay out of the
    timings), then three rounds of do_bench medians with the systems in turns, the middle round kept."""
    from triton.testing import do_bench
    for f in runs.values():
        f()
    torch.cuda.synchronize()
    times = {name: [] for name in runs}
    for _ in range(3):
        for name, f in runs.items():
            times[name].append(do_bench(f, warmup=warmup, rep=rep, return_mode="median"))
    return {name: sorted(t)[1] for name, t in times.items()}


def host_ms(runs):
    """{system: ms}: per call, the wall time of CALLS calls of a system without a synchronisation; the
    systems take turns, REPEATS rounds, and each keeps its median round (the host's speed drifts)."""
    for f in runs.values():
        for _ in range(10):
            f()
    rounds = {system: [] for system in runs}
    for _ in range(REPEATS):
        for system, f in runs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(CALLS):
                f()
            rounds[system].append((time.perf_counter() - t0) / CALLS * 1e3)
    torch.cuda.synchronize()
    return {system: statistics.median(r) for system, r in rounds.items()}


def graph_ms(f, calls=1, cold=False):
    """Median ms per call of f, `calls` calls replayed from one CUDA graph (captured after a warm-up
    on a side stream; several calls, so that a short kernel's time is not the replay's launch).
    cold: each call after a write of twice the L2 cache (so no call finds its data there, as
    do_bench's calls do not), that write's own time in a graph subtracted."""
    from triton.testing import do_bench

    def replayed(step):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                step()
        return do_bench(graph.replay, return_mode="median") / calls
    if not cold:
        return replayed(f)
    flush = torch.empty(2 * torch.cuda.get_device_properties().L2_cache_size, dtype=torch.uint8, device="cuda")
    return replayed(lambda: (flush.zero_(), f())) - replayed(flush.zero_)


def show(row):
    """One measured row on a line, as the --test modes print them while they run."""
    echo("  " + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


def echo(text):
    """print(text), flushed: through tqdm.write where tqdm is installed, which takes a progress bar off
    the terminal's last line while the text is written, so that the two do not share a line."""
    tqdm = _tqdm()
    (print if tqdm is None else tqdm.write)(text)
    sys.stdout.flush()


def progress(items, label=str, quiet=False):
    """items (a list) under a progress bar on stderr as they are iterated: how many are done, label(item)
    of the one being measured, the time taken and an estimate of the time left. quiet, or without tqdm
    (the `bench` extra): items themselves."""
    tqdm = _tqdm()
    if quiet or tqdm is None:
        return items
    return _under_bar(tqdm(items), label)


def _under_bar(bar, label):
    with bar:
        for item in bar:
            bar.set_postfix_str(label(item))
            yield item


def _tqdm():
    """tqdm's bar, or None where it is not installed (the benchmark's rows run without it)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def write_rows(rows, out_dir, name, fields, defaults=None):
    """rows as <out_dir>/<name>_<gpu>.csv (write_table, a row's missing cells from `defaults`); returns
    the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}_{gpu_tag()}.csv")
    write_table(rows, path, fields, defaults)
    echo(f"wrote {path}")
    return path


def write_table(rows, path, fields, defaults=None):
    """rows as the CSV `path` with columns `fields` (a row's other keys left out, its missing ones from
    `defaults`), floats to 4 decimals, or to 3 significant digits below 1e-3 (an error of 2.4e-5 is not
    0.0000)."""
    cell = lambda v: (v if not isinstance(v, float) else f"{v:.2e}" if 0 < abs(v) < 1e-3 else f"{v:.4f}")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: cell(v) for k, v in {**(defaults or {}), **r}.items()})


def read_csv(path):
    """Rows of an existing CSV (numbers parsed), or [] if there is none."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _number(v: str):
    """A CSV cell as written: an int, a float (2.5, -1e-05), or the text itself (True, n/a, nan)."""
    for kind in (int, float):
        try:
            x = kind(v)
        except ValueError:
            continue
        return x if x == x and abs(x) != float("inf") else v
    return v


def gpu_tag():
    return torch.cuda.get_device_name().replace("NVIDIA ", "").split()[0].lower()


@contextlib.contextmanager
def system(name: str):
    """FLA's dispatch sends its KDA calls to kda_opt ("kda_opt", once kda_opt.use_in_fla() has
    registered it) or keeps them ("fla"): FLA_KDA_OPT, which it reads on every call."""
    before = os.environ.get("FLA_KDA_OPT")
    os.environ["FLA_KDA_OPT"] = "1" if name == "kda_opt" else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FLA_KDA_OPT")
        else:
            os.environ["FLA_KDA_OPT"] = before
