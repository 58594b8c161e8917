"""What the engine adapters (kda_opt/fla_backend, kda_opt/sglang, kda_opt/vllm) share: whether kda_opt
computes a call on its device (on_hopper, computes), and FLA's intermediate states (each sequence's
state before each chunk) laid over kda_forward's checkpoints (intermediate_states, first_rows).
"""
import functools

import torch

from .checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from .options import CHUNK


@functools.cache
def on_hopper(device: torch.device) -> bool:
    """Whether the device is a CUDA GPU of compute capability 9.x, the only one kda_opt runs on (asked
    of the driver once per device: every verified call asks)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def computes(x: torch.Tensor, state: torch.Tensor | None, K: int, V: int) -> bool:
    """Whether kda_opt computes an engine's call on the tokens x (q, or a packed mixed_qkv) of head
    dims K and V and the states `state` (a pool or the dense initial states; None: zeros): on Hopper,
    x of a dtype it takes, head dims it takes, states of a dtype it takes."""
    return (on_hopper(x.device) and x.dtype in SUPPORTED_DTYPES and K in SUPPORTED_HEAD_DIMS
            and V in SUPPORTED_HEAD_DIMS and (state is None or state.dtype in SUPPORTED_DTYPES))


def intermediate_states(v, K: int, rows: int, v_first: bool, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, checkpoints): FLA's intermediate states h [B, rows / B, HV, K, V] ([..., V, K] V-first) of
    `dtype`, row j of a sequence its state before its chunk j (rows: B · cdiv(T, 64); packed, B = 1,
    Σ_n cdiv(len_n, 64), sequence n's rows from Σ_{m<n} cdiv(len_m, 64), or more: the rows past the
    last sequence's are left as they are), and the buffer kda_forward writes its checkpoints into: the
    same storage one row on, so that the state after chunk j lands in the row before chunk j + 1. Each
    sequence's last checkpoint lands in the next sequence's first row (or a spare row past h), which
    first_rows then writes."""
    B, _, HV, V = v.shape
    row = (V, K) if v_first else (K, V)
    flat = v.new_empty((rows + 1, HV, *row), dtype=dtype)
    return flat[:rows].view(B, rows // B, HV, *row), flat[1:].view(B, rows // B, HV, *row)


def first_rows(h: torch.Tensor, initial_state, has_initial_state, cu_seqlens) -> None:
    """Writes each sequence's row before its first chunk in h (intermediate_states): its initial
    state in h's dtype, zeros without one (or where has_initial_state is false)."""
    starts = None if initial_state is None else initial_state.to(h.dtype)
    if starts is not None and has_initial_state is not None:
        starts = torch.where(has_initial_state.view(-1, 1, 1, 1), starts, 0)
    if cu_seqlens is None:
        h[:, 0] = 0 if starts is None else starts
        return
    whole, first = spare_rows(h), sequence_rows(cu_seqlens, h.shape[1])
    if starts is None:
        whole.index_fill_(0, first, 0)
    else:
        whole.index_copy_(0, first, starts)


def spare_rows(h: torch.Tensor) -> torch.Tensor:
    """h [1, rows, ...] (intermediate_states, packed) as [rows + 1, ...]: its rows and the spare row
    past them."""
    return h.as_strided((h.shape[1] + 1, *h.shape[2:]), h.stride()[1:])


def sequence_rows(cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """[N]: packed sequence n's first row of intermediate states, Σ_{m<n} cdiv(len_m, 64), counted on
    the device; `rows` (the spare row) for a sequence of no token, which has none."""
    lengths = cu_seqlens.diff()
    chunks = lengths.add(CHUNK - 1).div(CHUNK, rounding_mode="floor")
    return torch.where(lengths > 0, chunks.cumsum(0) - chunks, rows)
