"""Fused kernels for mHC hyper-connections (Triton) beside their plain-PyTorch references.

post.py       apply_h_res + apply_h_post + residual add, one pass, and its backward
aggregate.py  y = Σ_i H_pre[i] x[i], and its backward
project.py    the projection v·φᵀ and Σ v² from one read of the stream, and its backward
mapping.py    α/r/bias, σ maps and every Sinkhorn-Knopp normalisation in registers, and the
              backward through them (recomputed forward, rebuilt iterates)
reference.py  the same math in PyTorch (MappingSpec describes a mapping's constants)
"""
from .aggregate import mhc_aggregate_bwd, mhc_aggregate_fwd
from .mapping import MAX_SINKHORN_STEPS, MAX_STREAMS, mhc_mapping_bwd, mhc_mapping_fwd
from .post import mhc_post_bwd, mhc_post_fwd
from .project import mhc_project_bwd, mhc_project_fwd
from .reference import (
    MappingSpec,
    mhc_aggregate_bwd_ref,
    mhc_aggregate_ref,
    mhc_mapping_ref,
    mhc_post_bwd_ref,
    mhc_post_ref,
    mhc_project_bwd_ref,
    mhc_project_ref,
    sinkhorn_ref,
)
from ._common import SUPPORTED_DTYPES, triton_available

__all__ = [
    "MAX_SINKHORN_STEPS", "MAX_STREAMS", "MappingSpec", "SUPPORTED_DTYPES",
    "mhc_aggregate_bwd", "mhc_aggregate_bwd_ref", "mhc_aggregate_fwd", "mhc_aggregate_ref",
    "mhc_mapping_bwd", "mhc_mapping_fwd", "mhc_mapping_ref",
    "mhc_post_bwd", "mhc_post_bwd_ref", "mhc_post_fwd", "mhc_post_ref",
    "mhc_project_bwd", "mhc_project_bwd_ref", "mhc_project_fwd", "mhc_project_ref",
    "sinkhorn_ref", "triton_available",
]
