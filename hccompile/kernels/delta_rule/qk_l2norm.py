"""The optional in-kernel l2norm of q and k (use_qk_l2norm_in_kernel), both ways: y = x / sqrt(sum x^2
+ 1e-6) per head row, stored contiguous in the plan's normed_qk_dtype for every later kernel to read,
and its backward from the key-head gradients. One kernel; BACKWARD picks the direction.

Not named l2norm.py: the package exports reference.py's `l2norm`, which a submodule of that name
would shadow.
"""

from __future__ import annotations

from typing import Callable

import torch

from .plan import MAX_HEAD_DIM, block_size

from .._triton import direct, tl, triton

# Rows of q or k per l2norm program, and its warps (read at call time: benchmarks/tune_delta_rule.py
# times other values).
L2NORM_BLOCK_ROWS = 16
L2NORM_WARPS = 4


if triton is not None:

    @triton.jit
    def _l2norm_kernel(
        x_ptr, y_ptr, dy_ptr, dx_ptr,
        stride_xb, stride_xt, stride_xh, stride_xk,
        stride_db, stride_dt, stride_dh, stride_dk,
        T, H, K, n_rows,
        BACKWARD: tl.constexpr,
        BR: tl.constexpr,
        BK: tl.constexpr,
    ):
        """Forward: y = x / sqrt(sum x^2 + 1e-6), contiguous [B, T, H, K] in y's dtype.

        Backward: dx = (dy - y (y . dy)) / sqrt(sum x^2 + 1e-6), in dx's dtype and layout
        (dy is fp32 contiguous, dx strided like x).
        """
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        valid = rows < n_rows
        batch = (rows // (T * H)).to(tl.int64)
        token = ((rows // H) % T).to(tl.int64)
        head = (rows % H).to(tl.int64)
        cols = tl.arange(0, BK)
        mask = valid[:, None] & (cols[None, :] < K)
        x_offsets = (batch * stride_xb + token * stride_xt + head * stride_xh)[:, None] + cols[None, :] * stride_xk
        x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)
        y = x * rstd[:, None]
        flat = rows[:, None].to(tl.int64) * K + cols[None, :]
        if BACKWARD:
            dy = tl.load(dy_ptr + flat, mask=mask, other=0.0)
            dx = (dy - y * tl.sum(y * dy, axis=1)[:, None]) * rstd[:, None]
            d_offsets = (batch * stride_db + token * stride_dt + head * stride_dh)[:, None] + cols[None, :] * stride_dk
            tl.store(dx_ptr + d_offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(y_ptr + flat, y.to(y_ptr.dtype.element_ty), mask=mask)


def l2norm_forward(x: torch.Tensor, dtype: torch.dtype, launch: Callable = direct) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6), contiguous, in `dtype` (the plan's normed_qk_dtype)."""
    batch, time, heads, dim = x.shape
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    n_rows = batch * time * heads
    if n_rows:
        launch(_l2norm_kernel)[(triton.cdiv(n_rows, L2NORM_BLOCK_ROWS),)](
            x, y, y, y, *x.stride(), *x.stride(), time, heads, dim, n_rows,
            BACKWARD=False, BR=L2NORM_BLOCK_ROWS, BK=block_size(dim, MAX_HEAD_DIM), num_warps=L2NORM_WARPS,
        )
    return y


def l2norm_backward(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, launch: Callable = direct) -> None:
    batch, time, heads, dim = x.shape
    n_rows = batch * time * heads
    if n_rows:
        launch(_l2norm_kernel)[(triton.cdiv(n_rows, L2NORM_BLOCK_ROWS),)](
            x, x, dy, dx, *x.stride(), *dx.stride(), time, heads, dim, n_rows,
            BACKWARD=True, BR=L2NORM_BLOCK_ROWS, BK=block_size(dim, MAX_HEAD_DIM), num_warps=L2NORM_WARPS,
        )
