"""Whether KDA's decayed_scores_backward pays with one program per chunk instead of one per row sub-chunk
(issue 20: KDA B1 T32768 H16 D128 at 0.837x FLA's time, 0.8 wanted; the kernel takes 2.04 of 9.35 ms busy,
session 45's profile at a43c424).

Today's kernel (scores.py, _decayed_scores_backward_kernel with _sub_chunk_scores_backward) runs four programs
per chunk, each loading the whole chunk's q, k and fp32 G tiles per key tile for its sub-chunk's row and column
roles. The forward's score kernel gained 0.24 ms at B1 from one program per chunk (scores_chunk.py, session 45).
Variants, each checked on the kernel tests' per-channel cases (and again with every diagonal block split,
scores.FACTOR_SPAN_LIMIT = 0) against float64 before it is timed:

    sub             today's kernel (the reference timing)
    chunk-wN        one program per chunk and value head running today's per-sub-chunk body for its sub-chunks
                    one after another (scores._sub_chunk_scores_backward, unchanged): the chunk's tiles come
                    from L1 for the second to fourth sub-chunk; N warps (today's: 4)
    chunk-wN-bkM    the same with key tiles at most M wide (today's: 64 at K >= 64)
    tiles-wN[-bkM]  one program per chunk with the loops the other way round: per key tile the chunk's q, k and
                    G tiles loaded once, then each sub-chunk's roles (their dP and dKdot tiles loaded per key tile)

Compiled for sm_90 on the CPU (Triton 3.6, K 128 bf16): sub 255 registers and 32 bytes of spills at 4 warps (two
programs per SM); chunk-w4 255 and 56 bytes; chunk-w8 192 and none (one program per SM); chunk-w4-bk32 246
and none (two per SM); tiles spills at every option tried (255 registers; w4 1024 bytes, w8 464, w4-bk32 512,
w8-bk32 224): only tiles-w8-bk32 is in the default list.

Each is timed on KDA's fwd+bwd (do_bench) with the score backward's own GPU time (profiler):

    python benchmarks/analysis/chunk_scores_backward.py [--variants sub,chunk-w4,...] [--repeats 1]
           [--time-shapes B1T32768H16D128,B4T4096H16D128]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import check_cases, check_then_time, delta_rule_step, time_step, use_kernel_tests  # noqa: E402

use_kernel_tests()

from hccompile.kernels._triton import tl, triton  # noqa: E402
from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule import scores as score_kernels  # noqa: E402
from hccompile.kernels.delta_rule.plan import SUB_CHUNK  # noqa: E402
from hccompile.kernels.delta_rule.scores import (_split_diagonal_backward, _split_diagonal_gradients,  # noqa: E402
                                                 _sub_chunk_scores_backward, _sub_chunk_span)
from hccompile.kernels.delta_rule.tiles import (_dot, _gate_offset, _load_rows, _load_vector,  # noqa: E402
                                                _row_chunk_coords, _store_rows, _varlen_chunk_coords)


@triton.jit
def _chunk_scores_backward_kernel(
    q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
    stride_qb, stride_qt, stride_qh, stride_qk,
    stride_kb, stride_kt, stride_kh, stride_kk,
    chunk_table_ptr, cu_seqlens_ptr,
    T, NT, HV, GROUP, K, factor_limit,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HALF_DOTS: tl.constexpr,
):
    """decayed_scores_backward for per-channel gates, one program per chunk and value head: its sub-chunks'
    row and column roles one after another (each writes only its own rows of dq, dk and dG)."""
    factor_limit = tl.cast(factor_limit, tl.float32)
    pid_chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        seq = tl.load(chunk_table_ptr + 2 * pid_chunk)
        chunk = tl.load(chunk_table_ptr + 2 * pid_chunk + 1)
        batch, start, length = _varlen_chunk_coords(chunk, tl.load(cu_seqlens_ptr + seq),
                                                    tl.load(cu_seqlens_ptr + seq + 1), BT)
    else:
        batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
    key_head = head // GROUP
    q_ptr += batch * stride_qb + key_head * stride_qh
    k_ptr += batch * stride_kb + key_head * stride_kh
    gate_offset = _gate_offset(batch, head, T, HV, K, 2)
    cum_ptr += gate_offset
    dg_ptr += gate_offset
    square_ptr_offset = (batch * T) * HV * BT + head * BT
    dkdot_ptr += square_ptr_offset
    dscores_ptr += square_ptr_offset
    key_offset = (batch * T) * HV * K + head * K
    dot_dtype = k_ptr.dtype.element_ty if HALF_DOTS else tl.float32
    for block_b in tl.static_range(BT // BC):
        if block_b * BC < length:
            _sub_chunk_scores_backward(
                q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
                stride_qt, stride_qk, stride_kt, stride_kk, start, length, key_offset, block_b, HV, K,
                factor_limit, dot_dtype, BT, BC, BK, DOT_PRECISION, HALF_DOTS,
            )


@triton.jit
def _sub_chunk_key_tile(q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr, q_all, k_all, g_all, kc,
                        stride_qt, stride_qk, stride_kt, stride_kk, start, length, block_b, span, HV, K,
                        factor_limit, dot_dtype, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, HALF_DOTS: tl.constexpr):
    """One key tile of scores._sub_chunk_scores_backward's loop for sub-chunk `block_b`, given the chunk's
    q, k and G tiles of that key tile (q_all, k_all, g_all [BT, BK] fp32, zero past `length`) and the
    sub-chunk's gate span (scores._sub_chunk_span); its dP and
    dKdot rows and columns loaded here (from L1/L2: once per key tile and sub-chunk). dq_ptr and dk_ptr
    start at the head's key offset."""
    sub = tl.arange(0, BC)
    local = tl.arange(0, BT)
    rows_b = block_b * BC + sub
    valid_b = rows_b < length
    tokens_b = start + rows_b
    valid = local < length
    tokens = start + local
    first = block_b * BC
    last = tl.minimum(first + BC, length) - 1
    factored = span <= factor_limit
    col_end = tl.where(factored, first + BC, first)
    row_begin = tl.where(factored, first, first + BC)
    dscores_rows = _load_rows(dscores_ptr, tokens_b, local, HV * BT, 1, valid_b, BT).to(dot_dtype)
    dkdot_rows = _load_rows(dkdot_ptr, tokens_b, local, HV * BT, 1, valid_b, BT).to(dot_dtype)
    dscores_cols = tl.trans(_load_rows(dscores_ptr, tokens, rows_b, HV * BT, 1, valid, BT)).to(dot_dtype)
    dkdot_cols = tl.trans(_load_rows(dkdot_ptr, tokens, rows_b, HV * BT, 1, valid, BT)).to(dot_dtype)
    q_b = _load_rows(q_ptr, tokens_b, kc, stride_qt, stride_qk, valid_b, K)
    k_b = _load_rows(k_ptr, tokens_b, kc, stride_kt, stride_kk, valid_b, K)
    g_b = _load_rows(cum_ptr, tokens_b, kc, HV * K, 1, valid_b, K)
    g_first = _load_vector(cum_ptr, start + first, kc, HV * K, 1, first < length, K)
    g_last = _load_vector(cum_ptr, start + last, kc, HV * K, 1, first < length, K)
    col_decay = tl.exp(tl.where(((local < col_end) & valid)[:, None], g_first[None, :] - g_all, float("-inf")))
    k_cols = k_all * col_decay
    row_decay = tl.exp(tl.where(valid_b[:, None], g_b - g_first[None, :], 0.0))
    dq_pair = row_decay * _dot(dscores_rows, k_cols, dot_dtype, DOT_PRECISION)
    dk_rows = row_decay * _dot(dkdot_rows, k_cols, dot_dtype, DOT_PRECISION)
    to_last = tl.exp(tl.where(((local >= row_begin) & valid)[:, None], g_all - g_last[None, :], float("-inf")))
    pulled = _dot(dkdot_cols, k_all * to_last, dot_dtype, DOT_PRECISION)
    pulled += _dot(dscores_cols, q_all * to_last, dot_dtype, DOT_PRECISION)
    dk_cols = tl.exp(tl.where(valid_b[:, None], g_last[None, :] - g_b, 0.0)) * pulled
    if HALF_DOTS:
        dq_split = tl.zeros([BC, BK], dtype=tl.float32)
        dk_rows_split = tl.zeros([BC, BK], dtype=tl.float32)
        dk_cols_split = tl.zeros([BC, BK], dtype=tl.float32)
        if span > factor_limit:
            dscores_diagonal = _load_rows(dscores_ptr, tokens_b, rows_b, HV * BT, 1, valid_b, BT)
            dkdot_diagonal = _load_rows(dkdot_ptr, tokens_b, rows_b, HV * BT, 1, valid_b, BT)
            dq_split, dk_rows_split, dk_cols_split = _split_diagonal_gradients(
                q_b, k_b, g_b, dscores_diagonal, dkdot_diagonal, cum_ptr, start + first, length - first, kc,
                HV, K, dot_dtype, BC, DOT_PRECISION)
        dq_pair += dq_split
        dk_rows += dk_rows_split
        dk_cols += dk_cols_split
    dq = _load_rows(dq_ptr, tokens_b, kc, HV * K, 1, valid_b, K) + dq_pair
    dk = _load_rows(dk_ptr, tokens_b, kc, HV * K, 1, valid_b, K) + dk_rows + dk_cols
    _store_rows(dq_ptr, dq, tokens_b, kc, HV * K, 1, valid_b, K)
    _store_rows(dk_ptr, dk, tokens_b, kc, HV * K, 1, valid_b, K)
    dg = _load_rows(dg_ptr, tokens_b, kc, HV * K, 1, valid_b, K)
    dg += q_b * dq_pair + k_b * (dk_rows - dk_cols)
    _store_rows(dg_ptr, dg, tokens_b, kc, HV * K, 1, valid_b, K)


@triton.jit
def _chunk_tiles_scores_backward_kernel(
    q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
    stride_qb, stride_qt, stride_qh, stride_qk,
    stride_kb, stride_kt, stride_kh, stride_kk,
    chunk_table_ptr, cu_seqlens_ptr,
    T, NT, HV, GROUP, K, factor_limit,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HALF_DOTS: tl.constexpr,
):
    """As _chunk_scores_backward_kernel with the loops the other way round: per key tile the chunk's q, k and
    G tiles are loaded once, then each sub-chunk's roles take their share of it."""
    factor_limit = tl.cast(factor_limit, tl.float32)
    pid_chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        seq = tl.load(chunk_table_ptr + 2 * pid_chunk)
        chunk = tl.load(chunk_table_ptr + 2 * pid_chunk + 1)
        batch, start, length = _varlen_chunk_coords(chunk, tl.load(cu_seqlens_ptr + seq),
                                                    tl.load(cu_seqlens_ptr + seq + 1), BT)
    else:
        batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
    key_head = head // GROUP
    q_ptr += batch * stride_qb + key_head * stride_qh
    k_ptr += batch * stride_kb + key_head * stride_kh
    gate_offset = _gate_offset(batch, head, T, HV, K, 2)
    cum_ptr += gate_offset
    dg_ptr += gate_offset
    square_ptr_offset = (batch * T) * HV * BT + head * BT
    dkdot_ptr += square_ptr_offset
    dscores_ptr += square_ptr_offset
    key_offset = (batch * T) * HV * K + head * K
    dot_dtype = k_ptr.dtype.element_ty if HALF_DOTS else tl.float32
    local = tl.arange(0, BT)
    valid = local < length
    tokens = start + local
    last_token = start + length - 1
    # each sub-chunk's gate span once (a sub-chunk past the end: 0)
    span0 = _sub_chunk_span(cum_ptr, start, tl.minimum(start + BC - 1, last_token), HV, K, BK)
    span1 = span0
    span2 = span0
    span3 = span0
    if BT // BC >= 2:
        span1 = _sub_chunk_span(cum_ptr, start + BC, tl.minimum(start + 2 * BC - 1, last_token), HV, K, BK)
    if BT // BC >= 4:
        span2 = _sub_chunk_span(cum_ptr, start + 2 * BC, tl.minimum(start + 3 * BC - 1, last_token), HV, K, BK)
        span3 = _sub_chunk_span(cum_ptr, start + 3 * BC, tl.minimum(start + 4 * BC - 1, last_token), HV, K, BK)
    for k0 in range(0, K, BK):
        kc = k0 + tl.arange(0, BK)
        q_all = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
        k_all = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
        g_all = _load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K)
        for block_b in tl.static_range(BT // BC):
            span = span0
            if block_b == 1:
                span = span1
            if block_b == 2:
                span = span2
            if block_b == 3:
                span = span3
            if block_b * BC < length:
                _sub_chunk_key_tile(q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr + key_offset,
                                    dk_ptr + key_offset, dg_ptr, q_all, k_all, g_all, kc, stride_qt, stride_qk,
                                    stride_kt, stride_kk, start, length, block_b, span, HV, K, factor_limit,
                                    dot_dtype, BT, BC, BK, DOT_PRECISION, HALF_DOTS)
    if not HALF_DOTS:
        sub = tl.arange(0, BC)
        for block_b in tl.static_range(BT // BC):
            first = block_b * BC
            if first < length:
                last = tl.minimum(first + BC, length) - 1
                span = _sub_chunk_span(cum_ptr, start + first, start + last, HV, K, BK)
                if span > factor_limit:
                    rows_b = first + sub
                    valid_b = rows_b < length
                    _split_diagonal_backward(
                        q_ptr, k_ptr, cum_ptr, dq_ptr + key_offset, dk_ptr + key_offset, dg_ptr,
                        _load_rows(dscores_ptr, start + rows_b, rows_b, HV * BT, 1, valid_b, BT),
                        _load_rows(dkdot_ptr, start + rows_b, rows_b, HV * BT, 1, valid_b, BT),
                        start + first, length - first, stride_qt, stride_qk, stride_kt, stride_kk, HV, K,
                        dot_dtype, BC, BK, DOT_PRECISION)


ORIGINAL_LAUNCH = chunk_kernels.launch_scores_backward


def chunk_launch(warps: int, block_k: int | None, kernel=None):
    def launch(plan, q, k, cum, dkdot, dscores, dq_heads, dk_heads, dcum, num_chunks, table, seqlens):
        if plan.problem.gate != "channel":
            return ORIGINAL_LAUNCH(plan, q, k, cum, dkdot, dscores, dq_heads, dk_heads, dcum, num_chunks, table,
                                   seqlens)
        problem = plan.problem
        chunk = plan.chunk_size
        plan.launch(kernel or _chunk_scores_backward_kernel)[(num_chunks, problem.value_heads)](
            q, k, cum, dkdot, dscores, dq_heads, dk_heads, dcum, *q.stride(), *k.stride(), table, seqlens,
            problem.time, plan.chunks_per_row, problem.value_heads, problem.group_size, problem.key_dim,
            float(score_kernels.FACTOR_SPAN_LIMIT), BT=chunk, BC=min(chunk, SUB_CHUNK),
            BK=min(score_kernels.scores_block_k(plan), block_k or 256), IS_VARLEN=plan.varlen,
            DOT_PRECISION=plan.dot_precision, HALF_DOTS=plan.scores_half_dots, num_warps=warps,
        )
    return launch


def apply(variant: str) -> None:
    if variant == "sub":
        chunk_kernels.launch_scores_backward = ORIGINAL_LAUNCH
    elif variant.startswith(("chunk-w", "tiles-w")):
        parts = variant.split("-")
        block_k = int(parts[2][2:]) if len(parts) > 2 else None
        kernel = _chunk_tiles_scores_backward_kernel if parts[0] == "tiles" else None
        chunk_kernels.launch_scores_backward = chunk_launch(int(parts[1][1:]), block_k, kernel)
    else:
        raise ValueError(variant)


def check(repeats: int) -> list[str]:
    import test_delta_rule_chunk as t

    cases = [c for c in t.KERNEL_CASES + t.NARROW_SWEEP_CASES if c[2] == "channel"]
    failures = check_cases(cases, repeats)
    limit = score_kernels.FACTOR_SPAN_LIMIT
    score_kernels.FACTOR_SPAN_LIMIT = 0.0  # every diagonal block split
    try:
        failures += [f"split: {line}" for line in check_cases(cases, 1)]
    finally:
        score_kernels.FACTOR_SPAN_LIMIT = limit
    return failures


def time_variant(shape: str) -> str:
    ms, kernels = time_step(*delta_rule_step("kda", shape), ("scores_backward",))
    return f"kda fwd+bwd {ms:.3f} ms, scores backward {kernels['scores_backward']:.3f} ms"

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="sub,chunk-w4,chunk-w8,chunk-w4-bk32,tiles-w8-bk32")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--time-shapes", default="B1T32768H16D128,B4T4096H16D128")
    a = p.parse_args()
    check_then_time(a.variants.split(","), apply, lambda: check(a.repeats), time_variant, a.time_shapes.split(","),
                    reference="sub")

if __name__ == "__main__":
    main()
