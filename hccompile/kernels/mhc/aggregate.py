"""The mHC aggregate kernel, y = Σ_i H_pre[i] x[i] (the sublayer's input), and its backward's
reduction dH_pre[i] = Σ_c x[i]·dy (dx = H_pre ⊗ dy is the caller's broadcast product).

It cannot join the post kernel of the previous sublayer: H_pre of this sublayer comes from the
projection of the whole new stream, so the new stream must be complete first. On its own it
replaces what the graphs spell as a [tokens, 1, n] × [tokens, n, C] batched matmul (a cuBLAS call
with a 1×n×C problem per token) or a broadcast multiply and sum.

Layouts as in reference.py: x [T1, T2, n, C], h_pre [T1, T2, n], y / dy [T1, T2, C], any strides.
"""
from __future__ import annotations

import torch

from . import _common as common
from .._triton import cdiv, tl, triton

if triton is not None:

    @triton.jit
    def _mhc_aggregate_fwd_kernel(
        x_ptr, h_ptr, y_ptr,
        T, T2, C,
        sx1, sx2, sxn, sxc,
        sh1, sh2, shn,
        sy1, sy2, syc,
        N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """One program: BLOCK_T tokens × BLOCK_C channels, the streams unrolled: the sum over
        streams is register arithmetic on [BLOCK_T, BLOCK_C] tiles, never a cross-warp reduction."""
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
        tok_ok = tok < T
        t1 = (tok // T2).to(tl.int64)
        t2 = (tok % T2).to(tl.int64)
        tc_ok = tok_ok[:, None] & (cols < C)
        x_tok = (t1 * sx1 + t2 * sx2)[:, None] + cols * sxc
        h_tok = t1 * sh1 + t2 * sh2
        y = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for i in tl.static_range(N):
            h_i = tl.load(h_ptr + h_tok + i * shn, mask=tok_ok, other=0.0).to(tl.float32)
            x_i = tl.load(x_ptr + x_tok + i * sxn, mask=tc_ok, other=0.0).to(tl.float32)
            y += h_i[:, None] * x_i
        tl.store(y_ptr + (t1 * sy1 + t2 * sy2)[:, None] + cols * syc, y.to(y_ptr.dtype.element_ty),
                 mask=tc_ok)

    @triton.jit
    def _mhc_aggregate_bwd_kernel(
        x_ptr, dy_ptr, dh_ptr,
        T, T2, C,
        sx1, sx2, sxn, sxc,
        sdy1, sdy2, sdyc,
        sdh1, sdh2, sdhn,
        N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """dH_pre[i] = Σ_c x[i]·dy. One program: BLOCK_R rows, a row being one (token, stream)
        pair, sweeping C in [BLOCK_R, BLOCK_C] tiles. The products accumulate elementwise and are
        summed over C once, after the sweep: one shuffle tree per row, not one per stream and step
        (a token's dy is read once per stream, from L1)."""
        row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        tok = row // N
        stream = row - tok * N
        tok_ok = tok < T
        t1 = (tok // T2).to(tl.int64)
        t2 = (tok % T2).to(tl.int64)
        x_row = (t1 * sx1 + t2 * sx2 + stream * sxn)[:, None]
        dy_row = (t1 * sdy1 + t2 * sdy2)[:, None]
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = (c0 + tl.arange(0, BLOCK_C))[None, :]
            tc_ok = tok_ok[:, None] & (cols < C)
            dy = tl.load(dy_ptr + dy_row + cols * sdyc, mask=tc_ok, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + x_row + cols * sxc, mask=tc_ok, other=0.0).to(tl.float32)
            acc += x * dy
        tl.store(dh_ptr + t1 * sdh1 + t2 * sdh2 + stream * sdhn, tl.sum(acc, axis=1).to(dh_ptr.dtype.element_ty),
                 mask=tok_ok)


def check_aggregate_inputs(x, h_pre, dy=None) -> None:
    common.check_tensor("x", x, 4, "[T1, T2, n, C]")
    T1, T2, n, C = x.shape
    common.check_tensor("h_pre", h_pre, 3, "[T1, T2, n]", shape=(T1, T2, n))
    named = dict(x=x, h_pre=h_pre)
    if dy is not None:
        common.check_tensor("dy", dy, 3, "[T1, T2, C]", shape=(T1, T2, C))
        named["dy"] = dy
    common.check_same_device(**named)
    common.check_streams(n)


def mhc_aggregate_fwd(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """y [T1, T2, C], contiguous, in x's dtype."""
    check_aggregate_inputs(x, h_pre)
    common.require(x.device, _mhc_aggregate_fwd_kernel, __name__)
    if x.dtype == torch.float64:
        raise TypeError("x: float64 runs the reference (mhc_aggregate_ref), not the kernel")
    return launch_aggregate_fwd(x, h_pre)


def launch_aggregate_fwd(x, h_pre, wrap=common.direct) -> torch.Tensor:
    """mhc_aggregate_fwd without the checks (the ops check once, then call this)."""
    T1, T2, n, C = x.shape
    y = common.new_output((T1, T2, C), x.dtype, x.device)
    if T1 * T2 == 0 or C == 0:
        return y
    bt, bc = common.channel_blocks(C)
    wrap(_mhc_aggregate_fwd_kernel)[(cdiv(T1 * T2, bt), cdiv(C, bc))](
        x, h_pre, y, T1 * T2, T2, C, *x.stride(), *h_pre.stride(), *y.stride(),
        N=n, BLOCK_T=bt, BLOCK_C=bc,
    )
    return y


def mhc_aggregate_bwd(x: torch.Tensor, h_pre: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dh_pre [T1, T2, n] in h_pre's dtype. dx = H_pre ⊗ dy is a broadcast product, left to the
    caller: under torch.compile Inductor folds it into the kernel that sums the stream's gradient
    contributions, instead of this kernel writing an n·C-sized dx that the sum reads back."""
    check_aggregate_inputs(x, h_pre, dy)
    common.require(x.device, _mhc_aggregate_bwd_kernel, __name__)
    if x.dtype == torch.float64:
        raise TypeError("x: float64 runs the reference (mhc_aggregate_bwd_ref), not the kernel")
    return launch_aggregate_bwd(x, h_pre, dy)


def launch_aggregate_bwd(x, h_pre, dy, wrap=common.direct) -> torch.Tensor:
    """mhc_aggregate_bwd without the checks (the ops check once, then call this)."""
    T1, T2, n, C = x.shape
    dh = common.new_output(tuple(h_pre.shape), h_pre.dtype, x.device)
    if T1 * T2 == 0:
        return dh
    if C == 0:
        return dh.zero_()
    br, bc = common.row_blocks(C, x.element_size())
    wrap(_mhc_aggregate_bwd_kernel)[(cdiv(T1 * T2 * n, br),)](
        x, dy, dh, T1 * T2, T2, C, *x.stride(), *dy.stride(), *dh.stride(),
        N=n, BLOCK_R=br, BLOCK_C=bc,
    )
    return dh
