"""Prototype (issue 18): the mHC stream's whole gradient from one kernel, instead of the projection's
backward kernel beside the Inductor pointwise kernels that sum the stream's gradient.

Per sublayer, the compiled C1024 n4 backward (`diag_mhc-dump_2026-11-30_h200x2_30b2b4b.tgz`) computes the
gradient of the sublayer's input stream x [T, n, C] from three terms:

    dx[t, i, c] = Σ_j A[t, i, j] g[t, j, c]          (the post's residual mix; g: the gradient of its output)
                + h_pre[t, i] dy[t, c]                (the aggregate y = Σ_i h_pre[i] x[i]; dy: y's gradient)
                + Σ_w dproj[t, w] φ[w, i·C + c] + 2 dsq[t] x[t, i, c]     (mhc_project: proj = x·φᵀ, sq = Σ x²)
    dφ[w, k]    = Σ_t dproj[t, w] x[t, k]             (k = i·C + c)

Today the last line and its dx term are `_mhc_project_bwd_kernel` (reads x, writes dv), and Inductor sums
the three terms in pointwise kernels that read g in float32 (128 MB a layer at C1024 B4 S2048), write the
sum twice (with and without dv) and read dv back: about 7 stream-sized reads and writes a sublayer, 0.1 ms
each of the 8 sublayers' kernels `_8`, `_13`, `_14` (`diag_mhc-profile_…73e592c.txt`). Here one kernel
reads x and g once and writes dx once: 3.

Layout of this prototype: x, g, dx [T, n·C] contiguous; A [T, n, n], h_pre [T, n] float32; dy [T, C];
φ [W, n·C]; dproj [T, W]; dsq [T] float32. A program holds BLOCK_C channels of every stream for one
share of the tokens (the op's backward kernel's split), so that dφ's partial stays in registers and g, x
and dy are read from HBM once. A first version held one stream per program (n programs reading the same g
and dy): 189 us a sublayer at C1024 B4 S2048 n4 on the H200 against ~150 in the compiled step
(`diag_mhc-stream-grad-proto_…fa17690.txt`, BENCHMARKS.md session 40), so it was dropped. If this one
pays, it becomes `mhc_project_backward`'s kernel with a post_grad pass that hands it g, A,
h_pre and dy (the graph's add of the three terms), as mhc_project_proto.py became project.py.

    TRITON_INTERPRET=1 python benchmarks/analysis/mhc_stream_grad_proto.py --check   # CPU: against float64
    python benchmarks/analysis/mhc_stream_grad_proto.py                              # GPU: check, then time
    python benchmarks/analysis/mhc_stream_grad_proto.py --sm90                       # compile each for sm_90
    python benchmarks/analysis/mhc_stream_grad_proto.py --dx-only                    # GPU: dx alone + cuBLAS dφ

The fused kernel was slower than today's pair (165 against ~150 µs, session 41); its dφ, a reduction over
the tokens, is what keeps a program's loop serial. Without it (DPHI false) every program is one token block
and channel block, per-token work only, and dφ = dprojᵀ x is a cuBLAS product reading x again: if dx alone
runs near its bytes (~50 µs) that pair beats the op's kernel + Inductor's sum, and a post_grad pass can hand
it the sum's terms. Timed on one H200 (session 51, `diag_mhc-dx-proto_…6c96e5f.txt`): dx alone 101.6 µs at best,
so the spread [tokens, n·channels] tile is the slow part, not dφ. `_stream_dx_tile_kernel` is the same dx in
plain [tokens, channels of one stream] tiles, as the op's projection backward tiles its dv, each g and dy tile
read by the n programs of its channel block (from L2 after the first): `--dx-only` times both.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mhc_project_proto import BLOCK_W, precision, report  # noqa: E402  (the op's tiles and the checks' report)


@triton.jit
def _spread(t, BLOCK_T: tl.constexpr, N_POW2: tl.constexpr, BLOCK_C: tl.constexpr, PER_STREAM: tl.constexpr):
    """[BLOCK_T, N_POW2] (PER_STREAM) or [BLOCK_T, BLOCK_C] to the tile's [BLOCK_T, N_POW2 * BLOCK_C] columns
    (column = stream * BLOCK_C + channel), without loading the value again per column."""
    if PER_STREAM:
        t = tl.broadcast_to(t[:, :, None], (BLOCK_T, N_POW2, BLOCK_C))
    else:
        t = tl.broadcast_to(t[:, None, :], (BLOCK_T, N_POW2, BLOCK_C))
    return tl.reshape(t, (BLOCK_T, N_POW2 * BLOCK_C))


@triton.jit
def _stream_grad_kernel(
    x_ptr, w_ptr, dproj_ptr, dsq_ptr, g_ptr, a_ptr, hp_ptr, dy_ptr, dx_ptr, dw_ptr,
    T, C, W, tokens_per_split,
    N: tl.constexpr, N_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, DPHI: tl.constexpr,
):
    """dx for BLOCK_C columns of every stream at once over one share of the tokens, and the share's dφ
    partial. A tile's N_POW2 * BLOCK_C columns are stream i = col // BLOCK_C, channel c = cs[col % BLOCK_C]:
    each stream's dx mixes every stream's g at the same channel, so g, x and dy are read from HBM once, and
    the projection's two products are one dot each over all the streams."""
    cols = tl.arange(0, N_POW2 * BLOCK_C)
    stream = cols // BLOCK_C
    cs = tl.program_id(0) * BLOCK_C + cols % BLOCK_C
    streams = tl.arange(0, N_POW2)
    cs1 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    share = tl.program_id(1)
    K = N * C
    outs = tl.arange(0, BLOCK_W)
    col_ok = (stream < N) & (cs < C)
    out_ok = outs < W
    ks = (stream * C + cs).to(tl.int64)
    w = tl.load(w_ptr + outs[:, None] * K + ks[None, :], mask=out_ok[:, None] & col_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter multiplies 16-bit bit patterns as integers
        w = w.to(tl.float32)
    dw = tl.zeros([BLOCK_W, N_POW2 * BLOCK_C], dtype=tl.float32)
    start = share * tokens_per_split
    for t0 in range(start, start + tokens_per_split, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T)
        tok_ok = (tok < T) & (tok < start + tokens_per_split)
        tok64 = tok.to(tl.int64)
        tc = tok_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + tok64[:, None] * K + ks[None, :], mask=tc, other=0.0)
        gp = tl.load(dproj_ptr + tok64[:, None] * W + outs[None, :], mask=tok_ok[:, None] & out_ok[None, :],
                     other=0.0)
        dsq = tl.load(dsq_ptr + tok64, mask=tok_ok, other=0.0).to(tl.float32)
        # h_pre[t, i] [BLOCK_T, N_POW2] and dy[t, c] [BLOCK_T, BLOCK_C], spread over the tile's columns
        hp = _spread(tl.load(hp_ptr + tok64[:, None] * N + streams[None, :], mask=tok_ok[:, None] & (streams < N)[None, :],
                             other=0.0).to(tl.float32), BLOCK_T, N_POW2, BLOCK_C, True)
        dy = _spread(tl.load(dy_ptr + tok64[:, None] * C + cs1[None, :], mask=tok_ok[:, None] & (cs1 < C)[None, :],
                             other=0.0).to(tl.float32), BLOCK_T, N_POW2, BLOCK_C, False)
        if UPCAST:
            gp = gp.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(gp, w, input_precision=PRECISION) + (2.0 * dsq)[:, None] * x.to(tl.float32) + hp * dy
        for j in tl.static_range(N):
            a_ij = tl.load(a_ptr + tok64[:, None] * (N * N) + streams[None, :] * N + j,
                           mask=tok_ok[:, None] & (streams < N)[None, :], other=0.0).to(tl.float32)
            g_j = tl.load(g_ptr + tok64[:, None] * K + (j * C + cs1).to(tl.int64)[None, :],
                          mask=tok_ok[:, None] & (cs1 < C)[None, :], other=0.0).to(tl.float32)
            acc += _spread(a_ij, BLOCK_T, N_POW2, BLOCK_C, True) * _spread(g_j, BLOCK_T, N_POW2, BLOCK_C, False)
        tl.store(dx_ptr + tok64[:, None] * K + ks[None, :], acc.to(dx_ptr.dtype.element_ty), mask=tc)
        if DPHI:
            dw = tl.dot(tl.trans(gp), x, dw, input_precision=PRECISION)
    if DPHI:
        tl.store(dw_ptr + share * W * K + outs[:, None] * K + ks[None, :], dw, mask=out_ok[:, None] & col_ok[None, :])


@triton.jit
def _stream_dx_tile_kernel(
    x_ptr, w_ptr, dproj_ptr, dsq_ptr, g_ptr, a_ptr, hp_ptr, dy_ptr, dx_ptr,
    T, C, W,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """dx for one [BLOCK_T, BLOCK_K] tile of the flattened stream (k = i·C + c, BLOCK_K dividing C, so the tile is
    one stream i's channels): plain 2-D tiles, no spreading. The mix reads the N tiles of g at the same channels
    (each g tile is read by the N programs of its channel block, from L2 after the first), dy's tile likewise,
    A's column i and h_pre's i as per-token vectors; the projection's product is one dot [BLOCK_T, W] x [W, BLOCK_K]."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    K = N * C
    stream = (tl.program_id(1) * BLOCK_K) // C
    cs = ks - stream * C
    outs = tl.arange(0, BLOCK_W)
    tok_ok = tok < T
    k_ok = ks < K
    tok64 = tok.to(tl.int64)
    tk = tok_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + tok64[:, None] * K + ks[None, :], mask=tk, other=0.0)
    gp = tl.load(dproj_ptr + tok64[:, None] * W + outs[None, :], mask=tok_ok[:, None] & (outs < W)[None, :], other=0.0)
    w = tl.load(w_ptr + outs[:, None] * K + ks[None, :], mask=(outs < W)[:, None] & k_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter multiplies 16-bit bit patterns as integers
        x, gp, w = x.to(tl.float32), gp.to(tl.float32), w.to(tl.float32)
    dsq = tl.load(dsq_ptr + tok64, mask=tok_ok, other=0.0).to(tl.float32)
    hp = tl.load(hp_ptr + tok64 * N + stream, mask=tok_ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + tok64[:, None] * C + cs[None, :], mask=tk, other=0.0).to(tl.float32)
    acc = tl.dot(gp, w, input_precision=PRECISION) + (2.0 * dsq)[:, None] * x.to(tl.float32) + hp[:, None] * dy
    for j in tl.static_range(N):
        a_ij = tl.load(a_ptr + tok64 * (N * N) + stream * N + j, mask=tok_ok, other=0.0).to(tl.float32)
        g_j = tl.load(g_ptr + tok64[:, None] * K + (j * C + cs)[None, :], mask=tk, other=0.0).to(tl.float32)
        acc += a_ij[:, None] * g_j
    tl.store(dx_ptr + tok64[:, None] * K + ks[None, :], acc.to(dx_ptr.dtype.element_ty), mask=tk)


def stream_dx_tiles(x, w, dproj, dsq, g, a, hp, dy, n: int, block_t: int = 32, block_k: int = 128, warps: int = 4,
                    stages: int = 2):
    """_stream_dx_tile_kernel over every tile (dx only; dφ = dprojᵀ x apart)."""
    T, K = x.shape
    C, W = K // n, w.shape[0]
    block_k = min(block_k, C)
    assert C % block_k == 0, "a tile holds one stream's channels"
    dx = torch.empty_like(x)
    _stream_dx_tile_kernel[(triton.cdiv(T, block_t), K // block_k)](
        x, w, dproj, dsq, g, a, hp, dy, dx, T, C, W,
        N=n, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_W=BLOCK_W, PRECISION=precision(x.dtype), UPCAST=INTERPRETED,
        num_warps=warps, num_stages=stages)
    return dx


def stream_grad(x, w, dproj, dsq, g, a, hp, dy, n: int, splits: int = 16, block_t: int = 32,
                     block_c: int = 64, warps: int = 4, stages: int = 3, dphi_in_kernel: bool = True):
    """_stream_grad_kernel: (dx [T, n·C] in x's dtype, dφ [W, n·C] float32). Without dphi_in_kernel the
    kernel forms dx alone (every program independent: `splits` is then only how the tokens are shared out)
    and dφ = dprojᵀ x is one cuBLAS product reading x a second time."""
    T, K = x.shape
    C, W = K // n, w.shape[0]
    dx = torch.empty_like(x)
    partial = torch.empty(splits if dphi_in_kernel else 1, W, K, dtype=torch.float32, device=x.device)
    per_split = triton.cdiv(triton.cdiv(T, splits), block_t) * block_t
    _stream_grad_kernel[(triton.cdiv(C, block_c), splits)](
        x, w, dproj, dsq, g, a, hp, dy, dx, partial, T, C, W, per_split,
        N=n, N_POW2=triton.next_power_of_2(n), BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_W=BLOCK_W,
        PRECISION=precision(x.dtype), UPCAST=INTERPRETED, DPHI=dphi_in_kernel, num_warps=warps, num_stages=stages)
    if not dphi_in_kernel:
        return dx, (dproj.T.float() @ x.float()) if x.device.type == "cpu" else torch.mm(dproj.T, x).float()
    return dx, partial.sum(0)


def reference(x, w, dproj, dsq, g, a, hp, dy, n: int):
    """float64: (dx, dφ)."""
    T, K = x.shape
    C = K // n
    x64 = x.double()
    mix = torch.einsum("tij,tjc->tic", a.double(), g.double().view(T, n, C))
    pre = hp.double()[:, :, None] * dy.double()[:, None, :]
    dx = (mix + pre).reshape(T, K) + dproj.double() @ w.double() + 2 * dsq.double()[:, None] * x64
    return dx, dproj.double().T @ x64


def inputs(device: str, T: int, n: int, C: int, W: int, dtype: torch.dtype, g_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n * C, generator=gen).to(device, dtype)
    w = (torch.randn(W, n * C, generator=gen) * 0.02).to(device, dtype)
    dproj = torch.randn(T, W, generator=gen).to(device, dtype)
    dsq = torch.randn(T, generator=gen).to(device, torch.float32)
    g = torch.randn(T, n * C, generator=gen).to(device, g_dtype)
    a = torch.softmax(torch.randn(T, n, n, generator=gen), -1).to(device)
    hp = torch.sigmoid(torch.randn(T, n, generator=gen)).to(device)
    dy = torch.randn(T, C, generator=gen).to(device, dtype)
    return x, w, dproj, dsq, g, a, hp, dy


def check(device: str, T: int, n: int, C: int, dtype: torch.dtype, g_dtype: torch.dtype, block_c: int) -> None:
    args = inputs(device, T, n, C, 24, dtype, g_dtype)
    want = reference(*args, n=n)
    got = stream_grad(*args, n=n, splits=3, block_t=16, block_c=block_c)
    report(f"T{T} n{n} C{C} {dtype} g {g_dtype}", dict(zip(("dx", "dphi"), got)), want, dtype)
    got = stream_grad(*args, n=n, splits=5, block_t=16, block_c=block_c, dphi_in_kernel=False)
    report(f"T{T} n{n} C{C} {dtype} g {g_dtype}, dphi by a product", dict(zip(("dx", "dphi"), got)), want, dtype)
    tile_k = max(d for d in (16, 32, 64, 128) if C % d == 0) if C % 16 == 0 else None
    if tile_k is not None:
        dx = stream_dx_tiles(*args, n=n, block_t=16, block_k=min(tile_k, block_c))
        report(f"T{T} n{n} C{C} {dtype} g {g_dtype}, dx by 2-D tiles", {"dx": dx}, want[:1], dtype)


# (splits, BLOCK_T, BLOCK_C, warps): a tile is n_pow2 * BLOCK_C columns wide. Compiled for
# sm_90 (Triton 3.6, n 4): only BLOCK_T 32 BLOCK_C 64 at 4 warps spills (264 bytes a thread; 1424 when h_pre,
# dy and A were loaded per column rather than once per token and spread over the columns); 255 registers but
# at BLOCK_T 16 BLOCK_C 32 (166) and BLOCK_T 32 BLOCK_C 32 at 8 warps (230).
CONFIGS = ((16, 32, 64, 4), (16, 32, 64, 8), (16, 16, 64, 4), (16, 32, 32, 4), (16, 32, 32, 8),
           (16, 16, 32, 4), (16, 64, 32, 8), (32, 32, 32, 4))


def time_gpu(T: int, n: int, C: int, dx_only: bool = False) -> None:
    """The prototype against what the compiled step runs today for the same terms: the op's backward kernel
    (dv, dφ) and Inductor's sum of the mix, the aggregate's term and dv, with g in float32 as the graph has it."""
    from triton.testing import do_bench

    from hccompile.kernels.mhc import project as P

    dtype = torch.bfloat16
    x, w, dproj, dsq, g, a, hp, dy = inputs("cuda", T, n, C, 24, dtype, dtype)
    g32 = g.float()
    x3, gp3, s3 = x.unsqueeze(0), dproj.unsqueeze(0), dsq.unsqueeze(0)

    def project_bwd():
        return P.launch_project_bwd(x3, w, gp3, s3)

    @torch.compile
    def inductor_sum(g32, a, hp, dy, dv):
        mix = torch.einsum("tij,tjc->tic", a, g32.view(T, n, C)).to(dtype)
        return (mix + (hp[:, :, None] * dy[:, None, :]).to(dtype)).reshape(T, n * C) + dv

    def today():
        dv, dw = project_bwd()
        return inductor_sum(g32, a, hp, dy, dv[0]), dw

    print(f"x [{T}, {n}x{C}] bf16 clone (read + write): {do_bench(lambda: x.clone()) * 1e3:.1f} us", flush=True)
    print(f"today: the op's backward kernel alone: {do_bench(project_bwd) * 1e3:.1f} us", flush=True)
    print(f"today: the op's backward kernel + Inductor's sum (g float32): {do_bench(today) * 1e3:.1f} us", flush=True)
    for splits, bt, bc, warps in () if dx_only else CONFIGS:
        ms = do_bench(lambda: stream_grad(x, w, dproj, dsq, g, a, hp, dy, n, splits, bt, bc, warps))
        print(f"fused splits {splits:2d} BT {bt:3d} BC {bc} warps {warps}: {ms * 1e3:.1f} us", flush=True)
    # dx alone (per-token work, every program independent), dφ by cuBLAS beside it
    dphi = lambda: torch.mm(dproj.T, x)  # noqa: E731
    print(f"dphi = dproj^T x alone (cuBLAS, bf16 out): {do_bench(dphi) * 1e3:.1f} us", flush=True)
    for bt, bk, warps, stages in DX_TILE_CONFIGS:
        ms = do_bench(lambda: stream_dx_tiles(x, w, dproj, dsq, g, a, hp, dy, n, bt, bk, warps, stages))
        print(f"dx by 2-D tiles BT {bt:3d} BK {bk} warps {warps} stages {stages}: {ms * 1e3:.1f} us", flush=True)
    for bt, bc, warps in DX_ONLY_CONFIGS:
        splits = triton.cdiv(T, bt)
        ms = do_bench(lambda: stream_grad(x, w, dproj, dsq, g, a, hp, dy, n, splits, bt, bc, warps, dphi_in_kernel=False))
        ms_dx = do_bench(lambda: _dx_only(x, w, dproj, dsq, g, a, hp, dy, n, splits, bt, bc, warps))
        print(f"dx alone BT {bt:3d} BC {bc} warps {warps}: {ms_dx * 1e3:.1f} us; with cuBLAS dphi {ms * 1e3:.1f} us",
              flush=True)


# (BLOCK_T, BLOCK_C, warps) of the dx-only kernel: one program per token block and channel block
DX_ONLY_CONFIGS = ((16, 64, 4), (16, 32, 4), (8, 64, 4), (16, 64, 8), (32, 64, 8), (32, 32, 4))


# (BLOCK_T, BLOCK_K, warps, stages) of the 2-D tile dx kernel; compiled for sm_90 (Triton 3.9, n 4): 116-184
# registers without spills (64 x 128 at 4 warps and 128 x 128 at 8 spill, left out)
DX_TILE_CONFIGS = ((32, 128, 4, 2), (16, 128, 4, 2), (64, 128, 8, 2), (32, 256, 8, 2), (64, 64, 4, 2),
                   (16, 256, 4, 2), (32, 64, 4, 2))


def _dx_only(x, w, dproj, dsq, g, a, hp, dy, n, splits, block_t, block_c, warps):
    T, K = x.shape
    C, W = K // n, w.shape[0]
    dx = torch.empty_like(x)
    _stream_grad_kernel[(triton.cdiv(C, block_c), splits)](
        x, w, dproj, dsq, g, a, hp, dy, dx, dx, T, C, W, block_t,
        N=n, N_POW2=triton.next_power_of_2(n), BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_W=BLOCK_W,
        PRECISION=precision(x.dtype), UPCAST=INTERPRETED, DPHI=False, num_warps=warps, num_stages=3)
    return dx


def sm90(T: int, n: int, C: int) -> None:
    """--sm90 (no GPU, no TRITON_INTERPRET): each timed configuration compiled for sm_90 as a launch would
    specialise it, with its registers and spills (hccompile's compile_check)."""
    from hccompile.kernels.mhc.compile_check import compile_launch, resources

    K, W = n * C, 24
    x, w = torch.empty(T, K, dtype=torch.bfloat16), torch.empty(W, K, dtype=torch.bfloat16)
    dproj, dsq, g = torch.empty(T, W, dtype=torch.bfloat16), torch.empty(T), torch.empty(T, K, dtype=torch.bfloat16)
    a, hp, dy, dx = torch.empty(T, n, n), torch.empty(T, n), torch.empty(T, C, dtype=torch.bfloat16), torch.empty_like(x)
    for splits, bt, bc, warps in CONFIGS:
        partial = torch.empty(splits, W, K)
        per = triton.cdiv(triton.cdiv(T, splits), bt) * bt
        args = (x, w, dproj, dsq, g, a, hp, dy, dx, partial, T, C, W, per)
        kw = dict(N=n, N_POW2=triton.next_power_of_2(n), BLOCK_T=bt, BLOCK_C=bc, BLOCK_W=BLOCK_W, PRECISION="tf32",
                  UPCAST=False, DPHI=True, num_warps=warps, num_stages=3)
        print("stream grad", kw, resources(compile_launch(_stream_grad_kernel, args, kw)), flush=True)
    for bt, bk, warps, stages in DX_TILE_CONFIGS:
        args = (x, w, dproj, dsq, g, a, hp, dy, dx, T, C, W)
        kw = dict(N=n, BLOCK_T=bt, BLOCK_K=bk, BLOCK_W=BLOCK_W, PRECISION="tf32", UPCAST=False, num_warps=warps,
                  num_stages=stages)
        print("dx by 2-D tiles", kw, resources(compile_launch(_stream_dx_tile_kernel, args, kw)), flush=True)
    for bt, bc, warps in DX_ONLY_CONFIGS:
        args = (x, w, dproj, dsq, g, a, hp, dy, dx, dx, T, C, W, bt)
        kw = dict(N=n, N_POW2=triton.next_power_of_2(n), BLOCK_T=bt, BLOCK_C=bc, BLOCK_W=BLOCK_W, PRECISION="tf32",
                  UPCAST=False, DPHI=False, num_warps=warps, num_stages=3)
        print("dx alone", kw, resources(compile_launch(_stream_grad_kernel, args, kw)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="only check against float64")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--channels", type=int, default=1024, help="C")
    p.add_argument("--streams", type=int, default=4, help="n")
    p.add_argument("--sm90", action="store_true", help="compile every timed configuration for sm_90 (no GPU)")
    p.add_argument("--dx-only", action="store_true",
                   help="time only the dx-alone kernel (dφ by cuBLAS beside it), not the fused kernel's configurations")
    args = p.parse_args()
    if args.sm90:
        sm90(args.tokens, args.streams, args.channels)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if INTERPRETED:  # the tests' interpreter fixes (bf16 rounding, scalar loop bounds on Triton 3.6)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
        import interpreter_compat

        interpreter_compat.apply()
    small = 16 if device == "cpu" else 128
    for T, n, C, dtype, g_dtype in ((45, 4, 24, torch.float32, torch.float32), (37, 3, 40, torch.bfloat16, torch.bfloat16),
                                    (50, 4, 32, torch.bfloat16, torch.float32), (45, 3, 48, torch.float32, torch.float32)):
        check(device, T, n, C, dtype, g_dtype, small)
    if device == "cuda":
        check(device, 1000, 4, 1024, torch.bfloat16, torch.bfloat16, 128)
        if not args.check:
            time_gpu(args.tokens, args.streams, args.channels, args.dx_only)


if __name__ == "__main__":
    main()
