"""Step 3 of the forward (wy_solve) and the backward's second kernel (wy_backward): the WY form of a
chunk's delta-rule updates,

    A = (I + diag(beta) Kdot)^-1,   W = A diag(beta)(K e^G),   U~ = A diag(beta) V,

with which the state sweep (state.py) needs only U = U~ - W h per chunk. A is fp32 [BT, BT] per
chunk, lower triangular: its diagonal sub-chunk blocks come from forward substitution, the blocks
below from the block recurrence, elementwise or with exact fp32 products, because every later product
goes through it. The forward may keep A (and Kdot, P) for the backward, whose wy_solve then only
forms W and U~. Without per-channel gates (plan.fused_scores_forward) wy_solve forms L = diag(beta)
Kdot's blocks from the keys itself (FORM_KDOT), FLA's fused kkt + solve: no Kdot in memory.

wy_backward, given dU and the chunk-start state gradients, returns dv and dbeta complete, the parts of
dq, dk and dG that do not go through the pairwise decays, and dKdot and dP for decayed_scores_backward
(scores.py). Without per-channel gates (plan.FUSED_SCORES_BACKWARD) it takes the gradients through
Kdot and P itself: dq, dk and dG complete, and dKdot and dP never leave the program. There, while
plan.SPLIT_WY_BACKWARD is on, dqkw.py and wy_bwd.py do its work in two kernels instead; per-channel
gates (and FUSED_SCORES_BACKWARD off) always take this one.
"""

from __future__ import annotations

import torch

from .plan import GATE_CODES, Plan

from .._triton import tl, triton

if triton is not None:
    from .tiles import (_chunk_end_decays, _dot, _gate_offset, _load_rows, _load_stored_rows, _load_vector,
                        _pair_decays, _row_chunk_coords, _store_rows, _varlen_chunk_coords)
    from .gate_cumsum import _scalar_gate_sum

    @triton.jit
    def _substitution_step(inverse, kdot_ptr, beta_ptr, stride_bt, start, first, length, row_stride, r,
                           BC: tl.constexpr):
        """Row r of (I + L_bb)^-1, for the [BC, BC] diagonal block of L = diag(beta) Kdot whose first row is `first`.

        Forward substitution: row r of the inverse is e_r - sum_{j<r} L_rj row_j, and rows j < r
        are final once steps 1..r-1 ran on `inverse` (which starts as the identity). Row r of L is
        read from kdot (a cached [BC] load), so a step costs one [BC, BC] multiply-reduce.
        Elementwise fp32: every later product goes through this inverse. Rows past `length` stay
        unit rows.
        """
        sub = tl.arange(0, BC)
        t = first + r
        row_valid = t < length
        token = start + t
        # Columns j < r of a valid row: one block comparison (see _load_vector), no scalar splat.
        l_row = tl.load(kdot_ptr + token * row_stride + first + sub, mask=sub < tl.where(row_valid, r, 0), other=0.0)
        beta_t = tl.load(beta_ptr + token * stride_bt, mask=row_valid, other=0.0).to(tl.float32)
        new_row = -beta_t * tl.sum(l_row[:, None] * inverse, axis=0)
        return tl.where(sub[:, None] == r, inverse + new_row[None, :], inverse)

    @triton.jit
    def _register_substitution_step(inverse, lower, r, BC: tl.constexpr):
        """_substitution_step with L's diagonal block held in registers (`lower`: strictly lower,
        beta applied, zero in rows past the chunk's end): row r taken out by a masked sum, as FLA's
        solve does, instead of a load on the substitution's dependency chain."""
        sub = tl.arange(0, BC)
        l_row = tl.sum(tl.where(sub[:, None] == r, lower, 0.0), axis=0)
        new_row = -tl.sum(l_row[:, None] * inverse, axis=0)
        return tl.where(sub[:, None] == r, inverse + new_row[None, :], inverse)

    @triton.jit
    def _key_block(k_ptr, start, length, block, kc, stride_kt, stride_kk, K, BC: tl.constexpr):
        """Rows of sub-chunk `block` of a key tile [BC, BK], in k's stored dtype, zero past `length`."""
        rows = block * BC + tl.arange(0, BC)
        return _load_stored_rows(k_ptr, start + rows, kc, stride_kt, stride_kk, rows < length, K)

    @triton.jit
    def _key_products(k_ptr, start, length, stride_kt, stride_kk, K, dot_dtype, BC: tl.constexpr, BK: tl.constexpr,
                      NS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """K_i K_j^T [BC, BC] of the sub-chunks i >= j (NS <= 4 of them; zeros for pairs past NS) over
        the key dim, in one pass over the key tiles, with decayed_scores' operands (the intermediates'
        dtype, or fp32 at the plan's precision): (00, 10, 11, 20, 21, 22, 30, 31, 32, 33)."""
        kk00 = tl.zeros([BC, BC], dtype=tl.float32)
        kk10 = kk00
        kk11 = kk00
        kk20 = kk00
        kk21 = kk00
        kk22 = kk00
        kk30 = kk00
        kk31 = kk00
        kk32 = kk00
        kk33 = kk00
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            k_0 = _key_block(k_ptr, start, length, 0, kc, stride_kt, stride_kk, K, BC)
            kk00 += _dot(k_0, tl.trans(k_0), dot_dtype, DOT_PRECISION)
            if NS >= 2:
                k_1 = _key_block(k_ptr, start, length, 1, kc, stride_kt, stride_kk, K, BC)
                kk10 += _dot(k_1, tl.trans(k_0), dot_dtype, DOT_PRECISION)
                kk11 += _dot(k_1, tl.trans(k_1), dot_dtype, DOT_PRECISION)
            if NS >= 4:
                k_2 = _key_block(k_ptr, start, length, 2, kc, stride_kt, stride_kk, K, BC)
                k_3 = _key_block(k_ptr, start, length, 3, kc, stride_kt, stride_kk, K, BC)
                kk20 += _dot(k_2, tl.trans(k_0), dot_dtype, DOT_PRECISION)
                kk21 += _dot(k_2, tl.trans(k_1), dot_dtype, DOT_PRECISION)
                kk22 += _dot(k_2, tl.trans(k_2), dot_dtype, DOT_PRECISION)
                kk30 += _dot(k_3, tl.trans(k_0), dot_dtype, DOT_PRECISION)
                kk31 += _dot(k_3, tl.trans(k_1), dot_dtype, DOT_PRECISION)
                kk32 += _dot(k_3, tl.trans(k_2), dot_dtype, DOT_PRECISION)
                kk33 += _dot(k_3, tl.trans(k_3), dot_dtype, DOT_PRECISION)
        return kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33

    @triton.jit
    def _keys_lower_block(products, beta_ptr, cum_ptr, stride_bt, start, length, HV, block_i: tl.constexpr,
                          block_j: tl.constexpr, GATE: tl.constexpr, BC: tl.constexpr):
        """Block (i, j <= i) of L = diag(beta) Kdot from its key products `products` = K_i K_j^T [BC, BC]:
        Kdot = products o e^(G_t - G_s) as decayed_scores forms it (s < t on the diagonal), then
        beta; zero in rows or columns past `length`. No gate or a scalar one."""
        sub = tl.arange(0, BC)
        rows = block_i * BC + sub
        cols = block_j * BC + sub
        row_valid = rows < length
        visible = row_valid[:, None] & (cols < length)[None, :]
        if block_i == block_j:
            visible = visible & (sub[:, None] > sub[None, :])
        beta = tl.load(beta_ptr + (start + rows) * stride_bt, mask=row_valid, other=0.0).to(tl.float32)
        if GATE == 1:
            g_rows = tl.load(cum_ptr + (start + rows) * HV, mask=row_valid, other=0.0)
            g_cols = tl.load(cum_ptr + (start + cols) * HV, mask=cols < length, other=0.0)
            kdot = products * tl.exp(tl.where(visible, g_rows[:, None] - g_cols[None, :], float("-inf")))
        else:
            kdot = tl.where(visible, products, 0.0)
        return kdot * beta[:, None]

    @triton.jit
    def _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, block_i, block_j,
                     BT: tl.constexpr, BC: tl.constexpr):
        """The [BC, BC] block (block_i > block_j) of L = diag(beta) Kdot, zero in rows past `length`."""
        rows = block_i * BC + tl.arange(0, BC)
        cols = block_j * BC + tl.arange(0, BC)
        valid = rows < length
        beta = tl.load(beta_ptr + (start + rows) * stride_bt, mask=valid, other=0.0).to(tl.float32)
        return _load_rows(kdot_ptr, start + rows, cols, row_stride, 1, valid, BT) * beta[:, None]

    @triton.jit
    def _diagonal_lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, block,
                              BT: tl.constexpr, BC: tl.constexpr):
        """Diagonal block `block` [BC, BC] of L = diag(beta) Kdot, strictly lower, zero in rows past
        `length`: _register_substitution_step's operand, read from decayed_scores' Kdot."""
        sub = tl.arange(0, BC)
        lower = _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, block, block, BT, BC)
        return tl.where(sub[:, None] > sub[None, :], lower, 0.0)

    @triton.jit
    def _store_block(a_ptr, block, start, length, row_stride, block_i, block_j, BT: tl.constexpr,
                     BC: tl.constexpr):
        rows = block_i * BC + tl.arange(0, BC)
        cols = block_j * BC + tl.arange(0, BC)
        _store_rows(a_ptr, block, start + rows, cols, row_stride, 1, rows < length, BT)

    @triton.jit
    def _off_diagonal_block(a_ii, coupled):
        """A_ij = -A_ii sum_{j<=m<i} L_im A_mj, given that sum: row block i of (I + L) A = 0 off the diagonal.

        Exact fp32 products of [BC, BC] tiles (cheap at this size); the inverse feeds every later product.
        """
        return -tl.dot(a_ii, coupled, input_precision="ieee")

    @triton.jit
    def _wy_solve_kernel(
        k_ptr, v_ptr, beta_ptr, cum_ptr, kdot_ptr, a_ptr, w_ptr, u_ptr, kg_ptr, g_ptr,
        stride_kb, stride_kt, stride_kh, stride_kk,
        stride_vb, stride_vt, stride_vh, stride_vv,
        stride_bb, stride_bt, stride_bh,
        stride_gb, stride_gt, stride_gh,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, V,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        SOLVE: tl.constexpr,
        FORM_KDOT: tl.constexpr,
        REGISTER_DIAGONAL: tl.constexpr,
        FORM_CUM: tl.constexpr,
        FORM_WU: tl.constexpr,
    ):
        """A = (I + diag(beta) Kdot)^-1 block by block; W = A diag(beta)(K e^G); U~ = A diag(beta) V;
        with a channel gate also the keys decayed to the chunk's end, K e^(G_last - G), in kg_ptr
        ([B, T, HV, K], W's dtype): state_forward's sequential loop then reads them instead of
        forming them (fp32 [BT, K] key and gate loads and BT x K exps per chunk and value tile) on
        the critical path.

        Without SOLVE, A is already in `a_ptr` (the forward's, kept for the backward, or this
        forward's solve launch: plan.SPLIT_WY_SOLVE) and only W and U~ are formed; without FORM_WU
        only A (the solve launch of the split).

        With FORM_CUM (a scalar gate, plan.FOLDED_GATE_SUMS) the program first forms its chunk's G from
        the raw log-gates in g_ptr ([B, T, HV], strides stride_g*) into cum_ptr, as gate_cumsum would
        (this kernel is G's first reader), and reads it back after a barrier like every other reader.

        With FORM_KDOT (no gate or a scalar one: plan.fused_scores_forward) kdot_ptr is not read:
        the lower [BC, BC] blocks of L = diag(beta) Kdot (NS (NS + 1) / 2 of them, fp32) are formed
        in registers from the key tiles, K_i K_j^T over the key dim with decayed_scores' operands,
        and the substitution takes its rows from them. Without it, REGISTER_DIAGONAL loads L's diagonal
        blocks from Kdot into registers once, for the same register steps; off, each step loads its row.

        The NS = BT / BC <= 4 diagonal [BC, BC] blocks are inverted by forward substitution,
        the blocks below them by the block recurrence of _off_diagonal_block ([BC, BC] products
        only), and every block is stored to `a_ptr`. The program then reads its whole [BT, BT]
        A back (the barrier makes its own stores visible) for the tensor-core W and U~ products.
        """
        tl.static_assert(BT // BC <= 4, "wy_solve handles at most four sub-chunks per chunk")
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
        k_ptr += batch * stride_kb + key_head * stride_kh
        v_ptr += batch * stride_vb + head * stride_vh
        beta_ptr += batch * stride_bb + head * stride_bh
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        if FORM_CUM:
            tl.static_assert(GATE == 1, "wy_solve forms G of scalar gates only")
            _scalar_gate_sum(g_ptr + batch * stride_gb + head * stride_gh, cum_ptr, start, length, stride_gt, HV, BT)
            tl.debug_barrier()
        square_offset = (batch * T) * HV * BT + head * BT
        kdot_ptr += square_offset
        a_ptr += square_offset
        row_stride = HV * BT
        NS: tl.constexpr = BT // BC

        dot_dtype = w_ptr.dtype.element_ty
        if SOLVE:
            sub = tl.arange(0, BC)
            if FORM_KDOT:
                tl.static_assert(GATE != 2, "per-channel decays take decayed_scores' sub-chunk factoring")
                # All NS (NS + 1) / 2 blocks of L in one pass over the key tiles: fewer loads, and fewer
                # spills at sm_90 than the diagonal ones first and the rest after the substitution (sm90_registers.py).
                kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33 = _key_products(
                    k_ptr, start, length, stride_kt, stride_kk, K, dot_dtype, BC, BK, NS, DOT_PRECISION)
                l00 = _keys_lower_block(kk00, beta_ptr, cum_ptr, stride_bt, start, length, HV, 0, 0, GATE, BC)
                l10 = _keys_lower_block(kk10, beta_ptr, cum_ptr, stride_bt, start, length, HV, 1, 0, GATE, BC)
                l11 = _keys_lower_block(kk11, beta_ptr, cum_ptr, stride_bt, start, length, HV, 1, 1, GATE, BC)
                l20 = _keys_lower_block(kk20, beta_ptr, cum_ptr, stride_bt, start, length, HV, 2, 0, GATE, BC)
                l21 = _keys_lower_block(kk21, beta_ptr, cum_ptr, stride_bt, start, length, HV, 2, 1, GATE, BC)
                l22 = _keys_lower_block(kk22, beta_ptr, cum_ptr, stride_bt, start, length, HV, 2, 2, GATE, BC)
                l30 = _keys_lower_block(kk30, beta_ptr, cum_ptr, stride_bt, start, length, HV, 3, 0, GATE, BC)
                l31 = _keys_lower_block(kk31, beta_ptr, cum_ptr, stride_bt, start, length, HV, 3, 1, GATE, BC)
                l32 = _keys_lower_block(kk32, beta_ptr, cum_ptr, stride_bt, start, length, HV, 3, 2, GATE, BC)
                l33 = _keys_lower_block(kk33, beta_ptr, cum_ptr, stride_bt, start, length, HV, 3, 3, GATE, BC)
            elif REGISTER_DIAGONAL:
                l00 = _diagonal_lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 0, BT, BC)
                if NS >= 2:
                    l11 = _diagonal_lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 1, BT, BC)
                if NS >= 4:
                    l22 = _diagonal_lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 2, BT, BC)
                    l33 = _diagonal_lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 3, BT, BC)
            # The diagonal blocks' substitutions are independent chains: one loop runs them side by side.
            a00 = tl.where(sub[:, None] == sub[None, :], 1.0, 0.0)
            a11 = a00
            a22 = a00
            a33 = a00
            for r in range(1, BC):
                if FORM_KDOT or REGISTER_DIAGONAL:
                    a00 = _register_substitution_step(a00, l00, r, BC)
                    if NS >= 2:
                        a11 = _register_substitution_step(a11, l11, r, BC)
                    if NS >= 4:
                        a22 = _register_substitution_step(a22, l22, r, BC)
                        a33 = _register_substitution_step(a33, l33, r, BC)
                else:
                    a00 = _substitution_step(a00, kdot_ptr, beta_ptr, stride_bt, start, 0, length, row_stride, r, BC)
                    if NS >= 2:
                        a11 = _substitution_step(a11, kdot_ptr, beta_ptr, stride_bt, start, BC, length, row_stride, r,
                                                 BC)
                    if NS >= 4:
                        a22 = _substitution_step(a22, kdot_ptr, beta_ptr, stride_bt, start, 2 * BC, length, row_stride,
                                                 r, BC)
                        a33 = _substitution_step(a33, kdot_ptr, beta_ptr, stride_bt, start, 3 * BC, length, row_stride,
                                                 r, BC)
            _store_block(a_ptr, a00, start, length, row_stride, 0, 0, BT, BC)
            if NS >= 2:
                if not FORM_KDOT:
                    l10 = _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 1, 0, BT, BC)
                a10 = _off_diagonal_block(a11, tl.dot(l10, a00, input_precision="ieee"))
                _store_block(a_ptr, a11, start, length, row_stride, 1, 1, BT, BC)
                _store_block(a_ptr, a10, start, length, row_stride, 1, 0, BT, BC)
            if NS >= 4:
                if not FORM_KDOT:
                    l20 = _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 2, 0, BT, BC)
                    l21 = _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 2, 1, BT, BC)
                    l30 = _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 3, 0, BT, BC)
                    l31 = _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 3, 1, BT, BC)
                    l32 = _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 3, 2, BT, BC)
                a21 = _off_diagonal_block(a22, tl.dot(l21, a11, input_precision="ieee"))
                a32 = _off_diagonal_block(a33, tl.dot(l32, a22, input_precision="ieee"))
                a20 = _off_diagonal_block(a22, tl.dot(l20, a00, input_precision="ieee")
                                          + tl.dot(l21, a10, input_precision="ieee"))
                a31 = _off_diagonal_block(a33, tl.dot(l31, a11, input_precision="ieee")
                                          + tl.dot(l32, a21, input_precision="ieee"))
                a30 = _off_diagonal_block(a33, tl.dot(l30, a00, input_precision="ieee")
                                          + tl.dot(l31, a10, input_precision="ieee")
                                          + tl.dot(l32, a20, input_precision="ieee"))
                _store_block(a_ptr, a22, start, length, row_stride, 2, 2, BT, BC)
                _store_block(a_ptr, a33, start, length, row_stride, 3, 3, BT, BC)
                _store_block(a_ptr, a21, start, length, row_stride, 2, 1, BT, BC)
                _store_block(a_ptr, a32, start, length, row_stride, 3, 2, BT, BC)
                _store_block(a_ptr, a20, start, length, row_stride, 2, 0, BT, BC)
                _store_block(a_ptr, a31, start, length, row_stride, 3, 1, BT, BC)
                _store_block(a_ptr, a30, start, length, row_stride, 3, 0, BT, BC)
            # The blocks above the diagonal are zero; written so that A is complete in memory.
            zero_block = tl.zeros([BC, BC], dtype=tl.float32)
            for block_i in tl.static_range(NS):
                for block_j in tl.static_range(block_i + 1, NS):
                    _store_block(a_ptr, zero_block, start, length, row_stride, block_i, block_j, BT, BC)
            tl.debug_barrier()

        if FORM_WU:  # W and U~ from the stored A (the barrier above made this program's stores visible)
            local = tl.arange(0, BT)
            valid = local < length
            tokens = start + local
            inverse = _load_rows(a_ptr, tokens, local, row_stride, 1, valid, BT).to(dot_dtype)
            beta = tl.load(beta_ptr + tokens * stride_bt, mask=valid, other=0.0).to(tl.float32)
            if GATE == 1:
                gamma = tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))
            for k0 in range(0, K, BK):
                kc = k0 + tl.arange(0, BK)
                k_raw = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                k_tile = k_raw * beta[:, None]
                if GATE == 2:
                    g = _load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K)
                    k_tile *= tl.exp(g)
                    g_last = _load_vector(cum_ptr, start + length - 1, kc, HV * K, 1, length > 0, K)
                    k_decayed = k_raw * tl.exp(tl.where(valid[:, None], g_last[None, :] - g, 0.0))
                    _store_rows(kg_ptr + (batch * T) * HV * K + head * K, k_decayed, tokens, kc, HV * K, 1, valid, K)
                elif GATE == 1:
                    k_tile *= gamma[:, None]
                w = _dot(inverse, k_tile, dot_dtype, DOT_PRECISION)
                _store_rows(w_ptr + (batch * T) * HV * K + head * K, w, tokens, kc, HV * K, 1, valid, K)
            for v0 in range(0, V, BV):
                vc = v0 + tl.arange(0, BV)
                v_tile = _load_rows(v_ptr, tokens, vc, stride_vt, stride_vv, valid, V) * beta[:, None]
                u = _dot(inverse, v_tile, dot_dtype, DOT_PRECISION)
                _store_rows(u_ptr + (batch * T) * HV * V + head * V, u, tokens, vc, HV * V, 1, valid, V)

    @triton.jit
    def _wy_backward_kernel(
        q_ptr, k_ptr, v_ptr, beta_ptr, do_ptr, cum_ptr, inverse_ptr, kdot_ptr, u_ptr, du_ptr, h_ptr, dh_ptr,
        dv_ptr, dbeta_ptr, dq_ptr, dk_ptr, dg_ptr, dkdot_ptr, dscores_ptr,
        stride_qb, stride_qt, stride_qh, stride_qk,
        stride_kb, stride_kt, stride_kh, stride_kk,
        stride_vb, stride_vt, stride_vh, stride_vv,
        stride_bb, stride_bt, stride_bh,
        stride_dob, stride_dot, stride_doh, stride_dov,
        stride_dvb, stride_dvt, stride_dvh, stride_dvv,
        stride_dbb, stride_dbt, stride_dbh,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, V, scale,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FUSE_SCORES: tl.constexpr,
    ):
        """Per chunk and value head, everything but the pairwise-decay terms.

        Through U = A diag(beta) V - W h and W = A diag(beta)(K e^G): dv, dbeta (complete);
        through O's (Q e^G) h and S_end's terms: partial dq, dk and dG (the gradient of the
        cumulative gate). Stores dKdot = beta * dL with dL = -A^T dA A^T (strictly lower) and
        dP = scale dO U^T (lower) for decayed_scores_backward.

        With FUSE_SCORES (no gate or a scalar one, whose decays are one [BT, BT] tile) the terms
        through Kdot and P are added here instead, and dq, dk and dG leave complete (what
        _whole_chunk_scores_backward adds, without dKdot and dP's round trip through memory and
        its read-modify-write of dq and dG). dP is complete after the value loop: the key loop adds
        dP K to dq and dP^T Q to dk before it stores them. dKdot is complete only after the key
        loop (whose dW terms are part of dA): a last pass over the key tiles adds its products to
        the stored dk.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
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
        v_ptr += batch * stride_vb + head * stride_vh
        do_ptr += batch * stride_dob + head * stride_doh
        dv_ptr += batch * stride_dvb + head * stride_dvh
        gate_offset = _gate_offset(batch, head, T, HV, K, GATE)
        cum_ptr += gate_offset
        dg_ptr += gate_offset
        square_offset = (batch * T) * HV * BT + head * BT
        value_offset = (batch * T) * HV * V + head * V
        key_offset = (batch * T) * HV * K + head * K
        h_ptr += (pid_chunk.to(tl.int64) * HV + head) * K * V
        dh_ptr += (pid_chunk.to(tl.int64) * HV + head) * K * V

        local = tl.arange(0, BT)
        valid = local < length
        tokens = start + local
        last = start + length - 1
        beta = tl.load(beta_ptr + batch * stride_bb + head * stride_bh + tokens * stride_bt, mask=valid,
                       other=0.0).to(tl.float32)
        dot_dtype = h_ptr.dtype.element_ty
        # In the products' dtype through the loops; fp32 again for dL at the end.
        inverse = _load_rows(inverse_ptr + square_offset, tokens, local, HV * BT, 1, valid, BT)
        inverse = tl.where(local[:, None] >= local[None, :], inverse, 0.0).to(dot_dtype)
        d_inverse = tl.zeros([BT, BT], dtype=tl.float32)
        d_scores = tl.zeros([BT, BT], dtype=tl.float32)
        dbeta = tl.zeros([BT], dtype=tl.float32)
        for v0 in range(0, V, BV):
            vc = v0 + tl.arange(0, BV)
            u = _load_stored_rows(u_ptr + value_offset, tokens, vc, HV * V, 1, valid, V)
            du = _load_stored_rows(du_ptr + value_offset, tokens, vc, HV * V, 1, valid, V)
            do_tile = _load_stored_rows(do_ptr, tokens, vc, stride_dot, stride_dov, valid, V)
            v_tile = _load_rows(v_ptr, tokens, vc, stride_vt, stride_vv, valid, V)
            d_scores += _dot(do_tile, tl.trans(u), dot_dtype, DOT_PRECISION)
            d_inverse += _dot(du, tl.trans(v_tile * beta[:, None]), dot_dtype, DOT_PRECISION)
            inverse_t_du = _dot(tl.trans(inverse), du, dot_dtype, DOT_PRECISION)
            _store_rows(dv_ptr, inverse_t_du * beta[:, None], tokens, vc, stride_dvt, stride_dvv, valid, V)
            dbeta += tl.sum(v_tile * inverse_t_du, axis=1)
        d_scores = tl.where((local[:, None] >= local[None, :]) & valid[:, None], scale * d_scores, 0.0)
        if FUSE_SCORES:
            tl.static_assert(GATE != 2, "per-channel decays take decayed_scores_backward's sub-chunk programs")
            if GATE == 1:
                d_scores *= _pair_decays(cum_ptr, tokens, valid, HV, BT)
            # held through the key loop: in the products' dtype, half the registers of fp32 with half inputs
            d_scores = d_scores.to(dot_dtype)
        else:
            # Stored now rather than at the end: one [BT, BT] tile fewer held through the key loop.
            _store_rows(dscores_ptr + square_offset, d_scores, tokens, local, HV * BT, 1, valid, BT)

        dg_scalar = tl.zeros([BT], dtype=tl.float32)
        # Per key tile, three passes over the value tiles, one accumulator each (dW, dQ's state
        # term, dK's end-state term), each used up before the next: fewer [BT, BK] tiles live at
        # once than in one pass, for two more reads of the (cached) h tiles.
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            if GATE == 2:
                gamma = tl.exp(_load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K))
            elif GATE == 1:
                gamma = tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))[:, None]
            else:
                gamma = tl.full([BT, 1], 1.0, dtype=tl.float32)
            # Through W = A diag(beta)(K e^G) and U = U~ - W h.
            dw = tl.zeros([BT, BK], dtype=tl.float32)
            for v0 in range(0, V, BV):
                vc = v0 + tl.arange(0, BV)
                state = _load_stored_rows(h_ptr, kc, vc, V, 1, kc < K, V)
                du = _load_stored_rows(du_ptr + value_offset, tokens, vc, HV * V, 1, valid, V)
                dw -= _dot(du, tl.trans(state), dot_dtype, DOT_PRECISION)
            d_inverse += _dot(dw, tl.trans(k_tile * gamma * beta[:, None]), dot_dtype, DOT_PRECISION)
            inverse_t_dw = _dot(tl.trans(inverse), dw, dot_dtype, DOT_PRECISION)
            dbeta += tl.sum(inverse_t_dw * gamma * k_tile, axis=1)
            dk = inverse_t_dw * gamma * beta[:, None]
            # dG_t = k_t dk_t + q_t dq_t, less the end-state term of dk (whose G dependence is
            # through G_last - G_t), plus that term's G_last part on the chunk's last row.
            dg = k_tile * dk
            # Through O's (Q e^G) h.
            dq_state = tl.zeros([BT, BK], dtype=tl.float32)
            for v0 in range(0, V, BV):
                vc = v0 + tl.arange(0, BV)
                state = _load_stored_rows(h_ptr, kc, vc, V, 1, kc < K, V)
                do_tile = _load_stored_rows(do_ptr, tokens, vc, stride_dot, stride_dov, valid, V)
                dq_state += _dot(do_tile, tl.trans(state), dot_dtype, DOT_PRECISION)
            dq = scale * gamma * dq_state
            if FUSE_SCORES:
                # P's row role (dq_t += sum_s dP[t,s] k_s e^(G_t - G_s)) and column role (dk_s +=
                # sum_t dP[t,s] q_t e^(G_t - G_s)), and their share of dG, taken while dq is live:
                # dq and the q tile are then dead through the end-state loop below.
                if GATE == 1:
                    q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
                else:
                    q_tile = _load_stored_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
                dq += _dot(d_scores, k_tile, dot_dtype, DOT_PRECISION)
                dk_scores = _dot(tl.trans(d_scores), q_tile, dot_dtype, DOT_PRECISION)
                dk += dk_scores
                if GATE == 1:
                    dg += q_tile * dq - k_tile * dk_scores
            _store_rows(dq_ptr + key_offset, dq, tokens, kc, HV * K, 1, valid, K)
            # Through S_end = e^G_last S + (K e^(G_last - G))^T U.
            dk_to_end = tl.zeros([BT, BK], dtype=tl.float32)
            dg_whole = tl.zeros([BK], dtype=tl.float32)
            for v0 in range(0, V, BV):
                vc = v0 + tl.arange(0, BV)
                dstate = _load_stored_rows(dh_ptr, kc, vc, V, 1, kc < K, V)
                u = _load_stored_rows(u_ptr + value_offset, tokens, vc, HV * V, 1, valid, V)
                dk_to_end += _dot(u, tl.trans(dstate), dot_dtype, DOT_PRECISION)
                if GATE != 0:
                    state = _load_rows(h_ptr, kc, vc, V, 1, kc < K, V)
                    dg_whole += tl.sum(state * dstate.to(tl.float32), axis=1)
            if GATE != 0:
                if not FUSE_SCORES:
                    q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
                    dg += q_tile * dq
                to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, last, kc, HV, K, GATE)
                dk_to_end *= to_end
                k_to_end_grad = k_tile * dk_to_end
                dg -= k_to_end_grad
                dg_last = tl.sum(k_to_end_grad, axis=0) + whole * dg_whole
                dg += tl.where(local[:, None] == length - 1, dg_last[None, :], 0.0)
                if GATE == 2:
                    _store_rows(dg_ptr, dg, tokens, kc, HV * K, 1, valid, K)
                else:
                    dg_scalar += tl.sum(dg, axis=1)
            dk += dk_to_end
            _store_rows(dk_ptr + key_offset, dk, tokens, kc, HV * K, 1, valid, K)
        if not FUSE_SCORES:
            if GATE == 1:
                tl.store(dg_ptr + tokens * HV, dg_scalar, mask=valid)

        # A = (I + L)^-1  =>  dL = -A^T dA A^T, kept strictly lower.
        inverse = _load_rows(inverse_ptr + square_offset, tokens, local, HV * BT, 1, valid, BT)
        inverse = tl.where(local[:, None] >= local[None, :], inverse, 0.0)
        d_lower = -tl.dot(tl.dot(tl.trans(inverse), d_inverse, input_precision=DOT_PRECISION), tl.trans(inverse),
                          input_precision=DOT_PRECISION)
        d_lower = tl.where((local[:, None] > local[None, :]) & valid[:, None], d_lower, 0.0)
        kdot = _load_rows(kdot_ptr + square_offset, tokens, local, HV * BT, 1, valid, BT)
        kdot = tl.where(local[:, None] > local[None, :], kdot, 0.0)
        dbeta += tl.sum(d_lower * kdot, axis=1)
        tl.store(dbeta_ptr + batch * stride_dbb + head * stride_dbh + tokens * stride_dbt,
                 dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)
        d_kdot = d_lower * beta[:, None]
        if FUSE_SCORES:
            if GATE == 1:
                # Formed again (BT gate loads, BT^2 exps), not kept from dP's: one [BT, BT] fp32 tile
                # fewer live through the key loop of a kernel already at 255 registers.
                d_kdot *= _pair_decays(cum_ptr, tokens, valid, HV, BT)
            # dKdot is strictly lower, so dKdot + dKdot^T holds each of its elements once (no
            # rounding added): one product per key tile gives dk both the row role (dKdot K) and
            # the column role (dKdot^T K); dG's k (rows - columns) takes one more with the difference.
            d_kdot_t = tl.trans(d_kdot)
            d_kdot_both = (d_kdot + d_kdot_t).to(dot_dtype)
            if GATE == 1:
                d_kdot_rows_less_cols = (d_kdot - d_kdot_t).to(dot_dtype)
            # Each thread reads back dk elements other threads of this program stored.
            tl.debug_barrier()
            for k0 in range(0, K, BK):
                kc = k0 + tl.arange(0, BK)
                k_tile = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                dk = _load_rows(dk_ptr + key_offset, tokens, kc, HV * K, 1, valid, K)
                dk += _dot(d_kdot_both, k_tile, dot_dtype, DOT_PRECISION)
                _store_rows(dk_ptr + key_offset, dk, tokens, kc, HV * K, 1, valid, K)
                if GATE == 1:
                    dk_rows_less_cols = _dot(d_kdot_rows_less_cols, k_tile, dot_dtype, DOT_PRECISION)
                    dg_scalar += tl.sum(k_tile.to(tl.float32) * dk_rows_less_cols, axis=1)
            if GATE == 1:
                tl.store(dg_ptr + tokens * HV, dg_scalar, mask=valid)
        else:
            _store_rows(dkdot_ptr + square_offset, d_kdot, tokens, local, HV * BT, 1, valid, BT)


# The options below were timed with benchmarks/tune_delta_rule.py (H100, Triton 3.6, B4 T4096 H16
# K128 bf16, whole forward+backward, one kernel's options changed at a time; 2026-11-22).
#
# wy_backward holds A, dA and [BT, BK] accumulators next to the tiles it reads: compiled for
# sm_90 (Triton 3.8, BT = BK = BV = 64, bf16 inputs with l2norm), 4 warps spilled 1.2-1.5 KiB per
# thread, 8 warps 112-232 bytes (128 KiB shared memory either way), and 4 warps took 4-12 % longer.
# Three software-pipelining stages took up to 208 KiB of shared memory; with fp32 intermediates one
# stage beat two by 5-6 % (GDN, KDA), with half ones they tied. And with half intermediates two
# stages gave wrong, run-to-run different dk and dg on the H100 with Triton 3.6 (dk 3e-2 to 1.2e-1
# relative RMS in some runs and right in others, for the same inputs: fp16 KDA at K = V = 32, and
# bf16 GDN at K = V = 128 with narrowed sweep tiles; one stage: right and identical in every run,
# 2026-11-22). So one stage everywhere; test_backward_is_deterministic repeats those cases.
WY_BACKWARD_STAGES = 1
WY_BACKWARD_OPTIONS = {"num_warps": 8, "num_stages": WY_BACKWARD_STAGES}


def wy_solve_options(plan: Plan) -> dict[str, int]:
    """wy_solve's substitution is a chain of [16, 16] steps: with half inputs 2 warps took 1-5 % less
    than 4 (8 warps 1 % more), although they spill 8-96 bytes per thread at sm_90. fp32 inputs' exact
    (ieee) products spilled 10 KiB per thread at 2 warps, 5.5 KiB at 4 and 232-272 bytes at 8.
    Forming Kdot's ten [16, 16] blocks in the kernel (FORM_KDOT; B1 T32768 H16 D128 bf16 GDN's
    specialization, benchmarks/sm90_registers.py) took 255 registers at 2 warps and 3 stages with 144 bytes
    spilled on Triton 3.9 (24 on 3.6; reading decayed_scores' Kdot: 16 and 0), all of them outside the
    loops (SASS); 4 warps 72 bytes, 2 warps and 1 stage 80. Not yet timed: the options stay the timed
    ones."""
    if plan.input_dtype == torch.float32:
        return {"num_warps": 8}
    # Per-channel gates (KDA): one stage took 11.23-11.46 ms against 11.37-11.62 for Triton's default three
    # (B1 T32768 H16 D128 fwd+bwd, H100, Triton 3.6, tune_delta_rule twice, session 22); GDN showed no change.
    channel = plan.gate_code == GATE_CODES["channel"]
    return {"num_warps": 2, "num_stages": 1} if channel else {"num_warps": 2}
