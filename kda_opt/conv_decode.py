"""`kda_conv_decode`: a serving engine's whole decode step in one kernel, the short convolution's
update and the token recurrence, as Kimi-Linear's and K3's layers run it (SGLang's
`causal_conv1d_update` with SiLU, then its packed decode). Per request n (one token) and head h:
    x = mixed_qkv[n] (channels [q | k | v], H·K + H·K + H·V);  w = conv_state[slot] (the last 3 inputs)
    y_c = silu(b_c + Σ_{j<3} W[c, j] w[j, c] + W[c, 3] x_c) per channel c;  conv_state[slot] ← (w[1], w[2], x)
    q, k, v = y's channels of head h (q, k L2-normalised, q · scale), β = sigmoid(beta), a = the gate
    S ← Diag(exp a) S;  u = β (v − Sᵀ k);  S ← S + k uᵀ;  o = Sᵀ q        (kda_opt/recurrence's step)
with S = ssm_state[slot] read and written in place. One program per (request, head, V block of BV
columns), the launch of kda_decode's V-first fp32 decode (decode_plan.decode_launch): each convolves
its head's q and k channels and its block's v channels. Query and value heads are one set (H = HV), so
each channel of the window is read by its head's programs alone: a block shifts its own v channels
once it has read them, and the last of the head's programs to have read its q and k channels (a count
per (request, head), atomic, set back to 0 by that program) shifts those.
The count is released before the program stores anything, so its fence waits on no store.
A slot that is negative, past the pool or the pad slot reads a zero window and a zero state and
writes neither (its o is the zero state's).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .arguments import ConvDecodeArguments
from .checks import (SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, check_gate_parameters, check_pad_slot, checked_scale,
                     validate_devices)
from .decode_plan import GRID_AXIS_MAX, decode_launch
from .gate import gate_mode, log_decay
from .launch import Kernels, triton_launch
from .options import GateConfig
from .plan_cache import Entry, cached, signature
from .recurrence import _slot, l2normalised, step

# The convolution's width: the window holds its last WIDTH − 1 inputs (Kimi's short convolution).
WIDTH = 4


@triton.jit(do_not_specialize=["slots", "pad_slot"])
def conv_decode_kernel(
    x, g, beta, A_log, dt_bias, o,             # x [N, 2·H·K + H·V]; g [N, H, K]; beta [N, H]; o [N, H, V]
    window, weight, bias,                      # window [slots, 3, channels]; weight [channels, 4]; bias [channels]
    pool, indices, readers,                    # pool [slots, H, V, K]; indices [N]; readers [N·H] zeros
    slots, pad_slot, scale, lower_bound,
    S_X: tl.constexpr, S_G: tl.constexpr, S_GH: tl.constexpr, S_B: tl.constexpr, S_O: tl.constexpr,
    S_WIN: tl.constexpr, S_ROW: tl.constexpr, S_WC: tl.constexpr, S_WJ: tl.constexpr, S_POOL: tl.constexpr,
    S_IDX: tl.constexpr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, PAD: tl.constexpr,
):
    # Grid (V / BV, H, N): a (request, head)'s V blocks are neighbouring programs (kda_opt/recurrence's
    # decode_kernel with blocks first).
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    slot = _slot(indices, i_n, 0, True, slots, pad_slot, S_IDX, PAD)
    o_k, o_v = tl.arange(0, K), i_v * BV + tl.arange(0, BV)
    c_q, c_k, c_v = i_h * K + o_k, H * K + i_h * K + o_k, 2 * H * K + i_h * V + o_v
    # The head's state block [K, BV] at (channel, column), V-first in the pool.
    o_s = i_h * V * K + o_v[None, :] * K + o_k[:, None]
    b_s = tl.zeros([K, BV], dtype=tl.float32)
    if slot >= 0:
        b_s = tl.load(pool + slot * S_POOL + o_s).to(tl.float32)
    row = x + i_n * S_X
    win = window + tl.maximum(slot, 0) * S_WIN
    b_q, q1, q2, q3 = _convolved(row, win, weight, bias, c_q, slot, S_ROW, S_WC, S_WJ, HAS_CONV_BIAS)
    b_k, k1, k2, k3 = _convolved(row, win, weight, bias, c_k, slot, S_ROW, S_WC, S_WJ, HAS_CONV_BIAS)
    b_v, v1, v2, v3 = _convolved(row, win, weight, bias, c_v, slot, S_ROW, S_WC, S_WJ, HAS_CONV_BIAS)
    b_q, b_k = l2normalised(b_q) * scale, l2normalised(b_k)
    b_d = tl.exp(log_decay(tl.load(g + i_n * S_G + i_h * S_GH + o_k).to(tl.float32), A_log, dt_bias, i_h, o_k,
                           lower_bound, K, MODE, True, HAS_BIAS))
    b_beta = tl.sigmoid(tl.load(beta + i_n * S_B + i_h).to(tl.float32))
    b_s, b_o = step(b_s, b_q, b_k, b_v, b_d, b_beta)
    # The head's q and k channels are read by each of its V blocks: a block counts itself a reader
    # once their values are used and before it stores anything (a release that waits on no store);
    # the last reader takes the count back to 0 (an acquire) and shifts them.
    read = tl.atomic_add(readers + i_n * H + i_h, 1, sem="release")
    tl.store(o + i_n * S_O + i_h * V + o_v, b_o.to(o.dtype.element_ty))
    if slot >= 0:
        tl.store(pool + slot * S_POOL + o_s, b_s.to(pool.dtype.element_ty))
        # The block's v channels are its own: shifted once every thread's loads of them are used.
        tl.debug_barrier()
        _shifted(win, c_v, v1, v2, v3, S_ROW)
    if read == V // BV - 1:
        tl.atomic_xchg(readers + i_n * H + i_h, 0, sem="acquire")
        if slot >= 0:
            _shifted(win, c_q, q1, q2, q3, S_ROW)
            _shifted(win, c_k, k1, k2, k3, S_ROW)


@triton.jit
def _convolved(row, win, weight, bias, c, slot, S_ROW, S_WC, S_WJ, HAS_CONV_BIAS: tl.constexpr):
    """Channels c of the step's input row convolved with their window (zeros where slot < 0) and
    SiLU-activated, fp32; and the window's last two inputs and the row's, as they are (the new window)."""
    live = c * 0 + slot >= 0        # a block: the interpreter refuses a loaded scalar as a mask
    w0 = tl.load(win + c, mask=live, other=0.0)
    w1 = tl.load(win + S_ROW + c, mask=live, other=0.0)
    w2 = tl.load(win + 2 * S_ROW + c, mask=live, other=0.0)
    x = tl.load(row + c)
    acc = (w0.to(tl.float32) * tl.load(weight + c * S_WC).to(tl.float32)
           + w1.to(tl.float32) * tl.load(weight + c * S_WC + S_WJ).to(tl.float32)
           + w2.to(tl.float32) * tl.load(weight + c * S_WC + 2 * S_WJ).to(tl.float32)
           + x.to(tl.float32) * tl.load(weight + c * S_WC + 3 * S_WJ).to(tl.float32))
    if HAS_CONV_BIAS:
        acc += tl.load(bias + c).to(tl.float32)
    return acc * tl.sigmoid(acc), w1, w2, x


@triton.jit
def _shifted(win, c, w1, w2, x, S_ROW):
    """The window's channels c shifted by one input: (w1, w2, x), x in the window's dtype."""
    tl.store(win + c, w1)
    tl.store(win + S_ROW + c, w2)
    tl.store(win + 2 * S_ROW + c, x.to(win.dtype.element_ty))


@dataclass(frozen=True)
class ConvDecodePlan:
    """One kda_conv_decode call, resolved: N requests of one token, H heads of K and V channels, the
    pool's and window's slots."""
    N: int
    H: int
    K: int
    V: int
    slots: int
    pad_slot: int | None
    scale: float
    gate: GateConfig
    block_v: int
    num_warps: int


def make_conv_decode_plan(a: ConvDecodeArguments, sms: int | None = None) -> ConvDecodePlan:
    """kda_conv_decode's arguments checked (raising ValueError with what is wrong) and resolved; sms:
    the GPU's SM count, for the launch; None reads it from mixed_qkv's device, which must then be a
    CUDA GPU with every tensor on it (the CPU tests pass a count)."""
    x, pool, window, weight = a.mixed_qkv, a.ssm_state, a.conv_state, a.conv_weight
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"mixed_qkv must be [N, channels] with dense channels, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"mixed_qkv must be fp32, bf16 or fp16, got {x.dtype}")
    if pool.dim() != 4 or pool.dtype not in SUPPORTED_DTYPES or not pool[0].is_contiguous():
        raise ValueError(f"ssm_state must be a pool [slots, H, V, K] of dense fp32, bf16 or fp16 rows, got "
                         f"{tuple(pool.shape)} {pool.dtype} strides {pool.stride()}")
    N, channels = x.shape
    slots, H, V, K = pool.shape
    if K not in SUPPORTED_HEAD_DIMS or V not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims must be 64 or 128, got K={K}, V={V}")
    if channels != H * (2 * K + V):
        raise ValueError(f"mixed_qkv's {channels} channels are not q, k and v of the pool's {H} heads "
                         f"(2·H·K + H·V = {H * (2 * K + V)}): H query and value heads alike")
    if a.g.shape not in ((N, H * K), (N, H, K)) or a.g.stride(-1) != 1:
        raise ValueError(f"g must be [N, H·K] or [N, H, K] = ({N}, {H}, {K}) with dense channels, got "
                         f"{tuple(a.g.shape)}")
    if a.beta.shape not in ((N, H), (1, N, H)):
        raise ValueError(f"beta must be [N, H] = ({N}, {H}), got {tuple(a.beta.shape)}")
    if window.shape != (slots, WIDTH - 1, channels) or window.stride(-1) != 1 or window.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"conv_state must be [slots, {WIDTH - 1}, channels] = ({slots}, {WIDTH - 1}, {channels}) "
                         f"with dense channels, got {tuple(window.shape)} strides {window.stride()}")
    if weight.shape != (channels, WIDTH):
        raise ValueError(f"conv_weight must be [channels, {WIDTH}] = ({channels}, {WIDTH}), got {tuple(weight.shape)}")
    if a.conv_bias is not None and a.conv_bias.shape != (channels,):
        raise ValueError(f"conv_bias must be [channels] = ({channels},), got {tuple(a.conv_bias.shape)}")
    if a.A_log is None:
        raise ValueError("A_log must be given: the gate is activated in the kernel")
    check_gate_parameters(a.A_log, a.dt_bias, H, K)
    if a.lower_bound is not None and not a.lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {a.lower_bound}")
    indices = a.state_indices
    if indices.shape != (N,) or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be [N] = ({N},) int32 or int64, got {tuple(indices.shape)} {indices.dtype}")
    check_pad_slot(a.pad_slot, indices)
    if a.out is not None and (a.out.shape != (N, H, V) or a.out.dtype != x.dtype or not a.out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [N, H, V] = ({N}, {H}, {V}) tensor of mixed_qkv's dtype, got "
                         f"{tuple(a.out.shape)} {a.out.dtype}")
    if N > GRID_AXIS_MAX:
        raise ValueError(f"at most {GRID_AXIS_MAX} requests a step, got {N}")
    if sms is None:
        validate_devices(x, g=a.g, beta=a.beta, conv_state=window, conv_weight=weight, conv_bias=a.conv_bias,
                         ssm_state=pool, state_indices=indices, A_log=a.A_log, dt_bias=a.dt_bias, out=a.out)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    block_v, num_warps = decode_launch(N * H, V, True, True, sms)
    return ConvDecodePlan(N=N, H=H, K=K, V=V, slots=slots, pad_slot=a.pad_slot,
                          scale=K ** -0.5 if a.scale is None else checked_scale(a.scale),
                          gate=GateConfig(in_kernel=True, lower_bound=a.lower_bound), block_v=block_v,
                          num_warps=num_warps)


def kda_conv_decode(mixed_qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, conv_state: torch.Tensor,
                    conv_weight: torch.Tensor, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                    A_log: torch.Tensor, conv_bias: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                    lower_bound: float | None = None, scale: float | None = None, pad_slot: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    r"""A decode step from the projection's output: the short convolution's update and kda_decode's
    token recurrence in one kernel (module docstring), one token per request, both caches in place.

    Args:
        mixed_qkv: ``[N, 2·H·K + H·V]`` the step's inputs before the convolution, q's, k's and v's
            channels in that order (dense channels; fp32, bf16 or fp16).
        g: ``[N, H·K]`` or ``[N, H, K]`` the raw gate, activated in the kernel as kda_decode's
            ``use_gate_in_kernel`` (softplus of ``g + dt_bias`` times ``−exp(A_log)``, or with
            ``lower_bound`` the bounded sigmoid); beta: ``[N, H]`` logits (β = sigmoid(beta)).
        conv_state: ``[slots, 3, channels]`` each slot's last three inputs, oldest first (SGLang's
            ``conv[0]`` layout; dense channels): read, then shifted by this step's input.
        conv_weight: ``[channels, 4]`` the depthwise causal convolution's taps (tap 3 on the current
            input); conv_bias: ``[channels]`` or None.
        ssm_state: the state pool ``[slots, H, V, K]`` (V-first, dense rows; fp32, bf16 or fp16).
        state_indices: ``[N]`` int32/int64, request n's slot of both caches. A negative slot, one at or
            past ``slots`` and ``pad_slot`` read zeros and write nothing.
        A_log ``[H]``, dt_bias ``[H·K]`` or None, lower_bound, scale (None: K^-½): as kda_decode's.
        out: o's storage, contiguous ``[N, H, V]`` of mixed_qkv's dtype.

    q and k are L2-normalised in the kernel, as SGLang's and vLLM's decode steps do; the query and
    value heads are one set (H each). Returns o ``[N, H, V]`` in mixed_qkv's dtype. Needs a CUDA GPU of
    compute capability 9.0; no host-device synchronisation (it may be captured in a CUDA graph).
    """
    arguments = ConvDecodeArguments(
        mixed_qkv=mixed_qkv, g=g, beta=beta, conv_state=conv_state, conv_weight=conv_weight, ssm_state=ssm_state,
        state_indices=state_indices, A_log=A_log, conv_bias=conv_bias, dt_bias=dt_bias, lower_bound=lower_bound,
        scale=scale, pad_slot=pad_slot, out=out)
    entry = conv_decode_plan_for(arguments)
    return run(entry.plan, arguments, kernels=entry.kernels)


def conv_decode_plan_for(arguments: ConvDecodeArguments) -> Entry:
    """make_conv_decode_plan(arguments) made once per call signature (kda_opt/plan_cache), in its Entry."""
    key = signature(arguments)
    return cached(None if key is None else ("conv_decode", *key), lambda: make_conv_decode_plan(arguments))[0]


def run(plan: ConvDecodePlan, a: ConvDecodeArguments, *, kernels: Kernels | None = None) -> torch.Tensor:
    """kda_conv_decode's call under its plan: o [N, H, V]."""
    x, window, weight, pool = a.mixed_qkv, a.conv_state, a.conv_weight, a.ssm_state
    o = x.new_empty(plan.N, plan.H, plan.V) if a.out is None else a.out
    g = a.g.reshape(plan.N, plan.H, plan.K)
    beta = a.beta.reshape(plan.N, plan.H)
    triton_launch(
        conv_decode_kernel, (plan.V // plan.block_v, plan.H, plan.N), kernels,
        x, g, beta, a.A_log, a.dt_bias, o, window, weight, x if a.conv_bias is None else a.conv_bias, pool,
        a.state_indices, readers(x.device, plan.N * plan.H), plan.slots, -1 if plan.pad_slot is None else plan.pad_slot, plan.scale,
        float(plan.gate.lower_bound or 0.0),
        x.stride(0), g.stride(0), g.stride(1), beta.stride(0), o.stride(0), window.stride(0), window.stride(1),
        weight.stride(0), weight.stride(1), pool.stride(0), a.state_indices.stride(0),
        plan.H, plan.K, plan.V, plan.block_v, gate_mode(plan.gate), a.dt_bias is not None, a.conv_bias is not None,
        plan.pad_slot is not None, num_warps=plan.num_warps,
    )
    return o


_readers: dict[torch.device, torch.Tensor] = {}


def readers(device: torch.device, n: int) -> torch.Tensor:
    """The kernel's counts of readers, n int32 zeros on `device` (at least): one buffer a device, which
    each launch leaves zero, grown where a launch needs more (inside a CUDA graph's capture too: its
    zeros are then the graph's first work)."""
    buffer = _readers.get(device)
    if buffer is None or buffer.numel() < n:
        buffer = _readers[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buffer
