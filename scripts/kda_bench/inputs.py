"""The benchmark's inputs: kda_forward's keyword arguments for the calls it times, and for those only
(draw_call). Case.inputs draws them for every mode's rows and so for the profiling drivers
(scripts/run_profile.py, scripts/bench_stages.py); --test host's decode rows and --test decode's
steps call draw_call themselves. The benchmark's calls have K = V and as many value heads as query
heads, a gate mode of GATES, a decay of DECAYS and an argument layout of LAYOUTS (common.CONFIGS
names one per --config).

A case's numbers are those the profiles in profiles/ were measured on: one seeded generator draws
k, q, v, g ~ N(0, 1), β ~ U(0, 1), then what the gate mode takes (g anew for the preactivated gate;
A_log, dt_bias), then the initial state, in that order. The tests draw theirs, the benchmark's calls
among many others, with tests/inputs.py: tests/test_bench.py holds the two equal on these calls."""
import torch

# The gate modes the benchmark times (Case.gate) → kda_forward's gate arguments.
GATES = {
    "safe": dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),    # the default call
    "softplus": dict(use_gate_in_kernel=True),                                  # unbounded decay
    "preactivated": dict(use_gate_in_kernel=False),                             # g: the log-decay, in (−1, 0]
}
# --decay → dt_bias [H·K] (docs/DESIGN.md, How speed is measured; A_log = log U(1, 16) either way, as the
# Kimi layer initialises it): "fast" ~ N(0, 1), the fast-forgetting channels of a trained gate, or
# "layer" softplus⁻¹(U(0.001, 0.1)), as the layer initialises it (slow decay).
DT_BIAS = {
    "fast": lambda draws, n: draws.normal(n),
    "layer": lambda draws, n: draws.uniform(0.001, 0.1, n).expm1().log(),
}
DECAYS = tuple(DT_BIAS)
# A layout → the flags of kda_forward's call: k drawn unit-norm per head, as the Kimi layer feeds it
# (default); q and k normalised in kernel (l2norm); the Kimi layer's call, FlashKDA's only one (kimi):
# l2norm, β passed as logit(β), the state V-first [N, H, V, K].
KIMI = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)
LAYOUTS = {"default": {}, "l2norm": dict(use_qk_l2norm_in_kernel=True), "kimi": KIMI}


class Draws:
    """The numbers of one call, from one generator seeded with `seed` on the device `on`: the CPU's
    (the same inputs on any machine) or a GPU's (fast enough for cp's millions of tokens; the same
    on every GPU of one kind)."""

    def __init__(self, seed, on):
        self.on, self.generator = on, torch.Generator(device=on).manual_seed(seed)

    def normal(self, *shape):
        return torch.randn(*shape, generator=self.generator, device=self.on)

    def unit(self, *shape):
        return torch.rand(*shape, generator=self.generator, device=self.on)

    def uniform(self, low, high, *shape):
        return torch.empty(*shape, device=self.on).uniform_(low, high, generator=self.generator)


def draw_call(B, T, H, K, gate="safe", dtype=torch.bfloat16, seed=0, seqlens=None, layout="default",
              initial_state=False, decay="fast", device="cuda", draw_on="cpu"):
    """kda_forward's keyword arguments for one of the benchmark's calls, on `device`: B sequences of T
    tokens, or `seqlens` packed along T (B = 1, T their sum; cu_seqlens and cu_seqlens_cpu), H heads
    with K = V; q, k, v, g and β in dtype, the gate parameters fp32; the final state asked for, an
    initial state [N, H, K, K] fp32 ~ N(0, 1) passed if `initial_state`. Drawn on `draw_on` (Draws)."""
    mode, flags, dt_bias = GATES[gate], LAYOUTS[layout], DT_BIAS[decay]
    if seqlens is not None and (B, T) != (1, sum(seqlens)):
        raise ValueError(f"packed sequences {seqlens} make B = 1 and T = {sum(seqlens)}, not B={B}, T={T}")
    draws = Draws(seed, draw_on)
    k, q, v, g = (draws.normal(B, T, H, K) for _ in range(4))
    beta = draws.unit(B, T, H)
    if not flags.get("use_qk_l2norm_in_kernel"):
        k = k / k.norm(dim=-1, keepdim=True)
    if flags.get("use_beta_sigmoid_in_kernel"):
        beta = torch.logit(beta, eps=1e-6)
    if gate == "preactivated":
        g = -draws.unit(B, T, H, K)
    tokens = dict(q=q, k=k, v=v, g=g, beta=beta)
    args = {n: x.to(device, dtype) for n, x in tokens.items()}
    args.update(output_final_state=True, **mode, **flags)
    fp32 = lambda x: x.to(device, torch.float32)
    if gate != "preactivated":
        args["A_log"] = fp32(draws.uniform(1.0, 16.0, H).log())
        args["dt_bias"] = fp32(dt_bias(draws, H * K))
    if seqlens is not None:
        ends = torch.tensor([0, *seqlens]).cumsum(0)        # int64, as FLA documents cu_seqlens
        args.update(cu_seqlens_cpu=ends, cu_seqlens=ends.to(device))
    if initial_state:
        args["initial_state"] = fp32(draws.normal(B if seqlens is None else len(seqlens), H, K, K))
    return args
