"""kda_opt: a fused forward (prefill) engine for Kimi Delta Attention on NVIDIA Hopper."""
__version__ = "0.1.0"
