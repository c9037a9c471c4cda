"""The mHC projection and its norm statistic from one read of the stream (issue 18), and the backward
from one more.

    proj = v · φᵀ        sq = Σ_k v²        (v [T1, T2, K]: the flattened stream, K = n·C;
                                           φ [W, K]: F.linear's weight, W = n² + 2n coefficients)
    dv = dproj · φ + 2 · dsq · v           dφ = Σ_t dprojᵀ · v

The graphs spell this as a cuBLAS linear beside an Inductor reduction for the mean of squares: two
reads of the n·C stream in the forward, and in the backward dv written by cuBLAS, read back to add
the norm's term, and the stream read once more for dφ. On the H200 at T 8192, K 4096, W 24, bf16
(benchmarks/analysis/mhc_project_proto.py, 2026-11-30): the forward 34 µs against 48.5 for cuBLAS
+ Inductor (a copy of v takes 37); the backward 66 µs against 61 for cuBLAS's dv and dφ alone.

The forward: a program per BLOCK_T tokens sweeps K, a tensor-core dot per [BLOCK_T, BLOCK_K] tile
of v with the [BLOCK_K, BLOCK_W] tile of φᵀ, the squares summed on the same registers.
The backward: a program per BLOCK_K columns and per share of the tokens (SPLITS shares, a constant,
so that one compiled graph serves every length); it writes dv for its columns and its share's
partial dφ[:, columns], which the launcher sums over shares (fp32).

W is at most MAX_WIDTH (n = 10: 120 coefficients) for 16-bit streams and MAX_WIDTH_FLOAT32 (n = 4:
24) for float32 ones, whose operands go through the dot in full precision (TF32 left 7.6e-4 relative
error), emulated without tensor cores: compiled for sm_90, float32 tiles past 32 coefficients spill
in the backward (4.6 KB a thread at W 120). The ops compute wider projections with the reference.
"""
from __future__ import annotations

import torch

from . import _common as common
from .._triton import cdiv, next_power_of_2, tl, triton

MAX_WIDTH = 128
MAX_WIDTH_FLOAT32 = 32
SPLITS = 8  # token shares of the backward: with K 4096 in 128 columns, 256 programs
# (BLOCK_T, BLOCK_K, warps, stages): 16-bit at W <= 32 (the H200's fastest in the prototype, no
# spills), 16-bit wider (half the tokens), float32 (full-precision dots: smaller tiles, 8 warps)
TILES = {"16-bit": (64, 128, 4, 3), "16-bit wide": (32, 128, 4, 3), "float32": (32, 64, 8, 2)}

if triton is not None:

    @triton.jit
    def _mhc_project_fwd_kernel(
        v_ptr, w_ptr, proj_ptr, sq_ptr,
        T, T2, K, W,
        sv1, sv2, svk, swn, swk, sp1, sp2, spn, ss1, ss2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """proj[t, :] = v[t, :]·φᵀ and sq[t] = Σ_k v[t, k]² for BLOCK_T tokens, one sweep of K."""
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        outs = tl.arange(0, BLOCK_W)
        tok_ok = tok < T
        out_ok = outs < W
        t1 = (tok // T2).to(tl.int64)
        t2 = (tok % T2).to(tl.int64)
        v_rows = (t1 * sv1 + t2 * sv2)[:, None]
        acc = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.float32)
        squares = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            v = tl.load(v_ptr + v_rows + ks[None, :].to(tl.int64) * svk, mask=tok_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + outs[None, :] * swn + ks[:, None].to(tl.int64) * swk,
                        mask=k_ok[:, None] & out_ok[None, :], other=0.0)
            vf = v.to(tl.float32)
            if UPCAST:  # the interpreter multiplies 16-bit bit patterns as integers (_triton.dot)
                acc = tl.dot(vf, w.to(tl.float32), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(v, w, acc, input_precision=PRECISION)
            squares += vf * vf
        tl.store(proj_ptr + (t1 * sp1 + t2 * sp2)[:, None] + outs[None, :] * spn,
                 acc.to(proj_ptr.dtype.element_ty), mask=tok_ok[:, None] & out_ok[None, :])
        tl.store(sq_ptr + t1 * ss1 + t2 * ss2, tl.sum(squares, axis=1), mask=tok_ok)

    @triton.jit
    def _mhc_project_bwd_kernel(
        v_ptr, w_ptr, dproj_ptr, dsq_ptr, dv_ptr, dw_ptr,
        T, T2, K, W, tokens_per_split,
        sv1, sv2, svk, swn, swk, sd1, sd2, sdn, sq1, sq2, sdv1, sdv2, sdvk, sws, swn2, swk2,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """BLOCK_K columns, one share of the tokens: dv = dproj·φ + 2·dsq·v stored, and the share's
        dφ[:, columns] = Σ_t dproj[t, :]ᵀ v[t, columns] into dw_ptr[share] (zero for an empty share)."""
        ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        share = tl.program_id(1)
        outs = tl.arange(0, BLOCK_W)
        k_ok = ks < K
        out_ok = outs < W
        ks64 = ks.to(tl.int64)
        w = tl.load(w_ptr + outs[:, None] * swn + ks64[None, :] * swk, mask=out_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
        dw = tl.zeros([BLOCK_W, BLOCK_K], dtype=tl.float32)
        start = share * tokens_per_split
        for t0 in range(start, start + tokens_per_split, BLOCK_T):
            tok = t0 + tl.arange(0, BLOCK_T)
            tok_ok = (tok < T) & (tok < start + tokens_per_split)
            t1 = (tok // T2).to(tl.int64)
            t2 = (tok % T2).to(tl.int64)
            tk_ok = tok_ok[:, None] & k_ok[None, :]
            v = tl.load(v_ptr + (t1 * sv1 + t2 * sv2)[:, None] + ks64[None, :] * svk, mask=tk_ok, other=0.0)
            g = tl.load(dproj_ptr + (t1 * sd1 + t2 * sd2)[:, None] + outs[None, :] * sdn,
                        mask=tok_ok[:, None] & out_ok[None, :], other=0.0)
            dsq = tl.load(dsq_ptr + t1 * sq1 + t2 * sq2, mask=tok_ok, other=0.0).to(tl.float32)
            if UPCAST:
                g = g.to(tl.float32)
                v = v.to(tl.float32)
            dv = tl.dot(g, w, input_precision=PRECISION) + (2.0 * dsq)[:, None] * v.to(tl.float32)
            tl.store(dv_ptr + (t1 * sdv1 + t2 * sdv2)[:, None] + ks64[None, :] * sdvk,
                     dv.to(dv_ptr.dtype.element_ty), mask=tk_ok)
            dw = tl.dot(tl.trans(g), v, dw, input_precision=PRECISION)
        tl.store(dw_ptr + share * sws + outs[:, None] * swn2 + ks64[None, :] * swk2, dw,
                 mask=out_ok[:, None] & k_ok[None, :])

else:
    _mhc_project_fwd_kernel = _mhc_project_bwd_kernel = None


def check_project_inputs(v, w, dproj=None, dsq=None) -> None:
    common.check_tensor("v", v, 3, "[T1, T2, K]")
    common.check_tensor("w", w, 2, "[W, K]")
    T1, T2, K = v.shape
    W = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"w: shape {tuple(w.shape)} must be [W, K] with K = v's last size {K}")
    if w.dtype != v.dtype:
        raise TypeError(f"w: dtype {w.dtype} differs from v's {v.dtype}")
    named = dict(v=v, w=w)
    if dproj is not None:
        common.check_tensor("dproj", dproj, 3, "[T1, T2, W]", shape=(T1, T2, W))
        named["dproj"] = dproj
    if dsq is not None:
        common.check_tensor("dsq", dsq, 2, "[T1, T2]", shape=(T1, T2))
        named["dsq"] = dsq
    common.check_same_device(**named)


def kernel_width(W, dtype: torch.dtype) -> bool:
    """Whether the kernels take a projection of width W in `dtype` (else the ops compute the reference)."""
    return W <= (MAX_WIDTH_FLOAT32 if dtype == torch.float32 else MAX_WIDTH)


def _block_w(W: int) -> int:
    return max(16, next_power_of_2(W))


def _tiles(W: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    if dtype == torch.float32:
        return TILES["float32"]
    return TILES["16-bit" if _block_w(W) <= 32 else "16-bit wide"]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def sq_dtype(v: torch.Tensor) -> torch.dtype:
    """sq's dtype: float32 (float64 for a float64 v, which the reference computes)."""
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def mhc_project_fwd(v: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj [T1, T2, W] in v's dtype, sq [T1, T2] float32) for v [T1, T2, K], w [W, K]."""
    check_project_inputs(v, w)
    common.require(v.device, _mhc_project_fwd_kernel, __name__)
    if v.dtype == torch.float64 or not kernel_width(w.shape[0], v.dtype):
        raise TypeError("v: float64, or a projection wider than the kernels take, runs the reference "
                        "(mhc_project_ref)")
    return launch_project_fwd(v, w)


def launch_project_fwd(v, w, wrap=common.direct) -> tuple[torch.Tensor, torch.Tensor]:
    """mhc_project_fwd without the checks (the ops check once, then call this)."""
    T1, T2, K = v.shape
    W = w.shape[0]
    proj = common.new_output((T1, T2, W), v.dtype, v.device)
    sq = common.new_output((T1, T2), torch.float32, v.device)
    if T1 * T2 == 0:
        return proj, sq
    bt, bk, warps, stages = _tiles(W, v.dtype)
    wrap(_mhc_project_fwd_kernel)[(cdiv(T1 * T2, bt),)](
        v, w, proj, sq, T1 * T2, T2, K, W, *v.stride(), *w.stride(), *proj.stride(), *sq.stride(),
        BLOCK_T=bt, BLOCK_K=bk, BLOCK_W=_block_w(W), PRECISION=_precision(v.dtype),
        UPCAST=common.interpreted(_mhc_project_fwd_kernel), num_warps=warps, num_stages=stages,
    )
    return proj, sq


def mhc_project_bwd(v: torch.Tensor, w: torch.Tensor, dproj: torch.Tensor, dsq: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dv [T1, T2, K] in v's dtype, dw [W, K] in w's dtype) for the forward's gradients dproj and dsq."""
    check_project_inputs(v, w, dproj, dsq)
    common.require(v.device, _mhc_project_bwd_kernel, __name__)
    if v.dtype == torch.float64 or not kernel_width(w.shape[0], v.dtype):
        raise TypeError("v: float64, or a projection wider than the kernels take, runs the reference "
                        "(mhc_project_bwd_ref)")
    return launch_project_bwd(v, w, dproj, dsq)


def launch_project_bwd(v, w, dproj, dsq, wrap=common.direct) -> tuple[torch.Tensor, torch.Tensor]:
    """mhc_project_bwd without the checks (the ops check once, then call this)."""
    T1, T2, K = v.shape
    W = w.shape[0]
    dv = common.new_output((T1, T2, K), v.dtype, v.device)
    if T1 * T2 == 0 or K == 0:
        return dv, torch.zeros_like(w)
    partial = torch.empty(SPLITS, W, K, dtype=torch.float32, device=v.device)  # every element written
    bt, bk, warps, stages = _tiles(W, v.dtype)
    per_split = cdiv(cdiv(T1 * T2, SPLITS), bt) * bt
    wrap(_mhc_project_bwd_kernel)[(cdiv(K, bk), SPLITS)](
        v, w, dproj, dsq, dv, partial, T1 * T2, T2, K, W, per_split, *v.stride(), *w.stride(),
        *dproj.stride(), *dsq.stride(), *dv.stride(), *partial.stride(),
        BLOCK_T=bt, BLOCK_K=bk, BLOCK_W=_block_w(W), PRECISION=_precision(v.dtype),
        UPCAST=common.interpreted(_mhc_project_bwd_kernel), num_warps=warps, num_stages=stages,
    )
    return dv, partial.sum(0).to(w.dtype)


__all__ = ["MAX_WIDTH", "MAX_WIDTH_FLOAT32", "SPLITS", "TILES", "check_project_inputs", "kernel_width", "launch_project_bwd",
           "launch_project_fwd", "mhc_project_bwd", "mhc_project_fwd", "sq_dtype"]
