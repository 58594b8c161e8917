"""kda_opt as vLLM's KDA kernels (vllm 0.33): `register` is the `vllm.general_plugins` entry point
(pyproject.toml). With VLLM_KDA_OPT=1 it replaces, as each module is imported, four functions that
vLLM's KDA layers call (Kimi-Linear's `KimiGatedDeltaNetAttention._forward` and K3's
`KimiK3DeltaAttention._forward`):

    vllm.models.kimi_k3.nvidia.ops.third_party.kda (vLLM's copy of FLA, imported inside each forward):
        chunk_kda_with_fused_gate           prefill, after the short convolution       -> kda_forward
        fused_recurrent_kda                 speculative decode, the pool in place      -> kda_decode
        fused_recurrent_kda_packed_decode   decode from the convolution's output       -> kda_decode
    vllm.models.kimi_k3.nvidia.kda (K3's layer, a module-level function it calls by name):
        _flashkda_prefill                   K3's prefill on Hopper (its FlashKDA backend, chosen by
                                            vLLM's resolve_kda_prefill_backend)        -> kda_forward

Each replacement has vLLM's signature and semantics (its out buffers, the V-first pool [slots, H, V, K]
in its dtype, slot 0 and negative slots as padding: never read nor written, their decode rows of o
zero) and runs vLLM's own function on any call kda_opt does not compute (off Hopper, head dims other
than 64 and 128, other dtypes: `computes`). K3's fused CUDA decode (`ops.fused_kda_decode`: the short
convolution, KDA and the gated norm in one kernel) is not a function of these and stays vLLM's.
Without the variable, or without vLLM, nothing is replaced. vllm is never imported here: a
replacement is made when vLLM itself imports the module (`after_import`).

The math of each call (A_log [H], dt_bias [H·K], β logits, q/k L2-normalised in kernel):
    a = lower_bound · sigmoid(exp(A_log) · (g + dt_bias))   with a lower bound (K3)
    a = −exp(A_log) · softplus(g + dt_bias)                  without (Kimi-Linear)
    S ← (I − β k kᵀ) Diag(exp a) S + β k vᵀ,   o = K^−½ · qᵀ S
"""
import functools
import importlib.abc
import os
import sys

import torch

from . import engines
from .decode import kda_decode
from .forward import kda_forward
from .options import CHUNK

SWITCH = "VLLM_KDA_OPT"           # 1: vLLM's KDA functions are replaced by kda_opt's
KERNELS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
LAYER = "vllm.models.kimi_k3.nvidia.kda"
PAD_SLOT = 0                      # vLLM's NULL_BLOCK_ID: the slot its metadata pads with
# checkpoint_every for K3's one checkpoint per sequence: a multiple of 64 past any sequence's length,
# so that each sequence has a row after its first checkpoint_offsets[n] tokens and one at its end.
ONE_CHECKPOINT = 1 << 24
# Which calls kda_opt takes where it computes them: those --test vllm measured at least as fast as vLLM's
# own (CUDA graph replays for decode; docs/BENCHMARKING.md, "vLLM").
PACKED_DECODE_FROM = 128     # the fewest requests of a packed decode step it takes (kda_decode and the
                             # zeroing of padding rows are two launches to vLLM's one)
TAKES_SPEC_DECODE = False    # speculative decode: vLLM's kernel ahead at 2-4 drafts
FLASHKDA_WAVES = 2           # K3's FlashKDA prefill taken up to N·H ≤ this many SMs' worth of (request,
                             # head) pairs, FlashKDA's one CTA each: past it FlashKDA's GPU is full


def register() -> None:
    """The `vllm.general_plugins` entry point, run by vLLM's load_general_plugins in each of its
    processes: where VLLM_KDA_OPT=1, the functions of the module docstring are replaced as their
    modules are imported (at once where they already are)."""
    if os.environ.get(SWITCH, "0") != "1":
        return
    after_import(KERNELS, replace_kernels)
    after_import(LAYER, replace_layer)


def replace_kernels(module) -> None:
    """vLLM's three KDA functions in `module` (KERNELS) replaced by kda_opt's."""
    for name, ours in (("chunk_kda_with_fused_gate", prefill), ("fused_recurrent_kda", spec_decode),
                       ("fused_recurrent_kda_packed_decode", packed_decode)):
        _replace(module, name, ours)


def replace_layer(module) -> None:
    """K3's `_flashkda_prefill` in `module` (LAYER) replaced by kda_opt's."""
    _replace(module, "_flashkda_prefill", flashkda_prefill)


def _replace(module, name: str, ours) -> None:
    """module.name ← ours(vLLM's function), which holds vLLM's as `vllm_own` (once: a replacement is
    not replaced again)."""
    own = getattr(module, name)
    if not hasattr(own, "vllm_own"):
        replacement = ours(own)
        replacement.vllm_own = own
        setattr(module, name, replacement)


def after_import(name: str, patch) -> None:
    """patch(module) once the module `name` is imported: at once if it is, else right after its code
    has run, through a finder on sys.meta_path (which removes itself when it has served)."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, patch))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the module `name` through the finders after it and has its loader run patch on it."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = next((s for f in sys.meta_path if hasattr(f, "find_spec")
                     for s in (f.find_spec(fullname, path, target),) if s is not None), None)
        if spec is not None and spec.loader is not None:
            spec.loader = _Patching(spec.loader, self.patch)
        return spec


class _Patching(importlib.abc.Loader):
    """A module's loader, then patch(module)."""

    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


def _gate(A_log, dt_bias, lower_bound, l2norm: bool = True) -> dict:
    """kda_forward's and kda_decode's arguments for vLLM's raw gate (A_log [H], dt_bias [H·K], the
    lower bound or None), β logits, q/k L2 norm in kernel (l2norm) and V-first states."""
    return dict(use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=A_log.reshape(-1), dt_bias=dt_bias, lower_bound=lower_bound, state_v_first=True)


def _safe(lower_bound) -> bool:
    """kda_forward's safe_gate for a lower bound: the promise holds for bounds in [−5, 0)."""
    return lower_bound is not None and -5 <= lower_bound < 0


def _one_sequence(q: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """cu_seqlens_cpu where the call is one sequence: vLLM packs exactly its requests' tokens, so one
    request spans all T (which lets kda_forward run it in parallel segments); else None."""
    if cu_seqlens is None or cu_seqlens.shape[0] != 2:
        return None
    return torch.tensor([0, q.shape[1]])


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _rows(N: int, device: torch.device) -> torch.Tensor:
    """0 .. N − 1 on the device: each sequence's own row of a dense [N, …] state pool."""
    return torch.arange(N, dtype=torch.int32, device=device)


def prefill(vllm_own):
    """vLLM's chunk_kda_with_fused_gate, vllm_own where kda_opt does not compute the call: q, k
    [1, T, H, K], v [1, T, H, V] packed by cu_seqlens, raw_g [1, T, H, K], raw_beta [1, T, H] logits,
    initial_state [N, H, V, K] (None: zeros) -> (o [1, T, H, V], in out where given; the final states
    [N, H, V, K] fp32 with output_final_state, else None)."""
    def chunk_kda_with_fused_gate(q, k, v, raw_g, raw_beta, A_log, g_bias, scale=None, initial_state=None,
                                  output_final_state=False, lower_bound=None, use_qk_l2norm_in_kernel=False,
                                  cu_seqlens=None, out=None, **kwargs):
        if not engines.computes(q, initial_state, q.shape[-1], v.shape[-1]):
            return vllm_own(q, k, v, raw_g, raw_beta, A_log, g_bias, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, lower_bound=lower_bound,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, out=out,
                            **kwargs)
        o, final = kda_forward(q, k, v, raw_g, raw_beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, safe_gate=_safe(lower_bound),
                               **_gate(A_log, g_bias, lower_bound, use_qk_l2norm_in_kernel),
                               cu_seqlens=cu_seqlens, cu_seqlens_cpu=_one_sequence(q, cu_seqlens))
        return o if out is None else out.copy_(o), final
    return chunk_kda_with_fused_gate


def flashkda_prefill(vllm_own, waves: int | None = None):
    """K3's _flashkda_prefill: FlashKDA's call (bounded gate, β logits, q/k L2 norm in kernel) on q, k,
    v [1, T, H, 128] bf16 packed by cu_seqlens [N + 1] from initial_state [N, H, V, K]: o into out,
    the final states into final_state [N, H, V, K] (its dtype) and, where checkpoint_offsets [N] is
    given, into checkpoint_state[n] the state after sequence n's first checkpoint_offsets[n] tokens
    (0 or an empty sequence: none, the row left as it is) -> (out, final_state). workspace is
    FlashKDA's. Taken where N·H is at most `waves` (None: FLASHKDA_WAVES, as it is at the call) times
    the SM count."""
    def _flashkda_prefill(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, out,
                          final_state, workspace, checkpoint_state=None, checkpoint_offsets=None):
        N = cu_seqlens.shape[0] - 1
        if not (engines.computes(q, initial_state, q.shape[-1], v.shape[-1])
                and N * q.shape[2] <= (waves or FLASHKDA_WAVES) * _sms(q.device)):
            return vllm_own(q, k, v, g, beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, out,
                            final_state, workspace, checkpoint_state=checkpoint_state,
                            checkpoint_offsets=checkpoint_offsets)
        final_state[:N].copy_(initial_state)       # then read and written in place, as a pool of N rows
        checkpoints = first = None
        if checkpoint_offsets is not None:
            # Sequence n's rows: its state after its first f_n tokens, then (if longer) its final state.
            first = torch.where(checkpoint_offsets > 0, checkpoint_offsets, ONE_CHECKPOINT)
            checkpoints = checkpoint_state.new_empty((1, 2 * N + 1, *checkpoint_state.shape[1:]))
        o, _ = kda_forward(q, k, v, g, beta, initial_state=final_state, initial_state_indices=_rows(N, q.device),
                           safe_gate=_safe(lower_bound), **_gate(A_log, dt_bias, lower_bound),
                           cu_seqlens=cu_seqlens, cu_seqlens_cpu=_one_sequence(q, cu_seqlens),
                           checkpoints=checkpoints, checkpoint_every=CHUNK if first is None else ONE_CHECKPOINT,
                           checkpoint_offsets=first)
        if checkpoints is not None:
            # kda_forward's rows a sequence: none where it is empty, 1, and 1 more where it passes f_n.
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            counts = (lengths > 0).to(torch.int64) + (lengths > first)
            taken = checkpoints[0, counts.cumsum(0) - counts]          # each sequence's first row
            asked = (checkpoint_offsets > 0) & (lengths > 0)
            checkpoint_state[:N].copy_(torch.where(asked.view(-1, 1, 1, 1), taken, checkpoint_state[:N]))
        return out.copy_(o), final_state
    return _flashkda_prefill


def spec_decode(vllm_own, taken: bool | None = None):
    """vLLM's fused_recurrent_kda (speculative decode): q, k [1, T, H, K], v [1, T, H, V] packed by
    cu_seqlens [N + 1]; the pool initial_state [slots, H, V, K], request n read from
    ssm_state_indices[n, num_accepted_tokens[n] − 1] (column 0 without it) and its state after token t
    written to ssm_state_indices[n, t] ([N] indices: one token each, its state to ssm_state_indices[n])
    -> (o, in out where given; the pool). A padding request (slot 0 in every column, as vLLM's
    metadata pads; a negative slot is one too) reads and writes no state; its rows of o, which vLLM
    discards (its kernel zeroes the first and leaves the others), hold the recurrence from a zero
    state. fuse_gate picks vLLM's kernels for the same function. Taken where `taken` (None:
    TAKES_SPEC_DECODE, as it is at the call)."""
    def fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                            ssm_state_indices, num_accepted_tokens=None, out=None, fuse_gate=None):
        if not ((TAKES_SPEC_DECODE if taken is None else taken) and engines.computes(q, initial_state, q.shape[-1],
                                                                             v.shape[-1])):
            return vllm_own(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                            ssm_state_indices, num_accepted_tokens=num_accepted_tokens, out=out,
                            fuse_gate=fuse_gate)
        o, _ = kda_decode(q, k, v, raw_g, raw_beta, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
                          **_gate(A_log, dt_bias, lower_bound), cu_seqlens=cu_seqlens, inplace_final_state=True,
                          ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens, out=out,
                          pad_slot=PAD_SLOT)
        return o, initial_state
    return fused_recurrent_kda


def packed_decode(vllm_own, from_requests: int | None = None):
    """vLLM's fused_recurrent_kda_packed_decode: one token per request, q, k, v read in place from the
    short convolution's output mixed_qkv [B, 2·H·K + H·V], raw_g [1, B, H, K], raw_beta [1, B, H]
    logits; request n's state read from and written to initial_state[state_indices[n]] (the pool
    [slots, H, V, K]); a padding request (slot 0 or negative) reads and writes no state and its row
    of o is zero, as in vLLM -> (o [1, B, H, V], in out where given; the pool). Steps of fewer than
    from_requests requests (None: PACKED_DECODE_FROM, as it is at the call) are vLLM's."""
    def fused_recurrent_kda_packed_decode(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state,
                                          state_indices, scale=None, out=None):
        (_, H, V, K), B = initial_state.shape, mixed_qkv.shape[0]
        if not (B >= (from_requests or PACKED_DECODE_FROM) and engines.computes(mixed_qkv, initial_state, K, V)):
            return vllm_own(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, state_indices,
                            scale=scale, out=out)
        q, k, v = (x.unflatten(-1, (H, -1)).unsqueeze(1) for x in mixed_qkv.split([H * K, H * K, H * V], dim=-1))
        o, _ = kda_decode(q, k, v, raw_g.reshape(B, 1, H, K), raw_beta.reshape(B, 1, H), scale=scale,
                          initial_state=initial_state, **_gate(A_log, dt_bias, lower_bound), inplace_final_state=True,
                          ssm_state_indices=state_indices, out=None if out is None else out.transpose(0, 1),
                          pad_slot=PAD_SLOT)
        return o.transpose(0, 1).masked_fill_((state_indices <= PAD_SLOT).view(1, B, 1, 1), 0), initial_state
    return fused_recurrent_kda_packed_decode
