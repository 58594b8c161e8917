"""Correctness checks and benchmark of kda_forward against FLA chunk_kda (and FlashKDA, where it runs)
and the float64 recurrence.

Entry point: `python scripts/test.py ...`.
    --test naive      kda_forward vs the float64 recurrence (relative errors of o and final state),
                      FLA's and FlashKDA's errors beside
    --test fla        kda_forward vs FLA chunk_kda on the full shape
    --test benchmark  FLA, FlashKDA and kda_forward on the same inputs, alternating, medians of do_bench
    --test all        the three above (default); --sweep runs the sweep instead
    --test host       host time per call of kda_forward, FLA and FlashKDA, eager against a CUDA graph
                      (kda_bench/host) → <out-dir>/host_<gpu>.csv
    --test decode     decode, speculative verify and mixed steps: kda_decode / kda_forward, FLA's decode
                      kernel, FlashKDA's folded call, the copy floor (kda_bench/decode)
                      → <out-dir>/decode_<gpu>.csv
    --test model      FLA's own KDA model (fla.models.KDAForCausalLM) step by step, as FLA ships it and
                      with kda_opt registered (kda_bench/model) → <out-dir>/model_<gpu>.csv/.png
    --test cp         long sequences with few heads: kda_forward, its sequential path, FLA and FlashKDA; under
                      torchrun, one sequence split over the GPUs (kda_bench/cp) → <out-dir>/cp_<gpu>.csv
    --test sglang     SGLang's KDA calls (extend, decode, packed decode, chain and tree verify, the whole decode
                      step with its convolution; --sglang-calls picks some) through kda_opt's SGLang kernel
                      and hook and SGLang's own Triton, FlashKDA and Helion kernels (kda_bench/sglang)
                      → <out-dir>/sglang_<gpu>.csv
    --test vllm       vLLM's KDA calls (prefill, packed decode, speculative decode) through kda_opt's vLLM
                      functions, vLLM's own and FlashKDA (kda_bench/vllm) → <out-dir>/vllm_<gpu>.csv
What the modes share (the case, the timings, the rows printed and written): kda_bench/common. --sweep and
--test host, decode, model and cp draw a progress bar on stderr (tqdm; --quiet: none).
Exit code: 0 when every check passes, 1 when a correctness check fails (--test model: tokens that
differ), 2 when the machine cannot run the request (no GPU, no fla-core; for --test model, no
flash-linear-attention).
"""
import argparse
import dataclasses
import importlib.util
import math
import os
import sys

import torch

from kda_opt.reference import ERROR_FLOOR, error_bound, rel_err

from . import cp, decode, host, model, peers, serving, sglang, vllm
from .common import (CONFIGS, DTYPES, NOT_RUN, Case, echo, gpu_tag, medians_in_turns, progress, read_csv,
                     write_table)
from .inputs import DECAYS, GATES

# The float64 recurrence walks T token by token over [B, HV, K, V] float64 states: keep it under
# this many state elements × tokens (about a second on a GPU) by trimming T, and say so.
NAIVE_BUDGET = 2 ** 33
# The sweep, K = V = 128, each row in every gate mode: (B, T, H) of docs/DESIGN.md's sweep; then packed
# sequences at T ≈ 8192 per sequence: issue 8's mix (NUM_SEQS lengths uniform in [MIN_SEQ_LEN, 8192],
# seed 0) at H = 32, the peers' two mixes at H = 96, and three mixes of many short sequences (SHORT_MIXES);
# then, in the default configuration, the default shape with q/k l2norm. The peers' rows (PEER_SHAPES,
# PEER_PACKED) are also a set of their own.
PEER_SHAPES = [(1, 8192, 96), (1, 8192, 64), (8, 4096, 32), (2, 16384, 64), (1, 32768, 32), (1, 65536, 16),
               (1, 2048, 16)]
# A server's prefill batch: hundreds of short requests (lengths uniform in [1, MIN_SEQ_LEN]) beside a few
# long ones, in a seeded random order (short_mix_lengths): ("short", count, long lengths), H; and only
# short ones, lengths drawn lognormal with a median of 12 tokens in [1, MIN_SEQ_LEN] (lognormal_lengths):
# ("lognormal", count, median), H.
SHORT_MIXES = [(("short", 384, (4096, 4096)), 32), (("short", 256, (2048,) * 4), 96), (("lognormal", 400, 12), 96)]
PEER_PACKED = [((1300, 547, 2048, 963, 271, 3063), 96), ((1024,) * 8, 96)] + SHORT_MIXES
MIN_SEQ_LEN, NUM_SEQS = 64, 64
# Prefill under load (a busy server, an offline batch; the full GPU): the peers' large shapes, batches
# of 32 and 12 heads (Kimi-Linear's and K3's shards) that fill every SM, 64 long requests (lengths
# lognormal with a median of 2400 in [1, 32768]: about 245 k tokens, mean 3.8 k), a 128-request step
# (lognormal, median 1024 in [1, 8192]) and 512 requests of 512 tokens, all three at H = 32.
LOAD_SHAPES = [(1, 8192, 96), (8, 4096, 32), (2, 16384, 64), (16, 2048, 32), (32, 1024, 32), (16, 4096, 12),
               (8, 8192, 12)]
LOAD_PACKED = [(("lognormal", 64, 2400, 32768), 32), (("lognormal", 128, 1024, 8192), 32), ((512,) * 512, 32)]
SWEEP_SHAPES = list(dict.fromkeys(PEER_SHAPES + [(1, 1024 * 2 ** i, 32) for i in range(7)] + LOAD_SHAPES))
SWEEP_PACKED = [("drawn", 32)] + PEER_PACKED + LOAD_PACKED
# Tensor-parallel shards: the heads one GPU holds (a Kimi-K3-class model's 96 KDA heads over 8 GPUs:
# 12, over 4: 24; GLM-class models 8), fixed lengths (B, T, H); and chunked-prefill steps at H = 12:
# one long request's chunk beside short ones (short_mix_lengths), and lognormal mixes (16 requests of
# median 2048 in [1, 32768], 51,504 tokens at seed 0; 64 of median 512 in [1, 8192], 53,549).
TP_SHAPES = [(B, T, H) for B in (1, 4) for T in (8192, 32768, 131072) for H in (8, 12, 24)]
TP_PACKED = [(("short", 32, (8192,)), 12), (("short", 16, (32768,)), 12), (("lognormal", 16, 2048, 32768), 12),
             (("lognormal", 64, 512, 8192), 12)]
# Serving steps at Kimi-Linear's H = 32 (CONFIGS["serving"]): the peers' six-request mix, and 64
# requests drawn in [MIN_SEQ_LEN, 1024] (seed 1).
SERVING_STEPS = [((1300, 547, 2048, 963, 271, 3063), 32), (("drawn", 1024, 1), 32)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="scripts/test.py", description=__doc__.splitlines()[0])
    p.add_argument("--test", choices=["naive", "fla", "benchmark", "all", "host", "cp", "decode", "model", "sglang", "vllm"],
                   default="all")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--num-heads", type=int, default=96)
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--no-gate-in-kernel", dest="gate_in_kernel", action="store_false",
                   help="pass g as the log-decay itself, drawn in (-1, 0] (default: raw gate "
                        "activated in kernel); the safe-gate options then do not apply")
    p.add_argument("--no-safe-gate", dest="safe_gate", action="store_false",
                   help="softplus gate, unbounded decay (default: safe gate, sigmoid with lower bound)")
    p.add_argument("--lower-bound", type=float, default=-5.0)
    p.add_argument("--no-initial-state", dest="initial_state", action="store_false",
                   help="time the call without an initial state (default: with one, [N, HV, K, V] fp32 "
                        "~ N(0, 1), as a server passes; the naive and fla checks always pass one)")
    p.add_argument("--decay", choices=DECAYS, default="fast",
                   help="A_log = log U(1, 16) as the Kimi layer draws it, g ~ N(0, 1), and dt_bias ~ N(0, 1) "
                        "(fast: the fast-forgetting channels of a trained gate) or softplus^-1(U(0.001, 0.1)) "
                        "(layer: as the layer initialises it)")
    p.add_argument("--varlen", action="store_true",
                   help=f"pack --num-seqs sequences along T (cu_seqlens), lengths uniform in "
                        f"[{MIN_SEQ_LEN}, --seq-len] (seeded); B must be 1")
    p.add_argument("--num-seqs", type=int, default=NUM_SEQS, help="sequences of --varlen")
    p.add_argument("--seq-lens", type=lambda t: tuple(int(x) for x in t.split(",")),
                   help="pack sequences of exactly these lengths, e.g. 1300,547,2048 (implies --varlen)")
    p.add_argument("--config", choices=list(CONFIGS), default="default",
                   help="the call every system gets: default; l2norm (q/k l2norm in kernel); flashkda "
                        "(FlashKDA's: l2norm, beta logits, V-first states; safe gate, K = V = 128, bf16)")
    p.add_argument("--l2norm", dest="config", action="store_const", const="l2norm", help="--config l2norm")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--sweep", action="store_true", help="the sweep → profiles/benchmark_<gpu>.csv/.png")
    p.add_argument("--sweep-gates", help=f"gate modes the sweep runs, among {', '.join(GATES)} "
                                         "(default safe,softplus; safe with "
                                         "--config flashkda); its rows replace those of the same case "
                                         "in an existing CSV, so a sweep can be run in parts")
    p.add_argument("--sweep-rows", choices=["all", "shapes", "serving", "peers", "short", "step", "dtypes", "load",
                                             "tp"],
                   default="all",
                   help="which of the sweep's rows run: all; shapes (fixed-length SWEEP_SHAPES); serving "
                        "(the packed mixes and the l2norm row); peers (the peers' rows: PEER_SHAPES, then "
                        "PEER_PACKED); short (the many-short-sequence mixes alone, SHORT_MIXES); step (the "
                        "serving step with a state pool, SERVING_STEPS: kda_bench/serving); dtypes (the "
                        "default shape with bf16 and with fp32 q, k, v: --dtype is then not used); load "
                        "(prefill under load: LOAD_SHAPES, then LOAD_PACKED); tp (tensor-parallel shards, "
                        "8-24 heads a GPU: TP_SHAPES, then the chunked-prefill steps TP_PACKED)")
    p.add_argument("--resume", action="store_true",
                   help="--sweep: skip the cases that already have a row in the CSV, so that the same command, "
                        "run again, measures only what an interrupted sweep left")
    p.add_argument("--model-gates", default="softplus,safe",
                   help="--test model: the gates of the model's layer it runs, in order (softplus, safe), so "
                        "that a time-limited run can take one at a time")
    p.add_argument("--vllm-calls", default=",".join(vllm.CALLS),
                   help="--test vllm: the calls whose rows it runs (prefill, decode, spec_decode; all by default), "
                        "the CSV's rows of the others kept")
    p.add_argument("--sglang-calls", default=",".join(sglang.METHODS),
                   help="--test sglang: the calls whose rows it runs (extend, decode, packed_decode, verify, "
                        "tree_verify); the CSV's rows of the others are kept, so that a time-limited run can "
                        "take them in parts")
    p.add_argument("--out-dir", default="profiles", help="where --sweep and --test host write their CSV (and PNG)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (--sweep and --test host, decode, model and cp draw one on stderr)")
    args = p.parse_args(argv)
    if args.chunk_size != 64:
        p.error("--chunk-size: kda_opt computes chunk size 64 only")
    if (args.varlen or args.seq_lens) and args.batch_size != 1:
        p.error("--varlen / --seq-lens pack sequences into one batch entry: --batch-size must be 1")
    if args.seq_lens and min(args.seq_lens) < 1:
        p.error("--seq-lens: every length must be ≥ 1")
    if args.varlen and not args.seq_lens and (args.num_seqs < 1 or args.seq_len < MIN_SEQ_LEN):
        p.error(f"--varlen needs --num-seqs ≥ 1 and --seq-len ≥ {MIN_SEQ_LEN}")
    if not set(args.model_gates.split(",")) <= {"softplus", "safe"}:
        p.error(f"--model-gates: softplus and/or safe, got {args.model_gates}")
    if not set(args.sglang_calls.split(",")) <= set(sglang.METHODS):
        p.error(f"--sglang-calls: among {', '.join(sglang.METHODS)}, got {args.sglang_calls}")
    args.sweep_gates = args.sweep_gates or ("safe" if args.config == "flashkda" else "safe,softplus")
    if not set(args.sweep_gates.split(",")) <= set(GATES):
        p.error(f"--sweep-gates: among {', '.join(GATES)}, got {args.sweep_gates}")
    if args.config == "flashkda":
        unfit = [flag for flag, bad in (("--no-gate-in-kernel", not args.gate_in_kernel),
                                        ("--no-safe-gate", not args.safe_gate),
                                        ("--head-dim other than 128", args.head_dim != 128),
                                        ("--dtype other than bf16", args.dtype != "bf16"),
                                        ("--sweep-gates other than safe", args.sweep_gates != "safe")) if bad]
        if unfit:
            p.error(f"--config flashkda is FlashKDA's one configuration (safe gate in kernel, K = V = 128, "
                    f"bf16): not with {', '.join(unfit)}")
    return args


def varlen_lengths(num_seqs, max_len, seed):
    """num_seqs lengths uniform in [MIN_SEQ_LEN, max_len], from their own generator (seed)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(MIN_SEQ_LEN, max_len + 1, (num_seqs,), generator=gen).tolist())


def short_mix_lengths(count, long, seed):
    """count lengths uniform in [1, MIN_SEQ_LEN] and the lengths `long`, shuffled (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, MIN_SEQ_LEN + 1, (count,), generator=gen).tolist() + list(long)
    return tuple(lens[i] for i in torch.randperm(len(lens), generator=gen).tolist())


def lognormal_lengths(count, median, seed, longest=MIN_SEQ_LEN):
    """count lengths exp(N(ln median, 1)) rounded and clipped to [1, longest] (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    drawn = torch.exp(torch.randn(count, generator=gen, dtype=torch.float64) + math.log(median))
    return tuple(drawn.round().clamp(1, longest).long().tolist())


def mix_lengths(spec, seed):
    """A packed row's lengths: "drawn" (NUM_SEQS drawn by varlen_lengths up to 8192 with `seed`),
    ("drawn", max_len, its own seed), ("short", count, long) (short_mix_lengths), ("lognormal", count,
    median[, longest]) (lognormal_lengths), or the lengths."""
    if spec == "drawn":
        return varlen_lengths(NUM_SEQS, 8192, seed)
    if spec[0] == "drawn":
        return varlen_lengths(NUM_SEQS, *spec[1:])
    if spec[0] == "short":
        return short_mix_lengths(*spec[1:], seed)
    if spec[0] == "lognormal":
        return lognormal_lengths(*spec[1:3], seed, *spec[3:])
    return spec


def case_from_args(args, B=None, T=None, H=None, gate=None):
    """The case the options describe; the keywords override them."""
    if gate is None:
        gate = "preactivated" if not args.gate_in_kernel else "safe" if args.safe_gate else "softplus"
    T = T or args.seq_len
    seqlens = args.seq_lens or (varlen_lengths(args.num_seqs, T, args.seed) if args.varlen else None)
    if seqlens:
        B, T = 1, sum(seqlens)
    return Case(B or args.batch_size, T, H or args.num_heads, args.head_dim, gate, args.lower_bound,
                DTYPES[args.dtype], args.seed, seqlens, args.config, args.initial_state, args.decay)


def sweep_cases(args):
    """The sweep's rows (SWEEP_SHAPES, SWEEP_PACKED, the l2norm row; or PEER_SHAPES and PEER_PACKED;
    SHORT_MIXES; SERVING_STEPS; the dtypes; LOAD_SHAPES and LOAD_PACKED; TP_SHAPES and TP_PACKED:
    --sweep-rows picks) in --config, per gate mode."""
    base = Case(1, 8192, 96, args.head_dim, "safe", args.lower_bound, DTYPES[args.dtype], args.seed,
                config=args.config, initial_state=args.initial_state, decay=args.decay)
    cases = []
    for gate in args.sweep_gates.split(","):
        at = lambda **kw: dataclasses.replace(base, gate=gate, **kw)
        shapes = lambda rows: [at(B=B, T=T, H=H) for B, T, H in rows]
        mixes = lambda rows: [at(T=sum(lens), H=H, seqlens=lens) for lens, H in
                              ((mix_lengths(spec, args.seed), H) for spec, H in rows)]
        if args.sweep_rows == "peers":
            cases += shapes(PEER_SHAPES) + mixes(PEER_PACKED)
        if args.sweep_rows in ("all", "shapes"):
            cases += shapes(SWEEP_SHAPES)
        if args.sweep_rows in ("all", "serving"):
            cases += mixes(SWEEP_PACKED)
            if args.config == "default":
                cases.append(at(config="l2norm"))
        if args.sweep_rows == "short":
            cases += mixes(SHORT_MIXES)
        if args.sweep_rows == "step":
            cases += [dataclasses.replace(c, config="serving") for c in mixes(SERVING_STEPS)]
        if args.sweep_rows == "dtypes":
            cases += [at(dtype=dtype) for dtype in (torch.bfloat16, torch.float32)]
        if args.sweep_rows == "load":
            cases += shapes(LOAD_SHAPES) + mixes(LOAD_PACKED)
        if args.sweep_rows == "tp":
            cases += shapes(TP_SHAPES) + mixes(TP_PACKED)
    return cases


# ---- floors: the fewest bytes and FLOPs the forward needs ----

def min_bytes(c: Case) -> int:
    """Each input read once, each output written once: q, k, v, g, o, β, the initial states (if
    any) and the final states."""
    elt = torch.finfo(c.dtype).bits // 8
    n = c.B * c.T * c.H
    seqs = len(c.seqlens) if c.seqlens else c.B
    return n * (4 * c.K * elt + c.K * elt + elt) + (1 + c.initial_state) * seqs * c.H * c.K * c.K * 4


def min_flops(c: Case) -> int:
    """Matrix FLOPs of the chunked form per chunk and head (C = 64): Aqk and Akk 2·C²K each, W 2·C²K,
    U 2·C²V, V' = WS, qS and the state update 2·CKV each, Aqk·V' 2·C²V (triangles counted full)."""
    C, K, V = 64, c.K, c.K
    per_chunk = 3 * 2 * C * C * K + 2 * 2 * C * C * V + 3 * 2 * C * K * V
    chunks = sum(math.ceil(n / C) for n in c.seqlens) if c.seqlens else c.B * math.ceil(c.T / C)
    return c.H * chunks * per_chunk


def measure_ceilings():
    """Memory bandwidth (bytes read + written) and bf16 matrix rate, measured on this GPU."""
    from triton.testing import do_bench
    x = torch.empty(2 ** 28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / (do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    rate = 2 * 8192 ** 3 / (do_bench(lambda: a @ b, return_mode="median") * 1e-3)
    return bw, rate


# ---- the three tests ----

def naive_T(c: Case) -> int:
    return max(1, min(c.T, NAIVE_BUDGET // (c.B * c.H * c.K * c.K)))


def check_naive(c: Case, fla=None):
    """Errors of kda_forward (and FLA's, when given, and FlashKDA's, where it runs) against the
    float64 recurrence; the bound is FLA's."""
    from kda_opt import kda_forward
    from kda_opt.reference import reference_forward
    T = naive_T(c)
    if T < c.T:
        print(f"  naive: T trimmed from {c.T} to {T} to keep the float64 recurrence quick")
    args = c.trimmed(T).inputs(initial_state=True)
    ref_o, ref_s = reference_forward(**args)
    errors = lambda o, s: (rel_err(o, ref_o), rel_err(s, ref_s))
    row = dict(zip(("o", "state"), errors(*kda_forward(**args))))
    text = f"  naive (T={T}): o {row['o']:.2e}  state {row['state']:.2e}"
    if fla is not None:
        row.update(zip(("fla_o", "fla_state"), errors(*fla(**args))))
        text += f"   | FLA: o {row['fla_o']:.2e}  state {row['fla_state']:.2e}"
    flashkda, why_not = peers.flashkda(args)
    text += (f"   | FlashKDA: o {{:.2e}}  state {{:.2e}}".format(*errors(*flashkda())) if flashkda
             else f"   | FlashKDA: n/a ({why_not})")
    del ref_o, ref_s
    ok = row["o"] <= error_bound(row.get("fla_o", 0.0)) and row["state"] <= error_bound(row.get("fla_state", 0.0))
    print(f"{text}   bound max(2×FLA, {ERROR_FLOOR:g}) → {'PASS' if ok else 'FAIL'}")
    return ok


def check_fla(c: Case, fla):
    """kda_forward vs FLA chunk_kda on the full shape (both in the same precision)."""
    from kda_opt import kda_forward
    args = c.inputs(initial_state=True)
    o, s = kda_forward(**args)
    fo, fs = fla(**args)
    eo, es = rel_err(o, fo), rel_err(s, fs)
    ok = eo <= 2 * ERROR_FLOOR and es <= 2 * ERROR_FLOOR
    print(f"  vs FLA ({c.label}): o {eo:.2e}  state {es:.2e}   → {'PASS' if ok else 'FAIL'}")
    return ok


# A row's columns of kda_opt's time in some of its kernels, each the kernels whose names start with one
# of the prefixes: stage 1's (kda_opt/gate), and everything before stage 4 (stage 1, stages 2+3 of
# kda_opt/intra, and kda_opt/seqs' tables and order of packed sequences).
STAGE1_KERNELS = ("gate_cumsum",)
KERNEL_COLUMNS = {"stage1_ms": STAGE1_KERNELS,
                  "stages13_ms": STAGE1_KERNELS + ("intra_chunk", "chunk_offsets", "chunk_indices", "longest_first",
                                                   "ahead_layout")}


def kernel_ms(f, columns: dict, calls=3) -> dict:
    """{column: GPU ms per call of f spent in the kernels whose names start with one of its prefixes}
    (0.0 where none runs), from one torch.profiler run over `calls` calls after one; NOT_RUN without
    CUDA."""
    if not torch.cuda.is_available():
        return dict.fromkeys(columns, NOT_RUN)
    from torch.profiler import ProfilerActivity, profile
    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
    events = p.key_averages()
    return {column: sum(e.device_time_total for e in events if e.key.startswith(prefixes)) / calls / 1e3
            for column, prefixes in columns.items()}


CHECKPOINT_EVERY = 512  # tokens between the checkpoints FlashKDA's-configuration rows also time (8 chunks)


def benchmark(c: Case, fla, warmup, rep, ceilings, kda_forward=None):
    """Median ms of FLA, FlashKDA (where it runs) and kda_forward on the same inputs, alternating, and
    of kda_forward without the initial state where the case has one (what the state costs us) and, in
    FlashKDA's configuration, with fp32 checkpoints every CHECKPOINT_EVERY tokens; returns a CSV row.
    kda_forward: kda_opt's, unless given."""
    if kda_forward is None:
        from kda_opt import kda_forward
    args = c.inputs()
    errors = {}
    if c.config == "serving":
        runs, why_not = serving.step_runs(args, fla, kda_forward, c.seed)
    else:
        runs = {"fla": lambda: fla(**args), "kda_opt": lambda: kda_forward(**args)}
        if c.initial_state:
            stateless = {**args, "initial_state": None}
            runs["kda_opt_no_state"] = lambda: kda_forward(**stateless)
        call, why_not = peers.flashkda(args)
        if call:
            runs["flashkda"] = call
        cudnn, errors = cudnn_peers(c, args, kda_forward)
        runs.update(cudnn)
        if c.config == "flashkda" and c.initial_state:
            N = len(c.seqlens) if c.seqlens else c.B
            buffer = serving.checkpoint_buffer(args["initial_state"], c.B, c.T, N, CHECKPOINT_EVERY)
            every = {**args, "checkpoints": buffer, "checkpoint_every": CHECKPOINT_EVERY}
            runs["kda_opt_ckpt_every"] = lambda: kda_forward(**every)
    flashkda = "flashkda" in runs
    ms = medians_in_turns(runs, warmup, rep)
    stages = kernel_ms(runs["kda_opt"], KERNEL_COLUMNS)
    stage1 = stages["stage1_ms"]
    ours_ms = ms["kda_opt"]
    bw, rate = ceilings
    nbytes, flops = min_bytes(c), min_flops(c)
    cost = lambda base, over: 100 * (ms[over] / ms[base] - 1) if base in ms and over in ms else NOT_RUN
    row = dict(**c.columns, fla_ms=ms["fla"], kda_opt_ms=ours_ms, speedup=ms["fla"] / ours_ms,
               kda_opt_no_state_ms=ms.get("kda_opt_no_state", NOT_RUN),
               state_cost_pct=cost("kda_opt_no_state", "kda_opt"),
               kda_opt_dense_ms=ms.get("kda_opt_dense", NOT_RUN), pool_cost_pct=cost("kda_opt_dense", "kda_opt"),
               kda_opt_ckpt_ms=ms.get("kda_opt_ckpt", NOT_RUN), ckpt_cost_pct=cost("kda_opt", "kda_opt_ckpt"),
               kda_opt_ckpt_every_ms=ms.get("kda_opt_ckpt_every", NOT_RUN),
               ckpt_every_cost_pct=cost("kda_opt", "kda_opt_ckpt_every"),
               **stages, flashkda_ms=ms.get("flashkda", NOT_RUN),
               speedup_vs_flashkda=ms["flashkda"] / ours_ms if flashkda else NOT_RUN,
               tbps=nbytes / (ours_ms * 1e-3) / 1e12, tflops=flops / (ours_ms * 1e-3) / 1e12,
               bytes_floor_pct=100 * nbytes / bw / (ours_ms * 1e-3),
               flops_floor_pct=100 * flops / rate / (ours_ms * 1e-3),
               fla_flash_kda=os.environ.get("FLA_FLASH_KDA", ""), kda_opt_err=errors.get("kda_opt", NOT_RUN),
               **{f"{name}_{x}": value for name in CUDNN_COLUMNS
                  for x, value in (("ms", ms.get(name, NOT_RUN)), ("err", errors.get(name, NOT_RUN)))})
    peer = (f"FlashKDA {ms['flashkda']:.3f} ms ({row['speedup_vs_flashkda']:.2f}×)" if flashkda
            else f"FlashKDA n/a ({why_not})")
    peer += "".join(f"  cuDNN {name[len('cudnn_'):]} {ms[name]:.3f} ms (o's error {errors[name]}, "
                    f"ours {errors['kda_opt']})" for name in CUDNN_COLUMNS if name in ms)
    state = ""
    if "kda_opt_no_state" in ms:
        state = f" (no state {ms['kda_opt_no_state']:.3f} ms: {row['state_cost_pct']:+.1f} %)"
    if "kda_opt_ckpt_every" in ms:
        state += (f" (checkpoints every {CHECKPOINT_EVERY} tokens {ms['kda_opt_ckpt_every']:.3f} ms: "
                  f"{row['ckpt_every_cost_pct']:+.1f} %)")
    if c.config == "serving":
        state = (f" (pool {row['pool_cost_pct']:+.1f} % over the dense call {ms['kda_opt_dense']:.3f} ms; checkpoints "
                 f"{ms['kda_opt_ckpt']:.3f} ms, {row['ckpt_cost_pct']:+.1f} %)")
    if stage1 != NOT_RUN:
        state += f" (stage 1 {stage1:.3f} ms, stages 1–3 {stages['stages13_ms']:.3f})"
    echo(f"  {c.label}: FLA {ms['fla']:.3f} ms  kda_opt {ours_ms:.3f} ms{state}  speedup {row['speedup']:.2f}×  "
         f"{peer}  {row['tbps']:.2f} TB/s ({row['bytes_floor_pct']:.0f}% of bytes floor)  "
         f"{row['tflops']:.0f} TFLOP/s ({row['flops_floor_pct']:.0f}% of FLOP floor)")
    return row


CUDNN_COLUMNS = [f"cudnn_{engine}" for engine in peers.CUDNN_ENGINES]


def cudnn_peers(c: Case, args, kda_forward):
    """({cudnn_<engine>: call}, {name: o's error}) for the cuDNN engines that make the call (none
    without the frontend): the calls on `args`, and the errors against the float64 recurrence of each
    engine and of kda_opt on the case's first naive_T tokens (cuDNN's fused engine cuts its warm-ups
    where the gate lets it, so its error, like its time, follows the gate: `--decay`)."""
    calls = {f"cudnn_{e}": peers.cudnn(args, e)[0] for e in peers.CUDNN_ENGINES}
    calls = {name: call for name, call in calls.items() if call}
    if not calls:
        return {}, {}
    from kda_opt.reference import reference_forward
    trimmed = c.trimmed(naive_T(c)).inputs()
    o_ref, _ = reference_forward(**trimmed)
    errors = {"kda_opt": rel_err(kda_forward(**trimmed)[0], o_ref)}
    for name in calls:
        call, _ = peers.cudnn(trimmed, name[len("cudnn_"):])
        errors[name] = rel_err(call()[0], o_ref) if call else NOT_RUN
    return calls, errors


# ---- sweep output ----

# varlen: sequences packed along T (0: a fixed-length batch of B); config: a key of CONFIGS;
# initial_state: 1 where every system got one; decay: inputs.DECAYS; dtype: q, k and v's (DTYPES: every
# system got the same tensors; FLA computes fp32 in its own precision); kda_opt_no_state_ms /
# state_cost_pct: kda_forward without the state, and what the state costs it (NOT_RUN without one);
# stage1_ms: of kda_opt_ms, stage 1's pass (0 where the call has none); stages13_ms: of kda_opt_ms,
# everything before stage 4 (KERNEL_COLUMNS);
# flashkda_ms / speedup_vs_flashkda: NOT_RUN where FlashKDA cannot compute the case; fla_flash_kda:
# FLA_FLASH_KDA as FLA saw it ("0": FLA on its own Triton path). Serving-step rows (config serving,
# kda_bench/serving): fla_ms and flashkda_ms gather, call and scatter; kda_opt_ms reads and writes the
# pool in place; kda_opt_dense_ms / pool_cost_pct: the call on gathered states, and what the pool adds;
# kda_opt_ckpt_ms / ckpt_cost_pct: the pool call with checkpoints after every chunk, and what they add.
# kda_opt_ckpt_every_ms / ckpt_every_cost_pct (FlashKDA's configuration with a state): the call with
# fp32 V-first checkpoints every CHECKPOINT_EVERY tokens, and what they add. cudnn_<engine>_ms /
# cudnn_<engine>_err (peers.CUDNN_ENGINES, where the frontend is installed and the engine makes the call):
# its time, and o's error against the float64 recurrence on the case's first naive_T tokens, beside
# kda_opt's on the same tokens (kda_opt_err).
CSV_FIELDS = ["B", "T", "H", "K", "V", "mode", "varlen", "config", "initial_state", "decay", "dtype", "fla_ms",
              "kda_opt_ms", "speedup", "kda_opt_no_state_ms", "state_cost_pct", "stage1_ms", "stages13_ms",
              "flashkda_ms",
              "speedup_vs_flashkda", "tbps", "tflops", "bytes_floor_pct", "flops_floor_pct", "fla_flash_kda",
              "kda_opt_dense_ms", "pool_cost_pct", "kda_opt_ckpt_ms", "ckpt_cost_pct", "kda_opt_ckpt_every_ms",
              "ckpt_every_cost_pct", "kda_opt_err"] + [f"{name}_{x}" for name in CUDNN_COLUMNS for x in ("ms", "err")]
ROW_KEY = ("B", "T", "H", "K", "mode", "varlen", "config", "initial_state", "decay", "dtype")
# Rows of CSVs written before these columns existed: fixed-length batches in the default
# configuration, no initial state, A_log and dt_bias ~ 0.5·N(0, 1), FlashKDA not timed, FLA on its
# Triton path (the CLI has set FLA_FLASH_KDA=0 since its first version), bf16 q, k and v.
ROW_DEFAULTS = {"varlen": 0, "config": "default", "initial_state": 0, "decay": "0.5N(0,1)", "dtype": "bf16",
                "kda_opt_no_state_ms": NOT_RUN, "state_cost_pct": NOT_RUN, "stage1_ms": NOT_RUN, "stages13_ms": NOT_RUN,
                "flashkda_ms": NOT_RUN, "speedup_vs_flashkda": NOT_RUN, "fla_flash_kda": "0",
                "kda_opt_dense_ms": NOT_RUN, "pool_cost_pct": NOT_RUN, "kda_opt_ckpt_ms": NOT_RUN, "ckpt_cost_pct": NOT_RUN,
                "kda_opt_ckpt_every_ms": NOT_RUN, "ckpt_every_cost_pct": NOT_RUN, "kda_opt_err": NOT_RUN,
                **{f"{name}_{x}": NOT_RUN for name in CUDNN_COLUMNS for x in ("ms", "err")}}


def row_key(r):
    """The case a CSV row (or Case.columns) is of; missing columns from ROW_DEFAULTS."""
    r = {**ROW_DEFAULTS, **r}
    return tuple(r[k] for k in ROW_KEY)


def merge_rows(old, new):
    """old rows with those of the same case replaced by new ones, sorted by config, mode, varlen, H, B, T."""
    merged = {row_key(r): {**ROW_DEFAULTS, **r} for r in (*old, *new)}    # a new row replaces its case's old one
    return sorted(merged.values(), key=lambda r: (r["config"], r["mode"], -r["initial_state"], str(r["decay"]),
                                                  r["varlen"], r["H"], r["B"], r["T"], r["dtype"]))


def write_csv(rows, path):
    write_table(rows, path, CSV_FIELDS, ROW_DEFAULTS)


def write_plot(rows, path, title, config="default"):
    """The sweep's rows in one configuration. Where FlashKDA was timed (its configuration): every case's
    ms per system as bars, kda_opt's speedup over FlashKDA above its bar. Otherwise: ms vs T at H = 32
    (B = 1, fixed length) for every system timed and both gate modes, speedup over FLA on a second axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in ({**ROW_DEFAULTS, **r} for r in rows) if r["config"] == config]
    peer_rows = [r for r in rows if r["flashkda_ms"] != NOT_RUN]
    # Bars: about 0.7 inch per case, so that a full sweep's labels do not overlap.
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(peer_rows)), 4.5) if peer_rows else (7, 4), dpi=80)
    (plot_cases if peer_rows else plot_scaling)(ax, peer_rows or rows, config)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_cases(ax, rows, config):
    """Bars of FLA, kda_opt and FlashKDA ms per case (fixed-length shapes, then packed mixes)."""
    rows = sorted(rows, key=lambda r: (r["varlen"], -r["H"], r["B"], r["T"]))
    x = range(len(rows))
    for i, (name, col, color) in enumerate((("FLA", "fla_ms", "tab:gray"), ("kda_opt", "kda_opt_ms", "tab:blue"),
                                            ("FlashKDA", "flashkda_ms", "tab:red"))):
        ax.bar([j + (i - 1) * 0.27 for j in x], [r[col] for r in rows], 0.27, color=color, label=name)
    for j, r in enumerate(rows):
        ax.annotate(f"{r['speedup_vs_flashkda']:.2f}×", (j, r["kda_opt_ms"]), ha="center", va="bottom", fontsize=7)
    label = lambda r: (f"{r['varlen']} seqs\nT={r['T']}\nH={r['H']}" if r["varlen"]
                       else f"{r['B']}×{r['T']}\nH={r['H']}")
    ax.set_xticks(list(x), [label(r) for r in rows], fontsize=7)
    ax.set(yscale="log", ylabel="ms", xlabel=f"B×T, H (K=V=128, {config}); above kda_opt: speedup over FlashKDA")
    ax.legend(loc="upper left", fontsize=7)


def plot_scaling(ax, rows, config):
    """ms vs T at H = 32, B = 1, fixed length; speedup over FLA on a second axis."""
    ax2 = ax.twinx()
    for mode, style in (("safe", "-"), ("softplus", "--")):
        pts = sorted((r["T"], r) for r in rows if r["mode"] == mode and r["H"] == 32 and r["B"] == 1 and not r["varlen"])
        if not pts:
            continue
        Ts = [t for t, _ in pts]
        ax.plot(Ts, [r["fla_ms"] for _, r in pts], "o" + style, color="tab:gray", label=f"FLA ({mode})")
        ax.plot(Ts, [r["kda_opt_ms"] for _, r in pts], "o" + style, color="tab:blue", label=f"kda_opt ({mode})")
        ax2.plot(Ts, [r["speedup"] for _, r in pts], "x" + style, color="tab:green", label=f"speedup ({mode})")
    ax.set(xscale="log", yscale="log", xlabel=f"T (B=1, H=32, K=V=128, {config})", ylabel="ms")
    ax2.set_ylabel("speedup over FLA", color="tab:green")
    if ax.lines:  # an early partial sweep may have no H=32 rows yet
        ax.legend(loc="upper left", fontsize=7)
        ax2.legend(loc="lower right", fontsize=7)


# ---- main ----

def refuse(msg):
    print(f"scripts/test.py: {msg}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        return refuse("needs a CUDA GPU (none found); the CPU test suite is `bash scripts/check.sh`")
    if args.test == "cp" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return cp.main_across_ranks(args.out_dir, args.quiet)
    if args.test == "sglang":
        if importlib.util.find_spec("sglang") is None:
            return refuse("--test sglang needs SGLang (pip install sglang)")
        rows = sglang.sglang_rows(args.out_dir, args.warmup, args.rep, args.quiet,
                                  calls=tuple(args.sglang_calls.split(",")))
        print(f"\n{'call':>13} {'H':>3} {'N':>4} {'tokens':>6} {'gate':>8} {'timing':>6} {'SGLang':>8} {'ours':>8} "
              f"{'speedup':>7} {'taken':>5} {'FlashKDA':>8} {'Helion':>8} {'its err':>8} {'max err':>8} untouched  "
              f"SGLang's kernel")
        shown = lambda x, form: x if isinstance(x, str) else f"{x:{form}}"
        for r in rows:
            print(f"{r['call']:>13} {r['H']:>3} {r['requests']:>4} {r['tokens']:>6} {r['gate']:>8} {r['timing']:>6} "
                  f"{r['sglang_ms']:8.3f} {r['kda_opt_ms']:8.3f} {r['speedup']:7.2f} {str(r['taken']):>5} "
                  f"{shown(r['sglang_flashkda_ms'], '8.3f'):>8} {shown(r['sglang_helion_ms'], '8.3f'):>8} "
                  f"{shown(r['helion_max_rel_err'], '8.2e'):>8} {r['max_rel_err']:8.2e} "
                  f"{str(r['untouched_ok']):>9}  {r['sglang_kernel']}")
        host_time = sglang.host_rows()
        print("host ms per extend call: " + ", ".join(f"{n} {t:.4f}" for n, t in host_time.items()))
        # Two kernels each within the floor of the float64 truth differ by at most twice it.
        return 0 if all(r["untouched_ok"] and r["max_rel_err"] <= 2 * ERROR_FLOOR for r in rows) else 1
    if args.test == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return refuse("--test vllm needs vLLM (pip install --no-deps vllm; docs/USAGE.md, \"vLLM\")")
        rows = vllm.vllm_rows(args.out_dir, args.warmup, args.rep, args.quiet, calls=tuple(args.vllm_calls.split(",")))
        return 0 if all(r["max_rel_err"] <= 2 * ERROR_FLOOR for r in rows) else 1
    fla = peers.fla_chunk_kda()
    if fla is None and (args.sweep or args.test in ("fla", "benchmark", "all", "host", "cp", "decode", "model")):
        return refuse(f"--test {args.test} needs fla-core (pip install 'kda-opt[bench]')")
    if args.test == "model" and importlib.util.find_spec("fla.models") is None:
        return refuse("--test model needs FLA's models (pip install 'kda-opt[bench]': flash-linear-attention)")
    from triton import __version__ as triton_version
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton_version}, "
          f"FLA_FLASH_KDA={os.environ.get('FLA_FLASH_KDA')}")

    ok = True
    if args.test == "host":
        rows = host.host_rows(fla, args.out_dir, args.quiet)
        print(f"\n{'call':42s} {'ours host':>9} {'FLA host':>9} {'via FLA':>9} {'FKDA host':>9} {'eager':>9} "
              f"{'graph':>9}")
        for r in rows:
            cells = [r[f] for f in host.FIELDS[1:]]
            print(f"{r['call']:42s} " + " ".join(f"{c:9.4f}" if isinstance(c, float) else f"{c:>9}" for c in cells))
        return 0
    if args.test == "decode":
        rows = decode.decode_rows(fla, args.out_dir, args.warmup, args.rep, args.quiet)
        print(f"\n{'mode':>6} {'N':>5} {'H':>3} {'T':>2} {'prefill':>7} {'state':>5} {'ours ms':>8} {'FLA ms':>8} "
              f"{'FlashKDA':>8} {'floor':>7} {'% floor':>7} {'graph':>7} {'host':>7}")
        for r in rows:
            cells = [r[f] for f in decode.FIELDS[6:]]
            print(f"{r['mode']:>6} {r['requests']:>5} {r['H']:>3} {r['tokens_per_request']:>2} {r['prefill_tokens']:>7} "
                  f"{r['state_dtype']:>5} " + " ".join(f"{c:8.3f}" if isinstance(c, float) else f"{c:>8}" for c in cells))
        return 0
    if args.test == "model":
        rows = model.model_rows(args.out_dir, tuple(args.model_gates.split(",")), args.quiet)
        print(f"\n{'gate':>8} {'phase':>14} {'B':>3} {'T':>5} {'padded':>6} {'FLA ms':>8} {'ours ms':>8} {'speedup':>7} "
              "tokens (parting gap, bf16 steps)")
        for r in rows:
            print(f"{r['gate']:>8} {r['phase']:>14} {r['B']:>3} {r['T']:>5} {str(r['padded']):>6} {r['fla_ms']:8.3f} "
                  f"{r['kda_opt_ms']:8.3f} {r['speedup']:7.2f} {r['tokens_match']} ({r['parting_gap']})")
        return 0 if all(r["tokens_match"] for r in rows) else 1
    if args.test == "cp":
        rows = cp.cp_rows(fla, args.out_dir, args.warmup, args.rep, args.quiet)
        print(f"\n{'B':>2} {'T':>7} {'H':>3} {'config':>8} {'ours ms':>8} {'sequential':>10} {'FLA ms':>8} {'FlashKDA':>8}")
        for r in rows:
            cells = [r[f] for f in ("kda_opt_ms", "sequential_ms", "fla_ms", "flashkda_ms")]
            print(f"{r['B']:>2} {r['T']:>7} {r['H']:>3} {r['config']:>8} "
                  + " ".join(f"{c:8.3f}" if isinstance(c, float) else f"{c:>8}" for c in cells))
        return 0
    if args.sweep:
        ceilings = measure_ceilings()
        cases = sweep_cases(args)
        os.makedirs(args.out_dir, exist_ok=True)
        base = os.path.join(args.out_dir, f"benchmark_{gpu_tag()}")
        png = (base + ("" if args.config == "default" else f"_{args.config}") + ("" if args.initial_state else "_nostate")
               + ("" if args.decay == "fast" else f"_{args.decay}") + ".png")
        plotted = lambda rows: [r for r in rows if (r["initial_state"], r["decay"]) == (int(args.initial_state), args.decay)]
        rows = read_csv(base + ".csv")
        if args.resume:
            done = {row_key(r) for r in rows}
            todo = [c for c in cases if row_key(c.columns) not in done]
            print(f"--resume: {len(cases) - len(todo)} of {len(cases)} cases already in {base}.csv")
            cases = todo
        for i, c in enumerate(progress(cases, lambda c: c.label, args.quiet), 1):
            echo(f"[{i}/{len(cases)}] {c.label}")
            rows = merge_rows(rows, [benchmark(c, fla, args.warmup, args.rep, ceilings)])
            # After every case, so that an interrupted sweep keeps what it measured.
            write_csv(rows, base + ".csv")
            write_plot(plotted(rows), png, f"kda_opt vs FLA chunk_kda, {torch.cuda.get_device_name()}", args.config)
        print(f"wrote {base}.csv and {png}")
        print_table(rows)
        return 0

    c = case_from_args(args)
    print(f"# {c.label}, {args.dtype}, lower_bound {c.lower_bound}")
    if args.test in ("naive", "all"):
        ok &= check_naive(c, fla)
    if args.test in ("fla", "all"):
        ok &= check_fla(c, fla)
    if args.test in ("benchmark", "all"):
        print_table([benchmark(c, fla, args.warmup, args.rep, measure_ceilings())])
    return 0 if ok else 1


def print_table(rows):
    fmt = lambda v, spec, unit="": (format(v, spec) + unit if isinstance(v, float)
                                    else f"{v:>{spec.split('.')[0].lstrip('+')}}" + " " * len(unit))
    print(f"\n{'B':>2} {'T':>6} {'H':>3} {'mode':>8} {'varlen':>6} {'config':>8} {'S0':>2} {'dtype':>5} {'FLA ms':>8} {'ours ms':>8} "
          f"{'speedup':>7} {'S0 cost':>7} {'FlashKDA':>8} {'× FKDA':>7} {'TB/s':>5} {'TFLOP/s':>7}")
    for r in rows:
        r = {**ROW_DEFAULTS, **r}
        print(f"{r['B']:>2} {r['T']:>6} {r['H']:>3} {r['mode']:>8} {r['varlen']:>6} {r['config']:>8} {r['initial_state']:>2} "
              f"{r['dtype']:>5} "
              f"{r['fla_ms']:>8.3f} {r['kda_opt_ms']:>8.3f} {r['speedup']:>6.2f}× {fmt(r['state_cost_pct'], '+6.1f', '%')} "
              f"{fmt(r['flashkda_ms'], '8.3f')} {fmt(r['speedup_vs_flashkda'], '6.2f', '×')} {r['tbps']:>5.2f} {r['tflops']:>7.0f}")


if __name__ == "__main__":
    sys.exit(main())
