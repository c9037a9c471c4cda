"""FLA 0.6.0 refuses its gated chunk backward (GDN) on Hopper with Triton >= 3.4, < 3.7.1 (fla #640:
wrong gradients), which is the H100 machine's Triton 3.6. The benchmarks that time FLA's GDN bypass
that refusal for timing and note each such row: its times stand, its errors do not."""
from __future__ import annotations

FLA_GDN_TIMING_ONLY = ("timing only: FLA refuses this backward on Hopper with Triton >=3.4,<3.7.1 (fla #640, wrong "
                       "gradients); refusal bypassed via fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1=True")


def unlock_fla_gdn_backward() -> bool:
    """Bypass FLA's refusal of the gated chunk backward (a module-level version flag read at call
    time). Returns whether a refusal was in force."""
    import fla.ops.common.chunk_o as chunk_o

    locked = bool(getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
                  and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True))
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return locked
