"""Causal linear attention without decay: Triton kernels and PyTorch references."""

from .reference import (
    causal_linear_attn_bwd_ref,
    causal_linear_attn_chunked_ref,
    causal_linear_attn_ref,
)
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
    "triton_available",
]
