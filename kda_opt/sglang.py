"""kda_opt as SGLang's KDA kernel (sglang 0.5.23): `register` is the `sglang.srt.plugins` entry point
(pyproject.toml). With SGLANG_KDA_OPT=1 it registers, through SGLang's HookRegistry, a class that
replaces SGLang's `TritonKDAKernel` (its default KDA kernel on Hopper): wherever SGLang would run its
Triton kernel, KdaOptKDAKernel runs kda_forward (extend), kda_decode (decode, chain verify) on the
calls kda_opt computes and SGLang's own Triton code (the class it replaces) on the others
(docs/USAGE.md, "SGLang"), and wraps SGLang's `KDAAttnBackend.forward_decode` (an AROUND hook,
`forward_decode`) so that the decode step it would run as the short convolution's update and then that
kernel runs as one kda_conv_decode call where that measured faster. Without the variable, or without
SGLang, nothing is registered and SGLang keeps its kernels.

How SGLang's calls map onto kda_opt's (SGLang's KDA backend, `kda_backend.py`):
- extend: packed `[1, T, H, K]` requests (`query_start_loc`), raw gate with A_log `[1, 1, HV, 1]` and
  dt_bias `[HV·K]`, β logits (`beta_is_raw`), q/k L2 norm in kernel, the state pool `[slots, HV, V, K]`
  read and written in place by `cache_indices` (−1: zeros, nothing written); its per-chunk states
  `h [1, NT, HV, V, K]` in k's dtype (`return_intermediate_states`: each request's state before each
  of its 64-token chunks) and the fp32 snapshot `track_state[n]` before chunk `track_chunk_idx[n]`.
- decode: one token per request, gate and β sigmoid in kernel, the pool in place.
- packed_decode (Kimi-Linear's decode on Hopper): the same, q, k, v still packed in the short
  convolution's output `mixed_qkv`.
- target_verify (chain): each draft token's state into `intermediate_states_buffer[row, t]`
  (`[rows, cache_steps, HV, V, K]`), the pool left alone.

sglang is imported by `register` and `kernel_class` only: `import kda_opt` works without it.
"""
import functools
import os

import torch

from . import engines, plan
from .checks import SUPPORTED_DTYPES
from .conv_decode import WIDTH, kda_conv_decode
from .decode import kda_decode
from .forward import kda_forward
from .options import CHUNK

SWITCH = "SGLANG_KDA_OPT"          # 1: SGLang's Triton KDA kernel is replaced by kda_opt's
TARGET = "sglang.srt.layers.attention.linear.kernels.kda_triton.TritonKDAKernel"
DECODE_STEP = "sglang.srt.layers.attention.linear.kda_backend.KDAAttnBackend.forward_decode"


def register() -> None:
    """The `sglang.srt.plugins` entry point, run by SGLang's `load_plugins` in each of its processes:
    where SGLANG_KDA_OPT=1, SGLang's TritonKDAKernel is replaced by kernel_class() (a class REPLACE
    hook, applied by SGLang's HookRegistry with its other hooks), and its backend's decode step is
    wrapped by forward_decode (an AROUND hook)."""
    if os.environ.get(SWITCH, "0") != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, kernel_class(), HookType.REPLACE)
    HookRegistry.register(DECODE_STEP, forward_decode, HookType.AROUND)


def forward_decode(original, backend, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    """SGLang's `KDAAttnBackend.forward_decode` (`original`, called as it is) where `fuses` says no; else
    its step (the short convolution's update of mixed_qkv and the conv window, then the KDA step on
    the pool) as one kda_conv_decode call, then SGLang's own tracking of the states for its prefix
    cache, as the original does after its chain: o [1, N, HV, V]."""
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    indices = backend.forward_metadata.mamba_cache_indices
    if not fuses(backend, layer, cache, indices, mixed_qkv):
        return original(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    conv_states, ssm_states = cache.conv[0], cache.temporal
    o = kda_conv_decode(mixed_qkv, a, b, conv_state=conv_states, conv_weight=layer.conv_weights,
                        ssm_state=ssm_states, state_indices=indices, A_log=layer.A_log.reshape(-1),
                        conv_bias=layer.bias, dt_bias=layer.dt_bias, lower_bound=layer.lower_bound,
                        scale=layer.head_k_dim ** -0.5)
    backend._track_mamba_state_decode(forward_batch, conv_states, ssm_states, indices, layer.layer_id)
    return o.unsqueeze(0)


def fuses(backend, layer, cache, indices, mixed_qkv) -> bool:
    """Whether forward_decode runs SGLang's decode step as kda_conv_decode: where SGLang would run the
    short convolution's update (width WIDTH) and then kda_opt's kernel on one token a request of at
    most CONV_DECODE_PAIRS (request, head) pairs, an fp32 pool and query heads as many as value heads; not
    SGLang's own fused K3 step (the model's stash of its output gate), its ReplaySSM ring, nor a
    deferred gate projection."""
    conv = cache.conv[0]
    return (isinstance(backend.kernel_dispatcher.decode_kernel, kernel_class())
            and getattr(cache, "replayssm_d", None) is None and not getattr(layer, "_k3_deferred_f_b", False)
            and (getattr(layer, "_k3_fused_decode_args", None) is None or getattr(layer, "_k3_onorm_gate", None) is None)
            and isinstance(mixed_qkv, torch.Tensor) and mixed_qkv.dim() == 2
            and mixed_qkv.shape[0] == indices.shape[0]
            and indices.shape[0] * layer.num_v_heads <= CONV_DECODE_PAIRS
            and layer.num_q_heads == layer.num_k_heads == layer.num_v_heads
            and isinstance(layer.conv_weights, torch.Tensor) and layer.conv_weights.shape[-1] == WIDTH
            and (layer.bias is None or isinstance(layer.bias, torch.Tensor))
            and conv.dim() == 3 and conv.shape[1] == WIDTH - 1 and conv.dtype in SUPPORTED_DTYPES
            and cache.temporal.dtype == torch.float32
            and engines.computes(mixed_qkv, cache.temporal, layer.head_k_dim, layer.head_v_dim))


@functools.cache
def kernel_class():
    """KdaOptKDAKernel, built once: a subclass of SGLang's TritonKDAKernel (so SGLang's checks that
    its decode and verify kernel is the Triton one still hold), whose methods run kda_opt where it
    computes the call and the Triton kernel's own methods elsewhere."""
    from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel

    class KdaOptKDAKernel(TritonKDAKernel):
        """SGLang's KDA kernel on kda_opt: extend through kda_forward; decode (steps of up to
        `decode_requests` requests), packed decode (fp32 pools; K3's safe gate too,
        `supports_packed_decode_safe_gate`, which sends it there), chain and tree verify
        (`takes_verify`, `takes_tree_verify`, both on by default) through kda_decode, each taken
        only where it measured at least SGLang's own kernel (docs/USAGE.md, "SGLang"); every other
        call, and every call off Hopper or with head dims other than 64 and 128, through SGLang's
        Triton kernel."""

        decode_requests = DECODE_REQUESTS
        takes_verify = True
        takes_tree_verify = True
        supports_packed_decode_safe_gate = True

        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log=None,
                   dt_bias=None, lower_bound=None, beta_is_raw=False, return_intermediate_states=False,
                   **kwargs):
            if not engines.computes(q, ssm_states, q.shape[-1], v.shape[-1]):
                return super().extend(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                                      query_start_loc=query_start_loc, A_log=A_log, dt_bias=dt_bias,
                                      lower_bound=lower_bound, beta_is_raw=beta_is_raw,
                                      return_intermediate_states=return_intermediate_states, **kwargs)
            return extend(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                          query_start_loc=query_start_loc, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                          beta_is_raw=beta_is_raw, return_intermediate_states=return_intermediate_states,
                          track_state=kwargs.get("track_state"), track_chunk_idx=kwargs.get("track_chunk_idx"),
                          extend_seq_lens_cpu=kwargs.get("extend_seq_lens_cpu"),
                          chunk_indices=kwargs.get("chunk_indices"))

        def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
                   lower_bound=None, **kwargs):
            if not (query_start_loc.shape[0] - 1 <= self.decode_requests and engines.computes(q, ssm_states, q.shape[-1], v.shape[-1])):
                return super().decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                                      cache_indices=cache_indices, query_start_loc=query_start_loc,
                                      lower_bound=lower_bound, **kwargs)
            return decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                          cache_indices=cache_indices, query_start_loc=query_start_loc, lower_bound=lower_bound)

        def packed_decode(self, mixed_qkv, a, b, *, A_log, dt_bias, scale, ssm_states, cache_indices, num_v_heads,
                          head_v_dim, lower_bound=None, **kwargs):
            # The ReplaySSM ring and the 16-bit pools (not measured) are SGLang's kernel's.
            if not (ssm_states.dtype == torch.float32 and all(kwargs.get(n) is None for n in REPLAYSSM)
                    and engines.computes(mixed_qkv, ssm_states, ssm_states.shape[-1], head_v_dim)):
                return super().packed_decode(mixed_qkv, a, b, A_log=A_log, dt_bias=dt_bias, scale=scale,
                                             ssm_states=ssm_states, cache_indices=cache_indices,
                                             num_v_heads=num_v_heads, head_v_dim=head_v_dim, lower_bound=lower_bound,
                                             **kwargs)
            return packed_decode(mixed_qkv, a, b, A_log=A_log, dt_bias=dt_bias, scale=scale, ssm_states=ssm_states,
                                 cache_indices=cache_indices, num_v_heads=num_v_heads, head_v_dim=head_v_dim,
                                 lower_bound=lower_bound)

        def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
                          intermediate_states_buffer, intermediate_state_indices, cache_steps,
                          retrieve_parent_token, lower_bound=None, **kwargs):
            # The ReplaySSM ring (cache_ring and its buffers) is SGLang's Triton kernel's alone.
            takes = self.takes_verify if retrieve_parent_token is None else self.takes_tree_verify
            if not (takes and not kwargs.get("cache_ring") and engines.computes(q, ssm_states, q.shape[-1], v.shape[-1])):
                return super().target_verify(
                    A_log, dt_bias, q, k, v, a, b, ssm_states=ssm_states, cache_indices=cache_indices,
                    query_start_loc=query_start_loc, intermediate_states_buffer=intermediate_states_buffer,
                    intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                    retrieve_parent_token=retrieve_parent_token, lower_bound=lower_bound, **kwargs)
            return verify(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                          cache_indices=cache_indices, query_start_loc=query_start_loc,
                          intermediate_states_buffer=intermediate_states_buffer,
                          intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                          retrieve_parent_token=retrieve_parent_token, lower_bound=lower_bound)

    return KdaOptKDAKernel


# The largest decode step (requests) KdaOptKDAKernel takes: the largest of `--test sglang`'s K3 decode
# rows up to which kda_decode measured at least SGLang's decode kernel, as CUDA graph replays
# (docs/BENCHMARKING.md, "SGLang").
DECODE_REQUESTS = 512


# The largest decode step, in (request, head) pairs, that forward_decode runs as kda_conv_decode: up to
# which the fused step measured faster than SGLang's convolution and then kda_opt's kernel, as CUDA
# graph replays; beyond it each of the fused kernel's programs, which convolves its head's q and k
# itself, holds more registers and longer than kda_decode's (docs/BENCHMARKING.md, "SGLang").
CONV_DECODE_PAIRS = 128


# SGLang's packed-decode keywords of its ReplaySSM ring, whose calls stay SGLang's.
REPLAYSSM = ("replayssm_d", "replayssm_k", "replayssm_g", "replayssm_write_pos")


def _gate(A_log, dt_bias, lower_bound) -> dict:
    """kda_forward's and kda_decode's gate arguments for SGLang's: the gate activated here where A_log
    is given (SGLang's A_log is [1, 1, HV, 1]), the bounded gate where lower_bound is."""
    return dict(use_gate_in_kernel=A_log is not None, A_log=None if A_log is None else A_log.reshape(-1),
                dt_bias=dt_bias, lower_bound=lower_bound)


def extend(q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log, dt_bias, lower_bound,
           beta_is_raw, return_intermediate_states, track_state, track_chunk_idx, extend_seq_lens_cpu,
           chunk_indices):
    """SGLang's extend through kda_forward: o [1, T, HV, V], or (o, h) with return_intermediate_states
    (module docstring); the pool and track_state written in place.

    The host lengths (extend_seq_lens_cpu) go to kda_forward only where they choose its schedule: one
    request (which then runs as one sequence, in parallel segments where they pay), a request long
    enough to be cut (plan.CUT_FROM) or, without per-chunk states, to run ahead of the others
    (plan.leads, _leads: replayed); any other call is replayed (kda_opt/replay) without them."""
    states = track_state is not None or return_intermediate_states
    lengths = extend_seq_lens_cpu
    cu_seqlens_cpu = None
    if lengths is not None and (len(lengths) == 1 or max(lengths) >= plan.CUT_FROM
                                or not states and _leads(lengths, v)):
        cu_seqlens_cpu = torch.tensor([0, *lengths]).cumsum(0)
    h = checkpoints = None
    if states:
        # The pool's rows before the call, which overwrites them: each request's state before its first chunk.
        starts = _starts(ssm_states, cache_indices)
        rows = _chunk_rows(q.shape[1], query_start_loc, extend_seq_lens_cpu, chunk_indices)
        # h in k's dtype, as SGLang's; the states snapshot exactly (fp32) where track_state asks for them.
        h, checkpoints = engines.intermediate_states(v, q.shape[-1], rows, True,
                                             k.dtype if track_state is None else torch.float32)
    o, _ = kda_forward(q, k, v, g, beta, initial_state=ssm_states, use_qk_l2norm_in_kernel=True,
                       use_beta_sigmoid_in_kernel=beta_is_raw, safe_gate=lower_bound is not None,
                       **_gate(A_log, dt_bias, lower_bound), state_v_first=True, cu_seqlens=query_start_loc,
                       cu_seqlens_cpu=cu_seqlens_cpu, initial_state_indices=cache_indices,
                       checkpoints=checkpoints)
    if not states:
        return o
    engines.first_rows(h, starts, None, query_start_loc)
    if track_state is not None:
        # Request n's state before its chunk track_chunk_idx[n]; a request not tracked (−1) gets some row.
        row = engines.sequence_rows(query_start_loc, rows) + track_chunk_idx.to(query_start_loc.dtype)
        whole = engines.spare_rows(h)
        torch.index_select(whole, 0, row.clamp(0, rows), out=track_state[:row.shape[0]])
        h = h.to(k.dtype)
    return (o, h) if return_intermediate_states else o


def _leads(lengths, v) -> bool:
    """Whether the longest request runs ahead of the others (plan.leads, by the rule of kda_forward's
    default tuning on a packed one-pass call, from the host lengths): v [1, T, HV, V]."""
    tuning = plan.Tuning()
    if max(lengths) < tuning.ahead_from:        # no rule takes it: the GPU's SM count not asked for
        return False
    HV, V = v.shape[2:]
    sms = torch.cuda.get_device_properties(v.device).multi_processor_count
    block_v = plan.one_pass_block_v(len(lengths), HV, V, sms, v.dtype, tuning)
    return plan.leads(lengths, HV, V, block_v, sms, plan.ahead_rule(tuning, block_v))


def _chunk_rows(T: int, query_start_loc, extend_seq_lens_cpu, chunk_indices) -> int:
    """Σ_n cdiv(len_n, 64), the rows of SGLang's h: from the host lengths, or the chunk table SGLang
    passed (its row count; a graph's is padded, more than enough), or cdiv(T, 64) + N − 1 (enough for
    any lengths)."""
    if extend_seq_lens_cpu is not None:
        return int(sum(-(-n // CHUNK) for n in extend_seq_lens_cpu))
    if chunk_indices is not None:
        return chunk_indices.shape[0]
    return -(-T // CHUNK) + query_start_loc.shape[0] - 2


def _starts(ssm_states, indices):
    """pool[indices[n]] for each request, zeros where the index is −1 (or past the pool), in the
    pool's dtype: the requests' states before the call."""
    slots = ssm_states.shape[0]
    live = (indices >= 0) & (indices < slots)
    return torch.where(live.view(-1, 1, 1, 1), ssm_states.index_select(0, indices.clamp(0, slots - 1)), 0)


def _decode(q, k, v, a, b, *, A_log, dt_bias, lower_bound, query_start_loc, pool, indices, **buffer):
    """kda_decode on SGLang's decode-style call (a: the gate [tokens, HV·K], b: β logits), the states
    read from `pool` by `indices` and written into it in place, or with `buffer` (kda_decode's
    intermediate_states_buffer, intermediate_state_indices and retrieve_parent_token) into that:
    o [1, tokens, HV, V]."""
    o, _ = kda_decode(q, k, v, a.reshape(v.shape[:-1] + (q.shape[-1],)), b, scale=None, initial_state=pool,
                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      **_gate(A_log, dt_bias, lower_bound), state_v_first=True, cu_seqlens=query_start_loc,
                      inplace_final_state=not buffer, ssm_state_indices=indices, **buffer)
    return o


def decode(q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc, lower_bound):
    """SGLang's decode through kda_decode: o [1, N, HV, V]; each request's state read from and written
    to pool[cache_indices[n]] (−1: zeros, nothing written). SGLang decodes one token per request: where
    the tokens are as many as the requests, they go to kda_decode as N requests of one token (q, k, v,
    β as [N, 1, ·, ·] views, no cu_seqlens), the form its kernels know to be one token each."""
    if q.shape[1] == query_start_loc.shape[0] - 1:
        o = _decode(*(x.transpose(0, 1) for x in (q, k, v)), a, b.transpose(0, 1), A_log=A_log, dt_bias=dt_bias,
                    lower_bound=lower_bound, query_start_loc=None, pool=ssm_states, indices=cache_indices)
        return o.transpose(0, 1)
    return _decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                   query_start_loc=query_start_loc, pool=ssm_states, indices=cache_indices)


def packed_decode(mixed_qkv, a, b, *, A_log, dt_bias, scale, ssm_states, cache_indices, num_v_heads, head_v_dim,
                  lower_bound):
    """SGLang's packed decode (Kimi-Linear's on Hopper, and K3's with the safe gate's lower_bound where
    the kernel says supports_packed_decode_safe_gate) through kda_decode: one token per request,
    q, k, v read in place from the short convolution's output mixed_qkv [N, 2·H·K + HV·V] (batched
    views [N, 1, heads, K]), the gate a [N, HV·K] and β logits b [N, HV] (or their 3-d forms); each
    request's state read from and written to pool[cache_indices[n]] (−1: zeros, nothing written):
    o [1, N, HV, V]."""
    N, K = mixed_qkv.shape[0], ssm_states.shape[-1]
    H = (mixed_qkv.shape[-1] - num_v_heads * head_v_dim) // (2 * K)
    q, k, v = (x.unflatten(-1, (-1, d)).unsqueeze(1) for x, d in zip(
        mixed_qkv.split([H * K, H * K, num_v_heads * head_v_dim], dim=-1), (K, K, head_v_dim)))
    o, _ = kda_decode(q, k, v, a.reshape(N, 1, num_v_heads, K), b.reshape(N, 1, num_v_heads), scale=scale,
                      initial_state=ssm_states, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      **_gate(A_log, dt_bias, lower_bound), state_v_first=True, inplace_final_state=True,
                      ssm_state_indices=cache_indices)
    return o.transpose(0, 1)


def verify(q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
           intermediate_states_buffer, intermediate_state_indices, cache_steps, retrieve_parent_token, lower_bound):
    """SGLang's verify through kda_decode: o [1, T, HV, V]; request n's state after its draft token t
    into intermediate_states_buffer[intermediate_state_indices[n], t] (t < cache_steps), the pool only
    read, in one pass; a chain, or with retrieve_parent_token a tree, each token t > 0 from the state
    after its parent token. SGLang gives padding requests (cache_indices −1: a zero start) a discard
    row of their own, which they write as its kernel does."""
    N = query_start_loc.shape[0] - 1
    return _decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                   query_start_loc=query_start_loc, pool=ssm_states, indices=cache_indices[:N],
                   intermediate_states_buffer=intermediate_states_buffer[:, :cache_steps],
                   intermediate_state_indices=intermediate_state_indices[:N],
                   retrieve_parent_token=None if retrieve_parent_token is None else retrieve_parent_token[:N])
