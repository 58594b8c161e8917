"""Float64 truth for every stage of the pipeline, in plain torch (CPU or GPU).

Recurrence (docs/DESIGN.md, Math), per batch b and value head h, state S [K, V]:
    S ← Diag(exp a_t) S;  S ← S + β_t k_t (v_t − k_tᵀ S)ᵀ;  o_t = (scale · q_t)ᵀ S
Chunked form (docs/DESIGN.md, Math), chunk C: Γ = in-chunk cumsum of a, Akk, Aqk, Tm = (I + Akk)⁻¹ Diag(β),
W = Tm (exp Γ ⊙ k), U = Tm v, then chunk by chunk V' = U − W S, O = (q ⊙ exp Γ) S + Aqk V',
S ← Diag(exp Γ_last) S + (k ⊙ exp(Γ_last − Γ))ᵀ V'.
Shapes follow FLA: q, k [B, T, H, K]; v [B, T, HV, V]; a, Γ [B, T, HV, K]; β [B, T, HV];
chunk matrices [B, T, HV, C] (row per token, column = position in its chunk); state [B, HV, K, V].
GVA: value head hv reads q/k head hv // (HV / H). Every function returns float64.
"""
import torch
import torch.nn.functional as F

from .options import L2NORM_EPS, LOG_DECAY_FLOOR


# The accuracy every forward is held to: ‖out − ref‖ / ‖ref‖ against this module's float64
# recurrence at most max(2 × FLA's error on the same inputs, ERROR_FLOOR) (docs/DESIGN.md, "Accuracy").
ERROR_FLOOR = 5e-3


def error_bound(fla_error: float = 0.0) -> float:
    """The largest relative error allowed where FLA's error on the same inputs is fla_error."""
    return max(2 * fla_error, ERROR_FLOOR)


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64, the error measure of every check; non-finite output gives inf."""
    out = out.double()
    ref = ref.double().to(out.device)
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def activate_gate(g, A_log=None, dt_bias=None, lower_bound=None):
    """Raw gate g [B, T, HV, K] → log-decay a ≤ 0, as FLA 0.6.0's in-kernel gate."""
    HV, K = g.shape[-2:]
    x = g.double()
    if dt_bias is not None:
        x = x + dt_bias.double().view(HV, K)
    rate = None if A_log is None else A_log.double().view(HV, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(x if rate is None else rate * x)
    if rate is None:
        raise ValueError("the softplus gate needs A_log")
    return -rate * F.softplus(x)


def floored(a):
    """The log-decay as the engine's stage 1 passes it on: max(a, LOG_DECAY_FLOOR) (kda_opt/options).
    The recurrence here takes a as it is; the stage references take it floored."""
    return a.double().clamp_min(LOG_DECAY_FLOOR)


def _expand_heads(x, HV):
    """q/k [B, T, H, K] → [B, T, HV, K] for grouped value heads (each qk head serves HV / H)."""
    return x.double().repeat_interleave(HV // x.shape[2], dim=2)


def recurrent_kda(q, k, v, a, beta, scale=None, initial_state=None):
    """Token-by-token recurrence; returns o [B, T, HV, V] and the final state [B, HV, K, V]."""
    B, T, HV, V = v.shape
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k = _expand_heads(q, HV) * scale, _expand_heads(k, HV)
    v, a, beta = v.double(), a.double(), beta.double()
    S = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.double()
    o = q.new_empty(B, T, HV, V)
    for t in range(T):
        S = S * a[:, t].exp()[..., None]
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], err)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


def _chunks(x, C):
    """[B, T, H, ...] → [B, H, NT, C, ...], zero-padding the tail chunk."""
    T = x.shape[1]
    NT = -(-T // C)
    pad = [0, 0] * (x.dim() - 2) + [0, NT * C - T]
    x = F.pad(x.double(), pad)
    x = x.view(x.shape[0], NT, C, *x.shape[2:])
    return x.movedim(3, 1)


def _unchunk(x, T):
    """[B, H, NT, C, ...] → [B, T, H, ...], dropping the tail padding."""
    x = x.movedim(1, 3)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T].contiguous()


def _valid(T, C, device):
    """[NT, C] mask of the positions that exist (the tail chunk is partial)."""
    NT = -(-T // C)
    return (torch.arange(NT * C, device=device) < T).view(NT, C)


def chunk_cumsum(a, chunk_size=64):
    """Γ: inclusive cumsum of a inside each chunk, [B, T, HV, K] (natural log)."""
    return _unchunk(_chunks(a, chunk_size).cumsum(3), a.shape[1])


def intra_chunk(q, k, gamma, beta, scale, chunk_size=64):
    """Aqk (i ≥ j, includes scale) and Akk (i > j, includes β_i), each [B, T, HV, C]."""
    T, HV, C = q.shape[1], gamma.shape[2], chunk_size
    qc, kc = _chunks(_expand_heads(q, HV), C), _chunks(_expand_heads(k, HV), C)
    gc, bc = _chunks(gamma, C), _chunks(beta, C)
    valid = _valid(T, C, q.device)
    # decay[..., i, j, d] = exp(Γ_i − Γ_j), kept only where it is used (j ≤ i, both valid).
    keep = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    keep = keep & valid[:, :, None] & valid[:, None, :]
    diff = (gc[..., :, None, :] - gc[..., None, :, :]).masked_fill(~keep[..., None], float("-inf"))
    decay = diff.exp()
    Aqk = scale * torch.einsum("bhnid,bhnjd,bhnijd->bhnij", qc, kc, decay)
    Akk = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", kc, kc, decay)
    Akk = (bc[..., None] * Akk).tril(-1)
    return _unchunk(Aqk, T), _unchunk(Akk, T)


def solve(Akk, beta, chunk_size=64):
    """Tm = (I + Akk)⁻¹ · Diag(β) per chunk, [B, T, HV, C]."""
    T, C = Akk.shape[1], chunk_size
    A, bc = _chunks(Akk, C), _chunks(beta, C)
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    Tm = inv * bc[..., None, :]
    return _unchunk(Tm * _valid(T, C, A.device)[:, None, :], T)


def wu(Tm, k, v, gamma, chunk_size=64):
    """W = Tm (exp Γ ⊙ k) [B, T, HV, K] and U = Tm v [B, T, HV, V]."""
    T, HV, C = v.shape[1], v.shape[2], chunk_size
    Tc = _chunks(Tm, C)
    kc = _chunks(_expand_heads(k, HV), C)
    W = Tc @ (_chunks(gamma, C).exp() * kc)
    U = Tc @ _chunks(v, C)
    return _unchunk(W, T), _unchunk(U, T)


def state_pass(q, k, W, U, Aqk, gamma, scale, initial_state=None, chunk_size=64):
    """The chunk-to-chunk recurrence: o [B, T, HV, V] and the final state [B, HV, K, V]."""
    B, T, HV, V = U.shape
    K, C = q.shape[-1], chunk_size
    qc, kc = _chunks(_expand_heads(q, HV), C), _chunks(_expand_heads(k, HV), C)
    Wc, Uc, Ac, gc = _chunks(W, C), _chunks(U, C), _chunks(Aqk, C), _chunks(gamma, C)
    S = qc.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.double()
    oc = torch.empty_like(Uc)
    for n in range(Uc.shape[2]):
        last = min(C, T - n * C) - 1
        g, g_last = gc[:, :, n], gc[:, :, n, last]
        v_new = Uc[:, :, n] - Wc[:, :, n] @ S
        oc[:, :, n] = (scale * qc[:, :, n] * g.exp()) @ S + Ac[:, :, n] @ v_new
        k_dec = kc[:, :, n] * (g_last[:, :, None] - g).exp()
        S = g_last.exp()[..., None] * S + k_dec.transpose(-1, -2) @ v_new
    return _unchunk(oc, T), S


def chunked_kda(q, k, v, a, beta, scale=None, initial_state=None, chunk_size=64):
    """The whole chunked form, stage by stage; equals recurrent_kda up to float64 rounding."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    gamma = chunk_cumsum(a, chunk_size)
    Aqk, Akk = intra_chunk(q, k, gamma, beta, scale, chunk_size)
    Tm = solve(Akk, beta, chunk_size)
    W, U = wu(Tm, k, v, gamma, chunk_size)
    return state_pass(q, k, W, U, Aqk, gamma, scale, initial_state, chunk_size)


def merge(h, M, v_first=False):
    """The states after n consecutive segments (kda_opt/merge's chain), S_0 = h_0, S_j = M_{j−1} S_{j−1}
    + h_j: h [n, …, HV, K, V] ([…, V, K] v_first), M [n − 1, …, HV, K, K]."""
    kv = (lambda S: S.transpose(-1, -2)) if v_first else (lambda S: S)
    states = [kv(h[0].double())]
    for j in range(1, h.shape[0]):
        states.append(M[j - 1].double() @ states[-1] + kv(h[j].double()))
    return kv(torch.stack(states))


def l2norm(x, eps=L2NORM_EPS):
    """x / sqrt(Σ x² + eps) over the last axis (FLA's l2norm), in float64."""
    x = x.double()
    return x / (x * x).sum(-1, keepdim=True).add(eps).sqrt()


def reference_forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                      allow_neg_eigval=False, A_log=None, dt_bias=None, safe_gate=False, lower_bound=None,
                      state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_size=64,
                      method="recurrent"):
    """kda_forward's arguments → float64 (o, final state or None). method="chunked" evaluates the
    chunked form instead of the token loop: equal to 1e-10 (tests/test_reference.py), far quicker
    for long T on a GPU, but it holds a [B, HV, T, 64, K] tensor. With cu_seqlens, each packed
    sequence is evaluated on its own, from its own initial state."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = (2.0 if allow_neg_eigval else 1.0) * torch.sigmoid(beta.double())
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    a = activate_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.double()
    o, S = _sequences(q, k, v, a, beta, scale, initial_state, cu_seqlens, method)
    if state_v_first:
        S = S.transpose(-1, -2)
    return o, (S if output_final_state else None)


def _sequences(q, k, v, a, beta, scale, initial_state, cu_seqlens, method):
    """o and the final states [N, HV, K, V] of the batch, or of each packed sequence on its own."""
    evaluate = {"recurrent": recurrent_kda, "chunked": chunked_kda}[method]
    if cu_seqlens is None:
        return evaluate(q, k, v, a, beta, scale, initial_state)
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        S0 = None if initial_state is None else initial_state[n:n + 1]
        if eos == bos:  # an empty sequence passes its state through
            HV, K, V = v.shape[2], q.shape[3], v.shape[3]
            states.append(S0.double() if S0 is not None else v.new_zeros(1, HV, K, V, dtype=torch.float64))
            continue
        o, S = evaluate(*(x[:, bos:eos] for x in (q, k, v, a, beta)), scale, S0)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, dim=1), torch.cat(states)


def reference_decode(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                     output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False,
                     cu_seqlens=None, *, inplace_final_state=False, ssm_state_indices=None, num_accepted_tokens=None,
                     out=None, pad_slot=None, intermediate_states_buffer=None, intermediate_state_indices=None,
                     retrieve_parent_token=None):
    """kda_decode's arguments → float64 (o, final state): the new final states
    (output_final_state), a float64 copy of the pool or of initial_state with the rows the call writes
    replaced (inplace_final_state), such a copy of intermediate_states_buffer (with one), or None; by
    its docstring's rules for slots, padding, accepted tokens and parent tokens, token after token."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = (2.0 if allow_neg_eigval else 1.0) * torch.sigmoid(beta.double())
    a = activate_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.double()
    B, T, HV, V = v.shape
    K = q.shape[-1]
    layout = (lambda S: S.transpose(-1, -2)) if state_v_first else (lambda S: S)
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [n * T for n in range(B + 1)]
    flat = [x.flatten(0, 1)[None] for x in (q, k, v, a, beta)]
    pool = None if initial_state is None else initial_state.double().clone()
    written = pool.clone() if inplace_final_state else None
    slots = 0 if pool is None else pool.shape[0]
    index = None if ssm_state_indices is None else ssm_state_indices.view(len(bounds) - 1, -1).tolist()
    per_token = ssm_state_indices is not None and ssm_state_indices.dim() == 2
    buffer = None if intermediate_states_buffer is None else intermediate_states_buffer.double().clone()

    def slot(n, column, live):
        row = index[n][column] if live and 0 <= column < len(index[n]) else -1
        return row if 0 <= row < slots and row != pad_slot else None

    o, finals = v.new_zeros(1, bounds[-1], HV, V, dtype=torch.float64), []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        column = 0 if num_accepted_tokens is None else int(num_accepted_tokens[n]) - 1
        live = index is None or 0 <= column < len(index[n])
        if index is not None:
            row = slot(n, column, live)
            S = pool.new_zeros(HV, K, V) if row is None else layout(pool[row])
        else:
            S = v.new_zeros(HV, K, V, dtype=torch.float64) if pool is None else layout(pool[n])
        S = S[None]
        buffer_row = None if buffer is None else int(intermediate_state_indices[n])
        if buffer_row is not None and not 0 <= buffer_row < len(buffer):
            buffer_row = None
        for t in range(eos - bos):
            parent = (-1 if retrieve_parent_token is None or buffer_row is None or t >= retrieve_parent_token.shape[1]
                      else int(retrieve_parent_token[n, t]))
            if 0 <= parent < min(t, buffer.shape[1]):     # the buffer's state after the parent, as written
                S = layout(buffer[buffer_row, parent].to(intermediate_states_buffer.dtype).double())[None]
            o[:, bos + t], S = (x[:, 0] if i == 0 else x for i, x in enumerate(recurrent_kda(
                *(x[:, bos + t:bos + t + 1] for x in flat), scale, S)))
            if inplace_final_state and per_token:
                row = slot(n, t, live)
                if row is not None:
                    written[row] = layout(S[0])
            if buffer_row is not None and t < buffer.shape[1]:
                buffer[buffer_row, t] = layout(S[0])
        finals.append(S[0])
        if inplace_final_state and not per_token:
            row = n if index is None else slot(n, 0, live)
            if row is not None:
                written[row] = layout(S[0])
    o = o.view(B, T, HV, V)
    if output_final_state:
        return o, layout(torch.stack(finals))
    return o, written if buffer is None else buffer


def reference_conv_decode(mixed_qkv, g, beta, *, conv_state, conv_weight, ssm_state, state_indices, A_log,
                          conv_bias=None, dt_bias=None, lower_bound=None, scale=None, pad_slot=None):
    """kda_conv_decode's arguments → float64 (o [N, H, V], the pool, the window), the caches as copies
    with the rows the call writes replaced: each request's channels convolved with its window (zeros
    where its slot is not read) and SiLU-activated, the window shifted by its input, then kda_decode's
    step on q, k, v of the result."""
    N, channels = mixed_qkv.shape
    slots, H, V, K = ssm_state.shape
    rows = [int(i) for i in state_indices]
    live = [0 <= i < slots and i != pad_slot for i in rows]
    x = mixed_qkv.double()
    window = conv_state.double().clone()
    taps = torch.stack([window[i] if ok else window.new_zeros(window.shape[1:]) for i, ok in zip(rows, live)])
    taps = torch.cat([taps, x[:, None]], 1)                               # [N, 4, channels], oldest first
    y = (taps * conv_weight.double().t()[None]).sum(1)
    if conv_bias is not None:
        y = y + conv_bias.double()
    y = torch.nn.functional.silu(y)
    for n, (i, ok) in enumerate(zip(rows, live)):
        if ok:
            window[i] = taps[n, 1:]
    q, k, v = (t.unflatten(-1, (H, -1))[None] for t in y.split([H * K, H * K, H * V], dim=-1))
    o, pool = reference_decode(q, k, v, g.reshape(1, N, H, K), beta.reshape(1, N, H), A_log=A_log.reshape(-1),
                               dt_bias=dt_bias, scale=scale, initial_state=ssm_state, use_qk_l2norm_in_kernel=True,
                               use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
                               state_v_first=True, cu_seqlens=torch.arange(N + 1), inplace_final_state=True,
                               ssm_state_indices=torch.tensor(rows), pad_slot=pad_slot)
    return o[0], pool, window
