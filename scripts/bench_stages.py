"""Each stage of kda_forward alone, timed with do_bench at one shape, beside its bytes floor.

    python scripts/bench_stages.py [scripts/test.py shape options] [--intra-warps 2,4]
                                   [--block-v 32,64,128] [--worker-warps 4,8] [--parallel-tokens N] [--once]
The stages are recorded from one real kda_forward on random inputs (Case.inputs, as the benchmark's),
so each runs with exactly the arguments kda_forward gives it, in any configuration (--varlen,
--config ...). A stage's floor is the bytes of its inputs and outputs over the copy bandwidth measured
here; `first s` is its first call's seconds, compiles included. Stage 2 (with the inverse, stage 3)
runs once per warp count, stage 4 once per (block_v, worker warps) pair; the defaults
are the plan's own choices (kda_opt/plan). Where kda_forward cuts the sequence into time segments, a stage's row
runs all its segments' launches one after another (without the overlap kda_forward gets); in parallel
segments stage 4's row runs its three passes, and the whole call's row adds the merge between them.
--parallel-tokens N plans parallel segments of at least N tokens wherever the call has one sequence
(Tuning(parallel=True, parallel_tokens=N)), and the last row times the whole call under that plan.
"""
import argparse
import itertools
import time

import torch
from triton.testing import do_bench

from kda_bench.bench import case_from_args, measure_ceilings, parse_args as bench_args
from kda_opt import kda_forward
from kda_opt.arguments import ForwardArguments
from kda_opt.forward import RUN_TENSORS, run as run_plan
from kda_opt.plan import Tuning, make_plan
from kda_opt.wuso import WORKER_WARPS


def nbytes(*xs):
    return sum(x.numel() * x.element_size() for x in xs if isinstance(x, torch.Tensor))


def ints(text):
    return [int(x) for x in text.split(",")] if text else [None]


def record_stages(forward):
    """Calls forward(launch) with a `launch` (as kda_opt.forward.run takes) that records every stage
    launch: {stage: [(launcher, args, kwargs, result), ...]}, one per time segment where the plan
    cuts the sequence."""
    calls = {}

    def record(name, launcher, *args, **kwargs):
        result = launcher(*args, **kwargs)
        calls.setdefault(name, []).append((launcher, args, kwargs, result))
        return result
    forward(record)
    return calls


def replay(records, **extra):
    """A call that runs a stage's recorded launches again, in order, with `extra` keyword arguments
    on top."""
    def run():
        for launcher, args, kwargs, _ in records:
            launcher(*args, **{**kwargs, **extra})
    return run


def stage_bytes(records, inputs, outputs):
    """Bytes of a stage's launches: the first `inputs` arguments and `outputs(result)` of each."""
    return sum(nbytes(*args[:inputs], *outputs(result)) for _, args, _, result in records)


def stage_rows(stages, intra_warps, block_v, worker_warps):
    """[(label, call, bytes)]: each recorded stage (record_stages) once, stage 2 once per warp count,
    stage 4 once per (block_v, worker warps); None or 0 in a list is the plan's own choice."""
    rows = []
    if "seqs" in stages:
        rows.append(("seqs (chunk table)", replay(stages["seqs"]), 0))
    rows.append(("gate", replay(stages["gate"]), stage_bytes(stages["gate"], 1, lambda r: [r])))
    for w in intra_warps:
        rows.append((f"intra warps={w or 'default'}", replay(stages["intra"], **({"num_warps": w} if w else {})),
                     stage_bytes(stages["intra"], 4, list)))
    for bv, warps in itertools.product(block_v, worker_warps):
        extra = {**({"block_v": bv} if bv else {}), **({"worker_warps": warps} if warps else {})}
        rows.append((f"wuso bv={bv or 'auto'} warps={warps or WORKER_WARPS}", replay(stages["wuso"], **extra),
                     stage_bytes(stages["wuso"], 6, lambda o: [o])))
    return rows


def tuning_for(parallel_tokens: int | None) -> Tuning:
    """The plan's knobs: kda_forward's own, or parallel segments of at least `parallel_tokens` tokens."""
    return Tuning() if parallel_tokens is None else Tuning(parallel=True, parallel_tokens=parallel_tokens)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intra-warps", type=ints, default=[None], help="stage 2 warp counts, e.g. 2,4")
    p.add_argument("--block-v", type=ints, default=[None], help="stage 4 V blocks to time, e.g. 32,64,128")
    p.add_argument("--worker-warps", type=ints, default=[None], help="stage 4 worker warps to time, e.g. 4,8")
    p.add_argument("--parallel-tokens", type=int, default=None,
                   help="plan parallel segments of at least this many tokens (one sequence), e.g. 768")
    p.add_argument("--once", action="store_true", help="run each stage once, untimed (for ncu)")
    own, rest = p.parse_known_args()
    c = case_from_args(bench_args(rest))
    a = c.inputs()
    bw, _ = measure_ceilings()
    plan = make_plan(ForwardArguments(**a), tuning=tuning_for(own.parallel_tokens))
    tensors = {n: a.get(n) for n in RUN_TENSORS}
    stages = record_stages(lambda launch: run_plan(plan, **tensors, launch=launch))

    rows = stage_rows(stages, own.intra_warps, own.block_v, own.worker_warps)
    if own.parallel_tokens is None:
        rows.append(("kda_forward", lambda: kda_forward(**a), 0))
    else:
        rows.append((f"{len(plan.segments)} {'parallel' if plan.parallel else 'time'} segments",
                     lambda: run_plan(plan, **tensors), 0))

    print(f"# {torch.cuda.get_device_name()}, {c.label}; copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'stage':<28} {'ms':>8} {'floor ms':>9} {'GB':>6} {'first s':>8}")
    for name, f, n in rows:
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        if own.once:
            continue
        ms = sorted(do_bench(f, warmup=25, rep=100, return_mode="median") for _ in range(3))[1]
        floor = f"{n / bw * 1e3:9.3f}" if n else f"{'':>9}"
        print(f"{name:<28} {ms:8.3f} {floor} {n / 1e9:6.2f} {first:8.1f}", flush=True)


if __name__ == "__main__":
    main()
