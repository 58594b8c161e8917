"""Inputs of the intermediate stages, built with the float64 reference: Γ (log2 units, fp32 as stage 1
writes it), the chunk matrices, and the raw q, k, v, β they come from; and the plan of a call
(plan_of)."""
import math

import torch

from kda_opt import reference as ref
from kda_opt import kda_forward
from kda_opt.arguments import ForwardArguments
from kda_opt.options import L2NORM_EPS
from kda_opt.plan import Tuning, make_plan


def plan_of(tuning: Tuning = Tuning(), sms: int | None = None, **arguments):
    """make_plan of kda_forward's call on these keyword arguments (its defaults for the others)."""
    return make_plan(ForwardArguments(**arguments), tuning=tuning, sms=sms)


def stage_inputs(B, T, H, K, V=None, HV=None, gate="safe", dtype=torch.float32, device="cpu", seed=0):
    """On `device`: q, k [B, T, H, K], v [B, T, HV, V], β [B, T, HV] in dtype; a and Γ (natural log)
    in float64; gcum = Γ / ln 2 in fp32. `gate`: "safe" (a ≥ −5 per token; bounded=True) or "softplus"
    (−4·softplus(3x), down to ≈ −50, floored as stage 1 floors it: reference.floored)."""
    V, HV = V or K, HV or H
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    x = torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64).to(device)
    a = -5 * torch.sigmoid(x) if gate == "safe" else ref.floored(-4 * torch.nn.functional.softplus(3 * x))
    gamma = ref.chunk_cumsum(a)
    to = lambda t: t.to(device=device, dtype=dtype)
    return dict(q=to(q), k=to(k), v=to(v), beta=to(beta), a=a, gamma=gamma,
                gcum=(gamma / math.log(2.0)).float(), bounded=gate == "safe")


def qk_rstd(q, k):
    """[2, B, H, T] float64: 1 / sqrt(Σ x² + eps) of every q and k row, the norms stage 2 writes
    for stage 4 (use_qk_l2norm_in_kernel)."""
    return torch.stack([(x.double().pow(2).sum(-1) + L2NORM_EPS).rsqrt().transpose(1, 2) for x in (q, k)])
