"""The engine's fixed constants, and the frozen values that travel through the stages: a call's sizes,
the gate option."""
import math
from dataclasses import dataclass
from enum import IntEnum

# Tokens per chunk: the only size the stages compute (stage 2 takes a chunk as four 16-row blocks).
# kda_forward's chunk_size argument (FLA's name) must equal it.
CHUNK = 64

# FLA's l2norm (use_qk_l2norm_in_kernel): x / sqrt(Σ x² + L2NORM_EPS) per head and token.
L2NORM_EPS = 1e-6
# The per-token log-decay is floored here (natural log): a decay below 2^-24 is taken as 2^-24. What
# the floor changes in a state is below fp32's resolution of that state, and it bounds how far Γ
# falls per token, which stage 2 needs for any gate (kda_opt/intra, "Unbounded gates").
LOG_DECAY_FLOOR = -24 * math.log(2.0)
# The sigmoid gate's lower_bound range [SAFE_LOWER_BOUND, 0) (FLA's for safe_gate): a ≥ lower_bound
# ≥ −5 per token, so that Γ falls at most 5/ln 2 per token in log2 units and stage 2 serves each
# diagonal block with its row block's one product (kda_opt/intra, "Bounded gates").
SAFE_LOWER_BOUND = -5.0
# The largest stride (in elements) of an array cuTile takes, and so of a batch entry (kda_opt/checks).
INT32_MAX = 2 ** 31 - 1


def in_safe_range(lower_bound: float) -> bool:
    """Whether lower_bound lies in [SAFE_LOWER_BOUND, 0)."""
    return SAFE_LOWER_BOUND <= lower_bound < 0.0


class Read(IntEnum):
    """Where kda_opt/recurrence's kernel reads each request's start (its READ)."""
    ZEROS = 0       # no state: zeros
    ROW = 1         # dense row n
    SLOT = 2        # pool row indices[n, accepted[n] − 1] (column 0 without accepted)


class Write(IntEnum):
    """Where kda_opt/recurrence's kernel writes each request's state (its WRITE)."""
    NONE = 0
    ROW = 1         # dense row n, after the last token
    SLOT = 2        # pool row indices[n], after the last token
    EACH_TOKEN = 3  # pool row indices[n, t], after each token t (speculative verify)
    BUFFER = 4      # buffer[buffer_rows[n], t], after each token t (SGLang's verify: the pool only read)


@dataclass(frozen=True)
class Sizes:
    """A call's sizes: q, k [B, T, H, K], v [B, T, HV, V]; N sequences (B, or packed)."""
    B: int
    T: int
    H: int
    K: int
    HV: int
    V: int
    N: int


def beta_scale(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> float | None:
    """β = beta_scale · sigmoid(beta) where beta holds logits (2 with allow_neg_eigval); None: beta is β."""
    return (2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else None


def state_shape(N: int, HV: int, K: int, V: int, v_first: bool) -> tuple[int, int, int, int]:
    """A state per sequence and value head: [N, HV, K, V], or [N, HV, V, K] (state_v_first)."""
    return (N, HV, V, K) if v_first else (N, HV, K, V)


@dataclass(frozen=True)
class GateConfig:
    """How stage 1 turns the gate input g into the per-channel log-decay a (docs/DESIGN.md, Math).

    in_kernel:   g is raw and is activated here; otherwise g already is a (≤ 0).
    lower_bound: with in_kernel, selects a = lower_bound · sigmoid(exp(A_log) · (g + dt_bias));
                 None selects a = -exp(A_log) · softplus(g + dt_bias).
    safe_gate:   the caller promises a ≥ lower_bound, so exp of in-chunk gate differences stays
                 bounded and the intra-chunk products may run on tensor cores in 16-bit.
    """

    in_kernel: bool = False
    lower_bound: float | None = None
    safe_gate: bool = False

    @property
    def bounded(self) -> bool:
        """a ≥ −5 by construction (sigmoid gate, lower_bound in the safe range), not only by promise:
        stage 2 then serves each diagonal block with the row block's one product (kda_opt/intra)."""
        return self.in_kernel and self.lower_bound is not None and in_safe_range(self.lower_bound)
