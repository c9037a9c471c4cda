"""The mHC post kernel: apply_h_res + apply_h_post + residual add in one pass, and its backward.

Per token (x [n, C], f [C]):  out[i] = Σ_j A[i, j] x[j] + H_post[i] f,  A = H_res or H_resᵀ.
Forward reads (n+1)·C values and writes n·C per token, where the unfused graph reads and writes the
mixed and post-distributed streams separately. The backward reads x, f and dout once and writes dx
and df once; the per-token n×n and n gradients are reductions over C kept in registers (n = 1, 2,
4) or, for other stream counts, in a per-token fp32 scratch (see _mhc_post_bwd_kernel).

Transposition costs nothing: the launcher swaps the strides of H_res (and of dH_res).
Layouts as in reference.py: x [T1, T2, n, C], h_res [T1, T2, n, n], h_post [T1, T2, n],
f [T1, T2, C], any strides; two token dims so that the streams may sit between them (streams
folded into the batch). `out_order` is the memory order (outer to inner) of out and dx.
"""
from __future__ import annotations

import torch

from . import _common as common
from .._triton import cdiv, next_power_of_2, scratch_rows, tl, triton

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
        N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        """One program: BLOCK_T tokens × BLOCK_C channels of every output stream, one output
        stream at a time. Every tile is the same 2-D [BLOCK_T, BLOCK_C] (16-byte vectors along C)
        and every per-token coefficient a [BLOCK_T] vector in its slice layout, so nothing changes
        layout: a [tokens, streams, C] tile, as before, took 5 layout conversions and 9 barriers
        per program on sm_90. The code reloads the input streams per output stream (a run-time
        loop over the outputs keeps it linear in n), but the compiler hoists those loads and keeps
        all n input tiles in registers; that is why stream_blocks shrinks the tile as n grows."""
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tok_ok = tok < T
        # int64: token offsets of tensors over 2**31 elements
        t1 = (tok // T2).to(tl.int64)
        t2 = (tok % T2).to(tl.int64)
        tc_ok = tok_ok[:, None] & (cols < C)[None, :]
        f = tl.load(f_ptr + (t1 * sf1 + t2 * sf2)[:, None] + cols[None, :] * sfc, mask=tc_ok,
                    other=0.0).to(tl.float32)
        x_tok = x_ptr + (t1 * sx1 + t2 * sx2)[:, None] + cols[None, :] * sxc
        a_tok = a_ptr + t1 * sa1 + t2 * sa2
        hp_tok = hp_ptr + t1 * sp1 + t2 * sp2
        out_tok = out_ptr + (t1 * so1 + t2 * so2)[:, None] + cols[None, :] * soc
        for i in range(N):
            hp_i = tl.load(hp_tok + i * spn, mask=tok_ok, other=0.0).to(tl.float32)
            acc = hp_i[:, None] * f
            for j in tl.static_range(N):
                a_ij = tl.load(a_tok + i * sai + j * saj, mask=tok_ok, other=0.0).to(tl.float32)
                x_j = tl.load(x_tok + j * sxn, mask=tc_ok, other=0.0).to(tl.float32)
                acc += a_ij[:, None] * x_j
            tl.store(out_tok + i * son, acc.to(out_ptr.dtype.element_ty), mask=tc_ok)

    @triton.jit
    def _stream_step(i, v_lo, v_hi, m_ptrs, m_stride, m_ok, hp_ptrs, spn, hp_ok, dout_ptrs, sdn,
                     dout_half, lo_ok, hi_ok, slot, d_lo, d_hi, sums,
                     HALVES: tl.constexpr, MIXED: tl.constexpr):
        """Stream i of one column sweep step: d += m[i]·dout_i, sums[i] += Σ_c dout_i·v."""
        g_lo = tl.load(dout_ptrs + i * sdn, mask=lo_ok, other=0.0).to(tl.float32)
        m = tl.load(m_ptrs + i * m_stride, mask=m_ok, other=0.0).to(tl.float32)
        if MIXED:  # H_post in another dtype than H_res: its own load, in f's column only
            m += tl.load(hp_ptrs + i * spn, mask=hp_ok, other=0.0).to(tl.float32)
        d_lo += m[:, None] * g_lo
        if HALVES == 2:
            g_hi = tl.load(dout_ptrs + i * sdn + dout_half, mask=hi_ok, other=0.0).to(tl.float32)
            d_hi += m[:, None] * g_hi
            # both halves in one shuffle tree
            s = tl.sum(g_lo * v_lo + g_hi * v_hi, axis=1)
        else:
            s = tl.sum(g_lo * v_lo, axis=1)
        sums = tl.where(slot == i, sums + s[:, None], sums)
        return d_lo, d_hi, sums

    @triton.jit
    def _column_step(v_ptrs, v_half, m_ptrs, m_stride, m_ok, hp_ptrs, spn, hp_ok, dout_ptrs, sdn,
                     dout_half, out_ptrs, out_half, out_ok, sum_ptrs, lo_ok, hi_ok, tok_ok, summed, slot,
                     n_streams, N: tl.constexpr, HALVES: tl.constexpr, UNROLL: tl.constexpr,
                     MIXED: tl.constexpr):
        """One column of the column sweep over one step of C: v = x[j] (or f), out = Σ_i m[i]·dout_i
        = dx[j] (or df) for m = A[:, j] (or H_post), and the column's n sums over C,
        Σ_c dout_i·v = dA[:, j] (or dH_post), added to the partial sums of the earlier steps at
        sum_ptrs (`summed`: where there are any). `out_ok` [1, BLOCK_C], all true or all false:
        whether out is stored (not dx[j] when the caller forms dx itself)."""
        v_lo = tl.load(v_ptrs, mask=lo_ok, other=0.0).to(tl.float32)
        v_hi = v_lo
        if HALVES == 2:
            v_hi = tl.load(v_ptrs + v_half, mask=hi_ok, other=0.0).to(tl.float32)
        d_lo = tl.zeros(v_lo.shape, dtype=tl.float32)
        d_hi = tl.zeros(v_lo.shape, dtype=tl.float32)
        sums = tl.load(sum_ptrs, mask=summed, other=0.0)
        # Streams in run-time loops: the code does not grow with n. UNROLL streams per iteration
        # keep several loads in flight, and from i0's known multiple of UNROLL the compiler resolves
        # `slot == i0 + r` to one compare for the one register per thread that can hold slot
        # i0 + r, not one per register; the remainder goes one stream at a time.
        n_unrolled = n_streams - n_streams % UNROLL
        for i0 in range(0, n_unrolled, UNROLL):
            for r in tl.static_range(UNROLL):
                d_lo, d_hi, sums = _stream_step(i0 + r, v_lo, v_hi, m_ptrs, m_stride, m_ok, hp_ptrs,
                                                spn, hp_ok, dout_ptrs, sdn, dout_half, lo_ok, hi_ok,
                                                slot, d_lo, d_hi, sums, HALVES, MIXED)
        for i in range(n_unrolled, n_streams):
            d_lo, d_hi, sums = _stream_step(i, v_lo, v_hi, m_ptrs, m_stride, m_ok, hp_ptrs, spn, hp_ok,
                                            dout_ptrs, sdn, dout_half, lo_ok, hi_ok, slot, d_lo, d_hi,
                                            sums, HALVES, MIXED)
        tl.store(out_ptrs, d_lo.to(out_ptrs.dtype.element_ty), mask=lo_ok & out_ok)
        if HALVES == 2:
            tl.store(out_ptrs + out_half, d_hi.to(out_ptrs.dtype.element_ty), mask=hi_ok & out_ok)
        tl.store(sum_ptrs, sums, mask=tok_ok[:, None] & (slot < N))

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
        sums_ptr, sst, ssj, n_streams,
        N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
        BY_COLUMN: tl.constexpr, HALVES: tl.constexpr, UNROLL: tl.constexpr, MIXED: tl.constexpr,
        WRITE_DX: tl.constexpr,
    ):
        """One program: BLOCK_T tokens, sweeping C in [BLOCK_T, BLOCK_C] tiles, one per stream.
        Not WRITE_DX: dx is left to the caller (a compiled graph forms Σ_i A[i, j]·dout_i where
        Inductor sums the stream's gradient contributions), only dA, dH_post and df are written.

        Every tile is 2-D with C inside a warp (the launcher keeps BLOCK_C at 8 lanes' worth of
        16-byte vectors), so the sums over streams are register arithmetic over the unrolled
        streams and each sum over C is one warp shuffle tree, never shared memory or a barrier.
        The n² + n sums over C (dA, dH_post) land in the slots of one [BLOCK_T, BLOCK_P] register
        accumulator: dA[i, j] in slot i·N + j, dH_post[i] in slot N² + i.

        BY_COLUMN (n not in SLOT_SWEEP_STREAMS, where those slots take O(n⁴) unrolled code, minutes of
        compilation and spills): the column sweep, whose code does not grow with n. Per step of C
        (HALVES tiles of BLOCK_C, 128 bytes per row and stream as above) a run-time loop over the
        n + 1 columns (x[j] with A[:, j], giving dx[j] and dA[:, j]; then f with H_post, giving df
        and dH_post), and in it a run-time loop over the streams (_column_step). A column's n sums
        over the step gather in a [BLOCK_T, BLOCK_P] tile (a register tile cannot be indexed by a
        run-time column) and are added to those of the earlier steps, kept in the tokens' rows of
        the fp32 scratch sums_ptr [tokens, n + 1, ssj] (column j's sums contiguous in row j); a
        program owns its tokens, and each sum is loaded and stored by the same thread (one pointer
        tile, one layout), so no atomics and no barrier. _mhc_post_bwd_sums_kernel then writes the
        rows into dA and dH_post. Traffic per token and step: x, f and dout read once from memory
        and dx, df written once, as in the slot sweep ((3n + 2) rows of 128 bytes; dout reread per
        column from L1, as the slot sweep does per j); besides, the partial sums' n·(n + 1) fp32
        read and written, L1/L2 traffic (at n = 16, 2.2 KB against the data's 6.4 KB), and once
        per token the finished sums written back and read by _mhc_post_bwd_sums_kernel (at
        n = 16 and C = 1024, 1 KB against the data's 100 KB in bf16)."""
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
        # the columns whose output is stored: every one, or f's (df) only when the caller forms dx.
        # As a [1, BLOCK_C] boolean tile, not a scalar: interpreters differ on scalar masks, and a
        # per-token bound made Triton 3.6's ptxas spill
        if WRITE_DX:
            first_out = 0
        else:
            first_out = n_streams
        if BY_COLUMN:
            slot = tl.arange(0, BLOCK_P)[None, :]
            sums_tok = tok.to(tl.int64)[:, None] * sst
            for c0 in range(0, C, HALVES * BLOCK_C):
                cols = (c0 + tl.arange(0, BLOCK_C))[None, :]
                lo_ok = tok_ok[:, None] & (cols < C)
                hi_ok = tok_ok[:, None] & (cols + BLOCK_C < C)
                # the first step finds no partial sums (a bound, not `& (c0 > 0)`: see htree/tiles.py)
                summed = tok_ok[:, None] & (slot < tl.where(c0 > 0, N, 0))
                dout_c = dout_ptr + d_tok + cols * sdc
                # columns j < n: x[j], A[:, j], dx[j], dA[:, j]; column n: f, H_post, df, dH_post.
                # f's column as the loop's last, not a pass after it: its pointers would stay live
                # across the loop, used once per step, and ptxas spilled such values.
                for j in range(n_streams + 1):
                    in_x = j < n_streams
                    if MIXED:  # A's column here, H_post's loaded beside it in f's column
                        m_ptrs, m_stride = a_ptr + a_tok + j * saj, sai
                        m_ok = tok < tl.where(in_x, T, 0)
                    else:
                        m_ptrs = tl.where(in_x, a_ptr + a_tok + j * saj, hp_ptr + hp_tok)
                        m_stride, m_ok = tl.where(in_x, sai, spn), tok_ok
                    _column_step(tl.where(in_x, x_ptr + x_tok + j * sxn + cols * sxc,
                                          f_ptr + f_tok + cols * sfc),
                                 tl.where(in_x, BLOCK_C * sxc, BLOCK_C * sfc),
                                 m_ptrs, m_stride, m_ok,
                                 hp_ptr + hp_tok, spn, tok < tl.where(in_x, 0, T),
                                 dout_c, sdn, BLOCK_C * sdc,
                                 tl.where(in_x, dx_ptr + dx_tok + j * sdxn + cols * sdxc,
                                          df_ptr + df_tok + cols * sdfc),
                                 tl.where(in_x, BLOCK_C * sdxc, BLOCK_C * sdfc),
                                 (cols * 0 + j) >= first_out,
                                 sums_ptr + sums_tok + j * ssj + slot, lo_ok, hi_ok, tok_ok, summed,
                                 slot, n_streams, N, HALVES, UNROLL, MIXED)
        else:
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
                    sums = tl.where(slot == N * N + i, sums + tl.sum(dout_i * f, axis=1)[:, None],
                                    sums)
                tl.store(df_ptr + df_tok + cols * sdfc, df.to(df_ptr.dtype.element_ty), mask=tc_ok)
                for j in tl.static_range(N):
                    x_j = tl.load(x_ptr + x_tok + j * sxn + cols * sxc, mask=tc_ok,
                                  other=0.0).to(tl.float32)
                    dx_j = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
                    for i in tl.static_range(N):
                        # dout_i again: an L1 hit, cheaper than keeping n tiles live across the j loop
                        dout_i = tl.load(dout_ptr + d_tok + i * sdn + cols * sdc, mask=tc_ok,
                                         other=0.0).to(tl.float32)
                        if WRITE_DX:
                            a_ij = tl.load(a_ptr + a_tok + i * sai + j * saj, mask=tok_ok, other=0.0)
                            dx_j += a_ij.to(tl.float32)[:, None] * dout_i
                        sums = tl.where(slot == i * N + j,
                                        sums + tl.sum(dout_i * x_j, axis=1)[:, None], sums)
                    if WRITE_DX:
                        tl.store(dx_ptr + dx_tok + j * sdxn + cols * sdxc,
                                 dx_j.to(dx_ptr.dtype.element_ty), mask=tc_ok)

            row = slot // N
            da_ptrs = (da_ptr + (t1 * sda1 + t2 * sda2)[:, None] + row * sdai
                       + (slot - row * N) * sdaj)
            tl.store(da_ptrs, sums.to(da_ptr.dtype.element_ty),
                     mask=tok_ok[:, None] & (slot < N * N))
            hp_slot = slot - N * N
            tl.store(dhp_ptr + (t1 * sdp1 + t2 * sdp2)[:, None] + hp_slot * sdpn,
                     sums.to(dhp_ptr.dtype.element_ty),
                     mask=tok_ok[:, None] & (hp_slot >= 0) & (hp_slot < N))

    @triton.jit
    def _mhc_post_bwd_sums_kernel(
        sums_ptr, da_ptr, dhp_ptr,
        T, T2,
        sst, ssj,
        sda1, sda2, sdai, sdaj,
        sdp1, sdp2, sdpn,
        N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
    ):
        """dA and dH_post in their dtypes and layouts from the column sweep's sums: rows j < N of
        a token's sums hold dA[:, j], row N dH_post."""
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tok_ok = tok < T
        t1 = (tok // T2).to(tl.int64)
        t2 = (tok % T2).to(tl.int64)
        q = tl.arange(0, BLOCK_J * BLOCK_N)[None, :]
        i, j = q % BLOCK_N, q // BLOCK_N
        ok = tok_ok[:, None] & (i < N) & (j <= N)
        sums = tl.load(sums_ptr + tok.to(tl.int64)[:, None] * sst + j * ssj + i, mask=ok, other=0.0)
        tl.store(da_ptr + (t1 * sda1 + t2 * sda2)[:, None] + i * sdai + j * sdaj,
                 sums.to(da_ptr.dtype.element_ty), mask=ok & (j < N))
        tl.store(dhp_ptr + (t1 * sdp1 + t2 * sdp2)[:, None] + i * sdpn,
                 sums.to(dhp_ptr.dtype.element_ty), mask=ok & (j == N))


def check_post_inputs(x, h_res, h_post, f, dout=None) -> None:
    """Shape contract of the post kernel (symbolic-size safe: only equality checks)."""
    common.check_tensor("x", x, 4, "[T1, T2, n, C]")
    T1, T2, n, C = x.shape
    common.check_tensor("h_res", h_res, 4, "[T1, T2, n, n]", shape=(T1, T2, n, n))
    common.check_tensor("h_post", h_post, 3, "[T1, T2, n]", shape=(T1, T2, n))
    common.check_tensor("f", f, 3, "[T1, T2, C]", shape=(T1, T2, C))
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
    bt, bc = common.stream_blocks(n, C, x.element_size())
    grid = (cdiv(T1 * T2, bt), cdiv(C, bc))
    wrap(_mhc_post_fwd_kernel)[grid](
        x, h_res, h_post, f, out, T1 * T2, T2, C,
        *x.stride(), *_mixing_strides(h_res, transpose_res), *h_post.stride(), *f.stride(),
        *out.stride(),
        N=n, BLOCK_T=bt, BLOCK_C=bc,
    )
    return out


def mhc_post_bwd(x: torch.Tensor, h_res: torch.Tensor, h_post: torch.Tensor, f: torch.Tensor,
                 dout: torch.Tensor, transpose_res: bool = False, out_order=(0, 1, 2, 3),
                 with_dx: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [memory in out_order], dh_res, dh_post, df), each in its input's dtype; without
    `with_dx`, dx is an empty [0] tensor (the caller forms Σ_i A[i, j]·dout_i itself)."""
    check_post_inputs(x, h_res, h_post, f, dout)
    common.require(x.device, _mhc_post_bwd_kernel, __name__)
    order = common.check_order(out_order, 4)
    if x.dtype == torch.float64:
        raise TypeError("x: float64 runs the reference (mhc_post_bwd_ref), not the kernel")
    return launch_post_bwd(x, h_res, h_post, f, dout, transpose_res, order, with_dx=with_dx)


# The stream counts whose backward is the slot sweep (see _mhc_post_bwd_kernel): where its unrolled
# code, which grows as n⁴, compiles for sm_90 without spills at the benchmark shape (C = 1024, bf16
# and fp32, Triton 3.6 and 3.9). It spills at n = 3 (bf16: 8 bytes, 560 at C = 40), n = 5 and 7 at
# C = 40, n = 8 (bf16, 112 bytes), and n = 16 compiles for minutes: those and every n but these take
# the column sweep.
SLOT_SWEEP_STREAMS = (1, 2, 4)
# Streams per iteration of the column sweep's stream loop, by dtype, for C a multiple of 16 (16-byte
# vectors) or not (an address per element). More keep more loads in flight and, from a multiple of
# the unroll, resolve each sum's slot with one compare, but take registers: these are the most with
# which ptxas (12.8 of Triton 3.6, 13.4 of 3.9) allocates every n from 3 to 16 at C = 40 and 1024
# for sm_90 without spilling (a step holds one fp32 tile, two 16-bit ones; fp16's conversions take
# more registers than bf16's).
COLUMN_UNROLL = {torch.float32: (4, 2), torch.bfloat16: (2, 1), torch.float16: (1, 1)}


def _strides_in_order(shape, order) -> tuple:
    """The strides of a dense tensor of `shape` whose memory holds the dims in `order`."""
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = step
        step = step * shape[d]
    return tuple(strides)


def launch_post_bwd(x, h_res, h_post, f, dout, transpose_res: bool, order, wrap=common.direct,
                    with_dx: bool = True):
    """mhc_post_bwd without the checks (the ops check once, then call this)."""
    # without dx: a [0] tensor, passed as the kernel's dx pointer, which it never stores through
    # (an input passed there would count as written in a traced graph, and be copied)
    # with the strides dx would have: Triton specialises on them, and a 0 there changed the column
    # sweep's store layout (a shared-memory round trip per column)
    dx = (common.new_output(tuple(x.shape), x.dtype, x.device, order) if with_dx
          else common.new_output((0,), x.dtype, x.device))
    dx_strides = dx.stride() if with_dx else _strides_in_order(tuple(x.shape), order)
    dh_res = common.new_output(tuple(h_res.shape), h_res.dtype, x.device)
    dh_post = common.new_output(tuple(h_post.shape), h_post.dtype, x.device)
    df = common.new_output(tuple(f.shape), f.dtype, x.device)
    T1, T2, n, C = x.shape
    if T1 * T2 == 0:
        return dx, dh_res, dh_post, df
    if C == 0:
        return dx, dh_res.zero_(), dh_post.zero_(), df
    T = T1 * T2
    by_column = n not in SLOT_SWEEP_STREAMS
    if by_column:
        bt, bc, halves, warps = common.column_sweep_blocks(x.element_size())
        unroll = COLUMN_UNROLL[x.dtype][0 if C % 16 == 0 else 1]
        if not with_dx and C % 16 != 0:
            unroll = 1  # fp32 without dx spilled 8 bytes at unroll 2 (n 3, 5, 9; C 40; Triton 3.6)
        unroll = unroll if n >= unroll else 1  # a loop that would never run only takes registers
        # per token n + 1 rows of partial sums (dA's columns, dH_post); rows of 16 (MAX_STREAMS):
        # a stride the compiler knows 16-divisible, hence 16-byte accesses, in the data tiles' layout
        sums = common.new_output((scratch_rows(T), n + 1, common.MAX_STREAMS), torch.float32,
                                 x.device)
        column = dict(BLOCK_P=bc, BY_COLUMN=True, HALVES=halves, UNROLL=unroll,
                      MIXED=h_post.dtype != h_res.dtype)
    else:
        bt, bc, bp, warps = common.sweep_blocks(C, x.element_size(), n * n + n)
        sums = x  # no scratch: the slot sweep sums in registers (an input, never written)
        # every constexpr passed, defaults too: torch's mutation analysis of a traced launch needs them
        column = dict(BLOCK_P=bp, BY_COLUMN=False, HALVES=1, UNROLL=1, MIXED=False)
    wrap(_mhc_post_bwd_kernel)[(cdiv(T, bt),)](
        x, h_res, h_post, f, dout, dx, dh_res, dh_post, df, T, T2, C,
        *x.stride(), *_mixing_strides(h_res, transpose_res), *h_post.stride(), *f.stride(),
        *dout.stride(), *dx_strides, *_mixing_strides(dh_res, transpose_res), *dh_post.stride(),
        *df.stride(), sums, sums.stride(0), sums.stride(1), n,
        N=n, BLOCK_T=bt, BLOCK_C=bc, num_warps=warps, WRITE_DX=with_dx, **column,
    )
    if by_column:
        bj = next_power_of_2(n + 1)
        bt = common.block_t(bj * common.MAX_STREAMS)
        wrap(_mhc_post_bwd_sums_kernel)[(cdiv(T, bt),)](
            sums, dh_res, dh_post, T, T2, sums.stride(0), sums.stride(1),
            *_mixing_strides(dh_res, transpose_res), *dh_post.stride(),
            N=n, BLOCK_T=bt, BLOCK_N=common.MAX_STREAMS, BLOCK_J=bj,
        )
    return dx, dh_res, dh_post, df
