"""Step 2 of the forward (decayed_scores) and its backward (decayed_scores_backward): the chunk's
pairwise products under the gates' decays,

    Kdot[t,s] = sum_c k_t k_s e^(G_t-G_s)  (s < t)        P[t,s] = sum_c q_t k_s e^(G_t-G_s)  (s <= t)

stored fp32 [B, T, HV, BT] (row t of a chunk against the chunk's columns). Kdot feeds the WY solve
(wy.py), P the output (output.py) and state_backward (state.py). Without per-channel gates the forward
launches this kernel only with plan.FUSED_SCORES_FORWARD off: wy_solve and the output kernel form
them otherwise.

Without per-channel gates the decays are one [BT, BT] tile and a program takes the whole chunk.
Per-channel decays cannot be factored over a whole chunk without overflow: a program takes the rows of
one sub-chunk (plan.SUB_CHUNK) and factors every block left of the diagonal through a row of that
sub-chunk (both factors <= 1), the diagonal block too while the sub-chunk's gate span allows it
(FACTOR_SPAN_LIMIT). Past it the diagonal block is split by halving (_level_factors): each pair
(t, s), s < t, is factored through a middle row m with s < m <= t, so no factor exceeds 1 whatever
the gates, and each of the log2(BC) levels of the split is one more product per role (t = s,
decay 1, apart). Those products take the factored ones' operand dtype and precision, and their cost
does not depend on the gates' values.
"""

from __future__ import annotations

import torch

from . import plan as kernel_plan
from .plan import GATE_CODES, SUB_CHUNK, Plan, block_size

from .._triton import tl, triton

# The score kernels factor a diagonal sub-chunk block too, through its first (or last) row,
# while the sub-chunk's gate span (max over channels of G_first - G_last) is at most this: the
# factors inside the block then stay <= e^40 (~2e17), far from fp32's and bf16's overflow
# (fp16 products take fp32 operands there: Plan.scores_half_dots). Past it the block is split
# instead (_level_factors; H100, bf16, B1 T32768 H16 K128, every block split: decayed_scores 2.52
# vs 1.45 ms factored, its backward 2.73 vs 2.16 ms). The span is taken over all K channels, so a
# program factors every key tile's block or none. Read at call time: tests set it to 0 (always
# split) or inf.
FACTOR_SPAN_LIMIT = 40.0


if triton is not None:
    from .tiles import (_dot, _gate_offset, _load_rows, _load_stored_rows, _load_vector, _pair_decays,
                        _row_chunk_coords, _store_rows, _varlen_chunk_coords)

    # Levels of the diagonal blocks' split (_level_factors): SUB_CHUNK halved down to single rows.
    SPLIT_LEVELS = tl.constexpr(SUB_CHUNK.bit_length() - 1)

    @triton.jit
    def _sub_chunk_span(cum_ptr, first_token, last_token, HV, K, BK: tl.constexpr):
        """max over all K channels of G_first - G_last of one sub-chunk (first_token..last_token,
        its valid rows): factoring its diagonal block through its first or last row takes factors
        up to e^span. 0 for a sub-chunk past the end (last_token < first_token)."""
        widest = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            g_first = _load_vector(cum_ptr, first_token, kc, HV * K, 1, first_token <= last_token, K)
            g_last = _load_vector(cum_ptr, last_token, kc, HV * K, 1, first_token <= last_token, K)
            widest = tl.maximum(widest, g_first - g_last)
        return tl.max(widest, axis=0)

    @triton.jit
    def _level_factors(cum_ptr, first_token, n_valid, kc, g, HV, K, BC: tl.constexpr, HALF: tl.constexpr):
        """One level of the split of a diagonal sub-chunk block: the pairs (t, s) whose indices in
        the sub-chunk differ in no bit above HALF (a power of 2) and have it set in t, clear in s:
        t in the upper half of a 2*HALF-row group, s in its lower half. Such a pair straddles the
        group's middle row m, so e^(G_t - G_s) = e^(G_t - G_m) e^(G_m - G_s) with both factors <= 1
        (gates are <= 0). Every pair s < t is in exactly one level, HALF = BC/2, ..., 1.
        Returns e^(G_t - G_m) on the upper rows and e^(G_m - G_s) on the lower rows (each [BC, BK],
        0 on the other rows) and the level's pairs [BC, BC]. `g`: the sub-chunk's gates [BC, BK],
        `n_valid`: its valid rows (may exceed BC)."""
        sub = tl.arange(0, BC)
        upper = (sub & HALF) != 0
        lower = (sub & HALF) == 0
        # the middle of an upper row's group, or of the group a lower row is the lower half of
        middle = ((sub // HALF) | 1) * HALF
        middle_valid = middle < n_valid
        g_middle = _load_rows(cum_ptr, first_token + middle, kc, HV * K, 1, middle_valid, K)
        # one exponential per row: each row is on one side of its middle
        exponent = tl.where(upper[:, None], g - g_middle, g_middle - g)
        factor = tl.exp(tl.where((middle_valid & (sub < n_valid))[:, None], exponent, float("-inf")))
        same_group = (sub[:, None] // (2 * HALF)) == (sub[None, :] // (2 * HALF))
        return (tl.where(upper[:, None], factor, 0.0), tl.where(lower[:, None], factor, 0.0),
                same_group & upper[:, None] & lower[None, :])

    @triton.jit
    def _store_columns(ptr, value, rows, cols, stride_row, row_mask, col_mask):
        """ptr[rows, cols] = value where both masks hold."""
        ptrs = ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
        tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _split_diagonal_scores(q_ptr, k_ptr, cum_ptr, kdot_ptr, scores_ptr, first_token, n_valid, cols,
                               stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype,
                               BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Kdot and P of one sub-chunk's diagonal block [BC, BC] (`cols` its chunk-local columns),
        one product per level of _level_factors (t = s apart: its decay is 1), stored. A pass of its
        own after the main products: inside their key loop its tiles raised decayed_scores to 208
        registers (H100, Triton 3.6), 20 % slower on factored blocks too."""
        tl.static_assert(BC == 2 ** SPLIT_LEVELS, "the levels split the sub-chunk down to single rows")
        sub = tl.arange(0, BC)
        tokens = first_token + sub
        valid = sub < n_valid
        kdot = tl.zeros([BC, BC], dtype=tl.float32)
        scores = tl.zeros([BC, BC], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            q_b = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            k_b = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            g_b = _load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K)
            scores += tl.where(sub[:, None] == sub[None, :], tl.sum(q_b * k_b, axis=1)[:, None], 0.0)
            for level in tl.static_range(SPLIT_LEVELS):
                from_middle, to_middle, pairs = _level_factors(cum_ptr, first_token, n_valid, kc, g_b, HV, K, BC,
                                                               BC >> (level + 1))
                keys = tl.trans(k_b * to_middle)
                kdot += tl.where(pairs, _dot(k_b * from_middle, keys, dot_dtype, DOT_PRECISION), 0.0)
                scores += tl.where(pairs, _dot(q_b * from_middle, keys, dot_dtype, DOT_PRECISION), 0.0)
        every_col = cols >= 0
        _store_columns(kdot_ptr, kdot, tokens, cols, HV * BT, valid, every_col)
        _store_columns(scores_ptr, scores, tokens, cols, HV * BT, valid, every_col)

    @triton.jit
    def _split_diagonal_gradients(q_b, k_b, g_b, dscores, dkdot, cum_ptr, first_token, n_valid, kc, HV, K,
                                  dot_dtype, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One key tile [BC, BK] of the gradients through a sub-chunk's diagonal block of Kdot and P
        (dscores, dkdot: its [BC, BC] of dP and dKdot, fp32): the row role dP K and dKdot K, and the
        column role dKdot^T K + dP^T Q, one product each per level of _level_factors; t = s apart
        (its decay is 1). Returns (dq, dk rows, dk columns)."""
        tl.static_assert(BC == 2 ** SPLIT_LEVELS, "the levels split the sub-chunk down to single rows")
        sub = tl.arange(0, BC)
        diagonal = sub[:, None] == sub[None, :]
        dscores_self = tl.sum(tl.where(diagonal, dscores, 0.0), axis=1)
        dkdot_self = tl.sum(tl.where(diagonal, dkdot, 0.0), axis=1)
        dq = dscores_self[:, None] * k_b
        dk_rows = dkdot_self[:, None] * k_b
        dk_cols = dk_rows + dscores_self[:, None] * q_b
        for level in tl.static_range(SPLIT_LEVELS):
            from_middle, to_middle, pairs = _level_factors(cum_ptr, first_token, n_valid, kc, g_b, HV, K, BC,
                                                           BC >> (level + 1))
            dscores_level = tl.where(pairs, dscores, 0.0)
            dkdot_level = tl.where(pairs, dkdot, 0.0)
            keys = k_b * to_middle
            dq += from_middle * _dot(dscores_level, keys, dot_dtype, DOT_PRECISION)
            dk_rows += from_middle * _dot(dkdot_level, keys, dot_dtype, DOT_PRECISION)
            pulled = _dot(tl.trans(dkdot_level), k_b * from_middle, dot_dtype, DOT_PRECISION)
            pulled += _dot(tl.trans(dscores_level), q_b * from_middle, dot_dtype, DOT_PRECISION)
            dk_cols += to_middle * pulled
        return dq, dk_rows, dk_cols

    @triton.jit
    def _split_diagonal_backward(q_ptr, k_ptr, cum_ptr, dq_ptr, dk_ptr, dg_ptr, dscores, dkdot, first_token, n_valid,
                                 stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BC: tl.constexpr,
                                 BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """_split_diagonal_gradients as a pass of its own over one sub-chunk's rows of dq, dk and dG,
        after the main products have stored theirs."""
        # Each thread reads back elements other threads of this program stored.
        tl.debug_barrier()
        sub = tl.arange(0, BC)
        tokens = first_token + sub
        valid = sub < n_valid
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            q_b = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            k_b = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            g_b = _load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K)
            dq_split, dk_rows, dk_cols = _split_diagonal_gradients(q_b, k_b, g_b, dscores, dkdot, cum_ptr, first_token,
                                                                   n_valid, kc, HV, K, dot_dtype, BC, DOT_PRECISION)
            dq = _load_rows(dq_ptr, tokens, kc, HV * K, 1, valid, K) + dq_split
            dk = _load_rows(dk_ptr, tokens, kc, HV * K, 1, valid, K) + dk_rows + dk_cols
            dg = _load_rows(dg_ptr, tokens, kc, HV * K, 1, valid, K) + q_b * dq_split + k_b * (dk_rows - dk_cols)
            _store_rows(dq_ptr, dq, tokens, kc, HV * K, 1, valid, K)
            _store_rows(dk_ptr, dk, tokens, kc, HV * K, 1, valid, K)
            _store_rows(dg_ptr, dg, tokens, kc, HV * K, 1, valid, K)

    @triton.jit
    def _sub_chunk_products(q_ptr, k_ptr, cum_ptr, start, length, first, factored_end, kc, k_all, g_all,
                            stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BT: tl.constexpr,
                            BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One key tile's share of the Kdot and P rows [BC, BT] of the per-channel sub-chunk whose first
        row is `first`, factored through that row, against the chunk's columns below `factored_end` and
        right of the sub-chunk (k_all, g_all: the chunk's key and gate tiles [BT, BK], fp32, zero past
        `length`). Both layouts' products: one program per sub-chunk here, one per chunk in
        scores_chunk.py."""
        sub = tl.arange(0, BC)
        local = tl.arange(0, BT)
        rows = first + sub
        row_valid = rows < length
        q_i = _load_rows(q_ptr, start + rows, kc, stride_qt, stride_qk, row_valid, K)
        k_i = _load_rows(k_ptr, start + rows, kc, stride_kt, stride_kk, row_valid, K)
        g_i = _load_rows(cum_ptr, start + rows, kc, HV * K, 1, row_valid, K)
        g_first = _load_vector(cum_ptr, start + first, kc, HV * K, 1, first < length, K)
        col_decay = tl.exp(tl.where(((local < factored_end) & (local < length))[:, None],
                                    g_first[None, :] - g_all, float("-inf")))
        row_decay = tl.exp(tl.where(row_valid[:, None], g_i - g_first[None, :], 0.0))
        k_cols = tl.trans(k_all * col_decay)
        return (_dot(k_i * row_decay, k_cols, dot_dtype, DOT_PRECISION),
                _dot(q_i * row_decay, k_cols, dot_dtype, DOT_PRECISION))

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
        the sub-chunk). Past `factor_limit` the products leave the diagonal block out; it is split
        (_split_diagonal_scores) and stored apart. Outputs are fp32 [B, T, HV, BT]: row t of a
        chunk holds its scores against the chunk's columns.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        factor_limit = tl.cast(factor_limit, tl.float32)
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        block_i = tl.program_id(2)
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
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        out_offset = (batch * T) * HV * BT + head * BT
        kdot_ptr += out_offset
        scores_ptr += out_offset

        sub = tl.arange(0, BC)
        local = tl.arange(0, BT)
        rows = block_i * BC + sub
        row_valid = rows < length
        col_valid = local < length
        first = block_i * BC
        # The products cover the columns below factored_end and those right of the sub-chunk: all of
        # them unless the diagonal block is split.
        factored_end = first + BC
        if GATE == 2:
            span = _sub_chunk_span(cum_ptr, start + first, start + tl.minimum(first + BC, length) - 1, HV, K, BK)
            factored_end = tl.where(span <= factor_limit, first + BC, first)
        # No stored intermediate here to take the products' dtype from: HALF_DOTS says whether they
        # are half (then q and k are in the intermediates' dtype).
        dot_dtype = k_ptr.dtype.element_ty if HALF_DOTS else tl.float32
        kdot = tl.zeros([BC, BT], dtype=tl.float32)
        scores = tl.zeros([BC, BT], dtype=tl.float32)
        if first < length:
            for k0 in range(0, K, BK):
                kc = k0 + tl.arange(0, BK)
                if GATE == 2:
                    k_all = _load_rows(k_ptr, start + local, kc, stride_kt, stride_kk, col_valid, K)
                    g_all = _load_rows(cum_ptr, start + local, kc, HV * K, 1, col_valid, K)
                    kdot_part, scores_part = _sub_chunk_products(
                        q_ptr, k_ptr, cum_ptr, start, length, first, factored_end, kc, k_all, g_all,
                        stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BT, BC, DOT_PRECISION)
                    kdot += kdot_part
                    scores += scores_part
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
            if GATE == 2:
                # Stored apart from the products, at addresses the store below leaves out: on the
                # H100 (Triton 3.6) adding to a tensor-core accumulator inside a runtime branch gave
                # wrong scores (relative error ~300 in o, tf32 and half products; the CPU interpreter
                # and exact fp32 products were right).
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
        columns: dKdot^T K + dP^T Q). Launched only with plan.FUSED_SCORES_BACKWARD off:
        wy_backward adds these terms itself otherwise."""
        local = tl.arange(0, BT)
        valid = local < length
        tokens = start + local
        dkdot = _load_rows(dkdot_ptr, tokens, local, HV * BT, 1, valid, BT)
        dscores = _load_rows(dscores_ptr, tokens, local, HV * BT, 1, valid, BT)
        if GATE == 1:
            decay = _pair_decays(cum_ptr, tokens, valid, HV, BT)
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
        HALF_DOTS: tl.constexpr,
    ):
        """Per-channel gates, rows of sub-chunk b: its row role (dP[t,s] k_s and dKdot[t,s] k_s
        for s <= t) and its column role (dk_s += sum_t (dKdot[t,s] k_t + dP[t,s] q_t) e^(G_t - G_s)),
        each one product over the whole chunk.

        The row role is factored through the first row r of b (e^(G_t - G_r) e^(G_r - G_s)), the
        column role through its last row e (e^(G_t - G_e) e^(G_e - G_s)): every factor is <= 1 off
        the diagonal block and <= e^span inside it, as in decayed_scores. Past `factor_limit` the
        products leave the diagonal block (b, b) out and _split_diagonal_gradients adds it. With
        half operands it joins the main key loop; with fp32 ones (more registers) it takes a pass
        of its own after it: H100, Triton 3.6, B1 T32768 H16 K128, joined vs apart, bf16 inputs
        2.16 vs 2.14 ms factored and 2.72 vs 3.39 ms split, fp16 inputs 2.61 vs 2.43 ms factored
        (78 bytes spilled) and 3.69 vs 3.96 ms split.
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
        span = _sub_chunk_span(cum_ptr, start + first, start + last, HV, K, BK)
        factored = span <= factor_limit
        # Row role: columns left of b, and b's own while factored.
        col_end = tl.where(factored, first + BC, first)
        # Column role: rows below b, and b's own while factored.
        row_begin = tl.where(factored, first, first + BC)
        # dP and dKdot are stored lower triangular (zero where s > t): the products need no mask.
        dscores_rows = _load_rows(dscores_ptr, tokens_b, local, HV * BT, 1, valid_b, BT).to(dot_dtype)
        dkdot_rows = _load_rows(dkdot_ptr, tokens_b, local, HV * BT, 1, valid_b, BT).to(dot_dtype)
        dscores_cols = tl.trans(_load_rows(dscores_ptr, tokens, rows_b, HV * BT, 1, valid, BT)).to(dot_dtype)
        dkdot_cols = tl.trans(_load_rows(dkdot_ptr, tokens, rows_b, HV * BT, 1, valid, BT)).to(dot_dtype)
        # fp32, for a split diagonal block
        dscores_diagonal = _load_rows(dscores_ptr, tokens_b, rows_b, HV * BT, 1, valid_b, BT)
        dkdot_diagonal = _load_rows(dkdot_ptr, tokens_b, rows_b, HV * BT, 1, valid_b, BT)
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
                # Apart from the products' results, as in decayed_scores (a Triton 3.6 miscompile on
                # the H100).
                dq_split = tl.zeros([BC, BK], dtype=tl.float32)
                dk_rows_split = tl.zeros([BC, BK], dtype=tl.float32)
                dk_cols_split = tl.zeros([BC, BK], dtype=tl.float32)
                if span > factor_limit:
                    dq_split, dk_rows_split, dk_cols_split = _split_diagonal_gradients(
                        q_b, k_b, g_b, dscores_diagonal, dkdot_diagonal, cum_ptr, start + first, length - first, kc,
                        HV, K, dot_dtype, BC, DOT_PRECISION)
                dq_pair += dq_split
                dk_rows += dk_rows_split
                dk_cols += dk_cols_split
            dq = _load_rows(dq_ptr + key_offset, tokens_b, kc, HV * K, 1, valid_b, K) + dq_pair
            dk = _load_rows(dk_ptr + key_offset, tokens_b, kc, HV * K, 1, valid_b, K) + dk_rows + dk_cols
            _store_rows(dq_ptr + key_offset, dq, tokens_b, kc, HV * K, 1, valid_b, K)
            _store_rows(dk_ptr + key_offset, dk, tokens_b, kc, HV * K, 1, valid_b, K)
            dg = _load_rows(dg_ptr, tokens_b, kc, HV * K, 1, valid_b, K)
            dg += q_b * dq_pair + k_b * (dk_rows - dk_cols)
            _store_rows(dg_ptr, dg, tokens_b, kc, HV * K, 1, valid_b, K)
        if not HALF_DOTS:
            if span > factor_limit:
                _split_diagonal_backward(q_ptr, k_ptr, cum_ptr, dq_ptr + key_offset, dk_ptr + key_offset, dg_ptr,
                                         dscores_diagonal, dkdot_diagonal, start + first, length - first,
                                         stride_qt, stride_qk, stride_kt, stride_kk, HV, K, dot_dtype, BC, BK,
                                         DOT_PRECISION)

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
        CHUNK_PROGRAM: tl.constexpr,
    ):
        """Adds the gradients through Kdot and P to dq, dk, dG for the rows of sub-chunk b.

        Kdot[t,s] and P[t,s] pair row t with column s through e^(G_t - G_s), so sub-chunk b
        collects its row role (blocks (b, j <= b)) and its column role (blocks (i >= b, b)),
        and dG_t = q_t dq_t + k_t dk_t(rows) - k_t dk_t(columns) per channel. Without
        per-channel gates the sub-chunk is the whole chunk (BC == BT). CHUNK_PROGRAM (per-channel
        gates): one program per chunk takes its sub-chunks one after another (grid axis 2 of size 1),
        the second to fourth reading the chunk's q, k and G tiles from L1/L2 rather than HBM; each
        sub-chunk writes only its own rows, so the results are those of one program per sub-chunk.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        factor_limit = tl.cast(factor_limit, tl.float32)
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        block_b = tl.program_id(2)
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
        gate_offset = _gate_offset(batch, head, T, HV, K, GATE)
        cum_ptr += gate_offset
        dg_ptr += gate_offset
        square_ptr_offset = (batch * T) * HV * BT + head * BT
        dkdot_ptr += square_ptr_offset
        dscores_ptr += square_ptr_offset
        key_offset = (batch * T) * HV * K + head * K
        # As in decayed_scores: with HALF_DOTS, q and k are in the intermediates' dtype.
        dot_dtype = k_ptr.dtype.element_ty if HALF_DOTS else tl.float32
        if CHUNK_PROGRAM:
            tl.static_assert(GATE == 2, "one program per chunk is the per-channel gates' layout")
            # A loop, not unrolled: unrolled, a sub-chunk whose diagonal block splits cost the program far more
            # (one H200, B1 T32768 H16 K128, benchmarks/analysis/split_apart_proto.py: every block split 3.821
            # ms unrolled against 2.636 looped; FLA-initialised in-kernel gates, 3.5 % split, 2.215 against
            # 1.964; logsigmoid gates, none split, 1.799 against 1.894). The same results bit for bit.
            for sub_chunk in range(BT // BC):
                if sub_chunk * BC < length:
                    _sub_chunk_scores_backward(
                        q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
                        stride_qt, stride_qk, stride_kt, stride_kk, start, length, key_offset, sub_chunk, HV, K,
                        factor_limit, dot_dtype, BT, BC, BK, DOT_PRECISION, HALF_DOTS,
                    )
        elif block_b * BC < length:
            if GATE == 2:
                _sub_chunk_scores_backward(
                    q_ptr, k_ptr, cum_ptr, dkdot_ptr, dscores_ptr, dq_ptr, dk_ptr, dg_ptr,
                    stride_qt, stride_qk, stride_kt, stride_kk, start, length, key_offset, block_b, HV, K,
                    factor_limit, dot_dtype, BT, BC, BK, DOT_PRECISION, HALF_DOTS,
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


def scores_block_k(plan: Plan) -> int:
    """BK of the score kernels: with per-channel gates and fp32 inputs (exact fp32 products, no
    tensor cores) 64 spilled in decayed_scores (sm_90, Triton 3.8, 8 warps: 72 bytes); 32 does not."""
    block_k = block_size(plan.problem.key_dim)
    if plan.gate_code == GATE_CODES["channel"] and plan.input_dtype == torch.float32:
        return min(block_k, 32)
    return block_k


def _score_launch(plan: Plan, num_chunks: int, table, seqlens, backward: bool):
    """(grid, trailing arguments and constants) of the two score kernels over `num_chunks` chunks
    of `table`: one program per chunk, value head and row sub-chunk; the backward's with per-channel
    gates one per chunk and value head while plan.CHUNK_SCORE_PROGRAMS."""
    problem = plan.problem
    chunk = plan.chunk_size
    sub_chunk = SUB_CHUNK if problem.gate == "channel" else chunk
    chunk_program = backward and problem.gate == "channel" and kernel_plan.CHUNK_SCORE_PROGRAMS
    grid = (num_chunks, problem.value_heads, 1 if chunk_program else chunk // sub_chunk)
    args = (table, seqlens, problem.time, plan.chunks_per_row, problem.value_heads, problem.group_size,
            problem.key_dim, float(FACTOR_SPAN_LIMIT))
    constants = dict(GATE=plan.gate_code, BT=chunk, BC=sub_chunk, BK=scores_block_k(plan), IS_VARLEN=plan.varlen,
                     DOT_PRECISION=plan.dot_precision, HALF_DOTS=plan.scores_half_dots,
                     num_warps=_scores_warps(problem.gate, backward))
    if backward:
        constants["CHUNK_PROGRAM"] = chunk_program
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
