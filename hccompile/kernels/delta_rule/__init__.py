"""The (gated) delta rule: plain, GDN (scalar gate) and KDA (per-channel gate).

Triton kernels (chunk.py) beside their plain-PyTorch references (reference.py).
"""

from .chunk import MAX_HEAD_DIM, chunk_delta_rule_bwd, chunk_delta_rule_fwd, triton_available
from .reference import (
    chunk_delta_rule_ref,
    check_delta_rule_inputs,
    kda_gate,
    l2norm,
    naive_recurrent_delta_rule,
)

__all__ = [
    "MAX_HEAD_DIM",
    "check_delta_rule_inputs",
    "chunk_delta_rule_bwd",
    "chunk_delta_rule_fwd",
    "chunk_delta_rule_ref",
    "kda_gate",
    "l2norm",
    "naive_recurrent_delta_rule",
    "triton_available",
]
