"""The local part of dU, scale P^T dO, formed chunk-parallel before the backward state sweep
(plan.LOCAL_DU_KERNEL), as FLA's chunk_bwd_dv_local does:

    dU_local[c] = scale P_c^T dO_c        (P_c the chunk's decayed scores, lower-triangular with
                                           its diagonal; dO_c the chunk's [BT, V] output gradient)

stored into the sweep's dU buffer in the intermediates' dtype. The sweep (state.py, LOCAL_DU) then
loads those rows in place of P and the product and overwrites them with the whole dU. In the sweep
the product is off its chain, but each chunk step waits for it: on one H200 (session 48,
benchmarks/analysis/sweep_step_work.py, GDN B1 T32768 H16 D128) the sweep took 0.675 ms reading the
local part against 0.853 forming it. One more rounding of the local part (to the intermediates'
dtype before the chain's term is added), as FLA's. The reference is reference.local_du_ref.
"""

from __future__ import annotations

from .plan import Plan, block_size

from .._triton import cdiv, tl, triton

# The value tile and warps of the launch (one program per chunk, value head and value tile).
LOCAL_DU_BLOCK_V = 64
LOCAL_DU_WARPS = 4

if triton is not None:
    from .tiles import _dot, _load_rows, _load_stored_rows, _row_chunk_coords, _store_rows, _varlen_chunk_coords

    @triton.jit
    def _local_du_kernel(
        scores_ptr, do_ptr, du_ptr,
        stride_dob, stride_dot, stride_doh, stride_dov,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, V, scale,
        BT: tl.constexpr,
        BV: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One program per (chunk, value head, value tile): du[chunk rows, tile] = scale P^T dO, P
        from scores_ptr ([B, T, HV, BT], masked to s <= t as the sweep masks it), du [B, T, HV, V]
        contiguous in the intermediates' dtype, whose dtype the product's operands take."""
        scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        if IS_VARLEN:
            seq = tl.load(chunk_table_ptr + 2 * pid_chunk)
            chunk = tl.load(chunk_table_ptr + 2 * pid_chunk + 1)
            batch, start, length = _varlen_chunk_coords(chunk, tl.load(cu_seqlens_ptr + seq),
                                                        tl.load(cu_seqlens_ptr + seq + 1), BT)
        else:
            batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
        scores_ptr += (batch * T) * HV * BT + head * BT
        du_ptr += (batch * T) * HV * V + head * V
        do_ptr += batch * stride_dob + head * stride_doh
        local = tl.arange(0, BT)
        valid = local < length
        tokens = start + local
        vc = pid_v * BV + tl.arange(0, BV)
        dot_dtype = du_ptr.dtype.element_ty
        scores = _load_rows(scores_ptr, tokens, local, HV * BT, 1, valid, BT)
        scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
        do_tile = _load_stored_rows(do_ptr, tokens, vc, stride_dot, stride_dov, valid, V)
        du = scale * _dot(tl.trans(scores), do_tile, dot_dtype, DOT_PRECISION)
        _store_rows(du_ptr, du, tokens, vc, HV * V, 1, valid, V)

else:
    _local_du_kernel = None


def launch_local_du(plan: Plan, scores, do, du, num_chunks: int, table, seqlens, scale: float) -> None:
    """_local_du_kernel on `num_chunks` chunks (the first `table` lists, varlen): du's rows get
    scale P^T dO, which the backward sweep (LOCAL_DU) completes in place."""
    problem = plan.problem
    block_v = block_size(problem.value_dim, LOCAL_DU_BLOCK_V)
    plan.launch(_local_du_kernel)[(num_chunks, problem.value_heads, cdiv(problem.value_dim, block_v))](
        scores, do, du, *do.stride(), table, seqlens,
        problem.time, plan.chunks_per_row, problem.value_heads, problem.value_dim, float(scale),
        BT=plan.chunk_size, BV=block_v, IS_VARLEN=plan.varlen, DOT_PRECISION=plan.dot_precision,
        num_warps=LOCAL_DU_WARPS,
    )


__all__ = ["LOCAL_DU_BLOCK_V", "LOCAL_DU_WARPS", "_local_du_kernel", "launch_local_du"]
