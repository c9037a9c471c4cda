"""A prototype, not hccompile code: the mHC projection of the flattened stream in one pass, forward and
backward, timed against what the compiled step runs today (issue 18's "fewer, larger kernels").

Today, per sublayer, the compiled C1024 step reads the n·C stream v [T, K] (K = n·C) for the projection:
- forward: a cuBLAS matmul proj = v·φᵀ ([T, K] × [K, W], W = n² + 2n = 24) and an Inductor reduction
  Σ v² per token (the norm r), each reading v: 8 × 20 + 7 × 23 µs a step on the H200 (session 37's profile);
- backward: dv = dproj·φ (a cuBLAS matmul writing [T, K], read back by the stream-gradient sum) and
  dφ = dprojᵀ·v (split-K cuBLAS, reading v again); the norm's term 2·dsq·v rides in Inductor's sum, which
  reads v a third time.

The two kernels here read v once each way:
- `project_fwd`: proj and Σ v² from one sweep of v (tl.dot on [BLOCK_T, BLOCK_K] × [BLOCK_K, 32] tiles);
- `project_bwd`: dv = dproj·φ + 2·dsq·v and dφ in one sweep. A program owns BLOCK_K columns of v and walks a
  share of the tokens, so φ's tile stays in registers and dφ's [32, BLOCK_K] sums need no atomics: one
  partial per token share, summed after (SPLITS rows).

    TRITON_INTERPRET=1 python benchmarks/analysis/mhc_project_proto.py --check   # CPU: against float64
    python benchmarks/analysis/mhc_project_proto.py                              # GPU: check, then time

The GPU run prints each side's time per call, at C1024 n4 B4 S2048 bf16 (T 8192, K 4096). If the fused pair
wins, it becomes an op in hccompile/kernels/mhc with its pass rewrite (linear(v, φ) and mean(v², -1) on the
same v).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _project_fwd_kernel(v_ptr, w_ptr, proj_ptr, sq_ptr, T, K, W,
                        svt, svk, swn, swk, spt, spn,
                        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """proj[t, :] = v[t, :]·φᵀ and sq[t] = Σ_k v[t, k]² for BLOCK_T tokens, one sweep over K."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    outs = tl.arange(0, BLOCK_W)
    row_ok = rows < T
    out_ok = outs < W
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.float32)
    squares = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        v = tl.load(v_ptr + rows64[:, None] * svt + ks[None, :] * svk, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + outs[None, :] * swn + ks[:, None] * swk, mask=k_ok[:, None] & out_ok[None, :],
                    other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 bit patterns as integers (_triton.dot)
            w = w.to(tl.float32)
        vf = v.to(tl.float32)
        acc = tl.dot(vf if UPCAST else v, w, acc, input_precision=PRECISION)
        squares += vf * vf
    tl.store(proj_ptr + rows64[:, None] * spt + outs[None, :] * spn, acc.to(proj_ptr.dtype.element_ty),
             mask=row_ok[:, None] & out_ok[None, :])
    tl.store(sq_ptr + rows64, tl.sum(squares, axis=1), mask=row_ok)


@triton.jit
def _project_bwd_kernel(v_ptr, w_ptr, dproj_ptr, dsq_ptr, dv_ptr, dw_ptr, T, K, W, tokens_per_split,
                        svt, svk, swn, swk, sdt, sdn, sdvt, sdvk, sws, swn2, swk2,
                        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """For BLOCK_K columns of v and one share of the tokens: dv = dproj·φ + 2·dsq·v, stored, and the
    share's dφ[:, columns] = Σ_t dproj[t, :]ᵀ v[t, columns] into dw_ptr[split]."""
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(1)
    outs = tl.arange(0, BLOCK_W)
    k_ok = ks < K
    out_ok = outs < W
    w = tl.load(w_ptr + outs[:, None] * swn + ks[None, :] * swk, mask=out_ok[:, None] & k_ok[None, :],
                other=0.0)
    if UPCAST:
        w = w.to(tl.float32)
    dw = tl.zeros([BLOCK_W, BLOCK_K], dtype=tl.float32)
    start = split * tokens_per_split
    for t0 in range(start, start + tokens_per_split, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = (rows < T) & (rows < start + tokens_per_split)
        rows64 = rows.to(tl.int64)
        tk_ok = row_ok[:, None] & k_ok[None, :]
        v = tl.load(v_ptr + rows64[:, None] * svt + ks[None, :] * svk, mask=tk_ok, other=0.0)
        g = tl.load(dproj_ptr + rows64[:, None] * sdt + outs[None, :] * sdn,
                    mask=row_ok[:, None] & out_ok[None, :], other=0.0)
        dsq = tl.load(dsq_ptr + rows64, mask=row_ok, other=0.0)
        if UPCAST:
            g = g.to(tl.float32)
            v = v.to(tl.float32)
        dv = tl.dot(g, w, input_precision=PRECISION) + (2.0 * dsq)[:, None] * v.to(tl.float32)
        tl.store(dv_ptr + rows64[:, None] * sdvt + ks[None, :] * sdvk, dv.to(dv_ptr.dtype.element_ty), mask=tk_ok)
        dw = tl.dot(tl.trans(g), v, dw, input_precision=PRECISION)
    tl.store(dw_ptr + split * sws + outs[:, None] * swn2 + ks[None, :] * swk2, dw,
             mask=out_ok[:, None] & k_ok[None, :])


BLOCK_W = 32
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def precision(dtype: torch.dtype) -> str:
    """float32 operands in full precision: tl.dot's default TF32 gave 7.6e-4 relative error on the H200."""
    return "ieee" if dtype == torch.float32 else "tf32"


def project_fwd(v: torch.Tensor, w: torch.Tensor, block_t: int = 32, block_k: int = 128, warps: int = 4,
                stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj [T, W] in v's dtype, sq [T] float32) for v [T, K], w [W, K] (F.linear's weight)."""
    T, K = v.shape
    W = w.shape[0]
    proj = torch.empty(T, W, dtype=v.dtype, device=v.device)
    sq = torch.empty(T, dtype=torch.float32, device=v.device)
    _project_fwd_kernel[(triton.cdiv(T, block_t),)](
        v, w, proj, sq, T, K, W, *v.stride(), *w.stride(), *proj.stride(),
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_W=BLOCK_W, UPCAST=INTERPRETED, PRECISION=precision(v.dtype),
        num_warps=warps, num_stages=stages)
    return proj, sq


def project_bwd(v: torch.Tensor, w: torch.Tensor, dproj: torch.Tensor, dsq: torch.Tensor, splits: int = 8,
                block_t: int = 64, block_k: int = 128, warps: int = 4, stages: int = 3
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dv [T, K] in v's dtype, dw [W, K] float32) for the forward's outputs' gradients dproj [T, W] and
    dsq [T] (of sq = Σ v²)."""
    T, K = v.shape
    W = w.shape[0]
    dv = torch.empty_like(v)
    partial = torch.empty(splits, W, K, dtype=torch.float32, device=v.device)
    per_split = triton.cdiv(triton.cdiv(T, splits), block_t) * block_t
    _project_bwd_kernel[(triton.cdiv(K, block_k), splits)](
        v, w, dproj, dsq, dv, partial, T, K, W, per_split, *v.stride(), *w.stride(), *dproj.stride(),
        *dv.stride(), *partial.stride(),
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_W=BLOCK_W, UPCAST=INTERPRETED, PRECISION=precision(v.dtype),
        num_warps=warps, num_stages=stages)
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
    errors = [rel(got, ref) for got, ref in zip((proj, sq, dv, dw), want)]
    limit = 1e-5 if dtype == torch.float32 else 8e-3
    status = "ok" if all(e < limit and e == e for e in errors) else "FAILED"
    print(f"check T{T} K{K} W{W} {dtype}: proj {errors[0]:.1e} sq {errors[1]:.1e} dv {errors[2]:.1e} "
          f"dw {errors[3]:.1e} (limit {limit:.0e}) {status}", flush=True)
    if status != "ok":
        raise SystemExit(1)


# (BLOCK_T, BLOCK_K, warps, stages) and (splits, BLOCK_T, BLOCK_K, warps), timed side by side
FWD_CONFIGS = ((16, 128, 4, 3), (32, 128, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3),
               (32, 128, 4, 4))
BWD_CONFIGS = ((8, 64, 128, 4), (16, 64, 128, 4), (4, 64, 128, 4), (8, 32, 128, 4), (8, 64, 64, 4),
               (8, 128, 128, 8))


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


def sm90(T: int = 8192, K: int = 4096, W: int = 24) -> None:
    """--sm90 (no GPU needed, no TRITON_INTERPRET): each timed configuration compiled for sm_90 as a launch
    would specialise it, with its registers, spills and layout conversions (hccompile's compile_check)."""
    from hccompile.kernels.mhc.compile_check import compile_launch, resources

    v = torch.empty(T, K, dtype=torch.bfloat16)
    w = torch.empty(W, K, dtype=torch.bfloat16)
    proj, sq = torch.empty(T, W, dtype=torch.bfloat16), torch.empty(T)
    dproj, dsq, dv = torch.empty(T, W, dtype=torch.bfloat16), torch.empty(T), torch.empty_like(v)
    for bt, bk, warps, stages in FWD_CONFIGS:
        args = (v, w, proj, sq, T, K, W, *v.stride(), *w.stride(), *proj.stride())
        kw = dict(BLOCK_T=bt, BLOCK_K=bk, BLOCK_W=BLOCK_W, UPCAST=False, PRECISION="tf32", num_warps=warps,
                  num_stages=stages)
        print("forward ", kw, resources(compile_launch(_project_fwd_kernel, args, kw)), flush=True)
    for splits, bt, bk, warps in BWD_CONFIGS:
        partial = torch.empty(splits, W, K)
        per = triton.cdiv(triton.cdiv(T, splits), bt) * bt
        args = (v, w, dproj, dsq, dv, partial, T, K, W, per, *v.stride(), *w.stride(), *dproj.stride(),
                *dv.stride(), *partial.stride())
        kw = dict(BLOCK_T=bt, BLOCK_K=bk, BLOCK_W=BLOCK_W, UPCAST=False, PRECISION="tf32", num_warps=warps,
                  num_stages=3)
        print("backward", kw, resources(compile_launch(_project_bwd_kernel, args, kw)), flush=True)


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
