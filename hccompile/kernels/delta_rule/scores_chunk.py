"""decayed_scores for per-channel gates with one program per chunk (plan.CHUNK_SCORE_PROGRAMS, the default):
the same Kdot and P as scores.py's _decayed_scores_kernel, whose grid takes one program per row
sub-chunk and so loads the chunk's key and gate tiles ([BT, BK], the gates fp32) once per sub-chunk.
Here a program loads them once per key tile and forms every sub-chunk's rows from them:

    Kdot[t,s] = sum_c k_t k_s e^(G_t-G_s)  (s < t)        P[t,s] = sum_c q_t k_s e^(G_t-G_s)  (s <= t)

Each sub-chunk's rows are factored through its first row exactly as scores.py does (both factors
<= 1 left of the diagonal; the diagonal block while the sub-chunk's gate span is at most the factor
limit, split by scores._split_diagonal_scores past it), so the two kernels store the same values.
The reference is reference.intra_chunk_matrices_ref.
"""

from __future__ import annotations

from . import scores as score_kernels
from .plan import SUB_CHUNK, Plan

from .._triton import tl, triton

if triton is not None:
    from .scores import _split_diagonal_scores, _store_columns, _sub_chunk_products, _sub_chunk_span
    from .tiles import _gate_offset, _load_rows, _row_chunk_coords, _varlen_chunk_coords

    @triton.jit
    def _store_sub_chunk(q_ptr, k_ptr, cum_ptr, kdot_ptr, scores_ptr, kdot, scores, start, length, first,
                         span, factor_limit, stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype,
                         BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Stores one sub-chunk's rows; past the factor limit its diagonal block is split and stored
        apart (at the addresses the masked store below leaves out), as scores.py's kernel does."""
        sub = tl.arange(0, BC)
        local = tl.arange(0, BT)
        rows = first + sub
        row_valid = rows < length
        factored_end = tl.where(span <= factor_limit, first + BC, first)
        if span > factor_limit:
            _split_diagonal_scores(q_ptr, k_ptr, cum_ptr, kdot_ptr, scores_ptr, start + first, length - first,
                                   first + sub, stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype,
                                   BT, BC, BK, DOT_PRECISION)
        kdot = tl.where(rows[:, None] > local[None, :], kdot, 0.0)
        scores = tl.where(rows[:, None] >= local[None, :], scores, 0.0)
        factored_cols = (local < factored_end) | (local >= first + BC)
        _store_columns(kdot_ptr, kdot, start + rows, local, HV * BT, row_valid, factored_cols)
        _store_columns(scores_ptr, scores, start + rows, local, HV * BT, row_valid, factored_cols)

    @triton.jit
    def _chunk_scores_kernel(
        q_ptr, k_ptr, cum_ptr, kdot_ptr, scores_ptr,
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
        """Kdot and P of one chunk and value head, per-channel gates: its NS = BT / BC <= 4 sub-chunks'
        rows side by side, each key tile of the chunk loaded once for all of them."""
        tl.static_assert(BT // BC <= 4, "at most four sub-chunks per chunk")
        NS: tl.constexpr = BT // BC
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
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
        cum_ptr += _gate_offset(batch, head, T, HV, K, 2)
        out_offset = (batch * T) * HV * BT + head * BT
        kdot_ptr += out_offset
        scores_ptr += out_offset
        dot_dtype = k_ptr.dtype.element_ty if HALF_DOTS else tl.float32

        local = tl.arange(0, BT)
        col_valid = local < length
        last = start + length - 1
        span0 = _sub_chunk_span(cum_ptr, start, tl.minimum(start + BC - 1, last), HV, K, BK)
        end0 = tl.where(span0 <= factor_limit, BC, 0)
        kdot0 = tl.zeros([BC, BT], dtype=tl.float32)
        scores0 = tl.zeros([BC, BT], dtype=tl.float32)
        if NS >= 2:
            span1 = _sub_chunk_span(cum_ptr, start + BC, tl.minimum(start + 2 * BC - 1, last), HV, K, BK)
            end1 = tl.where(span1 <= factor_limit, 2 * BC, BC)
            kdot1 = tl.zeros([BC, BT], dtype=tl.float32)
            scores1 = tl.zeros([BC, BT], dtype=tl.float32)
        if NS >= 4:
            span2 = _sub_chunk_span(cum_ptr, start + 2 * BC, tl.minimum(start + 3 * BC - 1, last), HV, K, BK)
            span3 = _sub_chunk_span(cum_ptr, start + 3 * BC, tl.minimum(start + 4 * BC - 1, last), HV, K, BK)
            end2 = tl.where(span2 <= factor_limit, 3 * BC, 2 * BC)
            end3 = tl.where(span3 <= factor_limit, 4 * BC, 3 * BC)
            kdot2 = tl.zeros([BC, BT], dtype=tl.float32)
            scores2 = tl.zeros([BC, BT], dtype=tl.float32)
            kdot3 = tl.zeros([BC, BT], dtype=tl.float32)
            scores3 = tl.zeros([BC, BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            k_all = _load_rows(k_ptr, start + local, kc, stride_kt, stride_kk, col_valid, K)
            g_all = _load_rows(cum_ptr, start + local, kc, HV * K, 1, col_valid, K)
            kd, sc = _sub_chunk_products(q_ptr, k_ptr, cum_ptr, start, length, 0, end0, kc, k_all, g_all,
                                         stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BT, BC,
                                         DOT_PRECISION)
            kdot0 += kd
            scores0 += sc
            if NS >= 2:
                kd, sc = _sub_chunk_products(q_ptr, k_ptr, cum_ptr, start, length, BC, end1, kc, k_all, g_all,
                                             stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BT, BC,
                                             DOT_PRECISION)
                kdot1 += kd
                scores1 += sc
            if NS >= 4:
                kd, sc = _sub_chunk_products(q_ptr, k_ptr, cum_ptr, start, length, 2 * BC, end2, kc, k_all,
                                             g_all, stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype,
                                             BT, BC, DOT_PRECISION)
                kdot2 += kd
                scores2 += sc
                kd, sc = _sub_chunk_products(q_ptr, k_ptr, cum_ptr, start, length, 3 * BC, end3, kc, k_all,
                                             g_all, stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype,
                                             BT, BC, DOT_PRECISION)
                kdot3 += kd
                scores3 += sc
        _store_sub_chunk(q_ptr, k_ptr, cum_ptr, kdot_ptr, scores_ptr, kdot0, scores0, start, length, 0, span0,
                         factor_limit, stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BT, BC, BK,
                         DOT_PRECISION)
        if NS >= 2:
            _store_sub_chunk(q_ptr, k_ptr, cum_ptr, kdot_ptr, scores_ptr, kdot1, scores1, start, length, BC, span1,
                             factor_limit, stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BT, BC,
                             BK, DOT_PRECISION)
        if NS >= 4:
            _store_sub_chunk(q_ptr, k_ptr, cum_ptr, kdot_ptr, scores_ptr, kdot2, scores2, start, length, 2 * BC,
                             span2, factor_limit, stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BT,
                             BC, BK, DOT_PRECISION)
            _store_sub_chunk(q_ptr, k_ptr, cum_ptr, kdot_ptr, scores_ptr, kdot3, scores3, start, length, 3 * BC,
                             span3, factor_limit, stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BT,
                             BC, BK, DOT_PRECISION)


# Options untimed (the layout was: plan.CHUNK_SCORE_PROGRAMS). Compiled for sm_90 on the CPU (Triton 3.6,
# KDA K 128 bf16, benchmarks' specialization): BK 64 spilled at 4 and 8 warps (255 registers, 80 / 64 bytes); BK 32 at 4 warps 240 registers and none (two
# programs per SM, as scores.py's kernel at 192), at 8 warps 250, at 2 warps 40 bytes of spills; BK 16
# at 4 warps 192 registers.
CHUNK_SCORES_WARPS = 4
# The key tile's widest (scores.py's otherwise: 64 at K >= 64).
CHUNK_SCORES_BLOCK_K = 32


def launch_chunk_scores(plan: Plan, q, k, cum, kdot, scores, num_chunks: int, table, seqlens) -> None:
    """_chunk_scores_kernel over `num_chunks` chunks of `table`: one program per chunk and value head."""
    problem = plan.problem
    chunk = plan.chunk_size
    plan.launch(_chunk_scores_kernel)[(num_chunks, problem.value_heads)](
        q, k, cum, kdot, scores, *q.stride(), *k.stride(), table, seqlens, problem.time, plan.chunks_per_row,
        problem.value_heads, problem.group_size, problem.key_dim, float(score_kernels.FACTOR_SPAN_LIMIT),
        BT=chunk, BC=min(chunk, SUB_CHUNK), BK=min(score_kernels.scores_block_k(plan), CHUNK_SCORES_BLOCK_K),
        IS_VARLEN=plan.varlen, DOT_PRECISION=plan.dot_precision, HALF_DOTS=plan.scores_half_dots,
        num_warps=CHUNK_SCORES_WARPS,
    )
