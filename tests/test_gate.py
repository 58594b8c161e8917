"""Stage 1 (gate activation, the log-decay floor, chunk cumsum in log2 units) against the reference,
every gate mode."""
import math

import pytest
import torch

from kda_opt import reference as ref
from kda_opt.gate import gate_cumsum
from kda_opt.options import CHUNK, GateConfig
from kda_opt.seqs import packed
from tests.conftest import gpu, kernel_device, rel_err

MODES = {
    "sigmoid": (GateConfig(in_kernel=True, lower_bound=-5.0, safe_gate=True), True, True),
    "sigmoid_no_A": (GateConfig(in_kernel=True, lower_bound=-3.0), False, True),
    "sigmoid_no_bias": (GateConfig(in_kernel=True, lower_bound=-5.0), True, False),
    "softplus": (GateConfig(in_kernel=True), True, True),
    "preactivated": (GateConfig(), False, False),
}


def expected_gcum(g, gate, A_log, dt_bias):
    a = ref.activate_gate(g, A_log, dt_bias, gate.lower_bound) if gate.in_kernel else g.double()
    return ref.chunk_cumsum(ref.floored(a), CHUNK) / math.log(2.0)


def run_case(B, T, HV, K, mode, dtype, device):
    gate, has_a, has_bias = MODES[mode]
    gen = torch.Generator().manual_seed(B * 1000 + T)
    g = (3 * torch.randn(B, T, HV, K, generator=gen)).to(dtype)
    if mode == "preactivated":
        g = -torch.rand(B, T, HV, K, generator=gen).to(dtype)
    A_log = torch.randn(HV, generator=gen) if has_a else None
    dt_bias = torch.randn(HV * K, generator=gen) if has_bias else None
    to = lambda x: None if x is None else x.to(device)
    out = gate_cumsum(to(g), gate, to(A_log), to(dt_bias))
    assert out.dtype == torch.float32 and out.shape == (B, T, HV, K)
    return rel_err(out, expected_gcum(g, gate, A_log, dt_bias))


# Under the interpreter (numpy), sigmoid(x) of a very negative x overflows exp(−x) to inf and warns;
# 1 / (1 + inf) = 0 is the right limit.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
def test_gate_interpreter_or_gpu(mode, T):
    """Tier (b) on CPU under the interpreter (float32), or directly on the GPU when there is one."""
    assert run_case(2, T, 3, 32, mode, torch.float32, kernel_device()) < 1e-6


@pytest.mark.parametrize("K", [20, 96])
def test_gate_ragged_head_dim(K):
    """K not a multiple of the kernel's K tile: the masked columns must be neither read nor written."""
    assert run_case(1, 70, 2, K, "sigmoid", torch.float32, kernel_device()) < 1e-6


@pytest.mark.parametrize("lens", [[1, 63, 64, 65, 130, 0, 7], [200], [0, 3, 64]])
@pytest.mark.parametrize("mode", ["sigmoid", "softplus", "preactivated"])
def test_gate_packed_sequences(lens, mode):
    """Sequences packed along T (cu_seqlens): each one's chunks start at its own first token, so the
    result is the concatenation of the sequences run one by one."""
    gate, has_a, has_bias = MODES[mode]
    T, HV, K = sum(lens), 3, 32
    gen = torch.Generator().manual_seed(T)
    g = 3 * torch.randn(1, T, HV, K, generator=gen)
    if mode == "preactivated":
        g = -torch.rand(1, T, HV, K, generator=gen)
    A_log = torch.randn(HV, generator=gen) if has_a else None
    dt_bias = torch.randn(HV * K, generator=gen) if has_bias else None
    cu = torch.tensor([0, *lens]).cumsum(0)
    dev = kernel_device()
    to = lambda x: None if x is None else x.to(dev)
    out = gate_cumsum(to(g), gate, to(A_log), to(dt_bias), packed(cu.to(dev), T))
    expected = torch.cat([expected_gcum(g[:, a:b], gate, A_log, dt_bias)
                          for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    assert rel_err(out, expected) < 1e-6


def test_gate_skips_single_token_sequences(monkeypatch):
    """A table without the one-token sequences (packed(skip_single=True), as a plan that routes them
    to kda_opt/decode builds it): their rows are not written (NaN where the buffer starts as NaN),
    every other row as with the whole table, bit for bit."""
    lens, HV, K = [1, 63, 1, 65, 1, 3], 2, 32
    T, dev = sum(lens), kernel_device()
    g = (3 * torch.randn(1, T, HV, K, generator=torch.Generator().manual_seed(3))).to(dev)
    cu = torch.tensor([0, *lens]).cumsum(0).to(dev)
    gate = MODES["sigmoid"][0]
    plain, without = gate_cumsum(g, gate, seqs=packed(cu, T)), packed(cu, T, skip_single=True)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    skipped = gate_cumsum(g, gate, seqs=without)
    single = torch.tensor([n == 1 for n in lens for _ in range(n)])
    assert skipped[:, single].isnan().all() and not plain[:, single].isnan().any()
    assert torch.equal(skipped[:, ~single], plain[:, ~single])


@pytest.mark.parametrize("mode", ["softplus", "preactivated"])
def test_gate_floor(mode):
    """A log-decay below LOG_DECAY_FLOOR (decay < 2^-24) counts as the floor: Γ falls by exactly 24
    (log2 units) per such token, at most, whatever the gate; milder tokens keep their own value."""
    gate = MODES[mode][0]
    g = torch.tensor([0.0, 40.0, -3.0, 1e4, 2.0]).view(1, 5, 1, 1).expand(1, 5, 1, 4).clone()
    if mode == "preactivated":
        g = torch.tensor([-0.5, -100.0, -3.0, -float("inf"), -16.0]).view(1, 5, 1, 1).expand(1, 5, 1, 4).clone()
    A_log = torch.zeros(1) if mode == "softplus" else None
    dev = kernel_device()
    out = gate_cumsum(g.to(dev), gate, None if A_log is None else A_log.to(dev), None).cpu()
    steps = -torch.diff(torch.cat([torch.zeros(1, 1, 1, 4), out], 1), dim=1) / 24   # in units of the floor
    a = ref.activate_gate(g, A_log) if gate.in_kernel else g.double()
    expected = torch.minimum(-a / (24 * math.log(2.0)), torch.ones(()))
    assert torch.isfinite(out).all()
    assert torch.allclose(steps.double(), expected, rtol=1e-5, atol=1e-6)   # the GPU's exp and log
    assert (expected == 1).sum() >= 8 and (expected < 1).sum() >= 8      # both sides of the floor


@gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 1000, 8192])
def test_gate_gpu(mode, dtype, T):
    assert run_case(2, T, 4, 128, mode, dtype, "cuda") < 1e-5


@pytest.mark.parametrize("config,bounded", [
    (GateConfig(in_kernel=True, lower_bound=-5.0, safe_gate=True), True),
    (GateConfig(in_kernel=True, lower_bound=-3.0), True),
    (GateConfig(in_kernel=True, lower_bound=-6.0), False),      # below the bound stage 2 assumes
    (GateConfig(in_kernel=True, lower_bound=0.0), False),       # outside safe_gate's range, as make_plan says
    (GateConfig(in_kernel=True), False),                         # softplus: unbounded
    (GateConfig(in_kernel=False, lower_bound=-5.0, safe_gate=True), False),  # a promise, not a construction
])
def test_gate_bounded(config, bounded):
    """Only the sigmoid gate in kernel with lower_bound in [−5, 0) lets stage 2 skip its span check."""
    assert config.bounded is bounded


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["sigmoid", "softplus"])
def test_gate_parameters_read_in_their_own_dtype(mode, dtype):
    """A_log and dt_bias of a 16-bit dtype (a bf16 model's parameters) are read as fp32 in the kernel:
    the same Γ as the same values passed as fp32, bit for bit, with no conversion before the launch."""
    gate = MODES[mode][0]
    gen = torch.Generator().manual_seed(5)
    dev = kernel_device()
    g = (3 * torch.randn(1, 70, 2, 32, generator=gen)).to(dev)
    A_log, dt_bias = torch.randn(2, generator=gen).to(dev, dtype), torch.randn(64, generator=gen).to(dev, dtype)
    assert torch.equal(gate_cumsum(g, gate, A_log, dt_bias), gate_cumsum(g, gate, A_log.float(), dt_bias.float()))
