"""kda_opt: a fused forward (prefill) engine for Kimi Delta Attention on NVIDIA Hopper.

`kda_forward` is the entry point (same arguments and function as FLA 0.6.0's `chunk_kda`), and
`kda_decode` the decode and speculative-verify step (FLA's `fused_recurrent_kda`, kda_opt/decode),
`kda_conv_decode` a server's decode step with its short convolution fused in (kda_opt/conv_decode);
`kda_opt.reference` holds the float64 truth every stage is tested against; `use_in_fla()` makes FLA's
`chunk_kda` and decode kernel run kda_opt where it can (kda_opt/fla_backend).
"""
from . import op  # noqa: F401  registers torch.ops.kda_opt.forward, kda_forward's form under torch.compile
from .conv_decode import kda_conv_decode
from .decode import kda_decode
from .fla_backend import use_in_fla
from .forward import kda_forward

__all__ = ["kda_conv_decode", "kda_decode", "kda_forward", "use_in_fla"]
__version__ = "0.1.0"
