"""Random, non-zero inputs for kda_forward in each gate mode: shared by the tests, the benchmark
and the profiling driver, so all three exercise the same function."""
import torch

# name → kda_forward gate arguments (A_log / dt_bias are drawn when the mode uses them)
GATE_MODES = {
    "safe": dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),          # SPEC §5 default
    "safe_no_A": dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),     # A_log None
    "softplus": dict(use_gate_in_kernel=True),                                        # unbounded decay
    "preactivated": dict(use_gate_in_kernel=False),                                   # g is a ≤ 0
}


def random_inputs(B, T, H, K, V=None, HV=None, gate="safe", dtype=torch.bfloat16, device="cuda",
                  seed=0, initial_state=False, output_final_state=True, seqlens=None, l2norm=False,
                  beta_logits=False, state_v_first=False):
    """kda_forward keyword arguments: q, v, g ~ N(0, 1), k unit-norm per head (as the Kimi layer
    feeds it), β ~ U(0, 1), A_log, dt_bias ~ 0.5·N(0, 1), initial state ~ N(0, 1) if asked.
    seqlens: pack sequences of these lengths along T (B = 1, T = their sum), with cu_seqlens on the
    device and cu_seqlens_cpu. l2norm: q and k ~ N(0, 1) normalised in kernel
    (use_qk_l2norm_in_kernel). beta_logits: beta as logits, logit(β), sigmoid in kernel.
    state_v_first: the initial state [N, HV, V, K] (state_v_first=True)."""
    V, HV = V or K, HV or H
    if seqlens is not None and (B != 1 or sum(seqlens) != T):
        raise ValueError(f"seqlens {seqlens} need B = 1 and T = their sum, got B={B}, T={T}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)
    k = randn(B, T, H, K)
    args = dict(
        q=randn(B, T, H, K), k=k if l2norm else k / k.norm(dim=-1, keepdim=True), v=randn(B, T, HV, V),
        g=randn(B, T, HV, K), beta=torch.rand(B, T, HV, generator=gen),
        output_final_state=output_final_state, **GATE_MODES[gate],
    )
    if l2norm:
        args["use_qk_l2norm_in_kernel"] = True
    if beta_logits:
        args.update(beta=torch.logit(args["beta"], eps=1e-6), use_beta_sigmoid_in_kernel=True)
    if state_v_first:
        args["state_v_first"] = True
    if gate == "preactivated":
        args["g"] = -torch.rand(B, T, HV, K, generator=gen)  # log-decay in (−1, 0]
    if gate in ("safe", "softplus"):
        args["A_log"] = 0.5 * randn(HV)
    if gate != "preactivated":
        args["dt_bias"] = 0.5 * randn(HV * K)
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
