"""The second half of the split wy_backward (plan.SPLIT_WY_BACKWARD; no gate or a scalar one): the
gradients through the WY form, FLA's prepare_wy_repr_bwd. After dqkw.py, per chunk and value head,
with A = (I + L)^-1, L = diag(beta) Kdot, Kdot[t, s] = k_t k_s D[t, s] (s < t),
D[t, s] = e^(G_t - G_s) and gamma = e^G:

    through U~ = A diag(beta) V:        dA += dU (V beta)^T,  dv = beta A^T dU,  dbeta += rowsum(v A^T dU)
    through W = A diag(beta)(K gamma):  dA += dW (K gamma beta)^T,  dk += gamma beta A^T dW,
                                        dbeta += rowsum(gamma k A^T dW),  dG += rowsum(k dk that term)
    dL = -A^T dA A^T (strictly lower), and through L without Kdot itself (R2 of
    benchmarks/analysis/gdn_traffic_2026-11-26.md), R = (dL o D) K and C = (diag(beta) dL o D)^T K:
                                        dk += beta R + C,  dbeta += rowsum(k R),  dG += rowsum(k (beta R - C))

dA is complete after a value loop and a key loop (dW from dqkw.py); the last key loop forms A^T dW,
R and C per key tile and adds them to dqkw.py's partial dk, which it stores complete, as it does dG
(these rows plus dqkw.py's partial rows: its first key tile's, then its second's). The reference is reference.wy_bwd_ref.
"""

from __future__ import annotations

from .plan import Plan, block_size

from .._triton import tl, triton

if triton is not None:
    from .tiles import (_dot, _gate_offset, _load_rows, _load_stored_rows, _pair_decays, _row_chunk_coords,
                        _store_rows, _varlen_chunk_coords)

    @triton.jit
    def _wy_bwd_kernel(
        k_ptr, v_ptr, beta_ptr, cum_ptr, inverse_ptr, du_ptr, dw_ptr,
        dv_ptr, dbeta_ptr, dk_ptr, dk_out_ptr, dg_ptr, dg_second_ptr,
        stride_kb, stride_kt, stride_kh, stride_kk,
        stride_vb, stride_vt, stride_vh, stride_vv,
        stride_bb, stride_bt, stride_bh,
        stride_dvb, stride_dvt, stride_dvh, stride_dvv,
        stride_dbb, stride_dbt, stride_dbh,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, V,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DG_PARTS: tl.constexpr,
        HALF_DL: tl.constexpr,
        REVERSE_DG: tl.constexpr,
    ):
        """One program per (chunk, value head): see the module docstring. dk_ptr and dg_ptr hold
        dqkw.py's partial sums ([B, T, HV, K] and [B, T, HV, 1] fp32), with DG_PARTS 2 dg_second_ptr
        its second key tile's rows of dG; dk leaves complete in dk_out_ptr (dk_ptr itself, or a
        [B, T, HV, K] tensor of its own dtype: plan.half_key_gradients) and dg in dg_ptr; dv and dbeta
        take their tensors' dtypes. REVERSE_DG: dg_ptr takes dG's reverse sum over the rest of each
        token's chunk, the gradient of the scalar log-gate g (gate_cumsum.py's reverse launch)."""
        tl.static_assert(GATE != 2, "per-channel gates take wy.py's wy_backward and scores.py's backward")
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
        dv_ptr += batch * stride_dvb + head * stride_dvh
        gate_offset = _gate_offset(batch, head, T, HV, K, GATE)
        cum_ptr += gate_offset
        dg_ptr += gate_offset
        dg_second_ptr += gate_offset
        square_offset = (batch * T) * HV * BT + head * BT
        value_offset = (batch * T) * HV * V + head * V
        key_offset = (batch * T) * HV * K + head * K
        du_ptr += value_offset
        dw_ptr += key_offset
        dk_ptr += key_offset
        dk_out_ptr += key_offset

        local = tl.arange(0, BT)
        valid = local < length
        tokens = start + local
        beta = tl.load(beta_ptr + batch * stride_bb + head * stride_bh + tokens * stride_bt, mask=valid,
                       other=0.0).to(tl.float32)
        if GATE == 1:
            gamma = tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))[:, None]
        else:
            gamma = tl.full([BT, 1], 1.0, dtype=tl.float32)
        dot_dtype = du_ptr.dtype.element_ty
        # In the products' dtype through the loops; fp32 again for dL.
        inverse = _load_rows(inverse_ptr + square_offset, tokens, local, HV * BT, 1, valid, BT)
        inverse = tl.where(local[:, None] >= local[None, :], inverse, 0.0).to(dot_dtype)
        d_inverse = tl.zeros([BT, BT], dtype=tl.float32)
        dbeta = tl.zeros([BT], dtype=tl.float32)
        for v0 in range(0, V, BV):
            vc = v0 + tl.arange(0, BV)
            du = _load_stored_rows(du_ptr, tokens, vc, HV * V, 1, valid, V)
            v_tile = _load_rows(v_ptr, tokens, vc, stride_vt, stride_vv, valid, V)
            d_inverse += _dot(du, tl.trans(v_tile * beta[:, None]), dot_dtype, DOT_PRECISION)
            inverse_t_du = _dot(tl.trans(inverse), du, dot_dtype, DOT_PRECISION)
            _store_rows(dv_ptr, inverse_t_du * beta[:, None], tokens, vc, stride_dvt, stride_dvv, valid, V)
            dbeta += tl.sum(v_tile * inverse_t_du, axis=1)
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            dw = _load_stored_rows(dw_ptr, tokens, kc, HV * K, 1, valid, K)
            k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            d_inverse += _dot(dw, tl.trans(k_tile * gamma * beta[:, None]), dot_dtype, DOT_PRECISION)

        # A = (I + L)^-1  =>  dL = -A^T dA A^T, kept strictly lower. HALF_DL: both products from A and
        # dA in the products' dtype (FLA's prepare_wy_repr_bwd); else from the stored fp32 A at
        # DOT_PRECISION (tf32 with half inputs). The same with fp32 intermediates.
        if HALF_DL:
            d_lower = -_dot(_dot(tl.trans(inverse), d_inverse, dot_dtype, DOT_PRECISION), tl.trans(inverse),
                            dot_dtype, DOT_PRECISION)
        else:
            inverse_f32 = _load_rows(inverse_ptr + square_offset, tokens, local, HV * BT, 1, valid, BT)
            inverse_f32 = tl.where(local[:, None] >= local[None, :], inverse_f32, 0.0)
            d_lower = -tl.dot(tl.dot(tl.trans(inverse_f32), d_inverse, input_precision=DOT_PRECISION),
                              tl.trans(inverse_f32), input_precision=DOT_PRECISION)
        d_lower = tl.where((local[:, None] > local[None, :]) & valid[:, None], d_lower, 0.0)
        if GATE == 1:
            d_lower *= _pair_decays(cum_ptr, tokens, valid, HV, BT)
        # R = (dL o D) K takes dL's rows, C = (diag(beta) dL o D)^T K its columns.
        d_rows = d_lower.to(dot_dtype)
        d_cols = tl.trans(d_lower * beta[:, None]).to(dot_dtype)
        dg = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            dw = _load_stored_rows(dw_ptr, tokens, kc, HV * K, 1, valid, K)
            k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            inverse_t_dw = _dot(tl.trans(inverse), dw, dot_dtype, DOT_PRECISION)
            rows = _dot(d_rows, k_tile, dot_dtype, DOT_PRECISION)
            cols = _dot(d_cols, k_tile, dot_dtype, DOT_PRECISION)
            dbeta += tl.sum(k_tile * (inverse_t_dw * gamma + rows), axis=1)
            dk_wy = inverse_t_dw * gamma * beta[:, None] + beta[:, None] * rows
            dk = _load_rows(dk_ptr, tokens, kc, HV * K, 1, valid, K)
            _store_rows(dk_out_ptr, dk + dk_wy + cols, tokens, kc, HV * K, 1, valid, K)
            if GATE == 1:
                dg += tl.sum(k_tile * (dk_wy - cols), axis=1)
        tl.store(dbeta_ptr + batch * stride_dbb + head * stride_dbh + tokens * stride_dbt,
                 dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)
        if GATE == 1:
            dg += tl.load(dg_ptr + tokens * HV, mask=valid, other=0.0)
            if DG_PARTS == 2:
                dg += tl.load(dg_second_ptr + tokens * HV, mask=valid, other=0.0)
            if REVERSE_DG:  # rows past the chunk's end hold 0 (their keys and partial rows load as 0)
                dg = tl.cumsum(dg, axis=0, reverse=True)
            tl.store(dg_ptr + tokens * HV, dg, mask=valid)


# Launch options. Compiled for sm_90 on the CPU (Triton 3.9, bf16, scalar gate, B1 T32768 H16 D128's
# specializations; ptxas's resource usage): BK = BV = 64 at 4 warps took 255 registers and spilled 152
# bytes per thread (BV = 32: 80), 8 warps 226 and none; BK = 32, BV = 64 at 4 warps 218 and none, at 2
# warps 255 and 504 bytes. On the H100 (Triton 3.6) BK 32 at 4 warps, and at 8, gave wrong dbeta and dk
# (relative RMS 0.8-1.6) for the plain delta rule at K 100, V 60, varlen, GVA, chunk 64 (right with a
# scalar gate at K 60, V 100): the products of dqkw.py's error (a [BT, BT] register operand against a
# 64-byte-swizzled key tile). Right in both: BK 32 at 2 warps (mma.sync), BK 64 at 4 warps and at 8
# (benchmarks/diag_wy_split.py, session 24). Timed in one process at GDN B1 T32768 H16 D128 bf16 (the
# whole forward + backward, dqkw at its options below; one round): BK 64 at 4 warps 2 stages 4.98 ms,
# BK 32 at 2 warps 5.14, BK 64 at 8 warps 1 stage 5.19 (main's single wy_backward: 5.49). On one H200
# (session 45, tune_delta_rule.py, results/diag_gdn-tune_2026-11-30_h200x1_e8b5009.jsonl; the fwd+bwd
# with dqkw's one-pass kernel, 2 stages there): 1 stage 4.221 ms, 2 stages 4.329, 3 stages 4.278, 8 warps
# 4.647, BK 32 4.390, BK 16 4.525, BV 32 4.365, BV 128 4.355.
WY_BWD_BLOCK_K = 64
WY_BWD_BLOCK_V = 64
WY_BWD_STAGES = 1
WY_BWD_OPTIONS = {"num_warps": 4, "num_stages": WY_BWD_STAGES}
# dL = -A^T dA A^T with A and dA rounded to the products' dtype (bf16 tensor-core rate, no second
# load of the fp32 A), as FLA's prepare_wy_repr_bwd forms it, rather than tf32 products of fp32
# ones. Read at launch time. On one H200: GDN B1 T32768 H16 D128 fwd+bwd 0.990x the time of fp32 A
# (session 45, tune_delta_rule.py); relative RMS errors against float64 (session 46,
# benchmarks/delta_rule_accuracy.py, T1000 H2 D128 bf16) equal to the fp32-A form's within rounding: random
# inputs dg 3.7e-3 against 3.6e-3, the rest equal; aligned keys dg 4.6e-2 against 4.9e-2, dbeta 1.9e-2
# against 1.6e-2 (FLA's 4.5e-2 and 3.9e-2).
WY_BWD_HALF_DL = True


def launch_wy_bwd(plan: Plan, k, v, beta, cum, inverse, du, dw, dv, dbeta, dk_heads, dcum, num_chunks, table,
                  seqlens, dk_out=None, dcum_second=None, reverse_dg: bool = False) -> None:
    """_wy_bwd_kernel on `num_chunks` chunks (the first `table` lists, varlen): writes dv and dbeta and
    completes dk_heads (into dk_out when given) and dcum (dqkw.py's partial sums, plus dcum_second, its
    second key tile's rows, when given)."""
    problem = plan.problem
    plan.launch(_wy_bwd_kernel)[(num_chunks, problem.value_heads)](
        k, v, beta, cum, inverse, du, dw, dv, dbeta, dk_heads, dk_heads if dk_out is None else dk_out, dcum,
        dcum_second if dcum_second is not None else plan.dummy,
        *k.stride(), *v.stride(), *beta.stride(), *dv.stride(), *dbeta.stride(), table, seqlens,
        problem.time, plan.chunks_per_row, problem.value_heads, problem.group_size, problem.key_dim,
        problem.value_dim,
        GATE=plan.gate_code, BT=plan.chunk_size, BK=block_size(problem.key_dim, WY_BWD_BLOCK_K),
        BV=block_size(problem.value_dim, WY_BWD_BLOCK_V), IS_VARLEN=plan.varlen, DOT_PRECISION=plan.dot_precision,
        DG_PARTS=1 if dcum_second is None else 2, HALF_DL=WY_BWD_HALF_DL, REVERSE_DG=reverse_dg, **WY_BWD_OPTIONS,
    )
