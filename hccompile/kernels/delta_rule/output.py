"""Step 5 of the forward (output): O = scale ((Q e^G) h + P U) per chunk, value head and value tile,
from the chunk-start states h and corrected values U of state_forward (state.py). Chunk-parallel, as
every step but the state sweeps.

The scores P[t, s] = sum_c q_t k_s e^(G_t - G_s) (s <= t) come from decayed_scores (scores.py), or
without per-channel gates (plan.fused_scores_forward) are formed here, as FLA's chunk_fwd_o does: one
more [BT, BK] x [BK, BT] product per key tile, from the k tiles instead of a stored [BT, BT] fp32 P
(the same bytes at bf16), and no decayed_scores launch. A forward that keeps its intermediates has
the first value tile's program store P, in the intermediates' dtype (every consumer rounds P to it
before its products: the backward sees the operands it would have seen); the backward's
recomputation, which needs P but no O, runs the kernel in a P-only mode (one program per chunk and
value head), so that kept and recomputed P are the same kernel's, bit for bit.
"""

from __future__ import annotations

from .plan import Plan, block_size

from .._triton import cdiv, tl, triton


def output_grid(num_chunks, value_heads: int, value_dim: int, block_v: int) -> tuple:
    """_output_kernel's grid: (chunks x value tiles, value heads), the value tiles of one chunk
    neighbouring programs (the kernel decodes its first program id so)."""
    return (num_chunks * cdiv(value_dim, block_v), value_heads)


if triton is not None:
    from .tiles import (_dot, _gate_offset, _load_rows, _load_stored_rows, _pair_decays, _row_chunk_coords,
                        _store_rows, _varlen_chunk_coords)

    @triton.jit
    def _output_kernel(
        q_ptr, k_ptr, cum_ptr, h_ptr, scores_ptr, u_ptr, o_ptr,
        stride_qb, stride_qt, stride_qh, stride_qk,
        stride_kb, stride_kt, stride_kh, stride_kk,
        stride_ob, stride_ot, stride_oh, stride_ov,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, V, scale,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FORM_SCORES: tl.constexpr,
        STORE_SCORES: tl.constexpr,
        SCORES_ONLY: tl.constexpr,
    ):
        """O = scale ((Q e^G) h + P U) for one chunk, value head and value tile; grid (chunks x value
        tiles, value heads).

        P is read from scores_ptr ([B, T, HV, BT], decayed_scores'), or with FORM_SCORES (no gate or
        a scalar one) formed from q and k (k_ptr, [B, T, H, K] like q) and the pair decays; with
        STORE_SCORES the program of the first value tile stores it to scores_ptr (its dtype). With
        SCORES_ONLY (and FORM_SCORES) the grid is (chunks, value heads) and P is all it forms and
        stores: h, u and o are not touched; the products' operands take scores_ptr's dtype."""
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        if SCORES_ONLY:
            tl.static_assert(FORM_SCORES, "the P-only mode forms P")
            pid_chunk = tl.program_id(0)
            pid_v = tl.program_id(0) * 0
        else:
            # The value tiles of one chunk are neighbouring programs (the grid's fastest axis), so the
            # second reads the chunk's q and P (or k) from L2 rather than DRAM: with the value tile as a
            # grid axis of its own, all chunks of one tile ran before any of the next (2 x 64 tiles at
            # V = 128).
            value_tiles = (V + BV - 1) // BV
            pid_chunk = tl.program_id(0) // value_tiles
            pid_v = tl.program_id(0) % value_tiles
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
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        scores_ptr += (batch * T) * HV * BT + head * BT
        h_ptr += (pid_chunk.to(tl.int64) * HV + head) * K * V
        if SCORES_ONLY:
            dot_dtype = scores_ptr.dtype.element_ty
        else:
            dot_dtype = h_ptr.dtype.element_ty

        local = tl.arange(0, BT)
        valid = local < length
        tokens = start + local
        vc = pid_v * BV + tl.arange(0, BV)
        acc = tl.zeros([BT, BV], dtype=tl.float32)
        scores = tl.zeros([BT, BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            if GATE == 2:
                q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
                q_tile *= tl.exp(_load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K))
            else:
                q_tile = _load_stored_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            if not SCORES_ONLY:
                state = _load_stored_rows(h_ptr, kc, vc, V, 1, kc < K, V)
                acc += _dot(q_tile, state, dot_dtype, DOT_PRECISION)
            if FORM_SCORES:
                tl.static_assert(GATE != 2, "per-channel decays take decayed_scores' sub-chunk factoring")
                # decayed_scores' operands: q and k in their stored dtype, rounded to the products'.
                k_tile = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                scores += _dot(q_tile, tl.trans(k_tile), dot_dtype, DOT_PRECISION)
        if FORM_SCORES:
            if GATE == 1:
                scores *= _pair_decays(cum_ptr, tokens, valid, HV, BT)
            else:
                scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
            if STORE_SCORES or SCORES_ONLY:
                # One program per chunk stores: the first value tile's (a column count of 0 masks the
                # others' stores, see tiles._load_vector on scalar conditions in masks).
                _store_rows(scores_ptr, scores, tokens, local, HV * BT, 1, valid, tl.where(pid_v == 0, BT, 0))
        else:
            scores = _load_rows(scores_ptr, tokens, local, HV * BT, 1, valid, BT)
            scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
        if not SCORES_ONLY:
            if GATE == 1:
                acc *= tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))[:, None]
            u = _load_stored_rows(u_ptr + (batch * T) * HV * V + head * V, tokens, vc, HV * V, 1, valid, V)
            acc += _dot(scores, u, dot_dtype, DOT_PRECISION)
            _store_rows(o_ptr + batch * stride_ob + head * stride_oh, acc * scale, tokens, vc, stride_ot, stride_ov,
                        valid, V)

    # The same kernel under a second JIT handle for the P-only launches of a recomputing backward (same
    # source): a compiled graph names kernels, and hccompile.lowering tells the backward op's launches
    # from the forward op's (whose first kernel is _output_kernel) by the handle.
    _output_scores_kernel = triton.jit(_output_kernel.fn)


# The value tile of the output kernel, read at launch time. Each value tile's program forms (or
# loads) the chunk's whole P, so a wider tile forms it fewer times (at V 128: once per chunk and
# head instead of twice) for a [BT, BV] fp32 accumulator twice as large. On one H200 (session 45,
# tune_delta_rule.py, fwd+bwd) 128 against 64: GDN B1 T32768 H16 D128 4.147 / 4.178 ms, KDA B4 T4096
# 4.429 / 4.443, KDA B1 9.910 / 9.945. sm_90 (Triton 3.6, K = V = 128 bf16): 168-176 registers, no
# spills, 96 KiB shared (64: 72-104 registers).
OUTPUT_BLOCK_V = 128


def launch_output(plan: Plan, q, k, cum, h, scores, u, o, num_chunks, table, seqlens, scale: float, *,
                  form_scores: bool, store_scores: bool = False) -> None:
    """_output_kernel on `num_chunks` chunks (the first `table` lists, varlen; `h` starts at the first):
    O into `o`. `form_scores`: P formed in the kernel (plan.fused_scores_forward) rather than read from
    `scores`; `store_scores`: then also stored into `scores` (chunk.py's forward keeping its
    intermediates). chunk.py and cp.py launch it.

    Triton's default launch options (4 warps, 3 stages), untimed with FORM_SCORES: compiled for sm_90
    (B1 T32768 H16 D128 bf16 GDN's specialization, benchmarks/sm90_registers.py, Triton 3.9 / 3.6) the
    kernel took 139 / 134 registers forming P (149 / 146 storing it; reading decayed_scores' P: 96), no
    spills, 72 KiB of shared memory (48 reading P); the P-only mode 105 / 104 registers."""
    problem = plan.problem
    block_v = block_size(problem.value_dim, OUTPUT_BLOCK_V)
    plan.launch(_output_kernel)[output_grid(num_chunks, problem.value_heads, problem.value_dim, block_v)](
        q, k, cum, h, scores, u, o, *q.stride(), *k.stride(), *o.stride(), table, seqlens,
        problem.time, plan.chunks_per_row, problem.value_heads, problem.group_size, problem.key_dim,
        problem.value_dim, float(scale), GATE=plan.gate_code, BT=plan.chunk_size, BK=block_size(problem.key_dim),
        BV=block_v, IS_VARLEN=plan.varlen, DOT_PRECISION=plan.dot_precision, FORM_SCORES=form_scores,
        STORE_SCORES=store_scores, SCORES_ONLY=False,
    )


def launch_scores_only(plan: Plan, q, k, cum, scores, num_chunks, table, seqlens) -> None:
    """_output_kernel's P-only mode on `num_chunks` chunks: P = (Q K^T) o D into `scores` (its dtype
    is the products' operands'), for a backward that recomputes the forward without its output
    (plan.fused_scores_forward). chunk.py's chunk_local_steps launches it, for CP's backward too."""
    problem = plan.problem
    dummy = plan.dummy
    plan.launch(_output_scores_kernel)[(num_chunks, problem.value_heads)](
        q, k, cum, dummy, scores, dummy, dummy, *q.stride(), *k.stride(), 0, 0, 0, 0, table, seqlens,
        problem.time, plan.chunks_per_row, problem.value_heads, problem.group_size, problem.key_dim,
        problem.value_dim, 1.0, GATE=plan.gate_code, BT=plan.chunk_size, BK=block_size(problem.key_dim),
        BV=block_size(problem.value_dim), IS_VARLEN=plan.varlen, DOT_PRECISION=plan.dot_precision,
        FORM_SCORES=True, STORE_SCORES=False, SCORES_ONLY=True,
    )
