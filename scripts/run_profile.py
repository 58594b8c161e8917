"""Profiling driver: N forwards of kda_forward, of FLA chunk_kda and of FlashKDA (where it runs the
case: `--config flashkda`) at one shape, for Nsight Systems.

JIT compilation and FLA's autotuning run before the capture; the measured region is bracketed by
cudaProfilerStart/Stop, so `nsys profile --capture-range=cudaProfilerApi` records only it. Each
system's forwards sit inside an NVTX range `kda_opt/profile/<system>`. Used by scripts/profile.sh.
"""
import argparse
import sys

import nvtx
import torch

from kda_bench import peers
from kda_bench.bench import DTYPES, case_from_args, parse_args as bench_args
from kda_opt import kda_forward


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20, help="forwards per system inside the capture")
    p.add_argument("--no-fla", action="store_true", help="profile kda_forward alone (no FLA, no FlashKDA)")
    p.add_argument("--nvtx-cost", action="store_true",
                   help="no profile: time kda_forward with and without its NVTX ranges")
    p.add_argument("--torch-trace", metavar="CSV",
                   help="no nsys: record the kernels with torch.profiler and write them to CSV")
    args, shape_args = p.parse_known_args()
    case = case_from_args(bench_args(shape_args))  # --batch-size, --seq-len, ... as in scripts/test.py
    inputs = case.inputs()
    if args.nvtx_cost:
        return nvtx_cost(inputs)
    systems = {"kda_opt": lambda: kda_forward(**inputs)}
    if not args.no_fla:
        chunk_kda = peers.fla_chunk_kda()   # FLA on its Triton path (FLA_FLASH_KDA=0 unless set)
        if chunk_kda is None:
            sys.exit("run_profile.py: FLA is not installed (pip install 'kda-opt[bench]'), or pass --no-fla")
        systems["fla"] = lambda: chunk_kda(**inputs)
        flashkda, why_not = peers.flashkda(inputs)
        if flashkda is None:
            print(f"FlashKDA not profiled: {why_not}")
        else:
            systems["flashkda"] = flashkda
    for f in systems.values():  # JIT, autotuning, allocator warm-up: outside the capture
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    if args.torch_trace:
        write_torch_trace(systems, args.iters, args.torch_trace)
    else:
        torch.cuda.cudart().cudaProfilerStart()
        for name, f in systems.items():
            # The range closes after the device finishes, so it contains all of its kernels.
            with nvtx.annotate(f"kda_opt/profile/{name}", domain="kda_opt"):
                for _ in range(args.iters):
                    f()
                torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {args.iters} forwards each of {', '.join(systems)} at {case.label}, "
          f"{[n for n, d in DTYPES.items() if d == case.dtype][0]}")


def nvtx_cost(inputs):
    """Median forward time with the stages' NVTX ranges (kda_opt/launch.annotated, as KDA_OPT_NVTX=1
    runs them), then without (the range around the whole forward follows KDA_OPT_NVTX in both)."""
    from triton.testing import do_bench
    from kda_opt import kda_forward
    from kda_opt.arguments import ForwardArguments
    from kda_opt.forward import RUN_TENSORS, run
    from kda_opt.launch import annotated, direct
    from kda_opt.plan import make_plan
    plan, tensors = make_plan(ForwardArguments(**inputs)), {n: inputs.get(n) for n in RUN_TENSORS}
    times = {label: sorted(do_bench(lambda: run(plan, **tensors, launch=launch), return_mode="median")
                           for _ in range(5))[2]
             for label, launch in (("with NVTX ranges", annotated), ("without", direct))}
    print("  ".join(f"{k}: {v:.4f} ms" for k, v in times.items()))


def write_torch_trace(systems, iters, path):
    """Kernels of each system as CSV rows (Start (ns), Duration (ns), Name, System), the columns
    profile_summary.py reads from nsys's cuda_gpu_trace, plus the system each kernel belongs to."""
    import csv
    from torch.profiler import ProfilerActivity, profile
    with open(path, "w", newline="") as out:
        w = csv.writer(out)
        w.writerow(["Start (ns)", "Duration (ns)", "Name", "System"])
        for name, f in systems.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    f()
                torch.cuda.synchronize()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    w.writerow([int(e.time_range.start * 1000), int(e.time_range.elapsed_us() * 1000), e.name, name])


if __name__ == "__main__":
    main()
