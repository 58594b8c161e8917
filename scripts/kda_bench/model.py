"""A model's steps (`--test model`, docs/BENCHMARKING.md): FLA's own KDA model (flash-linear-attention's
`KDAForCausalLM`), small, with random seeded weights, run as FLA ships it and with kda_opt registered
(`kda_opt.use_in_fla()`), the two taking turns in one process. What a user sees before any kernel row:
every step pays the host's time around the kernels as well as their GPU time.

    model     hidden 2048, 32 heads of 128 (K = V = 128), 2 layers, vocab 4096, bf16; the gate as the
              layer computes it: softplus (FLA's default), or sigmoid with lower_bound −5 (safe gate)
    prefill   one forward over a batch of prompts with no cache, the states kept (use_cache)
    cached    a 500-token chunk into a cache that already holds a 500-token prompt
    decode    one greedy step, the median of REPEATS runs of DECODE_STEPS steps after a 128-token prompt
    padded    a left-padded batch (an attention mask: packed sequences in the layer), prefill and decode
Each step is timed from its call to the GPU's end (a synchronisation before and after), the median of
REPEATS; the logits of the last position only (logits_to_keep=1), as a server asks. tokens_match: the
greedy tokens of the two runs are identical (prefill: each prompt's next token; decode: every step's);
parting_gap: where they are not, how near a tie FLA's own choice was when they parted (parting_gap()).
FLA's own path is selected by FLA_KDA_OPT=0, which FLA's dispatch reads on every call.
Written to <out-dir>/model_<gpu>.csv after every row, and a plot (.png) at the end; a run of some
gates (--model-gates) keeps the other gates' rows already there.
"""
import copy
import os
import statistics
import time

import torch

from .common import NOT_RUN, gpu_tag, progress, read_csv, show, system, write_rows

CONFIG = dict(hidden_size=2048, num_heads=32, head_dim=128, num_hidden_layers=2, vocab_size=4096)
GATES = {"softplus": dict(), "safe": dict(safe_gate=True, lower_bound=-5.0)}
REPEATS, DECODE_STEPS, PROMPT = 10, 24, 128
# (phase, B, T, left-padded): T is the prompt's tokens (prefill), the chunk's (cached: a prompt of as
# many tokens before it) or 1 (decode, after a PROMPT-token prompt).
ROWS = [("prefill", 2, 1000, False), ("prefill", 1, 4096, False), ("prefill", 1, 8192, False),
        ("cached_prefill", 2, 500, False), ("decode", 2, 1, False), ("decode", 64, 1, False),
        ("prefill", 2, 1000, True), ("decode", 2, 1, True)]
FIELDS = ["gate", "phase", "B", "T", "padded", "fla_ms", "kda_opt_ms", "speedup", "tokens_match", "parting_gap"]
SYSTEMS = ("fla", "kda_opt")


def build(gate: str):
    """The model in bf16 on the GPU, in eval mode, with weights drawn from seed 0."""
    from fla.models import KDAConfig, KDAForCausalLM
    torch.manual_seed(0)
    model = KDAForCausalLM(KDAConfig(**CONFIG, **GATES[gate]))
    return model.to("cuda", torch.bfloat16).eval()


def prompts(B: int, T: int, padded: bool, seed: int = 0, device="cuda"):
    """(input_ids [B, T], attention_mask or None): random tokens; padded: request b's prompt is
    T − 100·b tokens long, left-padded (mask 0 before it)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG["vocab_size"], (B, T), generator=gen).to(device)
    if not padded:
        return ids, None
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        mask[b, :100 * b] = 0
    return ids, mask.to(device)


def timed(f) -> tuple[float, object]:
    """(ms from the call to the GPU's end, f's result)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def forward(model, ids, mask=None, cache=None):
    """One step: (next greedy tokens [B], the cache, their logits [B, vocab])."""
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    return logits.argmax(-1), out.past_key_values, logits


def parting_gap(tokens, logits, other_tokens):
    """Where other_tokens part from tokens [B, S] (greedy choices made from logits [B, S, vocab]), at
    each request's first differing step: the logit of tokens' choice less that of other_tokens', in
    steps of bf16 at the top logit (0: an exact tie); the largest over the requests that part, or
    NOT_RUN where none does. A greedy choice within a step or so of a tie goes either way for two
    kernels that round differently; after it the two runs continue different sequences."""
    differ = tokens != other_tokens
    if not differ.any():
        return NOT_RUN
    gaps = []
    for b in differ.any(1).nonzero()[:, 0].tolist():
        t = int(differ[b].nonzero()[0])
        row = logits[b, t].float()
        top = row[tokens[b, t]]
        step = 2.0 ** (torch.floor(torch.log2(top.abs().clamp_min(1e-30))) - 7)   # bf16: 8 significant bits
        gaps.append(float((top - row[other_tokens[b, t]]) / step))
    return max(gaps)


def in_turns(prepare):
    """{system: (ms per repeat, the last repeat's tokens [B, 1] and logits [B, 1, vocab])}: REPEATS
    repeats, the systems in turns, each timing the step prepare(system) returns (made untimed, outside
    the system's switch)."""
    times, tokens, logits = {s: [] for s in SYSTEMS}, {}, {}
    for _ in range(REPEATS):
        for s in SYSTEMS:
            step = prepare(s)
            with system(s):
                ms, (tokens[s], _, logits[s]) = timed(step)
            times[s].append(ms)
    return {s: (times[s], tokens[s][:, None], logits[s][:, None]) for s in SYSTEMS}


def prefill_row(model, B, T, padded):
    """in_turns' result for a prefill with no cache."""
    ids, mask = prompts(B, T, padded)
    return in_turns(lambda s: lambda: forward(model, ids, mask))


def cached_row(model, B, T):
    """in_turns' result for a T-token chunk into a cache holding a T-token prompt, each repeat from a
    copy of that cache."""
    first, _ = prompts(B, T, False, seed=1)
    ids, _ = prompts(B, T, False, seed=2)
    caches = {}
    for s in SYSTEMS:
        with system(s):
            caches[s] = forward(model, first)[1]

    def prepare(s):
        cache = copy.deepcopy(caches[s])
        return lambda: forward(model, ids, cache=cache)
    return in_turns(prepare)


def decode_row(model, B, padded):
    """{system: (ms per step, tokens [B, DECODE_STEPS + 1], their logits [B, DECODE_STEPS + 1, vocab])}:
    greedy steps after a PROMPT-token prompt, each system's whole run in turn, REPEATS runs each (a
    step is the host's, whose speed drifts: many short turns)."""
    ids, mask = prompts(B, PROMPT, padded)
    times, tokens, logits = {s: [] for s in SYSTEMS}, {}, {}
    for _ in range(REPEATS):
        for s in SYSTEMS:
            with system(s):
                step, cache, scores = forward(model, ids, mask)
                steps, kept, m = [step], [scores], mask
                for _ in range(DECODE_STEPS):
                    m = None if m is None else torch.cat((m, m.new_ones(B, 1)), 1)
                    ms, (step, cache, scores) = timed(lambda: forward(model, step[:, None], m, cache))
                    times[s].append(ms)
                    steps.append(step)
                    kept.append(scores)
            tokens[s], logits[s] = torch.stack(steps, 1), torch.stack(kept, 1)
    return {s: (times[s], tokens[s], logits[s]) for s in SYSTEMS}


def model_rows(out_dir, gates=tuple(GATES), quiet=False):
    """Measures every row of ROWS for each gate (a progress bar per gate unless quiet), writes
    <out_dir>/model_<gpu>.csv (and the plot) and returns the rows."""
    import kda_opt
    kda_opt.use_in_fla()
    rows, earlier = [], earlier_rows(os.path.join(out_dir, f"model_{gpu_tag()}.csv"), gates)
    with torch.inference_mode():
        for gate in gates:
            model = build(gate)
            label = lambda r: f"{gate} {r[0]} B={r[1]} T={r[2]}" + (" padded" if r[3] else "")
            for phase, B, T, padded in progress(ROWS, label, quiet):
                # Once each first: FLA's autotuning and the JIT stay out of the timings.
                if phase == "prefill":
                    run = lambda: prefill_row(model, B, T, padded)
                elif phase == "cached_prefill":
                    run = lambda: cached_row(model, B, T)
                else:
                    run = lambda: decode_row(model, B, padded)
                run()
                results = run()
                ms = {s: statistics.median(times) for s, (times, *_) in results.items()}
                (_, fla_tokens, fla_logits), (_, tokens, _) = results["fla"], results["kda_opt"]
                row = dict(gate=gate, phase=phase, B=B, T=T, padded=padded, fla_ms=ms["fla"],
                           kda_opt_ms=ms["kda_opt"], speedup=ms["fla"] / ms["kda_opt"],
                           tokens_match=bool(torch.equal(fla_tokens, tokens)),
                           parting_gap=parting_gap(fla_tokens, fla_logits, tokens))
                show(row)
                rows.append(row)
                # Written row by row, so that a run cut short keeps the rows it measured.
                written = with_other_gates(rows, earlier)
                write_rows(written, out_dir, "model", FIELDS)
            del model
    plot(written, os.path.join(out_dir, f"model_{gpu_tag()}.png"), torch.cuda.get_device_name())
    return rows


def earlier_rows(path, gates):
    """The rows of the CSV at `path` (if any) whose gate is not among `gates`: a run of those gates keeps them."""
    flag = lambda v: v in (True, "True")
    return [dict(r, padded=flag(r["padded"]), tokens_match=flag(r["tokens_match"]))
            for r in read_csv(path) if r["gate"] not in gates]


def with_other_gates(rows, earlier):
    """earlier rows (earlier_rows) and rows, in GATES' order."""
    return sorted(earlier + rows, key=lambda r: list(GATES).index(r["gate"]))


def plot(rows, path, gpu: str):
    """FLA's time over kda_opt's per row (above 1: kda_opt faster), a bar per row and gate; `gpu`
    names the GPU in the title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['phase']}\nB={r['B']} T={r['T']}{' padded' if r['padded'] else ''}" for r in rows
              if r["gate"] == rows[0]["gate"]]
    gates = list(dict.fromkeys(r["gate"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.3 * len(labels) + 2, 4))
    width = 0.8 / len(gates)
    for i, gate in enumerate(gates):
        speedups = [r["speedup"] for r in rows if r["gate"] == gate]
        ax.bar([x + i * width for x in range(len(speedups))], speedups, width, label=gate)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(gates) - 1) / 2 for x in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("FLA ms / kda_opt ms")
    ax.set_title(f"FLA's KDAForCausalLM, steps with kda_opt registered ({gpu})")
    ax.legend(title="gate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
