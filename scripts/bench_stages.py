"""Each stage of kda_forward alone, timed with do_bench at one shape, beside its bytes floor.

    python scripts/bench_stages.py [scripts/test.py shape options] [--intra-warps 2,4]
                                   [--block-v 32,64,128] [--worker-warps 4,8] [--once]
Stage inputs come from one real forward on random inputs (Case.inputs, as the benchmark's). A stage's
floor is the bytes of its inputs and outputs over the copy bandwidth measured here. Stage 2 (with the
inverse, stage 3) runs once per warp count asked for, stage 4 once per (block_v, worker warps) pair;
the defaults are the launchers' own choices.
"""
import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from kda_opt import kda_forward, wuso as stage4  # noqa: E402
from kda_opt.bench import case_from_args, measure_ceilings, parse_args as bench_args  # noqa: E402
from kda_opt.gate import gate_cumsum  # noqa: E402
from kda_opt.intra import intra_chunk  # noqa: E402
from kda_opt.options import GateConfig  # noqa: E402
from kda_opt.seqs import fixed, packed  # noqa: E402


def nbytes(*xs):
    return sum(x.numel() * x.element_size() for x in xs if isinstance(x, torch.Tensor))


def ints(text):
    return [int(x) for x in text.split(",")] if text else [None]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intra-warps", type=ints, default=[None], help="stage 2 warp counts, e.g. 2,4")
    p.add_argument("--block-v", type=ints, default=[None], help="stage 4 V blocks to time, e.g. 32,64,128")
    p.add_argument("--worker-warps", type=ints, default=[None], help="stage 4 worker warps to time, e.g. 4,8")
    p.add_argument("--once", action="store_true", help="run each stage once, untimed (for ncu)")
    own, rest = p.parse_known_args()
    c = case_from_args(bench_args(rest))
    a = c.inputs()
    q, k, v, g, beta = a["q"], a["k"], a["v"], a["g"], a["beta"]
    gate = GateConfig(a.get("use_gate_in_kernel", False), a.get("lower_bound"), a.get("safe_gate", False))
    scale = c.K ** -0.5
    bw, _ = measure_ceilings()
    cu_seqlens, l2norm = a.get("cu_seqlens"), c.l2norm
    seqs = fixed(c.B, c.T, 64) if cu_seqlens is None else packed(cu_seqlens, c.T, 64)

    gcum = gate_cumsum(g, gate, a.get("A_log"), a.get("dt_bias"), seqs=seqs)
    intra = dict(gate_bounded=gate.bounded, seqs=seqs, l2norm=l2norm)
    Aqk, Tm = intra_chunk(q, k, gcum, beta, scale, **intra)
    o = torch.empty_like(v)
    rows = [("gate", lambda: gate_cumsum(g, gate, a.get("A_log"), a.get("dt_bias"), seqs=seqs), nbytes(g, gcum))]
    if cu_seqlens is not None:
        rows.insert(0, ("seqs (chunk table)", lambda: packed(cu_seqlens, c.T, 64), 0))
    rows += [(f"intra warps={w or 'default'}",
              lambda w=w: intra_chunk(q, k, gcum, beta, scale, **intra, **({"num_warps": w} if w else {})),
              nbytes(q, k, gcum, beta, Aqk, Tm)) for w in own.intra_warps]
    base_kernel = stage4.wuso_kernel
    for bv in own.block_v:
        for warps in own.worker_warps:
            kernel = base_kernel if warps is None else base_kernel.replace_hints(num_worker_warps=warps)
            label = f"wuso bv={bv or 'auto'} warps={warps or stage4.WORKER_WARPS}"

            def run(kernel=kernel, bv=bv):
                stage4.wuso_kernel = kernel
                try:
                    return stage4.wuso(q, k, v, gcum, Tm, Aqk, scale, None, True, block_v=bv,
                                       cu_seqlens=cu_seqlens, l2norm=l2norm)
                finally:
                    stage4.wuso_kernel = base_kernel
            rows.append((label, run, nbytes(q, k, v, gcum, Tm, Aqk, o)))
    rows.append(("kda_forward", lambda: kda_forward(**a), 0))

    print(f"# {torch.cuda.get_device_name()}, {c.label}; copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'stage':<28} {'ms':>8} {'floor ms':>9} {'GB':>6}")
    for name, f, n in rows:
        f()
        torch.cuda.synchronize()
        if own.once:
            continue
        ms = sorted(do_bench(f, warmup=25, rep=100, return_mode="median") for _ in range(3))[1]
        floor = f"{n / bw * 1e3:9.3f}" if n else f"{'':>9}"
        print(f"{name:<28} {ms:8.3f} {floor} {n / 1e9:6.2f}", flush=True)


if __name__ == "__main__":
    main()
