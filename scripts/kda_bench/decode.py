"""Decode, speculative verify and mixed steps (`--test decode`, docs/BENCHMARKING.md): the steps a
server makes between prefills, by each system the way it makes them.

    decode   N requests of one token each, packed (cu_seqlens), their states in a pool read and
             written in place at random slots: kda_decode; FLA's fused_recurrent_kda_fwd (vLLM's
             decode call); FlashKDA's prefill call on one-token sequences, the rows gathered and
             scattered around it (FlashKDA has no decode path)
    verify   N requests of T tokens, the state after each token to its own slot ([N, T] indices,
             num_accepted_tokens): kda_decode against FLA's kernel with the same indices
    mixed    D decodes packed with a few prefills in one call (vLLM's Kimi layer sends a batch that
             holds a prefill through the prefill call): kda_forward with the pool (its one-token sequences
             through the decode kernel), and with them on stage 4 (Tuning(route_decodes=False),
             kda_opt_stage4_ms);
             FLA's chunk_kda on the prefills plus its decode kernel on the decodes; FlashKDA's one
             prefill call
Kimi's call: q/k L2 norm, β logits, safe gate (lower_bound −5), A_log = log U(1, 16), dt_bias; a V-first
pool of 2N + 8 rows. floor: the bytes the step must move (each state row read once and written once
per state it writes), moved the faster of two ways (a device-to-device copy, an in-place rewrite),
timed in the same run. kda_opt_graph_ms: per step, GRAPH_CALLS steps replayed from one CUDA graph,
each after a write that leaves the L2 cache holding nothing of the step (that write's time subtracted),
as a server runs its steps; pct_of_floor is the floor's share of it.
Written to <out-dir>/decode_<gpu>.csv.
"""
import torch

from . import peers
from .common import NOT_RUN, graph_ms, host_ms, medians_in_turns, planned_call, progress, show, write_rows
from .inputs import draw_call

K = 128
REQUESTS, HEADS = (1, 8, 64, 256, 1024), (8, 32, 96)
VERIFY = [(64, 32, 4), (64, 32, 8), (256, 32, 4), (256, 32, 8)]          # (requests, H, tokens per request)
MIXED = [(256, (2048, 1024, 512), 32), (128, (4096,), 96)]             # (decodes, prefill lengths, H)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FIELDS = ["mode", "requests", "H", "tokens_per_request", "prefill_tokens", "state_dtype", "kda_opt_ms", "fla_ms",
          "flashkda_ms", "floor_ms", "pct_of_floor", "kda_opt_graph_ms", "kda_opt_host_ms", "kda_opt_stage4_ms"]
GRAPH_CALLS = 20            # steps per CUDA graph in kda_opt_graph_ms (its time per step)


def steps():
    """Every row: (mode, requests, H, tokens per request, prefill lengths, state dtype name)."""
    rows = [("decode", n, h, 1, (), dt) for dt in STATE_DTYPES for h in HEADS for n in REQUESTS]
    rows += [("verify", n, h, t, (), "fp32") for n, h, t in VERIFY]
    rows += [("mixed", n, h, 1, lens, "fp32") for n, lens, h in MIXED]
    return rows


def state_bytes(requests, H, tokens, state_dtype, per_token):
    """Bytes a step must move: each request's state read once, written once (per token with per-token
    slots)."""
    writes = tokens if per_token else 1
    return requests * H * K * K * STATE_DTYPES[state_dtype].itemsize * (1 + writes)


def floor_ms(nbytes, device):
    """The faster of two ways to move `nbytes` (half read, half written), median ms: a
    device-to-device copy, and a pass that rewrites a buffer in place (as a step rewrites its pool's
    rows; on an H100 it is the faster of the two for a large step)."""
    from triton.testing import do_bench
    src = torch.zeros(nbytes // 8, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return min(do_bench(lambda: dst.copy_(src), return_mode="median"),
               do_bench(lambda: src.mul_(1.0), return_mode="median"))


def serving_call(requests, H, tokens, prefills, state_dtype, seed=0):
    """(kda_forward-style arguments of the packed step, the pool, its slots): requests of `tokens`
    tokens, then the prefills, packed; a pool of 2·N·tokens + 8 rows (2N + 8 for one token each) at
    shuffled slots (int32)."""
    lens = (tokens,) * requests + tuple(prefills)
    args = draw_call(1, sum(lens), H, K, seqlens=lens, seed=seed, layout="kimi")
    N, rows = len(lens), 2 * len(lens) * tokens + 8
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(rows, H, K, K, generator=gen).to("cuda", STATE_DTYPES[state_dtype])
    slots = torch.randperm(rows, generator=gen)[:N].to("cuda", torch.int32)
    return args, pool, slots


DECODE_KEYWORDS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "lower_bound", "use_qk_l2norm_in_kernel",
                   "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "state_v_first", "cu_seqlens")


def decode_runs(mode, requests, H, tokens, state_dtype, fla_decode):
    """{system: step()} for a decode or verify row."""
    from kda_opt import kda_decode
    args, pool, slots = serving_call(requests, H, tokens, (), state_dtype)
    call = {n: args[n] for n in DECODE_KEYWORDS if n in args}
    if mode == "verify":
        # Each token's state to its own slot; every request accepted all of its previous step's tokens.
        per_token = torch.randperm(pool.shape[0], device="cuda")[:requests * tokens].view(requests, tokens).int()
        call.update(ssm_state_indices=per_token, num_accepted_tokens=torch.full((requests,), tokens, device="cuda"))
    else:
        call["ssm_state_indices"] = slots
    out = torch.empty_like(args["v"])
    runs = {"kda_opt": lambda: kda_decode(**call, initial_state=pool, inplace_final_state=True, out=out),
            "fla": lambda: fla_decode(**call, initial_state=pool, inplace_final_state=True, out=out)}
    if mode == "decode":
        folded = folded_flashkda(args, pool, slots)
        if folded:
            runs["flashkda"] = folded
    return runs


def folded_flashkda(args, pool, slots):
    """FlashKDA's prefill call on the packed step, its states gathered from the pool and scattered
    back (fp32 pools only: FlashKDA reads fp32 or bf16 states of its own layout), or None."""
    if pool.dtype != torch.float32:
        return None
    gathered = pool.index_select(0, slots.long())
    call, _ = peers.flashkda({**args, "initial_state": gathered, "output_final_state": True})
    if call is None:
        return None

    def step():
        torch.index_select(pool, 0, slots.long(), out=gathered)
        pool.index_copy_(0, slots.long(), call()[1])
    return step


def mixed_runs(decodes, prefills, H, fla_chunk, fla_decode):
    """{system: step()} for a mixed row: decodes first, then the prefills, in one packed batch."""
    from kda_opt import kda_forward
    from kda_opt.plan import Tuning
    args, pool, slots = serving_call(decodes, H, 1, prefills, "fp32")
    ours = {**args, "initial_state": pool, "initial_state_indices": slots, "output_final_state": False}
    runs = {"kda_opt": lambda: kda_forward(**ours), "kda_opt_stage4": planned_call(ours, Tuning(route_decodes=False))}
    # FLA: its decode kernel on the decodes (pool in place), chunk_kda on the prefills (rows gathered).
    cu = args["cu_seqlens"]
    decode_part = {n: (x[:, :decodes] if n in ("q", "k", "v", "g", "beta") else x) for n, x in args.items()
                   if n in DECODE_KEYWORDS}
    decode_part.update(cu_seqlens=cu[:decodes + 1], ssm_state_indices=slots[:decodes])
    prefill_part = {n: (x[:, decodes:] if n in ("q", "k", "v", "g", "beta") else x) for n, x in args.items()}
    prefill_part.update(cu_seqlens=cu[decodes:] - decodes, cu_seqlens_cpu=args["cu_seqlens_cpu"][decodes:] - decodes,
                        output_final_state=True)
    rows = slots[decodes:].long()
    gathered = pool.index_select(0, rows)

    def fla_step():
        fla_decode(**decode_part, initial_state=pool, inplace_final_state=True)
        torch.index_select(pool, 0, rows, out=gathered)
        pool.index_copy_(0, rows, fla_chunk(**{**prefill_part, "initial_state": gathered})[1])
    runs["fla"] = fla_step
    folded = folded_flashkda(args, pool, slots)
    if folded:
        runs["flashkda"] = folded
    return runs


@torch.inference_mode()
def decode_rows(fla_chunk, out_dir, warmup=25, rep=100, quiet=False):
    """Measures every row of steps() (a progress bar unless quiet), writes <out_dir>/decode_<gpu>.csv and
    returns the rows."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    rows = []
    label = lambda s: f"{s[0]} N={s[1]} H={s[2]} T={s[3]} prefill={sum(s[4])} {s[5]} state"
    for mode, requests, H, tokens, prefills, state_dtype in progress(steps(), label, quiet):
        if mode == "mixed":
            runs = mixed_runs(requests, prefills, H, fla_chunk, fused_recurrent_kda_fwd)
            floor = NOT_RUN
        else:
            runs = decode_runs(mode, requests, H, tokens, state_dtype, fused_recurrent_kda_fwd)
            floor = floor_ms(state_bytes(requests, H, tokens, state_dtype, mode == "verify"), "cuda")
        ms = medians_in_turns(runs, warmup, rep)
        graph = graph_ms(runs["kda_opt"], GRAPH_CALLS, cold=True)
        row = dict(mode=mode, requests=requests, H=H, tokens_per_request=tokens, prefill_tokens=sum(prefills),
                   state_dtype=state_dtype, kda_opt_ms=ms["kda_opt"], fla_ms=ms["fla"],
                   flashkda_ms=ms.get("flashkda", NOT_RUN), floor_ms=floor,
                   pct_of_floor=NOT_RUN if floor == NOT_RUN else 100 * floor / graph, kda_opt_graph_ms=graph,
                   kda_opt_host_ms=host_ms({"kda_opt": runs["kda_opt"]})["kda_opt"],
                   kda_opt_stage4_ms=ms.get("kda_opt_stage4", NOT_RUN))
        show(row)
        rows.append(row)
    write_rows(rows, out_dir, "decode", FIELDS)
    return rows
