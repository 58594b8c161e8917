"""The tests' random, non-zero inputs for kda_forward in each gate mode (`from inputs import ...`:
pytest puts tests/ on the path). The benchmark and the profiling driver draw theirs with
scripts/kda_bench/inputs.py, which makes only the benchmark's calls and draws the same numbers as
random_inputs does for them (tests/test_bench.py holds the two equal)."""
import torch

# name → kda_forward gate arguments (A_log / dt_bias are drawn when the mode uses them)
GATE_MODES = {
    "safe": dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),          # the default call
    "safe_no_A": dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),     # A_log None
    "softplus": dict(use_gate_in_kernel=True),                                        # unbounded decay
    "preactivated": dict(use_gate_in_kernel=False),                                   # g is a ≤ 0
}


# How fast the gate forgets (docs/DESIGN.md, How speed is measured): A_log = log U(1, 16) as the Kimi layer initialises it (FLA's
# KimiDeltaAttention: A = exp(A_log) ∈ [1, 16]), g ~ N(0, 1), and dt_bias either
#   "fast":  ~ N(0, 1), the fast-forgetting channels of a trained gate (per-token log-decay of
#            order 1–10 in the fastest channels with the softplus gate), or
#   "layer": softplus⁻¹(U(0.001, 0.1)), as the layer initialises it (slow decay).
DECAYS = ("fast", "layer")
# kda_forward's arguments with a row per token.
PER_TOKEN = ("q", "k", "v", "g", "beta")


def random_inputs(B, T, H, K, V=None, HV=None, gate="safe", dtype=torch.bfloat16, device="cuda",
                  seed=0, initial_state=False, output_final_state=True, seqlens=None, l2norm=False,
                  beta_logits=False, state_v_first=False, decay="fast", draw_on="cpu"):
    """kda_forward keyword arguments: q, v, g ~ N(0, 1), k unit-norm per head (as the Kimi layer
    feeds it), β ~ U(0, 1), A_log and dt_bias as `decay` says (DECAYS), initial state ~ N(0, 1) if
    asked. seqlens: pack sequences of these lengths along T (B = 1, T = their sum), with cu_seqlens
    on the device and cu_seqlens_cpu. l2norm: q and k ~ N(0, 1) normalised in kernel
    (use_qk_l2norm_in_kernel). beta_logits: beta as logits, logit(β), sigmoid in kernel.
    state_v_first: the initial state [N, HV, V, K] (state_v_first=True). draw_on: the device whose
    generator draws the numbers (the CPU's: the same inputs on any machine; a GPU's: fast enough
    for millions of tokens, the same on every GPU of one kind)."""
    V, HV = V or K, HV or H
    if seqlens is not None and (B != 1 or sum(seqlens) != T):
        raise ValueError(f"seqlens {seqlens} need B = 1 and T = their sum, got B={B}, T={T}")
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    gen = torch.Generator(device=draw_on).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, device=draw_on)
    uniform = lambda lo, hi, *s: torch.empty(*s, device=draw_on).uniform_(lo, hi, generator=gen)
    k = randn(B, T, H, K)
    args = dict(
        q=randn(B, T, H, K), k=k if l2norm else k / k.norm(dim=-1, keepdim=True), v=randn(B, T, HV, V),
        g=randn(B, T, HV, K), beta=torch.rand(B, T, HV, generator=gen, device=draw_on),
        output_final_state=output_final_state, **GATE_MODES[gate],
    )
    if l2norm:
        args["use_qk_l2norm_in_kernel"] = True
    if beta_logits:
        args.update(beta=torch.logit(args["beta"], eps=1e-6), use_beta_sigmoid_in_kernel=True)
    if state_v_first:
        args["state_v_first"] = True
    if gate == "preactivated":
        args["g"] = -torch.rand(B, T, HV, K, generator=gen, device=draw_on)  # log-decay in (−1, 0]
    if gate in ("safe", "softplus"):
        args["A_log"] = uniform(1.0, 16.0, HV).log()
    if gate != "preactivated":
        args["dt_bias"] = randn(HV * K) if decay == "fast" else uniform(0.001, 0.1, HV * K).expm1().log()
    N = B
    if seqlens is not None:
        N = len(seqlens)
        args["cu_seqlens_cpu"] = torch.tensor([0, *seqlens]).cumsum(0)  # int64, as FLA documents it
        args["cu_seqlens"] = args["cu_seqlens_cpu"].to(device)
    if initial_state:
        args["initial_state"] = randn(N, HV, V, K) if state_v_first else randn(N, HV, K, V)
    low_precision = ("q", "k", "v", "g", "beta")
    return {n: (x.to(device, dtype if n in low_precision else torch.float32)
                if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in args.items()}


def ill_conditioned_inputs(B, T, H, K, gate="safe", neg_eigval=False, spread=0.05, seed=0, seqlens=None,
                           device="cuda", dtype=torch.bfloat16):
    """random_inputs (with an initial state) made ill-conditioned chunk by chunk: the keys of each
    64-token chunk near-collinear (one direction per chunk and head, plus spread · N(0, 1), then
    normalised), and β at its top: in (0.98, 1], or with neg_eigval in (1.96, 2] (beta as logits,
    allow_neg_eigval). Then I + Akk is far from I and its inverse's terms do not decay."""
    args = random_inputs(B, T, H, K, gate=gate, dtype=dtype, device=device, seed=seed, initial_state=True,
                         seqlens=seqlens, beta_logits=neg_eigval)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    chunks = -(-T // 64)
    direction = torch.randn(B, chunks, 1, H, K, generator=gen).expand(B, chunks, 64, H, K).reshape(B, -1, H, K)
    k = torch.nn.functional.normalize(direction[:, :T] + spread * torch.randn(B, T, H, K, generator=gen), dim=-1)
    top = 0.02 * torch.rand(args["beta"].shape, generator=gen)
    beta = torch.logit(1 - top / 2, eps=1e-7) if neg_eigval else 1 - top
    args.update(k=k.to(device, dtype), beta=beta.to(device, dtype))
    if neg_eigval:
        args["allow_neg_eigval"] = True
    return args
