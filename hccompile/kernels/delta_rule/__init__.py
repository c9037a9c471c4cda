"""The (gated) delta rule: plain, GDN (scalar gate) and KDA (per-channel gate).

Triton kernels (chunk.py's forward and backward, which run the step files gate_cumsum.py, scores.py,
wy.py, state.py, output.py, and dqkw.py and wy_bwd.py for the split wy_backward; cp.py for context
parallelism) beside their plain-PyTorch references
(reference.py).
"""

from .._triton import triton_available
from .chunk import chunk_delta_rule_bwd, chunk_delta_rule_fwd
from .plan import MAX_HEAD_DIM
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
