"""Step 5 of the forward (output): O = scale ((Q e^G) h + P U) per chunk, value head and value tile,
from the chunk-start states h and corrected values U of state_forward (state.py) and the scores P of
decayed_scores (scores.py). Chunk-parallel, as every step but the state sweeps.
"""

from __future__ import annotations

from .._triton import tl, triton

def output_grid(num_chunks, value_heads: int, value_dim: int, block_v: int) -> tuple:
    """_output_kernel's grid: (chunks x value tiles, value heads), the value tiles of one chunk
    neighbouring programs (the kernel decodes its first program id so)."""
    return (num_chunks * triton.cdiv(value_dim, block_v), value_heads)


if triton is not None:
    from .tiles import (_dot, _gate_offset, _load_rows, _load_stored_rows, _row_chunk_coords, _store_rows,
                        _varlen_chunk_coords)

    @triton.jit
    def _output_kernel(
        q_ptr, cum_ptr, h_ptr, scores_ptr, u_ptr, o_ptr,
        stride_qb, stride_qt, stride_qh, stride_qk,
        stride_ob, stride_ot, stride_oh, stride_ov,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, V, scale,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """O = scale ((Q e^G) h + P U) for one chunk, value head and value tile; grid (chunks x value
        tiles, value heads)."""
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        # The value tiles of one chunk are neighbouring programs (the grid's fastest axis), so the
        # second reads the chunk's q and P from L2 rather than DRAM: with the value tile as a grid axis
        # of its own, all chunks of one tile ran before any of the next (2 x 64 tiles at V = 128).
        value_tiles = (V + BV - 1) // BV
        pid_chunk = tl.program_id(0) // value_tiles
        pid_v = tl.program_id(0) % value_tiles
        head = tl.program_id(1).to(tl.int64)
        if IS_VARLEN:
            batch, start, length = _varlen_chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, BT)
        else:
            batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
        key_head = head // GROUP
        q_ptr += batch * stride_qb + key_head * stride_qh
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        h_ptr += (pid_chunk.to(tl.int64) * HV + head) * K * V
        dot_dtype = h_ptr.dtype.element_ty

        local = tl.arange(0, BT)
        valid = local < length
        tokens = start + local
        vc = pid_v * BV + tl.arange(0, BV)
        acc = tl.zeros([BT, BV], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            if GATE == 2:
                q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
                q_tile *= tl.exp(_load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K))
            else:
                q_tile = _load_stored_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            state = _load_stored_rows(h_ptr, kc, vc, V, 1, kc < K, V)
            acc += _dot(q_tile, state, dot_dtype, DOT_PRECISION)
        if GATE == 1:
            acc *= tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))[:, None]
        scores = _load_rows(scores_ptr + (batch * T) * HV * BT + head * BT, tokens, local, HV * BT, 1, valid, BT)
        scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
        u = _load_stored_rows(u_ptr + (batch * T) * HV * V + head * V, tokens, vc, HV * V, 1, valid, V)
        acc += _dot(scores, u, dot_dtype, DOT_PRECISION)
        _store_rows(o_ptr + batch * stride_ob + head * stride_oh, acc * scale, tokens, vc, stride_ot, stride_ov,
                    valid, V)
