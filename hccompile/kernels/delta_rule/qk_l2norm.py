"""The optional in-kernel l2norm of q and k (use_qk_l2norm_in_kernel), both ways and both tensors in one
launch: y = x / sqrt(sum x^2 + 1e-6) per head row, stored contiguous in the plan's normed_qk_dtype for
every later kernel to read, and its backward from the key-head gradients. One kernel; BACKWARD picks
the direction, the launch grid's second axis the tensor (0: q, 1: k), so that a step pays one launch
per direction for the pair rather than one per tensor.

Not named l2norm.py: the package exports reference.py's `l2norm`, which a submodule of that name
would shadow.
"""

from __future__ import annotations

from typing import Callable

import torch

from .plan import MAX_HEAD_DIM, block_size

from .._triton import cdiv, direct, tl, triton

# Rows of q or k per l2norm program, and its warps (read at call time: benchmarks/tune_delta_rule.py
# times other values).
L2NORM_BLOCK_ROWS = 16
L2NORM_WARPS = 4


if triton is not None:

    @triton.jit
    def _l2norm_rows(
        x_ptr, y_ptr, dy_ptr, dx_ptr,
        stride_xb, stride_xt, stride_xh, stride_xk,
        stride_db, stride_dt, stride_dh, stride_dk,
        T, H, K, n_rows,
        BACKWARD: tl.constexpr,
        BR: tl.constexpr,
        BK: tl.constexpr,
    ):
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
            dy = tl.load(dy_ptr + flat, mask=mask, other=0.0).to(tl.float32)
            dx = (dy - y * tl.sum(y * dy, axis=1)[:, None]) * rstd[:, None]
            d_offsets = (batch * stride_db + token * stride_dt + head * stride_dh)[:, None] + cols[None, :] * stride_dk
            tl.store(dx_ptr + d_offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(y_ptr + flat, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _l2norm_kernel(
        q_ptr, qn_ptr, dqn_ptr, dq_ptr,
        k_ptr, kn_ptr, dkn_ptr, dk_ptr,
        stride_qb, stride_qt, stride_qh, stride_qk,
        stride_kb, stride_kt, stride_kh, stride_kk,
        stride_dqb, stride_dqt, stride_dqh, stride_dqk,
        stride_dkb, stride_dkt, stride_dkh, stride_dkk,
        T, H, K, n_rows,
        BACKWARD: tl.constexpr,
        BR: tl.constexpr,
        BK: tl.constexpr,
    ):
        """Forward: qn, kn = l2norm(q), l2norm(k), contiguous [B, T, H, K] in qn's dtype.

        Backward: dx = (dxn - y (y . dxn)) / sqrt(sum x^2 + 1e-6) for x = q, k, in dx's dtype and
        layout (dxn is fp32 contiguous, dx strided like x; y recomputed from x).
        """
        if tl.program_id(1) == 0:
            _l2norm_rows(q_ptr, qn_ptr, dqn_ptr, dq_ptr, stride_qb, stride_qt, stride_qh, stride_qk,
                         stride_dqb, stride_dqt, stride_dqh, stride_dqk, T, H, K, n_rows, BACKWARD, BR, BK)
        else:
            _l2norm_rows(k_ptr, kn_ptr, dkn_ptr, dk_ptr, stride_kb, stride_kt, stride_kh, stride_kk,
                         stride_dkb, stride_dkt, stride_dkh, stride_dkk, T, H, K, n_rows, BACKWARD, BR, BK)


def _grid(q: torch.Tensor):
    batch, time, heads, _ = q.shape
    return (cdiv(batch * time * heads, L2NORM_BLOCK_ROWS), 2)


def l2norm_forward(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype, launch: Callable = direct
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) / sqrt(sum x^2 + 1e-6) per row, contiguous, in `dtype` (the plan's normed_qk_dtype)."""
    batch, time, heads, dim = q.shape
    qn = torch.empty(q.shape, dtype=dtype, device=q.device)
    kn = torch.empty(k.shape, dtype=dtype, device=k.device)
    n_rows = batch * time * heads
    if n_rows:
        launch(_l2norm_kernel)[_grid(q)](
            q, qn, qn, qn, k, kn, kn, kn, *q.stride(), *k.stride(), *q.stride(), *k.stride(),
            time, heads, dim, n_rows,
            BACKWARD=False, BR=L2NORM_BLOCK_ROWS, BK=block_size(dim, MAX_HEAD_DIM), num_warps=L2NORM_WARPS,
        )
    return qn, kn


def l2norm_backward(q: torch.Tensor, k: torch.Tensor, dqn: torch.Tensor, dkn: torch.Tensor, dq: torch.Tensor,
                    dk: torch.Tensor, launch: Callable = direct) -> None:
    """Writes dq, dk (strided like q, k) from the normed rows' contiguous gradients dqn, dkn (fp32, or
    the input dtype: plan.half_key_gradients)."""
    batch, time, heads, dim = q.shape
    n_rows = batch * time * heads
    if n_rows:
        launch(_l2norm_kernel)[_grid(q)](
            q, q, dqn, dq, k, k, dkn, dk, *q.stride(), *k.stride(), *dq.stride(), *dk.stride(),
            time, heads, dim, n_rows,
            BACKWARD=True, BR=L2NORM_BLOCK_ROWS, BK=block_size(dim, MAX_HEAD_DIM), num_warps=L2NORM_WARPS,
        )
