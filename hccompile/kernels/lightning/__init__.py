"""Causal linear attention: the simple no-decay kernels (simple.py), the lightning kernels with a
per-head decay and a micro-chunked backward (chunk.py), and their PyTorch references."""

from .reference import (
    causal_linear_attn_bwd_ref,
    causal_linear_attn_chunked_ref,
    causal_linear_attn_ref,
)
from .chunk import lightning_attn_bwd, lightning_attn_fwd
from .decay_reference import lightning_attn_recurrent_ref, lightning_attn_ref
from .simple import (
    MAX_HEAD_DIM,
    causal_linear_attn_bwd,
    causal_linear_attn_fwd,
    triton_available,
)

__all__ = [
    "MAX_HEAD_DIM",
    "causal_linear_attn_bwd",
    "causal_linear_attn_bwd_ref",
    "causal_linear_attn_chunked_ref",
    "causal_linear_attn_fwd",
    "causal_linear_attn_ref",
    "lightning_attn_bwd",
    "lightning_attn_fwd",
    "lightning_attn_recurrent_ref",
    "lightning_attn_ref",
    "triton_available",
]
