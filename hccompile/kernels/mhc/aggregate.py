"""The mHC aggregate kernel, y = Σ_i H_pre[i] x[i] (the sublayer's input), and its backward.

It cannot join the post kernel of the previous sublayer: H_pre of this sublayer comes from the
projection of the whole new stream, so the new stream must be complete first. On its own it
replaces what the graphs spell as a [tokens, 1, n] × [tokens, n, C] batched matmul (a cuBLAS call
with a 1×n×C problem per token) or a broadcast multiply and sum.

Layouts as in reference.py: x [T1, T2, n, C], h_pre [T1, T2, n], y / dy [T1, T2, C], any strides.
"""
from __future__ import annotations

import torch

from . import _common as common
from .._triton import tl, triton

if triton is not None:

    @triton.jit
    def _mhc_aggregate_fwd_kernel(
        x_ptr, h_ptr, y_ptr,
        T, T2, C,
        sx1, sx2, sxn, sxc,
        sh1, sh2, shn,
        sy1, sy2, syc,
        N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """One program: BLOCK_T tokens × BLOCK_C channels."""
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        streams = tl.arange(0, BLOCK_N)
        tok_ok = tok < T
        t1 = (tok // T2).to(tl.int64)
        t2 = (tok % T2).to(tl.int64)
        tn_ok = tok_ok[:, None] & (streams < N)[None, :]
        tc_ok = tok_ok[:, None] & (cols < C)[None, :]
        h = tl.load(h_ptr + (t1 * sh1 + t2 * sh2)[:, None] + streams[None, :] * shn, mask=tn_ok,
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + (t1 * sx1 + t2 * sx2)[:, None, None] + streams[None, :, None] * sxn
                    + cols[None, None, :] * sxc, mask=tn_ok[:, :, None] & tc_ok[:, None, :],
                    other=0.0).to(tl.float32)
        y = tl.sum(h[:, :, None] * x, axis=1)
        tl.store(y_ptr + (t1 * sy1 + t2 * sy2)[:, None] + cols[None, :] * syc,
                 y.to(y_ptr.dtype.element_ty), mask=tc_ok)

    @triton.jit
    def _mhc_aggregate_bwd_kernel(
        x_ptr, h_ptr, dy_ptr, dx_ptr, dh_ptr,
        T, T2, C,
        sx1, sx2, sxn, sxc,
        sh1, sh2, shn,
        sdy1, sdy2, sdyc,
        sdx1, sdx2, sdxn, sdxc,
        sdh1, sdh2, sdhn,
        N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """One program: BLOCK_T tokens, sweeping C; dH_pre is a reduction over C in registers."""
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        streams = tl.arange(0, BLOCK_N)
        tok_ok = tok < T
        t1 = (tok // T2).to(tl.int64)
        t2 = (tok % T2).to(tl.int64)
        tn_ok = tok_ok[:, None] & (streams < N)[None, :]
        h = tl.load(h_ptr + (t1 * sh1 + t2 * sh2)[:, None] + streams[None, :] * shn, mask=tn_ok,
                    other=0.0).to(tl.float32)
        dh = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            tc_ok = tok_ok[:, None] & (cols < C)[None, :]
            tnc_ok = tn_ok[:, :, None] & tc_ok[:, None, :]
            dy = tl.load(dy_ptr + (t1 * sdy1 + t2 * sdy2)[:, None] + cols[None, :] * sdyc, mask=tc_ok,
                         other=0.0).to(tl.float32)
            x = tl.load(x_ptr + (t1 * sx1 + t2 * sx2)[:, None, None] + streams[None, :, None] * sxn
                        + cols[None, None, :] * sxc, mask=tnc_ok, other=0.0).to(tl.float32)
            dh += tl.sum(x * dy[:, None, :], axis=2)
            dx = h[:, :, None] * dy[:, None, :]
            tl.store(dx_ptr + (t1 * sdx1 + t2 * sdx2)[:, None, None] + streams[None, :, None] * sdxn
                     + cols[None, None, :] * sdxc, dx.to(dx_ptr.dtype.element_ty), mask=tnc_ok)
        tl.store(dh_ptr + (t1 * sdh1 + t2 * sdh2)[:, None] + streams[None, :] * sdhn,
                 dh.to(dh_ptr.dtype.element_ty), mask=tn_ok)


def check_aggregate_inputs(x, h_pre, dy=None) -> None:
    common.check_tensor("x", x, 4, "[T1, T2, n, C]")
    common.check_tensor("h_pre", h_pre, 3, "[T1, T2, n]")
    T1, T2, n, C = x.shape
    if tuple(h_pre.shape) != (T1, T2, n):
        raise ValueError(f"h_pre: shape {tuple(h_pre.shape)} must be [T1, T2, n] = {(T1, T2, n)}")
    named = dict(x=x, h_pre=h_pre)
    if dy is not None:
        common.check_tensor("dy", dy, 3, "[T1, T2, C]")
        if tuple(dy.shape) != (T1, T2, C):
            raise ValueError(f"dy: shape {tuple(dy.shape)} must be [T1, T2, C] = {(T1, T2, C)}")
        named["dy"] = dy
    common.check_same_device(**named)
    from .mapping import MAX_STREAMS

    if isinstance(n, int) and n > MAX_STREAMS:
        raise ValueError(f"x: {n} streams exceed the kernels' maximum {MAX_STREAMS}")



def mhc_aggregate_fwd(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """y [T1, T2, C], contiguous, in x's dtype."""
    check_aggregate_inputs(x, h_pre)
    common.require(x.device, _mhc_aggregate_fwd_kernel, __name__)
    if x.dtype == torch.float64:
        raise TypeError("x: float64 runs the reference (mhc_aggregate_ref), not the kernel")
    T1, T2, n, C = x.shape
    y = common.new_output((T1, T2, C), x.dtype, x.device)
    if T1 * T2 == 0 or C == 0:
        return y
    bn, bc, bt = common.stream_blocks(n, C)
    _mhc_aggregate_fwd_kernel[(triton.cdiv(T1 * T2, bt), triton.cdiv(C, bc))](
        x, h_pre, y, T1 * T2, T2, C, *x.stride(), *h_pre.stride(), *y.stride(),
        N=n, BLOCK_N=bn, BLOCK_T=bt, BLOCK_C=bc,
    )
    return y


def mhc_aggregate_bwd(x: torch.Tensor, h_pre: torch.Tensor, dy: torch.Tensor, x_order=(0, 1, 2, 3)
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [memory in x_order], dh_pre), in x's and h_pre's dtypes."""
    check_aggregate_inputs(x, h_pre, dy)
    common.require(x.device, _mhc_aggregate_bwd_kernel, __name__)
    order = common.check_order(x_order, 4, "x_order")
    if x.dtype == torch.float64:
        raise TypeError("x: float64 runs the reference (mhc_aggregate_bwd_ref), not the kernel")
    T1, T2, n, C = x.shape
    dx = common.new_output(tuple(x.shape), x.dtype, x.device, order)
    dh = common.new_output(tuple(h_pre.shape), h_pre.dtype, x.device)
    if T1 * T2 == 0:
        return dx, dh
    if C == 0:
        return dx, dh.zero_()
    bn, bc, bt = common.stream_blocks(n, C, backward=True)
    _mhc_aggregate_bwd_kernel[(triton.cdiv(T1 * T2, bt),)](
        x, h_pre, dy, dx, dh, T1 * T2, T2, C,
        *x.stride(), *h_pre.stride(), *dy.stride(), *dx.stride(), *dh.stride(),
        N=n, BLOCK_N=bn, BLOCK_T=bt, BLOCK_C=bc,
    )
    return dx, dh
