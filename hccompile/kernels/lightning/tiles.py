"""Tile sizes and dot options shared by the lightning launchers (segments.py, sweeps.py)."""

from __future__ import annotations

import torch

from .._triton import interpreted, next_power_of_2

MAX_BLOCK = 256
# tl.dot needs every block dim to be at least 16.
MIN_DOT_DIM = 16


def _block_dim(dim: int, limit: int = MAX_BLOCK) -> int:
    return min(max(MIN_DOT_DIM, next_power_of_2(dim)), limit)


def _state_strides(state: torch.Tensor | None, transpose: bool) -> tuple[int, int, int, int]:
    """(outer, head, row, col) strides of a [N, H, K, V] state, rows/cols swapped if `transpose`."""
    if state is None:
        return (0, 0, 0, 0)
    sn, sh, sk, sv = state.stride()
    return (sn, sh, sv, sk) if transpose else (sn, sh, sk, sv)


def _dot_options(dtype: torch.dtype) -> dict:
    from .._triton import dot  # defined where Triton imports, as are the kernels these options are for

    return dict(
        # The default for fp32 is tf32 on GPUs, which would cost about three digits.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        UPCAST_OPERANDS=interpreted(dot) and dtype == torch.bfloat16,
    )
