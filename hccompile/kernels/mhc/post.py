"""The mHC post kernel: apply_h_res + apply_h_post + residual add in one pass, and its backward.

Per token (x [n, C], f [C]):  out[i] = Σ_j A[i, j] x[j] + H_post[i] f,  A = H_res or H_resᵀ.
Forward reads (n+1)·C values and writes n·C per token, where the unfused graph reads and writes the
mixed and post-distributed streams separately. The backward reads x, f and dout once and writes dx
and df once; the per-token n×n and n gradients are reductions over C kept in registers.

Transposition costs nothing: the launcher swaps the strides of H_res (and of dH_res).
Layouts as in reference.py: x [T1, T2, n, C], h_res [T1, T2, n, n], h_post [T1, T2, n],
f [T1, T2, C], any strides; two token dims so that the streams may sit between them (streams
folded into the batch). `out_order` is the memory order (outer to inner) of out and dx.
"""
from __future__ import annotations

import torch

from . import _common as common
from .._triton import tl, triton

if triton is not None:

    @triton.jit
    def _mhc_post_fwd_kernel(
        x_ptr, a_ptr, hp_ptr, f_ptr, out_ptr,
        T, T2, C,
        sx1, sx2, sxn, sxc,
        sa1, sa2, sai, saj,
        sp1, sp2, spn,
        sf1, sf2, sfc,
        so1, so2, son, soc,
        N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """One program: BLOCK_T tokens × BLOCK_C channels of every output stream."""
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        streams = tl.arange(0, BLOCK_N)
        tok_ok = tok < T
        # int64: token offsets of tensors over 2**31 elements
        t1 = (tok // T2).to(tl.int64)
        t2 = (tok % T2).to(tl.int64)
        tc_ok = tok_ok[:, None] & (cols < C)[None, :]
        tn_ok = tok_ok[:, None] & (streams < N)[None, :]

        f = tl.load(f_ptr + (t1 * sf1 + t2 * sf2)[:, None] + cols[None, :] * sfc, mask=tc_ok, other=0.0)
        hp = tl.load(hp_ptr + (t1 * sp1 + t2 * sp2)[:, None] + streams[None, :] * spn, mask=tn_ok,
                     other=0.0)
        acc = hp.to(tl.float32)[:, :, None] * f.to(tl.float32)[:, None, :]
        a_tok = (t1 * sa1 + t2 * sa2)[:, None] + streams[None, :] * sai
        x_tok = (t1 * sx1 + t2 * sx2)[:, None] + cols[None, :] * sxc
        for j in tl.static_range(N):
            a_col = tl.load(a_ptr + a_tok + j * saj, mask=tn_ok, other=0.0)   # A[:, :, j]
            x_j = tl.load(x_ptr + x_tok + j * sxn, mask=tc_ok, other=0.0)
            acc += a_col.to(tl.float32)[:, :, None] * x_j.to(tl.float32)[:, None, :]

        out_ptrs = (out_ptr + (t1 * so1 + t2 * so2)[:, None, None] + streams[None, :, None] * son
                    + cols[None, None, :] * soc)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tn_ok[:, :, None] & tc_ok[:, None, :])

    @triton.jit
    def _mhc_post_bwd_kernel(
        x_ptr, a_ptr, hp_ptr, f_ptr, dout_ptr,
        dx_ptr, da_ptr, dhp_ptr, df_ptr,
        T, T2, C,
        sx1, sx2, sxn, sxc,
        sa1, sa2, sai, saj,
        sp1, sp2, spn,
        sf1, sf2, sfc,
        sd1, sd2, sdn, sdc,
        sdx1, sdx2, sdxn, sdxc,
        sda1, sda2, sdai, sdaj,
        sdp1, sdp2, sdpn,
        sdf1, sdf2, sdfc,
        N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """One program: BLOCK_T tokens, sweeping C in [BLOCK_T, BLOCK_C] tiles, one per stream.

        Every tile is 2-D with C inside a warp (the launcher keeps BLOCK_C at 8 lanes' worth of
        16-byte vectors), so the sums over streams are register arithmetic over the unrolled
        streams and each sum over C is one warp shuffle tree, never shared memory or a barrier.
        The n² + n sums over C (dA, dH_post) land in the slots of one [BLOCK_T, BLOCK_P] register
        accumulator: dA[i, j] in slot i·N + j, dH_post[i] in slot N² + i."""
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tok_ok = tok < T
        # int64: token offsets of tensors over 2**31 elements
        t1 = (tok // T2).to(tl.int64)
        t2 = (tok % T2).to(tl.int64)
        x_tok = (t1 * sx1 + t2 * sx2)[:, None]
        a_tok = t1 * sa1 + t2 * sa2
        hp_tok = t1 * sp1 + t2 * sp2
        f_tok = (t1 * sf1 + t2 * sf2)[:, None]
        d_tok = (t1 * sd1 + t2 * sd2)[:, None]
        dx_tok = (t1 * sdx1 + t2 * sdx2)[:, None]
        df_tok = (t1 * sdf1 + t2 * sdf2)[:, None]
        slot = tl.arange(0, BLOCK_P)[None, :]
        sums = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = (c0 + tl.arange(0, BLOCK_C))[None, :]
            tc_ok = tok_ok[:, None] & (cols < C)
            f = tl.load(f_ptr + f_tok + cols * sfc, mask=tc_ok, other=0.0).to(tl.float32)
            df = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            for i in tl.static_range(N):
                dout_i = tl.load(dout_ptr + d_tok + i * sdn + cols * sdc, mask=tc_ok,
                                 other=0.0).to(tl.float32)
                hp_i = tl.load(hp_ptr + hp_tok + i * spn, mask=tok_ok, other=0.0).to(tl.float32)
                df += hp_i[:, None] * dout_i
                sums = tl.where(slot == N * N + i, sums + tl.sum(dout_i * f, axis=1)[:, None], sums)
            tl.store(df_ptr + df_tok + cols * sdfc, df.to(df_ptr.dtype.element_ty), mask=tc_ok)
            for j in tl.static_range(N):
                x_j = tl.load(x_ptr + x_tok + j * sxn + cols * sxc, mask=tc_ok, other=0.0).to(tl.float32)
                dx_j = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
                for i in tl.static_range(N):
                    # dout_i again: an L1 hit, cheaper than keeping n tiles live across the j loop
                    dout_i = tl.load(dout_ptr + d_tok + i * sdn + cols * sdc, mask=tc_ok,
                                     other=0.0).to(tl.float32)
                    a_ij = tl.load(a_ptr + a_tok + i * sai + j * saj, mask=tok_ok, other=0.0)
                    dx_j += a_ij.to(tl.float32)[:, None] * dout_i
                    sums = tl.where(slot == i * N + j, sums + tl.sum(dout_i * x_j, axis=1)[:, None],
                                    sums)
                tl.store(dx_ptr + dx_tok + j * sdxn + cols * sdxc, dx_j.to(dx_ptr.dtype.element_ty),
                         mask=tc_ok)

        row = slot // N
        da_ptrs = da_ptr + (t1 * sda1 + t2 * sda2)[:, None] + row * sdai + (slot - row * N) * sdaj
        tl.store(da_ptrs, sums.to(da_ptr.dtype.element_ty), mask=tok_ok[:, None] & (slot < N * N))
        hp_slot = slot - N * N
        tl.store(dhp_ptr + (t1 * sdp1 + t2 * sdp2)[:, None] + hp_slot * sdpn,
                 sums.to(dhp_ptr.dtype.element_ty),
                 mask=tok_ok[:, None] & (hp_slot >= 0) & (hp_slot < N))


def check_post_inputs(x, h_res, h_post, f, dout=None) -> None:
    """Shape contract of the post kernel (symbolic-size safe: only equality checks)."""
    common.check_tensor("x", x, 4, "[T1, T2, n, C]")
    common.check_tensor("h_res", h_res, 4, "[T1, T2, n, n]")
    common.check_tensor("h_post", h_post, 3, "[T1, T2, n]")
    common.check_tensor("f", f, 3, "[T1, T2, C]")
    T1, T2, n, C = x.shape
    if tuple(h_res.shape) != (T1, T2, n, n):
        raise ValueError(f"h_res: shape {tuple(h_res.shape)} must be [T1, T2, n, n] = {(T1, T2, n, n)}")
    if tuple(h_post.shape) != (T1, T2, n):
        raise ValueError(f"h_post: shape {tuple(h_post.shape)} must be [T1, T2, n] = {(T1, T2, n)}")
    if tuple(f.shape) != (T1, T2, C):
        raise ValueError(f"f: shape {tuple(f.shape)} must be [T1, T2, C] = {(T1, T2, C)}")
    if f.dtype != x.dtype:
        raise TypeError(f"f: dtype {f.dtype} differs from x's {x.dtype}")
    named = dict(x=x, h_res=h_res, h_post=h_post, f=f)
    if dout is not None:
        common.check_tensor("dout", dout, 4, "[T1, T2, n, C]")
        if tuple(dout.shape) != tuple(x.shape):
            raise ValueError(f"dout: shape {tuple(dout.shape)} must equal x's {tuple(x.shape)}")
        named["dout"] = dout
    common.check_same_device(**named)
    common.check_streams(n)


def _mixing_strides(h: torch.Tensor, transpose_res: bool) -> tuple[int, int, int, int]:
    s1, s2, si, sj = h.stride()
    return (s1, s2, sj, si) if transpose_res else (s1, s2, si, sj)


def mhc_post_fwd(x: torch.Tensor, h_res: torch.Tensor, h_post: torch.Tensor, f: torch.Tensor,
                 transpose_res: bool = False, out_order=(0, 1, 2, 3)) -> torch.Tensor:
    """out [T1, T2, n, C] in x's dtype, its memory in `out_order`."""
    check_post_inputs(x, h_res, h_post, f)
    common.require(x.device, _mhc_post_fwd_kernel, __name__)
    order = common.check_order(out_order, 4)
    if x.dtype == torch.float64:
        raise TypeError("x: float64 runs the reference (mhc_post_ref), not the kernel")
    return launch_post_fwd(x, h_res, h_post, f, transpose_res, order)


def launch_post_fwd(x, h_res, h_post, f, transpose_res: bool, order, wrap=common.direct) -> torch.Tensor:
    """mhc_post_fwd without the checks (the ops check once, then call this); `wrap` as in
    _common.direct."""
    out = common.new_output(tuple(x.shape), x.dtype, x.device, order)
    T1, T2, n, C = x.shape
    if T1 * T2 == 0 or C == 0:
        return out
    bn, bc, bt = common.stream_blocks(n, C)
    grid = (triton.cdiv(T1 * T2, bt), triton.cdiv(C, bc))
    wrap(_mhc_post_fwd_kernel)[grid](
        x, h_res, h_post, f, out, T1 * T2, T2, C,
        *x.stride(), *_mixing_strides(h_res, transpose_res), *h_post.stride(), *f.stride(),
        *out.stride(),
        N=n, BLOCK_N=bn, BLOCK_T=bt, BLOCK_C=bc,
    )
    return out


def mhc_post_bwd(x: torch.Tensor, h_res: torch.Tensor, h_post: torch.Tensor, f: torch.Tensor,
                 dout: torch.Tensor, transpose_res: bool = False, out_order=(0, 1, 2, 3)
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [memory in out_order], dh_res, dh_post, df), each in its input's dtype."""
    check_post_inputs(x, h_res, h_post, f, dout)
    common.require(x.device, _mhc_post_bwd_kernel, __name__)
    order = common.check_order(out_order, 4)
    if x.dtype == torch.float64:
        raise TypeError("x: float64 runs the reference (mhc_post_bwd_ref), not the kernel")
    return launch_post_bwd(x, h_res, h_post, f, dout, transpose_res, order)


def launch_post_bwd(x, h_res, h_post, f, dout, transpose_res: bool, order, wrap=common.direct):
    """mhc_post_bwd without the checks (the ops check once, then call this)."""
    dx = common.new_output(tuple(x.shape), x.dtype, x.device, order)
    dh_res = common.new_output(tuple(h_res.shape), h_res.dtype, x.device)
    dh_post = common.new_output(tuple(h_post.shape), h_post.dtype, x.device)
    df = common.new_output(tuple(f.shape), f.dtype, x.device)
    T1, T2, n, C = x.shape
    if T1 * T2 == 0:
        return dx, dh_res, dh_post, df
    if C == 0:
        return dx, dh_res.zero_(), dh_post.zero_(), df
    bt, bc, bp, warps = common.sweep_blocks(C, x.element_size(), n * n + n)
    wrap(_mhc_post_bwd_kernel)[(triton.cdiv(T1 * T2, bt),)](
        x, h_res, h_post, f, dout, dx, dh_res, dh_post, df, T1 * T2, T2, C,
        *x.stride(), *_mixing_strides(h_res, transpose_res), *h_post.stride(), *f.stride(),
        *dout.stride(), *dx.stride(), *_mixing_strides(dh_res, transpose_res), *dh_post.stride(),
        *df.stride(),
        N=n, BLOCK_P=bp, BLOCK_T=bt, BLOCK_C=bc, num_warps=warps,
    )
    return dx, dh_res, dh_post, df
