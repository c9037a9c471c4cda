"""Launch configurations of the mHC projection kernels (hccompile/kernels/mhc/project.py), timed side by
side with what the compiled step ran before them (issue 18). This was the kernels' prototype (36df33d); its
kernels became the op's, and it now sweeps their tiles on the op's own kernels.

Per sublayer the compiled C1024 step reads the n·C stream v [T, K] (K = n·C) for the projection:
- forward: before, a cuBLAS matmul proj = v·φᵀ ([T, K] × [K, W], W = n² + 2n = 24) and an Inductor
  reduction Σ v² per token (the norm r), each reading v; the op's kernel reads it once;
- backward: before, dv = dproj·φ (a cuBLAS matmul writing [T, K]) and dφ = dprojᵀ·v (split-K cuBLAS,
  reading v again); the op's kernel writes dv = dproj·φ + 2·dsq·v and its token share's dφ from one read.

    TRITON_INTERPRET=1 python benchmarks/analysis/mhc_project_proto.py --check   # CPU: against float64
    python benchmarks/analysis/mhc_project_proto.py                              # GPU: check, then time
    python benchmarks/analysis/mhc_project_proto.py --sm90                       # compile each for sm_90

The GPU run prints each configuration's time per call at C1024 n4 B4 S2048 bf16 (T 8192, K 4096); the op's
defaults are kernels/mhc/project.TILES and SPLITS.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hccompile.kernels.mhc import project as P  # noqa: E402

BLOCK_W = 32
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def precision(dtype: torch.dtype) -> str:
    """float32 operands in full precision: tl.dot's default TF32 gave 7.6e-4 relative error on the H200."""
    return "ieee" if dtype == torch.float32 else "tf32"


def project_fwd(v: torch.Tensor, w: torch.Tensor, block_t: int = 32, block_k: int = 128, warps: int = 4,
                stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj [T, W] in v's dtype, sq [T] float32) for v [T, K], w [W, K], through the op's forward kernel."""
    T, K = v.shape
    W = w.shape[0]
    v3 = v.unsqueeze(0)
    proj = torch.empty(1, T, W, dtype=v.dtype, device=v.device)
    sq = torch.empty(1, T, dtype=torch.float32, device=v.device)
    P._mhc_project_fwd_kernel[(triton.cdiv(T, block_t),)](
        v3, w, proj, sq, T, T, K, W, *v3.stride(), *w.stride(), *proj.stride(), *sq.stride(),
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_W=BLOCK_W, PRECISION=precision(v.dtype), UPCAST=INTERPRETED,
        num_warps=warps, num_stages=stages)
    return proj[0], sq[0]


def project_bwd(v: torch.Tensor, w: torch.Tensor, dproj: torch.Tensor, dsq: torch.Tensor, splits: int = 8,
                block_t: int = 64, block_k: int = 128, warps: int = 4, stages: int = 3
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dv [T, K] in v's dtype, dw [W, K] float32) for the forward's outputs' gradients dproj [T, W] and
    dsq [T] (of sq = Σ v²), through the op's backward kernel with `splits` token shares."""
    T, K = v.shape
    W = w.shape[0]
    v3, g3, s3 = v.unsqueeze(0), dproj.unsqueeze(0), dsq.unsqueeze(0)
    dv = torch.empty_like(v3)
    partial = torch.empty(splits, W, K, dtype=torch.float32, device=v.device)
    per_split = triton.cdiv(triton.cdiv(T, splits), block_t) * block_t
    P._mhc_project_bwd_kernel[(triton.cdiv(K, block_k), splits)](
        v3, w, g3, s3, dv, partial, T, T, K, W, per_split, *v3.stride(), *w.stride(), *g3.stride(),
        *s3.stride(), *dv.stride(), *partial.stride(),
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_W=BLOCK_W, PRECISION=precision(v.dtype), UPCAST=INTERPRETED,
        num_warps=warps, num_stages=stages)
    return dv[0], partial.sum(0)


@triton.jit
def _dv_kernel(v_ptr, w_ptr, dproj_ptr, dsq_ptr, dv_ptr, T, K, W,
               BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, PRECISION: tl.constexpr,
               UPCAST: tl.constexpr):
    """The split backward's first half (contiguous [T, K] v and dv, [T, W] dproj, [W, K] w): one [BLOCK_T,
    BLOCK_K] tile of dv = dproj·φ + 2·dsq·v per program, a stream's read and write and nothing carried."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    outs = tl.arange(0, BLOCK_W)
    tok_ok, k_ok, out_ok = tok < T, ks < K, outs < W
    tk_ok = tok_ok[:, None] & k_ok[None, :]
    offsets = tok[:, None].to(tl.int64) * K + ks[None, :]
    v = tl.load(v_ptr + offsets, mask=tk_ok, other=0.0)
    g = tl.load(dproj_ptr + tok[:, None].to(tl.int64) * W + outs[None, :], mask=tok_ok[:, None] & out_ok[None, :],
                other=0.0)
    w = tl.load(w_ptr + outs[:, None] * K + ks[None, :], mask=out_ok[:, None] & k_ok[None, :], other=0.0)
    dsq = tl.load(dsq_ptr + tok, mask=tok_ok, other=0.0).to(tl.float32)
    if UPCAST:
        g, w = g.to(tl.float32), w.to(tl.float32)
    dv = tl.dot(g, w, input_precision=PRECISION) + (2.0 * dsq)[:, None] * v.to(tl.float32)
    tl.store(dv_ptr + offsets, dv.to(dv_ptr.dtype.element_ty), mask=tk_ok)


@triton.jit
def _dw_kernel(v_ptr, dproj_ptr, dw_ptr, T, K, W, tokens_per_split,
               BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, PRECISION: tl.constexpr,
               UPCAST: tl.constexpr):
    """The split backward's second half: one share of the tokens' dφ[:, columns] = Σ_t dproj[t]ᵀ v[t, columns]
    into dw_ptr[share] ([splits, W, K] fp32), v read a second time."""
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    share = tl.program_id(1)
    outs = tl.arange(0, BLOCK_W)
    k_ok, out_ok = ks < K, outs < W
    dw = tl.zeros([BLOCK_W, BLOCK_K], dtype=tl.float32)
    start = share * tokens_per_split
    for t0 in range(start, start + tokens_per_split, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T)
        tok_ok = (tok < T) & (tok < start + tokens_per_split)
        v = tl.load(v_ptr + tok[:, None].to(tl.int64) * K + ks[None, :], mask=tok_ok[:, None] & k_ok[None, :],
                    other=0.0)
        g = tl.load(dproj_ptr + tok[:, None].to(tl.int64) * W + outs[None, :],
                    mask=tok_ok[:, None] & out_ok[None, :], other=0.0)
        if UPCAST:
            g, v = g.to(tl.float32), v.to(tl.float32)
        dw = tl.dot(tl.trans(g), v, dw, input_precision=PRECISION)
    tl.store(dw_ptr + share * W * K + outs[:, None] * K + ks[None, :], dw, mask=out_ok[:, None] & k_ok[None, :])


def project_bwd_split(v: torch.Tensor, w: torch.Tensor, dproj: torch.Tensor, dsq: torch.Tensor, splits: int = 8,
                      block_t: int = 64, block_k: int = 128, warps: int = 4, dv_block_t: int = 64,
                      dv_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """project_bwd as two launches: dv streamed tile by tile (no dφ accumulator carried), then dφ's token
    shares reading v again. Contiguous v [T, K], w [W, K], dproj [T, W]."""
    T, K = v.shape
    W = w.shape[0]
    dv = torch.empty_like(v)
    _dv_kernel[(triton.cdiv(T, dv_block_t), triton.cdiv(K, block_k))](
        v, w, dproj, dsq, dv, T, K, W, BLOCK_T=dv_block_t, BLOCK_K=block_k, BLOCK_W=BLOCK_W,
        PRECISION=precision(v.dtype), UPCAST=INTERPRETED, num_warps=dv_warps)
    partial = torch.empty(splits, W, K, dtype=torch.float32, device=v.device)
    per_split = triton.cdiv(triton.cdiv(T, splits), block_t) * block_t
    _dw_kernel[(triton.cdiv(K, block_k), splits)](
        v, dproj, partial, T, K, W, per_split, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_W=BLOCK_W,
        PRECISION=precision(v.dtype), UPCAST=INTERPRETED, num_warps=warps, num_stages=3)
    return dv, partial.sum(0)


def reference(v, w, dproj, dsq):
    """float64: (proj, sq, dv, dw)."""
    v64, w64 = v.double(), w.double()
    proj = v64 @ w64.T
    sq = (v64 * v64).sum(-1)
    dv = dproj.double() @ w64 + 2 * dsq.double()[:, None] * v64
    dw = dproj.double().T @ v64
    return proj, sq, dv, dw


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(device: str, T: int, K: int, W: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(T, K, generator=gen).to(device, dtype)
    w = (torch.randn(W, K, generator=gen) * 0.02).to(device, dtype)
    dproj = torch.randn(T, W, generator=gen).to(device, dtype)
    dsq = torch.randn(T, generator=gen).to(device, torch.float32)
    proj, sq = project_fwd(v, w, block_t=16, block_k=32 if device == "cpu" else 128)
    dv, dw = project_bwd(v, w, dproj, dsq, splits=3, block_t=16, block_k=32 if device == "cpu" else 128)
    want = reference(v, w, dproj, dsq)
    report(f"T{T} K{K} W{W} {dtype}", dict(zip(("proj", "sq", "dv", "dw"), (proj, sq, dv, dw))), want, dtype)
    dv, dw = project_bwd_split(v, w, dproj, dsq, splits=3, block_t=16, block_k=32 if device == "cpu" else 128,
                               dv_block_t=16)
    report(f"split backward T{T} K{K} W{W} {dtype}", {"dv": dv, "dw": dw}, want[2:], dtype)


def report(label: str, got: dict, want, dtype: torch.dtype) -> None:
    """Prints each output's relative error against its float64 reference (in `want`'s order) and exits 1 past
    the limit for `dtype` (FLA's 8e-3 for 16-bit operands) or on a NaN."""
    errors = {name: rel(g, r) for (name, g), r in zip(got.items(), want)}
    limit = 1e-5 if dtype == torch.float32 else 8e-3
    status = "ok" if all(e < limit for e in errors.values()) else "FAILED"  # NaN < limit is False
    print(f"check {label}: " + " ".join(f"{n} {e:.1e}" for n, e in errors.items()) + f" (limit {limit:.0e}) {status}",
          flush=True)
    if status != "ok":
        raise SystemExit(1)


# (BLOCK_T, BLOCK_K, warps, stages) and (splits, BLOCK_T, BLOCK_K, warps), timed side by side
FWD_CONFIGS = ((16, 128, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3),
               (32, 128, 4, 4))
BWD_CONFIGS = ((8, 64, 128, 4), (16, 64, 128, 4), (4, 64, 128, 4), (8, 32, 128, 4), (8, 64, 64, 4),
               (8, 128, 128, 8), (8, 64, 128, 8), (16, 64, 128, 8))
# the split backward: (splits, BLOCK_T, BLOCK_K, warps) of the dφ kernel, (BLOCK_T, warps) of the dv kernel
SPLIT_CONFIGS = (((8, 64, 128, 4), (64, 4)), ((8, 64, 128, 4), (32, 4)), ((8, 64, 128, 4), (128, 8)),
                 ((16, 64, 128, 4), (64, 4)), ((8, 128, 128, 8), (64, 4)))


def time_gpu(T: int, K: int, W: int) -> None:
    from triton.testing import do_bench

    dtype = torch.bfloat16
    v = torch.randn(T, K, device="cuda", dtype=dtype)
    w = torch.randn(W, K, device="cuda", dtype=dtype) * 0.02
    dproj = torch.randn(T, W, device="cuda", dtype=dtype)
    dsq = torch.randn(T, device="cuda", dtype=torch.float32)
    mean_sq = torch.compile(lambda x: x.float().pow(2).mean(-1))
    today_fwd = lambda: (torch.nn.functional.linear(v, w), mean_sq(v))  # noqa: E731
    today_bwd = lambda: (dproj @ w, dproj.T @ v)  # noqa: E731 (the norm's term rides in Inductor's sum)
    copy = do_bench(lambda: v.clone())
    print(f"v [{T}, {K}] bf16 clone (read + write): {copy * 1e3:.1f} us", flush=True)
    print(f"today forward (cuBLAS linear + Inductor mean of squares): {do_bench(today_fwd) * 1e3:.1f} us")
    print(f"today backward (cuBLAS dv and dW): {do_bench(today_bwd) * 1e3:.1f} us", flush=True)
    for bt, bk, warps, stages in FWD_CONFIGS:
        ms = do_bench(lambda: project_fwd(v, w, bt, bk, warps, stages))
        print(f"fused forward  BT {bt:3d} BK {bk} warps {warps} stages {stages}: {ms * 1e3:.1f} us", flush=True)
    for splits, bt, bk, warps in BWD_CONFIGS:
        ms = do_bench(lambda: project_bwd(v, w, dproj, dsq, splits, bt, bk, warps))
        print(f"fused backward splits {splits:2d} BT {bt:3d} BK {bk} warps {warps}: {ms * 1e3:.1f} us", flush=True)
    for (splits, bt, bk, warps), (dv_bt, dv_warps) in SPLIT_CONFIGS:
        ms = do_bench(lambda: project_bwd_split(v, w, dproj, dsq, splits, bt, bk, warps, dv_bt, dv_warps))
        dv_ms = do_bench(lambda: _dv_kernel[(triton.cdiv(T, dv_bt), triton.cdiv(K, bk))](
            v, w, dproj, dsq, torch.empty_like(v), T, K, W, BLOCK_T=dv_bt, BLOCK_K=bk, BLOCK_W=BLOCK_W,
            PRECISION="tf32", UPCAST=False, num_warps=dv_warps))
        print(f"split backward dphi splits {splits:2d} BT {bt:3d} BK {bk} warps {warps}, dv BT {dv_bt:3d} warps "
              f"{dv_warps}: {ms * 1e3:.1f} us (the dv kernel alone {dv_ms * 1e3:.1f} us)", flush=True)


def sm90(T: int = 8192, K: int = 4096, W: int = 24) -> None:
    """--sm90 (no GPU needed, no TRITON_INTERPRET): each timed configuration compiled for sm_90 as a launch
    would specialise it, with its registers, spills and layout conversions (hccompile's compile_check)."""
    from hccompile.kernels.mhc.compile_check import compile_launch, resources

    v = torch.empty(1, T, K, dtype=torch.bfloat16)
    w = torch.empty(W, K, dtype=torch.bfloat16)
    proj, sq = torch.empty(1, T, W, dtype=torch.bfloat16), torch.empty(1, T)
    dproj, dsq, dv = torch.empty(1, T, W, dtype=torch.bfloat16), torch.empty(1, T), torch.empty_like(v)
    for bt, bk, warps, stages in FWD_CONFIGS:
        args = (v, w, proj, sq, T, T, K, W, *v.stride(), *w.stride(), *proj.stride(), *sq.stride())
        kw = dict(BLOCK_T=bt, BLOCK_K=bk, BLOCK_W=BLOCK_W, PRECISION="tf32", UPCAST=False, num_warps=warps,
                  num_stages=stages)
        print("forward ", kw, resources(compile_launch(P._mhc_project_fwd_kernel, args, kw)), flush=True)
    for splits, bt, bk, warps in BWD_CONFIGS:
        partial = torch.empty(splits, W, K)
        per = triton.cdiv(triton.cdiv(T, splits), bt) * bt
        args = (v, w, dproj, dsq, dv, partial, T, T, K, W, per, *v.stride(), *w.stride(), *dproj.stride(),
                *dsq.stride(), *dv.stride(), *partial.stride())
        kw = dict(BLOCK_T=bt, BLOCK_K=bk, BLOCK_W=BLOCK_W, PRECISION="tf32", UPCAST=False, num_warps=warps,
                  num_stages=3)
        print("backward", kw, resources(compile_launch(P._mhc_project_bwd_kernel, args, kw)), flush=True)
    v2, g2, dv2 = v[0], dproj[0], dv[0]
    for (splits, bt, bk, warps), (dv_bt, dv_warps) in SPLIT_CONFIGS:
        kw = dict(BLOCK_T=dv_bt, BLOCK_K=bk, BLOCK_W=BLOCK_W, PRECISION="tf32", UPCAST=False, num_warps=dv_warps)
        print("split dv", kw, resources(compile_launch(_dv_kernel, (v2, w, g2, dsq[0], dv2, T, K, W), kw)), flush=True)
        partial = torch.empty(splits, W, K)
        per = triton.cdiv(triton.cdiv(T, splits), bt) * bt
        kw = dict(BLOCK_T=bt, BLOCK_K=bk, BLOCK_W=BLOCK_W, PRECISION="tf32", UPCAST=False, num_warps=warps, num_stages=3)
        print("split dw", kw, resources(compile_launch(_dw_kernel, (v2, g2, partial, T, K, W, per), kw)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="only check against float64")
    p.add_argument("--sm90", action="store_true", help="compile every timed configuration for sm_90 (no GPU)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--width", type=int, default=4096, help="K = n·C")
    a = p.parse_args()
    if a.sm90:
        sm90(a.tokens, a.width)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if INTERPRETED:  # the tests' interpreter fixes (bf16 rounding, scalar loop bounds on Triton 3.6)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
        import interpreter_compat

        interpreter_compat.apply()
    for T, K, dtype in ((70, 200, torch.float32), (45, 96, torch.bfloat16)):
        check(device, T, K, 24, dtype)
    if device == "cuda":
        check(device, 1000, 4096, 24, torch.bfloat16)
        if not a.check:
            time_gpu(a.tokens, a.width, 24)


if __name__ == "__main__":
    main()
