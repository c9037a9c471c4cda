"""Step 2 of the forward (decayed_scores) and its backward (decayed_scores_backward): the chunk's
pairwise products under the gates' decays,

    Kdot[t,s] = sum_c k_t k_s e^(G_t-G_s)  (s < t)        P[t,s] = sum_c q_t k_s e^(G_t-G_s)  (s <= t)

stored fp32 [B, T, HV, BT] (row t of a chunk against the chunk's columns). Kdot feeds the WY solve
(wy.py), P the output (output.py) and state_backward (state.py).

Without per-channel gates the decays are one [BT, BT] tile and a program takes the whole chunk.
Per-channel decays cannot be factored over a whole chunk without overflow: a program takes the rows of
one sub-chunk (plan.SUB_CHUNK) and factors every block left of the diagonal through a row of that
sub-chunk (both factors <= 1), the diagonal block too while the sub-chunk's gate span allows it
(FACTOR_SPAN_LIMIT); past it the diagonal block is summed exactly, one column per step.
"""

from __future__ import annotations

import torch

from .plan import GATE_CODES, SUB_CHUNK, Plan, block_size

from .._triton import tl, triton

# The score kernels factor a diagonal sub-chunk block too, through its first (or last) row,
# while the sub-chunk's gate span (max over channels of G_first - G_last) is at most this: the
# factors inside the block then stay <= e^40 (~2e17), far from fp32's and bf16's overflow
# (fp16 products take fp32 operands there: Plan.scores_half_dots). Past it the block is summed
# exactly, one column per step. Read at call time: tests set it to 0 (always exact) or inf.
FACTOR_SPAN_LIMIT = 40.0


if triton is not None:
    from .tiles import (_dot, _gate_offset, _load_rows, _load_stored_rows, _load_vector, _row_chunk_coords, _store_rows,
                        _varlen_chunk_coords)

    @triton.jit
    def _diagonal_column(k_ptr, cum_ptr, start, s, length, kc, rows, row_valid, g_rows, stride_kt, stride_kk,
                         HV, K):
        """Per-channel gates inside a diagonal sub-chunk block: key s (chunk-local), the rows that
        see it (t >= s) and their exact decays e^(G_t - G_s) (0 for the others)."""
        s_valid = s < length
        k_s = _load_vector(k_ptr, start + s, kc, stride_kt, stride_kk, s_valid, K)
        g_s = _load_vector(cum_ptr, start + s, kc, HV * K, 1, s_valid, K)
        visible = (rows >= s) & row_valid
        decay = tl.exp(tl.where(visible[:, None], g_rows - g_s[None, :], float("-inf")))
        return k_s, decay, visible

    @triton.jit
    def _decayed_scores_kernel(
        q_ptr, k_ptr, cum_ptr, kdot_ptr, scores_ptr,
        stride_qb, stride_qt, stride_qh, stride_qk,
        stride_kb, stride_kt, stride_kh, stride_kk,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, factor_limit,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        BK: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        HALF_DOTS: tl.constexpr,
    ):
        """The rows of sub-chunk i of Kdot (s < t) and P (s <= t), against all the chunk's columns.

        Without per-channel gates the sub-chunk is the whole chunk (BC == BT). With them, every
        block left of the diagonal and, while the gate span of sub-chunk i allows it, the diagonal
        block too is one product, factored through the first row r of sub-chunk i:
        e^(G_t - G_s) = e^(G_t - G_r) e^(G_r - G_s). The first factor is <= 1; the second is <= 1
        left of the diagonal and <= e^span inside it (span = max over channels of G_r - G_last of
        the sub-chunk). Past `factor_limit` the diagonal block is summed exactly, one column per
        step, instead. Outputs are fp32 [B, T, HV, BT]: row t of a chunk holds its scores
        against the chunk's columns.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        factor_limit = tl.cast(factor_limit, tl.float32)
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        block_i = tl.program_id(2)
        if IS_VARLEN:
            batch, start, length = _varlen_chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, BT)
        else:
            batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
        key_head = head // GROUP
        q_ptr += batch * stride_qb + key_head * stride_qh
        k_ptr += batch * stride_kb + key_head * stride_kh
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)

        sub = tl.arange(0, BC)
        local = tl.arange(0, BT)
        rows = block_i * BC + sub
        row_valid = rows < length
        col_valid = local < length
        first = block_i * BC
        # No stored intermediate here to take the products' dtype from: HALF_DOTS says whether they
        # are half (then q and k are in the intermediates' dtype).
        dot_dtype = k_ptr.dtype.element_ty if HALF_DOTS else tl.float32
        kdot = tl.zeros([BC, BT], dtype=tl.float32)
        scores = tl.zeros([BC, BT], dtype=tl.float32)
        # The exact diagonal blocks add up apart from the products' accumulators and join them after
        # the loop: on the H100 (Triton 3.6) adding to a tensor-core accumulator inside the runtime
        # branch gave wrong scores (relative error ~300 in o, tf32 and half products; the CPU
        # interpreter and exact fp32 products were right).
        kdot_exact = tl.zeros([BC, BT], dtype=tl.float32)
        scores_exact = tl.zeros([BC, BT], dtype=tl.float32)
        if first < length:
            for k0 in range(0, K, BK):
                kc = k0 + tl.arange(0, BK)
                if GATE == 2:
                    q_i = _load_rows(q_ptr, start + rows, kc, stride_qt, stride_qk, row_valid, K)
                    k_i = _load_rows(k_ptr, start + rows, kc, stride_kt, stride_kk, row_valid, K)
                    g_i = _load_rows(cum_ptr, start + rows, kc, HV * K, 1, row_valid, K)
                    k_all = _load_rows(k_ptr, start + local, kc, stride_kt, stride_kk, col_valid, K)
                    g_all = _load_rows(cum_ptr, start + local, kc, HV * K, 1, col_valid, K)
                    g_first = _load_vector(cum_ptr, start + first, kc, HV * K, 1, first < length, K)
                    g_last = _load_vector(cum_ptr, start + tl.minimum(first + BC, length) - 1, kc, HV * K, 1,
                                          first < length, K)
                    span = tl.max(g_first - g_last, axis=0)
                    factored_end = tl.where(span <= factor_limit, first + BC, first)
                    col_decay = tl.exp(tl.where((local < factored_end)[:, None] & col_valid[:, None],
                                                g_first[None, :] - g_all, float("-inf")))
                    row_decay = tl.exp(tl.where(row_valid[:, None], g_i - g_first[None, :], 0.0))
                    k_cols = tl.trans(k_all * col_decay)
                    kdot += _dot(k_i * row_decay, k_cols, dot_dtype, DOT_PRECISION)
                    scores += _dot(q_i * row_decay, k_cols, dot_dtype, DOT_PRECISION)
                    if span > factor_limit:
                        for c in range(BC):
                            k_s, decay, _ = _diagonal_column(
                                k_ptr, cum_ptr, start, first + c, length, kc, rows, row_valid, g_i,
                                stride_kt, stride_kk, HV, K)
                            weighted = k_s[None, :] * decay
                            column = local[None, :] == first + c
                            kdot_exact += tl.where(column, tl.sum(k_i * weighted, axis=1)[:, None], 0.0)
                            scores_exact += tl.where(column, tl.sum(q_i * weighted, axis=1)[:, None], 0.0)
                else:
                    q_i = _load_stored_rows(q_ptr, start + rows, kc, stride_qt, stride_qk, row_valid, K)
                    k_i = _load_stored_rows(k_ptr, start + rows, kc, stride_kt, stride_kk, row_valid, K)
                    k_all = _load_stored_rows(k_ptr, start + local, kc, stride_kt, stride_kk, col_valid, K)
                    kdot += _dot(k_i, tl.trans(k_all), dot_dtype, DOT_PRECISION)
                    scores += _dot(q_i, tl.trans(k_all), dot_dtype, DOT_PRECISION)
            if GATE == 1:
                g_i = tl.load(cum_ptr + (start + rows) * HV, mask=row_valid, other=0.0)
                g_j = tl.load(cum_ptr + (start + local) * HV, mask=col_valid, other=0.0)
                visible = (rows[:, None] >= local[None, :]) & row_valid[:, None] & col_valid[None, :]
                decay = tl.exp(tl.where(visible, g_i[:, None] - g_j[None, :], float("-inf")))
                kdot *= decay
                scores *= decay
        kdot = tl.where(rows[:, None] > local[None, :], kdot + kdot_exact, 0.0)
        scores = tl.where(rows[:, None] >= local[None, :], scores + scores_exact, 0.0)
        out_offset = (batch * T) * HV * BT + head * BT
        _store_rows(kdot_ptr + out_offset, kdot, start + rows, local, HV * BT, 1, row_valid, BT)
        _store_rows(scores_ptr + out_offset, scores, start + rows, local, HV * BT, 1, row_valid, BT)

    @triton.jit
    def _whole_chunk_scores_backward(
        q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
        stride_qt, stride_qk, stride_kt, stride_kk,
        start, length, key_offset, HV, K, dot_dtype,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """No gate or a scalar one: the decays of Kdot and P are one [BT, BT] tile, applied to
        dKdot and dP once; each key tile then takes four products (rows: dP K, dKdot K;
        columns: dKdot^T K + dP^T Q)."""
        local = tl.arange(0, BT)
        valid = local < length
        tokens = start + local
        dkdot = _load_rows(dkdot_ptr, tokens, local, HV * BT, 1, valid, BT)
        dscores = _load_rows(dscores_ptr, tokens, local, HV * BT, 1, valid, BT)
        if GATE == 1:
            g = tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0)
            visible = (local[:, None] >= local[None, :]) & valid[:, None] & valid[None, :]
            decay = tl.exp(tl.where(visible, g[:, None] - g[None, :], float("-inf")))
            dkdot *= decay
            dscores *= decay
        dkdot = dkdot.to(dot_dtype)
        dscores = dscores.to(dot_dtype)
        dg_scalar = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            q_tile = _load_stored_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            k_tile = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            # dq first, then dk: fewer [BT, BK] tiles live at once.
            dq_pair = _dot(dscores, k_tile, dot_dtype, DOT_PRECISION)
            if GATE == 1:
                dg_scalar += tl.sum(q_tile.to(tl.float32) * dq_pair, axis=1)
            dq = _load_rows(dq_ptr + key_offset, tokens, kc, HV * K, 1, valid, K) + dq_pair
            _store_rows(dq_ptr + key_offset, dq, tokens, kc, HV * K, 1, valid, K)
            dk_rows = _dot(dkdot, k_tile, dot_dtype, DOT_PRECISION)
            dk_cols = _dot(tl.trans(dkdot), k_tile, dot_dtype, DOT_PRECISION)
            dk_cols += _dot(tl.trans(dscores), q_tile, dot_dtype, DOT_PRECISION)
            if GATE == 1:
                dg_scalar += tl.sum(k_tile.to(tl.float32) * (dk_rows - dk_cols), axis=1)
            dk = _load_rows(dk_ptr + key_offset, tokens, kc, HV * K, 1, valid, K) + dk_rows + dk_cols
            _store_rows(dk_ptr + key_offset, dk, tokens, kc, HV * K, 1, valid, K)
        if GATE == 1:
            dg_ptrs = dg_ptr + tokens * HV
            tl.store(dg_ptrs, tl.load(dg_ptrs, mask=valid, other=0.0) + dg_scalar, mask=valid)

    @triton.jit
    def _sub_chunk_scores_backward(
        q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
        stride_qt, stride_qk, stride_kt, stride_kk,
        start, length, key_offset, block_b, HV, K, factor_limit, dot_dtype,
        BT: tl.constexpr,
        BC: tl.constexpr,
        BK: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Per-channel gates, rows of sub-chunk b: its row role (dP[t,s] k_s and dKdot[t,s] k_s
        for s <= t) and its column role (dk_s += sum_t (dKdot[t,s] k_t + dP[t,s] q_t) e^(G_t - G_s)),
        each one product over the whole chunk.

        The row role is factored through the first row r of b (e^(G_t - G_r) e^(G_r - G_s)), the
        column role through its last row e (e^(G_t - G_e) e^(G_e - G_s)): every factor is <= 1 off
        the diagonal block and <= e^span inside it, as in decayed_scores. Past `factor_limit` the
        products leave the diagonal block (b, b) out and it is summed exactly, one column s per
        step: e^(G_t - G_s) for the rows t >= s of the block serves both roles of column s.
        """
        sub = tl.arange(0, BC)
        local = tl.arange(0, BT)
        rows_b = block_b * BC + sub
        valid_b = rows_b < length
        tokens_b = start + rows_b
        valid = local < length
        tokens = start + local
        first = block_b * BC
        last = tl.minimum(first + BC, length) - 1
        # dP and dKdot are stored lower triangular (zero where s > t): the products need no mask.
        dscores_rows = _load_rows(dscores_ptr, tokens_b, local, HV * BT, 1, valid_b, BT).to(dot_dtype)
        dkdot_rows = _load_rows(dkdot_ptr, tokens_b, local, HV * BT, 1, valid_b, BT).to(dot_dtype)
        dscores_cols = tl.trans(_load_rows(dscores_ptr, tokens, rows_b, HV * BT, 1, valid, BT)).to(dot_dtype)
        dkdot_cols = tl.trans(_load_rows(dkdot_ptr, tokens, rows_b, HV * BT, 1, valid, BT)).to(dot_dtype)
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            q_b = _load_rows(q_ptr, tokens_b, kc, stride_qt, stride_qk, valid_b, K)
            k_b = _load_rows(k_ptr, tokens_b, kc, stride_kt, stride_kk, valid_b, K)
            g_b = _load_rows(cum_ptr, tokens_b, kc, HV * K, 1, valid_b, K)
            q_all = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            k_all = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            g_all = _load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K)
            g_first = _load_vector(cum_ptr, start + first, kc, HV * K, 1, first < length, K)
            g_last = _load_vector(cum_ptr, start + last, kc, HV * K, 1, first < length, K)
            span = tl.max(g_first - g_last, axis=0)
            factored = span <= factor_limit
            # Row role: columns left of b, and b's own while factored.
            col_end = tl.where(factored, first + BC, first)
            col_decay = tl.exp(tl.where(((local < col_end) & valid)[:, None], g_first[None, :] - g_all, float("-inf")))
            k_cols = k_all * col_decay
            row_decay = tl.exp(tl.where(valid_b[:, None], g_b - g_first[None, :], 0.0))
            dq_pair = row_decay * _dot(dscores_rows, k_cols, dot_dtype, DOT_PRECISION)
            dk_rows = row_decay * _dot(dkdot_rows, k_cols, dot_dtype, DOT_PRECISION)
            # Column role: rows below b, and b's own while factored.
            row_begin = tl.where(factored, first, first + BC)
            to_last = tl.exp(tl.where(((local >= row_begin) & valid)[:, None], g_all - g_last[None, :], float("-inf")))
            pulled = _dot(dkdot_cols, k_all * to_last, dot_dtype, DOT_PRECISION)
            pulled += _dot(dscores_cols, q_all * to_last, dot_dtype, DOT_PRECISION)
            dk_cols = tl.exp(tl.where(valid_b[:, None], g_last[None, :] - g_b, 0.0)) * pulled
            # Apart from the products' results, as in decayed_scores (a Triton 3.6 miscompile on the H100).
            dq_exact = tl.zeros([BC, BK], dtype=tl.float32)
            dk_rows_exact = tl.zeros([BC, BK], dtype=tl.float32)
            dk_cols_exact = tl.zeros([BC, BK], dtype=tl.float32)
            if span > factor_limit:
                for c in range(BC):
                    s = first + c
                    k_s, decay, visible = _diagonal_column(k_ptr, cum_ptr, start, s, length, kc, rows_b, valid_b,
                                                           g_b, stride_kt, stride_kk, HV, K)
                    dkdot_s = tl.load(dkdot_ptr + tokens_b * (HV * BT) + s, mask=visible, other=0.0)
                    dscores_s = tl.load(dscores_ptr + tokens_b * (HV * BT) + s, mask=visible, other=0.0)
                    dq_exact += dscores_s[:, None] * (k_s[None, :] * decay)
                    dk_rows_exact += dkdot_s[:, None] * (k_s[None, :] * decay)
                    pulled_s = tl.sum((dkdot_s[:, None] * k_b + dscores_s[:, None] * q_b) * decay, axis=0)
                    dk_cols_exact += tl.where(sub[:, None] == c, pulled_s[None, :], 0.0)
            dq_pair += dq_exact
            dk_rows += dk_rows_exact
            dk_cols += dk_cols_exact
            dq = _load_rows(dq_ptr + key_offset, tokens_b, kc, HV * K, 1, valid_b, K) + dq_pair
            dk = _load_rows(dk_ptr + key_offset, tokens_b, kc, HV * K, 1, valid_b, K) + dk_rows + dk_cols
            _store_rows(dq_ptr + key_offset, dq, tokens_b, kc, HV * K, 1, valid_b, K)
            _store_rows(dk_ptr + key_offset, dk, tokens_b, kc, HV * K, 1, valid_b, K)
            dg = _load_rows(dg_ptr, tokens_b, kc, HV * K, 1, valid_b, K)
            dg += q_b * dq_pair + k_b * (dk_rows - dk_cols)
            _store_rows(dg_ptr, dg, tokens_b, kc, HV * K, 1, valid_b, K)

    @triton.jit
    def _decayed_scores_backward_kernel(
        q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
        stride_qb, stride_qt, stride_qh, stride_qk,
        stride_kb, stride_kt, stride_kh, stride_kk,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, factor_limit,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        BK: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        HALF_DOTS: tl.constexpr,
    ):
        """Adds the gradients through Kdot and P to dq, dk, dG for the rows of sub-chunk b.

        Kdot[t,s] and P[t,s] pair row t with column s through e^(G_t - G_s), so sub-chunk b
        collects its row role (blocks (b, j <= b)) and its column role (blocks (i >= b, b)),
        and dG_t = q_t dq_t + k_t dk_t(rows) - k_t dk_t(columns) per channel. Without
        per-channel gates the sub-chunk is the whole chunk (BC == BT).
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        factor_limit = tl.cast(factor_limit, tl.float32)
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        block_b = tl.program_id(2)
        if IS_VARLEN:
            batch, start, length = _varlen_chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, BT)
        else:
            batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
        key_head = head // GROUP
        q_ptr += batch * stride_qb + key_head * stride_qh
        k_ptr += batch * stride_kb + key_head * stride_kh
        gate_offset = _gate_offset(batch, head, T, HV, K, GATE)
        cum_ptr += gate_offset
        dg_ptr += gate_offset
        square_ptr_offset = (batch * T) * HV * BT + head * BT
        dkdot_ptr += square_ptr_offset
        dscores_ptr += square_ptr_offset
        key_offset = (batch * T) * HV * K + head * K
        # As in decayed_scores: with HALF_DOTS, q and k are in the intermediates' dtype.
        dot_dtype = k_ptr.dtype.element_ty if HALF_DOTS else tl.float32
        if block_b * BC < length:
            if GATE == 2:
                _sub_chunk_scores_backward(
                    q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
                    stride_qt, stride_qk, stride_kt, stride_kk, start, length, key_offset, block_b, HV, K,
                    factor_limit, dot_dtype, BT, BC, BK, DOT_PRECISION,
                )
            else:
                tl.static_assert(BC == BT, "without per-channel gates the sub-chunk is the whole chunk")
                _whole_chunk_scores_backward(
                    q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
                    stride_qt, stride_qk, stride_kt, stride_kk, start, length, key_offset, HV, K,
                    dot_dtype, GATE, BT, BK, DOT_PRECISION,
                )


# The warps below were timed with benchmarks/tune_delta_rule.py (H100, Triton 3.6, B4 T4096 H16
# K128 bf16, whole forward+backward, one kernel's options changed at a time; 2026-11-22).
def _scores_warps(gate: str, backward: bool) -> int:
    """num_warps of decayed_scores (backward=False) and decayed_scores_backward. Without per-channel
    gates a program holds the whole chunk's [BT, BT] scores, and in the backward dKdot and dP next
    to four [BT, BK] products (at BT = BK = 64, sm_90, Triton 3.8, 4 warps spilled 264 bytes per
    thread, 8 none). With them a program holds [BC, BT] rows and [BT, BK] tiles: 4 warps were 2 %
    (forward) and 5-6 % (backward) faster than 8 over the whole step, although the backward then
    spills 32 bytes."""
    return 8 if backward and gate != "channel" else 4


def _scores_block_k(plan: Plan) -> int:
    """BK of the score kernels: with per-channel gates and fp32 inputs (exact fp32 products, no
    tensor cores) 64 spilled in decayed_scores (sm_90, Triton 3.8, 8 warps: 72 bytes); 32 does not."""
    block_k = block_size(plan.problem.key_dim)
    if plan.gate_code == GATE_CODES["channel"] and plan.input_dtype == torch.float32:
        return min(block_k, 32)
    return block_k


def _score_launch(plan: Plan, num_chunks: int, table, seqlens, backward: bool):
    """(grid, trailing arguments and constants) of the two score kernels over `num_chunks` chunks
    of `table`: one program per chunk, value head and row sub-chunk."""
    problem = plan.problem
    chunk = plan.chunk_size
    sub_chunk = SUB_CHUNK if problem.gate == "channel" else chunk
    grid = (num_chunks, problem.value_heads, chunk // sub_chunk)
    args = (table, seqlens, problem.time, plan.chunks_per_row, problem.value_heads, problem.group_size,
            problem.key_dim, float(FACTOR_SPAN_LIMIT))
    constants = dict(GATE=plan.gate_code, BT=chunk, BC=sub_chunk, BK=_scores_block_k(plan), IS_VARLEN=plan.varlen,
                     DOT_PRECISION=plan.dot_precision, HALF_DOTS=plan.scores_half_dots,
                     num_warps=_scores_warps(problem.gate, backward))
    return grid, args, constants


def launch_decayed_scores(plan: Plan, q, k, cum, kdot, scores, num_chunks: int, table, seqlens) -> None:
    """decayed_scores (chunk.py's forward and CP's share it)."""
    grid, args, constants = _score_launch(plan, num_chunks, table, seqlens, backward=False)
    plan.launch(_decayed_scores_kernel)[grid](q, k, cum, kdot, scores, *q.stride(), *k.stride(), *args, **constants)


def launch_scores_backward(plan: Plan, q, k, cum, dkdot, dscores, dq_heads, dk_heads, dcum, num_chunks: int,
                           table, seqlens) -> None:
    """decayed_scores_backward (chunk.py's backward and CP's)."""
    grid, args, constants = _score_launch(plan, num_chunks, table, seqlens, backward=True)
    plan.launch(_decayed_scores_backward_kernel)[grid](q, k, cum, dkdot, dscores, dq_heads, dk_heads, dcum, *q.stride(),
                                          *k.stride(), *args, **constants)
