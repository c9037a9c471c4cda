"""Chunked Triton kernels for the (gated) delta rule, forward and backward.

The forward pass is five small kernels, each one idea (see reference.chunk_delta_rule_ref
for the math they implement):

  1. gate_cumsum     chunk-local cumulative log-gate G (and KDA's gate activation)
  2. decayed_scores  Kdot[t,s] = sum_c k_t k_s e^(G_t-G_s) and P[t,s] = sum_c q_t k_s e^(G_t-G_s)
  3. wy_solve        A = (I + diag(beta) Kdot)^-1, W = A diag(beta)(K*e^G), U~ = A diag(beta) V
  4. state_forward   sequential over chunks: chunk-start states h, corrected values U = U~ - W h
  5. output          O = scale ((Q*e^G) h + P U)

The backward pass recomputes them, then runs state_backward (sequential, reverse),
wy_backward, decayed_scores_backward and gate_cumsum in reverse; a small kernel does the
optional l2norm of q and k both ways.

Precision. Running states, accumulators, gates and the [BT, BT] scores and inverse are fp32.
With half intermediates (_Plan.intermediate_dtype: fp16 inputs, and bf16 ones unless
BF16_INTERMEDIATES is off) the intermediates that feed tensor-core products are stored in the input dtype
(l2normed q and k, W, U~, U, the chunk states h, and the backward's dh and dU), and every product
over K, V or the chunk takes half operands with fp32 accumulation (_dot rounds fp32 register
tiles, e.g. the running state, right before the product), as FLA does. Otherwise intermediates
are fp32 and products exact (fp32 inputs) or tf32 (bf16 inputs with BF16_INTERMEDIATES off; their
l2-normed q and k are stored in fp16, see _Plan.normed_qk_dtype). Each kernel takes its operand
dtype from the stored intermediate it reads (`dot_dtype`), so launchers only pick buffer dtypes.

Gates are natural-log decays, assumed <= 0 as FLA does. Every decay factor in the kernels
is e^x with x <= 0: pairwise decays come from differences G_t - G_s (s <= t), never from
e^G_t / e^G_s, so a strongly decaying chunk underflows to 0 instead of overflowing.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

from .reference import DeltaRuleProblem, check_delta_rule_inputs, kda_gate

from .._triton import direct, dot, interpreted, require_triton, tl, triton, triton_available

__all__ = [
    "MAX_HEAD_DIM",
    "chunk_delta_rule_bwd",
    "chunk_delta_rule_fwd",
    "triton_available",
]

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Half-precision intermediates (_Plan.intermediate_dtype), as FLA keeps them. fp16 ones keep 10
# mantissa bits, as many as the tf32 products they replace: every test case, the ill-conditioned
# aligned-keys ones included, stays within FLA's limits (worst 1.6e-3 relative RMS). bf16 ones keep
# 7: on random inputs o/state/grads stay near 4e-3 against float64, FLA 0.6.0's own errors (3.9e-3
# o, 4.5e-3 dk measured side by side), within its test limits. On aligned keys (in-chunk condition
# numbers ~100) the roundings of U~, U, h, dU and of the products' operands add up to ~1.6e-2 (o)
# and ~5e-2 (dg), over FLA's test limits but again FLA's own errors there (1.5e-2, 4.5e-2); fp32
# intermediates with tf32 products keep 4.5e-3 (o) there, at 1.5-1.75x the time.
# HCCOMPILE_DELTA_RULE_BF16_INTERMEDIATES=0 (read at import; tests and benchmarks set this
# attribute) selects those for bf16 inputs.
BF16_INTERMEDIATES = os.environ.get("HCCOMPILE_DELTA_RULE_BF16_INTERMEDIATES", "1") != "0"
CHUNK_SIZES = (16, 32, 64)
DEFAULT_CHUNK_SIZE = 64
# Per-channel decays cannot be factored over a whole chunk without overflow, so the
# chunk is cut into sub-chunks of this size; blocks off the diagonal are factored
# through the first row of their row sub-chunk, diagonal blocks are summed exactly.
# The triangular solve inverts blocks of the same size first.
SUB_CHUNK = 16
# The score kernels factor a diagonal sub-chunk block too, through its first (or last) row,
# while the sub-chunk's gate span (max over channels of G_first - G_last) is at most this: the
# factors inside the block then stay <= e^40 (~2e17), far from fp32's and bf16's overflow
# (fp16 products take fp32 operands there: _Plan.scores_half_dots). Past it the block is summed
# exactly, one column per step. Read at call time: tests set it to 0 (always exact) or inf.
FACTOR_SPAN_LIMIT = 40.0
MIN_DOT_DIM = 16
# Key/value tiles of the chunk-parallel kernels; the sequential state kernels hold
# the whole key dim and at most STATE_TILE_ELEMENTS of the state per program.
MAX_TILE = 64
STATE_TILE_ELEMENTS = 64 * 64
# state_forward with half intermediates holds half [BT, K] tiles: compiled for sm_90 (Triton 3.8,
# fp16, l2norm), BV = 64 at K = 128 took 188-236 registers, no spills, 88-121 KiB shared memory
# with two stages (none, scalar, channel gates); state_backward at BV = 64 spilled 56-168 bytes
# (scalar, channel) where BV = 32 spilled none, so it keeps STATE_TILE_ELEMENTS. At K = 256,
# BV = 32: state_forward 162-252 registers, no spills, 52 KiB.
HALF_STATE_FORWARD_TILE_ELEMENTS = 128 * 64
# The state sweeps walk each sequence's chunks one after another, one program per (sequence,
# value head, value tile), and each walk is latency-bound. With few sequences x heads (one long
# sequence, a CP shard) the widest tile leaves most SMs idle: the tile is halved (down to
# MIN_DOT_DIM in the forward sweep, MIN_BACKWARD_SWEEP_TILE in the backward ones) while the grid
# would still fill at most half of SWEEP_MIN_PROGRAMS. None means the
# GPU's SM count (no narrowing off CUDA); 0 turns it off. Narrower tiles re-read k and w (from L2)
# once more per tile.
SWEEP_MIN_PROGRAMS: int | None = None
GATE_CODES = {"none": 0, "scalar": 1, "channel": 2}
# Gate activations of gate_cumsum: none, KDA's softplus form, KDA's lower-bound form.
ACTIVATION_NONE, ACTIVATION_SOFTPLUS, ACTIVATION_SIGMOID = 0, 1, 2




if triton is not None:

    # Triton's interpreter multiplies half operands wrongly (see _triton.dot); it decides at
    # kernel definition time, as this does.
    UPCAST_DOT_OPERANDS = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

    @triton.jit
    def _dot(a, b, dtype, DOT_PRECISION: tl.constexpr):
        """a @ b accumulated in fp32, operands rounded to `dtype`: the dtype of the stored
        intermediates (half for half inputs: tensor-core rate; fp32 with ieee otherwise)."""
        return dot(a.to(dtype), b.to(dtype), DOT_PRECISION, UPCAST_DOT_OPERANDS)

    @triton.jit
    def _sequence_bounds(seq, cu_seqlens_ptr, T, IS_VARLEN: tl.constexpr):
        """(batch, bos, eos) of sequence `seq`: a row of the batch, or a cu_seqlens span of batch 0."""
        if IS_VARLEN:
            batch = seq * 0
            bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
            eos = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
        else:
            batch = seq
            bos = (seq * 0).to(tl.int64)
            eos = bos + T
        return batch.to(tl.int64), bos, eos

    @triton.jit
    def _chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, T, NT, BT: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
        """(batch, first token, valid rows) of global chunk `pid_chunk`."""
        if IS_VARLEN:
            seq = tl.load(chunk_table_ptr + 2 * pid_chunk)
            chunk = tl.load(chunk_table_ptr + 2 * pid_chunk + 1)
        else:
            seq = pid_chunk // NT
            chunk = pid_chunk % NT
        batch, bos, eos = _sequence_bounds(seq, cu_seqlens_ptr, T, IS_VARLEN)
        start = bos + chunk.to(tl.int64) * BT
        length = tl.minimum(eos - start, BT)
        return batch, start, length

    @triton.jit
    def _load_rows(ptr, rows, cols, stride_row, stride_col, row_mask, n_cols):
        """ptr[rows, cols] as fp32, zero outside row_mask and [0, n_cols)."""
        ptrs = ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :] * stride_col
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _load_stored_rows(ptr, rows, cols, stride_row, stride_col, row_mask, n_cols):
        """ptr[rows, cols] in the stored dtype (for tiles that only feed _dot), zero outside."""
        ptrs = ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :] * stride_col
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _store_rows(ptr, value, rows, cols, stride_row, stride_col, row_mask, n_cols):
        ptrs = ptr + rows[:, None].to(tl.int64) * stride_row + cols[None, :] * stride_col
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_vector(ptr, row, cols, stride_row, stride_col, valid, n_cols):
        """ptr[row, cols] as an fp32 vector, zero unless `valid` (a scalar).

        The mask is one block comparison against a column count that is 0 when the row is not
        valid (cols >= 0), not `valid & (cols < n_cols)`: a scalar condition joined to a block
        mask is splat into it, and Triton's interpreter gives that splat the compared operands'
        integer dtype instead of int1 (a mask Triton 3.9's interpreter rejects)."""
        ptrs = ptr + row.to(tl.int64) * stride_row + cols * stride_col
        return tl.load(ptrs, mask=cols < tl.where(valid, n_cols, 0), other=0.0).to(tl.float32)

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
    def _gate_offset(batch, head, T, HV, K, GATE: tl.constexpr):
        """Offset of (batch, token 0, head) in the fp32 gate buffers [B, T, HV, K] or [B, T, HV, 1]."""
        width = 1
        if GATE == 2:
            width = K
        return (batch * T * HV + head) * width

    # ------------------------------------------------------------------------------------
    # 1. gate_cumsum

    @triton.jit
    def _gate_cumsum_kernel(
        g_ptr, out_ptr, A_log_ptr, dt_bias_ptr,
        stride_gb, stride_gt, stride_gh, stride_gk,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GK, lower_bound,
        ACTIVATION: tl.constexpr,
        REVERSE: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        IS_VARLEN: tl.constexpr,
    ):
        """out = chunk-local (reverse) cumulative sum over time of act(g); out is fp32 [B, T, HV, GK].

        GK is K for per-channel gates and 1 for scalar ones. The reverse sum is the
        backward of the forward one: dg_t = sum over t' >= t in the chunk of dG_t'.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        lower_bound = tl.cast(lower_bound, tl.float32)
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        pid_k = tl.program_id(2)
        batch, start, length = _chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, T, NT, BT, IS_VARLEN)
        local = tl.arange(0, BT)
        cols = pid_k * BK + tl.arange(0, BK)
        valid = local < length
        g = _load_rows(g_ptr + batch * stride_gb + head * stride_gh, start + local, cols,
                       stride_gt, stride_gk, valid, GK)
        if ACTIVATION != 0:
            rate = tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
            bias = tl.load(dt_bias_ptr + head * GK + cols, mask=cols < GK, other=0.0).to(tl.float32)
            x = g + bias[None, :]
            if ACTIVATION == 1:
                # Linear above 20, as torch's softplus; the clamp keeps exp finite there.
                softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
                g = -rate * softplus
            else:
                g = lower_bound * tl.sigmoid(rate * x)
            g = tl.where(valid[:, None], g, 0.0)
        total = tl.cumsum(g, axis=0)
        if REVERSE:
            total = tl.sum(g, axis=0)[None, :] - total + g
        out_row = HV * GK
        _store_rows(out_ptr + (batch * T) * out_row + head * GK, total, start + local, cols,
                    out_row, 1, valid, GK)

    # ------------------------------------------------------------------------------------
    # 2. decayed_scores

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
        batch, start, length = _chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, T, NT, BT, IS_VARLEN)
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

    # ------------------------------------------------------------------------------------
    # 3. wy_solve

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
    def _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, block_i, block_j,
                     BT: tl.constexpr, BC: tl.constexpr):
        """The [BC, BC] block (block_i > block_j) of L = diag(beta) Kdot, zero in rows past `length`."""
        rows = block_i * BC + tl.arange(0, BC)
        cols = block_j * BC + tl.arange(0, BC)
        valid = rows < length
        beta = tl.load(beta_ptr + (start + rows) * stride_bt, mask=valid, other=0.0).to(tl.float32)
        return _load_rows(kdot_ptr, start + rows, cols, row_stride, 1, valid, BT) * beta[:, None]

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
        k_ptr, v_ptr, beta_ptr, cum_ptr, kdot_ptr, a_ptr, w_ptr, u_ptr,
        stride_kb, stride_kt, stride_kh, stride_kk,
        stride_vb, stride_vt, stride_vh, stride_vv,
        stride_bb, stride_bt, stride_bh,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, V,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        SOLVE: tl.constexpr = True,
    ):
        """A = (I + diag(beta) Kdot)^-1 block by block; W = A diag(beta)(K e^G); U~ = A diag(beta) V.

        Without SOLVE, A is already in `a_ptr` (the forward's, kept for the backward) and only W
        and U~ are formed.

        The NS = BT / BC <= 4 diagonal [BC, BC] blocks are inverted by forward substitution,
        the blocks below them by the block recurrence of _off_diagonal_block ([BC, BC] products
        only), and every block is stored to `a_ptr`. The program then reads its whole [BT, BT]
        A back (the barrier makes its own stores visible) for the tensor-core W and U~ products.
        """
        tl.static_assert(BT // BC <= 4, "wy_solve handles at most four sub-chunks per chunk")
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        batch, start, length = _chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, T, NT, BT, IS_VARLEN)
        key_head = head // GROUP
        k_ptr += batch * stride_kb + key_head * stride_kh
        v_ptr += batch * stride_vb + head * stride_vh
        beta_ptr += batch * stride_bb + head * stride_bh
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        square_offset = (batch * T) * HV * BT + head * BT
        kdot_ptr += square_offset
        a_ptr += square_offset
        row_stride = HV * BT
        NS: tl.constexpr = BT // BC

        if SOLVE:
            # The diagonal blocks' substitutions are independent chains: one loop runs them side by side.
            sub = tl.arange(0, BC)
            a00 = tl.where(sub[:, None] == sub[None, :], 1.0, 0.0)
            a11 = a00
            a22 = a00
            a33 = a00
            for r in range(1, BC):
                a00 = _substitution_step(a00, kdot_ptr, beta_ptr, stride_bt, start, 0, length, row_stride, r, BC)
                if NS >= 2:
                    a11 = _substitution_step(a11, kdot_ptr, beta_ptr, stride_bt, start, BC, length, row_stride, r, BC)
                if NS >= 4:
                    a22 = _substitution_step(a22, kdot_ptr, beta_ptr, stride_bt, start, 2 * BC, length, row_stride, r,
                                             BC)
                    a33 = _substitution_step(a33, kdot_ptr, beta_ptr, stride_bt, start, 3 * BC, length, row_stride, r,
                                             BC)
            _store_block(a_ptr, a00, start, length, row_stride, 0, 0, BT, BC)
            if NS >= 2:
                l10 = _lower_block(kdot_ptr, beta_ptr, stride_bt, start, length, row_stride, 1, 0, BT, BC)
                a10 = _off_diagonal_block(a11, tl.dot(l10, a00, input_precision="ieee"))
                _store_block(a_ptr, a11, start, length, row_stride, 1, 1, BT, BC)
                _store_block(a_ptr, a10, start, length, row_stride, 1, 0, BT, BC)
            if NS >= 4:
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

        local = tl.arange(0, BT)
        valid = local < length
        tokens = start + local
        dot_dtype = w_ptr.dtype.element_ty
        inverse = _load_rows(a_ptr, tokens, local, row_stride, 1, valid, BT).to(dot_dtype)
        beta = tl.load(beta_ptr + tokens * stride_bt, mask=valid, other=0.0).to(tl.float32)
        if GATE == 1:
            gamma = tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K) * beta[:, None]
            if GATE == 2:
                k_tile *= tl.exp(_load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K))
            elif GATE == 1:
                k_tile *= gamma[:, None]
            w = _dot(inverse, k_tile, dot_dtype, DOT_PRECISION)
            _store_rows(w_ptr + (batch * T) * HV * K + head * K, w, tokens, kc, HV * K, 1, valid, K)
        for v0 in range(0, V, BV):
            vc = v0 + tl.arange(0, BV)
            v_tile = _load_rows(v_ptr, tokens, vc, stride_vt, stride_vv, valid, V) * beta[:, None]
            u = _dot(inverse, v_tile, dot_dtype, DOT_PRECISION)
            _store_rows(u_ptr + (batch * T) * HV * V + head * V, u, tokens, vc, HV * V, 1, valid, V)

    # ------------------------------------------------------------------------------------
    # 4. state_forward

    @triton.jit
    def _chunk_end_decays(cum_ptr, tokens, valid, last_token, kc, HV, K, GATE: tl.constexpr):
        """(e^(G_last - G_t) per row [BT, BK] or [BT, 1], e^G_last [BK] or [1]) of one chunk."""
        if GATE == 2:
            g = _load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K)
            g_last = _load_vector(cum_ptr, last_token, kc, HV * K, 1, last_token >= 0, K)
            to_end = tl.exp(tl.where(valid[:, None], g_last[None, :] - g, 0.0))
            whole = tl.exp(g_last)
        else:
            g = tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0)
            g_last = tl.load(cum_ptr + last_token * HV)
            to_end = tl.exp(tl.where(valid, g_last - g, 0.0))[:, None]
            whole = tl.exp(g_last + tl.zeros([1], dtype=tl.float32))
        return to_end, whole

    @triton.jit
    def _state_forward_kernel(
        k_ptr, cum_ptr, w_ptr, u_tilde_ptr, h0_ptr, h_ptr, u_ptr, ht_ptr,
        stride_kb, stride_kt, stride_kh, stride_kk,
        stride_h0n, stride_h0h, stride_h0k, stride_h0v,
        stride_htn, stride_hth, stride_htk, stride_htv,
        chunk_offsets_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, V,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BKF: tl.constexpr,
        BV: tl.constexpr,
        HAS_INITIAL_STATE: tl.constexpr,
        STORE_FINAL_STATE: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Walks one sequence's chunks for one value head and value tile.

        Stores every chunk's starting state h ([chunks, HV, K, V]) and its corrected values
        U = U~ - W h; S_end = e^G_last S + (K e^(G_last - G))^T U. The state is fp32; h, U and
        the products' operands are in the intermediates' dtype (h's).
        """
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        batch, bos, eos = _sequence_bounds(seq, cu_seqlens_ptr, T, IS_VARLEN)
        if IS_VARLEN:
            first_chunk = tl.load(chunk_offsets_ptr + seq).to(tl.int64)
        else:
            first_chunk = seq.to(tl.int64) * NT
        key_head = head // GROUP
        k_ptr += batch * stride_kb + key_head * stride_kh
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        w_ptr += (batch * T) * HV * K + head * K
        u_tilde_ptr += (batch * T) * HV * V + head * V
        u_ptr += (batch * T) * HV * V + head * V

        dot_dtype = h_ptr.dtype.element_ty
        kc = tl.arange(0, BKF)
        vc = pid_v * BV + tl.arange(0, BV)
        local = tl.arange(0, BT)
        if HAS_INITIAL_STATE:
            state = _load_rows(h0_ptr + seq * stride_h0n + head * stride_h0h, kc, vc, stride_h0k, stride_h0v,
                               kc < K, V)
        else:
            state = tl.zeros([BKF, BV], dtype=tl.float32)
        for chunk in range(0, tl.cdiv(eos - bos, BT)):
            start = bos + chunk * BT
            length = tl.minimum(eos - start, BT)
            tokens = start + local
            valid = local < length
            h_chunk_ptr = h_ptr + ((first_chunk + chunk) * HV + head) * K * V
            _store_rows(h_chunk_ptr, state, kc, vc, V, 1, kc < K, V)
            w = _load_stored_rows(w_ptr, tokens, kc, HV * K, 1, valid, K)
            u = _load_rows(u_tilde_ptr, tokens, vc, HV * V, 1, valid, V)
            u -= _dot(w, state, dot_dtype, DOT_PRECISION)
            _store_rows(u_ptr, u, tokens, vc, HV * V, 1, valid, V)
            if GATE != 0:
                k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K, GATE)
                k_tile *= to_end
                state *= whole[:, None]
            else:
                k_tile = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            state += _dot(tl.trans(k_tile), u, dot_dtype, DOT_PRECISION)
        if STORE_FINAL_STATE:
            _store_rows(ht_ptr + seq * stride_htn + head * stride_hth, state, kc, vc, stride_htk, stride_htv,
                        kc < K, V)

    # ------------------------------------------------------------------------------------
    # 5. output

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
        """O = scale ((Q e^G) h + P U) for one chunk, value head and value tile."""
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        batch, start, length = _chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, T, NT, BT, IS_VARLEN)
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

    # ------------------------------------------------------------------------------------
    # Backward 1. state_backward

    @triton.jit
    def _state_backward_kernel(
        q_ptr, k_ptr, cum_ptr, w_ptr, scores_ptr, do_ptr, dht_ptr, dh_ptr, du_ptr, dh0_ptr,
        stride_qb, stride_qt, stride_qh, stride_qk,
        stride_kb, stride_kt, stride_kh, stride_kk,
        stride_dob, stride_dot, stride_doh, stride_dov,
        stride_dhtn, stride_dhth, stride_dhtk, stride_dhtv,
        stride_dh0n, stride_dh0h, stride_dh0k, stride_dh0v,
        chunk_offsets_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, V, scale,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BKF: tl.constexpr,
        BV: tl.constexpr,
        HAS_FINAL_STATE_GRAD: tl.constexpr,
        STORE_INITIAL_STATE_GRAD: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Walks one sequence's chunks backwards for one value head and value tile.

        With dS the gradient of a chunk's end state: stores dS per chunk (dh), the full
        gradient of the corrected values dU = scale P^T dO + (K e^(G_last - G)) dS, and
        passes dS_start = scale (Q e^G)^T dO + e^G_last dS - W^T dU to the chunk before.
        dS is fp32; dh, dU and the products' operands are in the intermediates' dtype (w's).
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        batch, bos, eos = _sequence_bounds(seq, cu_seqlens_ptr, T, IS_VARLEN)
        if IS_VARLEN:
            first_chunk = tl.load(chunk_offsets_ptr + seq).to(tl.int64)
        else:
            first_chunk = seq.to(tl.int64) * NT
        key_head = head // GROUP
        q_ptr += batch * stride_qb + key_head * stride_qh
        k_ptr += batch * stride_kb + key_head * stride_kh
        do_ptr += batch * stride_dob + head * stride_doh
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        w_ptr += (batch * T) * HV * K + head * K
        scores_ptr += (batch * T) * HV * BT + head * BT
        du_ptr += (batch * T) * HV * V + head * V

        dot_dtype = w_ptr.dtype.element_ty
        kc = tl.arange(0, BKF)
        vc = pid_v * BV + tl.arange(0, BV)
        local = tl.arange(0, BT)
        if HAS_FINAL_STATE_GRAD:
            dstate = _load_rows(dht_ptr + seq * stride_dhtn + head * stride_dhth, kc, vc, stride_dhtk, stride_dhtv,
                                kc < K, V)
        else:
            dstate = tl.zeros([BKF, BV], dtype=tl.float32)
        num_chunks = tl.cdiv(eos - bos, BT)
        for step in range(0, num_chunks):
            chunk = num_chunks - 1 - step
            start = bos + chunk * BT
            length = tl.minimum(eos - start, BT)
            tokens = start + local
            valid = local < length
            _store_rows(dh_ptr + ((first_chunk + chunk) * HV + head) * K * V, dstate, kc, vc, V, 1, kc < K, V)
            do_tile = _load_stored_rows(do_ptr, tokens, vc, stride_dot, stride_dov, valid, V)
            scores = _load_rows(scores_ptr, tokens, local, HV * BT, 1, valid, BT)
            scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
            du = scale * _dot(tl.trans(scores), do_tile, dot_dtype, DOT_PRECISION)
            if GATE != 0:
                k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
                to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K, GATE)
                k_tile *= to_end
                if GATE == 2:
                    q_tile *= tl.exp(_load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K))
                else:
                    q_tile *= tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))[:, None]
            else:
                k_tile = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                q_tile = _load_stored_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            du += _dot(k_tile, dstate, dot_dtype, DOT_PRECISION)
            _store_rows(du_ptr, du, tokens, vc, HV * V, 1, valid, V)
            w = _load_stored_rows(w_ptr, tokens, kc, HV * K, 1, valid, K)
            if GATE != 0:
                dstate *= whole[:, None]
            dstate += scale * _dot(tl.trans(q_tile), do_tile, dot_dtype, DOT_PRECISION)
            dstate -= _dot(tl.trans(w), du, dot_dtype, DOT_PRECISION)
        if STORE_INITIAL_STATE_GRAD:
            _store_rows(dh0_ptr + seq * stride_dh0n + head * stride_dh0h, dstate, kc, vc, stride_dh0k, stride_dh0v,
                        kc < K, V)

    # ------------------------------------------------------------------------------------
    # Backward 2. wy_backward

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
    ):
        """Per chunk and value head, everything but the pairwise-decay terms.

        Through U = A diag(beta) V - W h and W = A diag(beta)(K e^G): dv, dbeta (complete);
        through O's (Q e^G) h and S_end's terms: partial dq, dk and dG (the gradient of the
        cumulative gate). Stores dKdot = beta * dL with dL = -A^T dA A^T (strictly lower) and
        dP = scale dO U^T (lower) for decayed_scores_backward.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        batch, start, length = _chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, T, NT, BT, IS_VARLEN)
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
        # Stored now rather than at the end: one [BT, BT] tile fewer held through the key loop.
        d_scores = tl.where((local[:, None] >= local[None, :]) & valid[:, None], scale * d_scores, 0.0)
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
        _store_rows(dkdot_ptr + square_offset, d_lower * beta[:, None], tokens, local, HV * BT, 1, valid, BT)

    # ------------------------------------------------------------------------------------
    # Backward 3. decayed_scores_backward

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
        batch, start, length = _chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, T, NT, BT, IS_VARLEN)
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

    # ------------------------------------------------------------------------------------
    # In-kernel l2norm of q and k

    @triton.jit
    def _l2norm_kernel(
        x_ptr, y_ptr, dy_ptr, dx_ptr,
        stride_xb, stride_xt, stride_xh, stride_xk,
        stride_db, stride_dt, stride_dh, stride_dk,
        T, H, K, n_rows,
        BACKWARD: tl.constexpr,
        BR: tl.constexpr,
        BK: tl.constexpr,
    ):
        """Forward: y = x / sqrt(sum x^2 + 1e-6), contiguous [B, T, H, K] in y's dtype.

        Backward: dx = (dy - y (y . dy)) / sqrt(sum x^2 + 1e-6), in dx's dtype and layout
        (dy is fp32 contiguous, dx strided like x).
        """
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        valid = rows < n_rows
        batch = (rows // (T * H)).to(tl.int64)
        token = ((rows // H) % T).to(tl.int64)
        head = (rows % H).to(tl.int64)
        cols = tl.arange(0, BK)
        mask = valid[:, None] & (cols[None, :] < K)
        x_offsets = (batch * stride_xb + token * stride_xt + head * stride_xh)[:, None] + cols[None, :] * stride_xk
        x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)
        y = x * rstd[:, None]
        flat = rows[:, None].to(tl.int64) * K + cols[None, :]
        if BACKWARD:
            dy = tl.load(dy_ptr + flat, mask=mask, other=0.0)
            dx = (dy - y * tl.sum(y * dy, axis=1)[:, None]) * rstd[:, None]
            d_offsets = (batch * stride_db + token * stride_dt + head * stride_dh)[:, None] + cols[None, :] * stride_dk
            tl.store(dx_ptr + d_offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(y_ptr + flat, y.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------
# Launchers


def _kernels_interpreted() -> bool:
    return interpreted(_output_kernel)


def _require_triton(device: torch.device) -> None:
    require_triton(device, _output_kernel, "hccompile.kernels.delta_rule.chunk", "chunk_delta_rule_ref")


def _check_kernel_inputs(problem: DeltaRuleProblem, chunk_size, **named) -> None:
    """Checks beyond shapes: dtypes, devices, head-dim limits and the chunk size."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size!r}")
    for name, dim in (("q", problem.key_dim), ("v", problem.value_dim)):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {dim} exceeds the supported maximum {MAX_HEAD_DIM}")
    device = named["q"].device
    for name, tensor in named.items():
        if tensor is None:
            continue
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name}: dtype {tensor.dtype} is not supported; expected one of float16, bfloat16, float32"
            )
        if name in ("k", "v") and tensor.dtype != named["q"].dtype:
            raise TypeError(f"{name}: dtype {tensor.dtype} differs from q's dtype {named['q'].dtype}")
        if tensor.device != device:
            raise ValueError(f"{name}: device {tensor.device} differs from q's device {device}")


def _check_out(name: str, out, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(out.shape)} differs from the expected {shape}")
    if out.dtype != dtype:
        raise TypeError(f"{name}: dtype {out.dtype} differs from the expected {dtype}")
    if out.device != device:
        raise ValueError(f"{name}: device {out.device} differs from the expected {device}")


def _block(dim: int, limit: int = MAX_TILE) -> int:
    return min(max(MIN_DOT_DIM, triton.next_power_of_2(dim)), limit)


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


# The narrowest value tile of the backward sweeps (state_backward, CP's summary sweeps). On the
# H100 (Triton 3.6), state_backward with 16-wide tiles, K = 128 and bf16 inputs returned a wrong
# initial-state gradient (relative RMS 0.27-0.33 against fp64; every other output right, and fp32
# inputs right), at T = 70 (two chunks); 32-wide tiles were right in every GPU test. The
# interpreter cannot show it (tests/kernels/test_delta_rule_chunk.py has the case).
MIN_BACKWARD_SWEEP_TILE = 32


def _narrow_for_occupancy(block_v: int, walks: int, value_dim: int, device: torch.device,
                          floor: int = MIN_DOT_DIM) -> int:
    """Halves a sweep's value tile, not below `floor`, while `walks` (sequences x value heads)
    times the tile count would fill at most half of SWEEP_MIN_PROGRAMS programs (see there)."""
    target = _multiprocessor_count(device) if SWEEP_MIN_PROGRAMS is None else SWEEP_MIN_PROGRAMS
    while block_v > floor and 2 * walks * triton.cdiv(value_dim, block_v) <= target:
        block_v //= 2
    return block_v


def _state_forward_block_v(block_k_full: int, value_dim: int, intermediate_dtype: torch.dtype, walks: int,
                           device: torch.device) -> int:
    """BV of state_forward (and CP's forward sweep) for `walks` = sequences x value heads."""
    elements = STATE_TILE_ELEMENTS if intermediate_dtype == torch.float32 else HALF_STATE_FORWARD_TILE_ELEMENTS
    widest = min(_block(value_dim), max(MIN_DOT_DIM, elements // block_k_full))
    return _narrow_for_occupancy(widest, walks, value_dim, device)


def _state_backward_block_v(block_k_full: int, value_dim: int, walks: int, device: torch.device) -> int:
    """BV of state_backward (and CP's backward sweep)."""
    widest = min(_block(value_dim), max(MIN_DOT_DIM, STATE_TILE_ELEMENTS // block_k_full))
    return _narrow_for_occupancy(widest, walks, value_dim, device, floor=MIN_BACKWARD_SWEEP_TILE)


def _state_launch_options(block_k_full: int, dtype: torch.dtype) -> dict[str, int]:
    """num_warps and num_stages of the sequential state kernels; `dtype` is the one of the k they read
    (the input's, or the intermediates' after the in-kernel l2norm).

    They hold [chunk, K] tiles of the whole key dim: more warps mean fewer spills. Each
    software-pipelining stage keeps another copy of those tiles in shared memory; compiled
    for sm_90 (Triton 3.8), two stages at K = 128 took 148-173 KiB for half inputs and up to
    217 KiB for fp32, three stages over 227 KiB (an H100's limit), so deeper ones are avoided.
    """
    num_warps = 4 if block_k_full <= 64 else 8
    two_stages = block_k_full <= 64 or (block_k_full == 128 and dtype != torch.float32)
    return {"num_warps": num_warps, "num_stages": 2 if two_stages else 1}


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


def _wy_solve_options(plan: "_Plan") -> dict[str, int]:
    """wy_solve's substitution is a chain of [16, 16] steps: with half inputs 2 warps took 1-5 % less
    than 4 (8 warps 1 % more), although they spill 8-96 bytes per thread at sm_90. fp32 inputs' exact
    (ieee) products spilled 10 KiB per thread at 2 warps, 5.5 KiB at 4 and 232-272 bytes at 8."""
    return {"num_warps": 8 if plan.input_dtype == torch.float32 else 2}


def _scores_warps(gate: str, backward: bool) -> int:
    """num_warps of decayed_scores (backward=False) and decayed_scores_backward. Without per-channel
    gates a program holds the whole chunk's [BT, BT] scores, and in the backward dKdot and dP next
    to four [BT, BK] products (at BT = BK = 64, sm_90, Triton 3.8, 4 warps spilled 264 bytes per
    thread, 8 none). With them a program holds [BC, BT] rows and [BT, BK] tiles: 4 warps were 2 %
    (forward) and 5-6 % (backward) faster than 8 over the whole step, although the backward then
    spills 32 bytes."""
    return 8 if backward and gate != "channel" else 4


@dataclass
class _Plan:
    """Launch geometry shared by the forward and backward launchers."""

    problem: DeltaRuleProblem
    chunk_size: int
    num_chunks: int  # over all sequences
    chunks_per_row: int  # NT, for fixed-length batches
    chunk_table: torch.Tensor | None  # [num_chunks, 2] (sequence, chunk) for varlen
    chunk_offsets: torch.Tensor | None  # [N] first global chunk of each sequence, for varlen
    cu_seqlens: torch.Tensor | None
    gate_code: int
    input_dtype: torch.dtype  # q's (and k's, v's)
    dummy: torch.Tensor  # stands in for absent optional tensors
    launch: Callable = direct  # wraps a kernel before its launch (see _make_plan)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def intermediate_dtype(self) -> torch.dtype:
        """dtype of the stored intermediates that feed the tensor-core products (l2normed q and
        k, W, U~, U, h, dh, dU), hence of those products' operands: fp16 for fp16 inputs, as FLA
        does; bf16 for bf16 inputs unless BF16_INTERMEDIATES is off (see there); fp32 otherwise.
        States, accumulators, gates, scores and the in-chunk inverse stay fp32 either way."""
        if self.input_dtype == torch.float16 or (self.input_dtype == torch.bfloat16 and BF16_INTERMEDIATES):
            return self.input_dtype
        return torch.float32

    @property
    def normed_qk_dtype(self) -> torch.dtype:
        """dtype of the in-kernel l2-normed q and k: the intermediates', except fp16 for bf16
        inputs whose intermediates are fp32. A unit vector's elements need no more range than
        fp16's, and its 10 mantissa bits are as many as the tf32 products they feed keep; half
        the bytes of fp32 in every kernel that reads q or k, and the state sweeps then fit two
        software-pipelining stages (_state_launch_options). Compiled for sm_90 (Triton 3.8, bf16
        with l2norm), state_backward's spills went from 320/400 to 96/232 bytes per thread at
        K = 128 (scalar/channel gates), state_forward's stay 0 with the second stage."""
        if self.input_dtype == torch.bfloat16 and self.intermediate_dtype == torch.float32:
            return torch.float16
        return self.intermediate_dtype

    @property
    def half_dots(self) -> bool:
        """Whether the products take half operands (the kernels without a stored intermediate to
        take the dtype from are told so)."""
        return self.intermediate_dtype != torch.float32

    @property
    def scores_half_dots(self) -> bool:
        """half_dots of the score kernels. With per-channel gates their factored diagonal blocks
        hold factors up to e^FACTOR_SPAN_LIMIT, past fp16's range: fp16 intermediates take fp32
        (tf32) operands there, bf16 ones (fp32's range) stay half."""
        return self.half_dots and not (self.gate_code == GATE_CODES["channel"]
                                       and self.intermediate_dtype == torch.float16)

    @property
    def dot_precision(self) -> str:
        """input_precision of the products with fp32 operands: exact for fp32 inputs (tf32, the GPU
        default, would cost about three digits), tf32 for half inputs."""
        return "ieee" if self.input_dtype == torch.float32 else "tf32"

    def chunk_args(self):
        table = self.chunk_table if self.chunk_table is not None else self.dummy
        seqlens = self.cu_seqlens if self.cu_seqlens is not None else self.dummy
        return table, seqlens


@functools.lru_cache(maxsize=16)
def _dummy(device: torch.device) -> torch.Tensor:
    """Stands in for absent optional tensors; never read or written by the kernels. One per
    device instead of an allocation and a fill on every call."""
    return torch.zeros(2, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=64)
def _varlen_chunk_tables(lengths: tuple[int, ...], chunk_size: int, device: torch.device):
    """(chunk_table [chunks, 2] (sequence, chunk), chunk_offsets [N]) as int32 device tensors.
    Cached by the sequence lengths: a training loop that repeats its packing (or a benchmark)
    pays the host-to-device copies once. The kernels only read them."""
    counts = [triton.cdiv(length, chunk_size) for length in lengths]
    pairs = [(seq, chunk) for seq, count in enumerate(counts) for chunk in range(count)]
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    chunk_table = torch.tensor(pairs or [(0, 0)], dtype=torch.int32, device=device)
    chunk_offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
    return chunk_table, chunk_offsets


def _make_plan(problem: DeltaRuleProblem, chunk_size: int, cu_seqlens, q: torch.Tensor,
               launch: Callable = direct, dummy: torch.Tensor | None = None) -> _Plan:
    """`launch` wraps each kernel before its launch: `direct`, or torch's wrap_triton when the
    launches are traced for Inductor (lowering/_launch.py; fixed-length rows only). `dummy`: a
    float32 tensor of at least 2 elements for the absent optional tensors (default: a cached one)."""
    device = q.device
    chunk_table = chunk_offsets = None
    if cu_seqlens is not None:
        lengths = tuple(eos - bos for _, bos, eos in problem.sequences)
        chunk_table, chunk_offsets = _varlen_chunk_tables(lengths, chunk_size, device)
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
        num_chunks = sum(triton.cdiv(length, chunk_size) for length in lengths)
    else:
        num_chunks = problem.batch * triton.cdiv(problem.time, chunk_size)
    if dummy is None:
        # traced: a buffer of the graph's own (a cached tensor would be a fake one, kept)
        dummy = torch.empty(2, dtype=torch.float32, device=device) if launch is not direct else _dummy(device)
    return _Plan(
        problem=problem,
        chunk_size=chunk_size,
        num_chunks=num_chunks,
        chunks_per_row=triton.cdiv(problem.time, chunk_size),
        chunk_table=chunk_table,
        chunk_offsets=chunk_offsets,
        cu_seqlens=cu_seqlens,
        gate_code=GATE_CODES[problem.gate],
        input_dtype=q.dtype,
        dummy=dummy,
        launch=launch,
    )


@dataclass
class _Forward:
    """Intermediates of the forward pass, all contiguous; fp32 but for w, u and h (the plan's
    intermediate_dtype) and the l2normed q and k (its normed_qk_dtype)."""

    q: torch.Tensor  # q or its l2norm
    k: torch.Tensor
    cum: torch.Tensor | None  # [B, T, HV, K or 1] chunk-local cumulative log-gate
    kdot: torch.Tensor  # [B, T, HV, BT]
    scores: torch.Tensor  # [B, T, HV, BT]
    inverse: torch.Tensor  # [B, T, HV, BT]
    w: torch.Tensor  # [B, T, HV, K]
    u: torch.Tensor  # [B, T, HV, V] corrected values
    h: torch.Tensor  # [chunks, HV, K, V] chunk-start states


# Rows of q or k per l2norm program, and its warps (read at call time: benchmarks/tune_delta_rule.py
# times other values).
L2NORM_BLOCK_ROWS = 16
L2NORM_WARPS = 4


def _l2norm_forward(x: torch.Tensor, dtype: torch.dtype, launch: Callable = direct) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6), contiguous, in `dtype` (the plan's normed_qk_dtype)."""
    batch, time, heads, dim = x.shape
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    n_rows = batch * time * heads
    if n_rows:
        launch(_l2norm_kernel)[(triton.cdiv(n_rows, L2NORM_BLOCK_ROWS),)](
            x, y, y, y, *x.stride(), *x.stride(), time, heads, dim, n_rows,
            BACKWARD=False, BR=L2NORM_BLOCK_ROWS, BK=_block(dim, MAX_HEAD_DIM), num_warps=L2NORM_WARPS,
        )
    return y


def _l2norm_backward(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, launch: Callable = direct) -> None:
    batch, time, heads, dim = x.shape
    n_rows = batch * time * heads
    if n_rows:
        launch(_l2norm_kernel)[(triton.cdiv(n_rows, L2NORM_BLOCK_ROWS),)](
            x, x, dy, dx, *x.stride(), *dx.stride(), time, heads, dim, n_rows,
            BACKWARD=True, BR=L2NORM_BLOCK_ROWS, BK=_block(dim, MAX_HEAD_DIM), num_warps=L2NORM_WARPS,
        )


def _gate_cumsum(plan: _Plan, g: torch.Tensor, activation: int, A_log, dt_bias, lower_bound, reverse: bool,
                 out: torch.Tensor | None = None):
    """The chunk-local (reverse) cumulative sum, fp32 [B, T, HV, K or 1], into `out` when given."""
    problem = plan.problem
    width = problem.key_dim if problem.gate == "channel" else 1
    if out is None:
        out = torch.empty(problem.batch, problem.time, problem.value_heads, width, dtype=torch.float32,
                          device=g.device)
    strides = g.stride() if g.dim() == 4 else (*g.stride(), 0)
    block_k = _block(width)
    table, seqlens = plan.chunk_args()
    dummy = plan.dummy
    plan.launch(_gate_cumsum_kernel)[(plan.num_chunks, problem.value_heads, triton.cdiv(width, block_k))](
        g, out, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        *strides, table, seqlens,
        problem.time, plan.chunks_per_row, problem.value_heads, width,
        float(lower_bound) if lower_bound is not None else 0.0,
        ACTIVATION=activation, REVERSE=reverse, BT=plan.chunk_size, BK=block_k, IS_VARLEN=plan.varlen,
    )
    return out


def _scores_block_k(plan: _Plan) -> int:
    """BK of the score kernels: with per-channel gates and fp32 inputs (exact fp32 products, no
    tensor cores) 64 spilled in decayed_scores (sm_90, Triton 3.8, 8 warps: 72 bytes); 32 does not."""
    block_k = _block(plan.problem.key_dim)
    if plan.gate_code == GATE_CODES["channel"] and plan.input_dtype == torch.float32:
        return min(block_k, 32)
    return block_k


def _score_launch(plan: _Plan, num_chunks: int, table, seqlens, backward: bool):
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


def _launch_decayed_scores(plan: _Plan, q, k, cum, kdot, scores, num_chunks: int, table, seqlens) -> None:
    """decayed_scores (chunk.py's forward and CP's share it)."""
    grid, args, constants = _score_launch(plan, num_chunks, table, seqlens, backward=False)
    plan.launch(_decayed_scores_kernel)[grid](q, k, cum, kdot, scores, *q.stride(), *k.stride(), *args, **constants)


def _launch_scores_backward(plan: _Plan, q, k, cum, dkdot, dscores, dq_heads, dk_heads, dcum, num_chunks: int,
                            table, seqlens) -> None:
    """decayed_scores_backward (chunk.py's backward and CP's)."""
    grid, args, constants = _score_launch(plan, num_chunks, table, seqlens, backward=True)
    plan.launch(_decayed_scores_backward_kernel)[grid](q, k, cum, dkdot, dscores, dq_heads, dk_heads, dcum, *q.stride(),
                                          *k.stride(), *args, **constants)


def _forward(plan: _Plan, q, k, v, beta, g, scale, initial_state, final_state, o, use_qk_l2norm_in_kernel,
             A_log, dt_bias, lower_bound, kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
             ) -> _Forward:
    """Runs the five forward kernels; writes o and final_state (when not None). With `kept`, the
    (kdot, scores, inverse) of an earlier forward on the same inputs, decayed_scores and the WY
    solve are skipped: wy_solve only forms W and U~ from the kept inverse."""
    problem = plan.problem
    batch, time, value_heads = problem.batch, problem.time, problem.value_heads
    key_dim, value_dim = problem.key_dim, problem.value_dim
    chunk = plan.chunk_size
    device = q.device
    stored = plan.intermediate_dtype
    if use_qk_l2norm_in_kernel:
        q, k = (_l2norm_forward(x, plan.normed_qk_dtype, plan.launch) for x in (q, k))
    table, seqlens = plan.chunk_args()
    common = dict(IS_VARLEN=plan.varlen)

    def buffer(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=device)

    cum = None
    if problem.gate != "none" and plan.num_chunks:
        if problem.gate_in_kernel:
            activation = ACTIVATION_SOFTPLUS if lower_bound is None else ACTIVATION_SIGMOID
        else:
            activation = ACTIVATION_NONE
        cum = _gate_cumsum(plan, g, activation, A_log, dt_bias, lower_bound, reverse=False)
    cum_arg = cum if cum is not None else plan.dummy

    if kept is None:
        kdot, scores, inverse = (buffer(batch, time, value_heads, chunk) for _ in range(3))
    else:
        kdot, scores, inverse = kept
    w = buffer(batch, time, value_heads, key_dim, dtype=stored)
    u_tilde = buffer(batch, time, value_heads, value_dim, dtype=stored)
    u = buffer(batch, time, value_heads, value_dim, dtype=stored)
    h = buffer(max(plan.num_chunks, 1), value_heads, key_dim, value_dim, dtype=stored)
    block_k = _block(key_dim)
    block_v = _block(value_dim)
    group = problem.group_size
    nt = plan.chunks_per_row
    if plan.num_chunks:
        if kept is None:
            _launch_decayed_scores(plan, q, k, cum_arg, kdot, scores, plan.num_chunks, table, seqlens)
        plan.launch(_wy_solve_kernel)[(plan.num_chunks, value_heads)](
            k, v, beta, cum_arg, kdot, inverse, w, u_tilde, *k.stride(), *v.stride(), *beta.stride(),
            table, seqlens, time, nt, value_heads, group, key_dim, value_dim,
            GATE=plan.gate_code, BT=chunk, BC=min(chunk, SUB_CHUNK), BK=block_k, BV=block_v,
            DOT_PRECISION=plan.dot_precision, SOLVE=kept is None, **_wy_solve_options(plan), **common,
        )
    block_k_full = _block(key_dim, MAX_HEAD_DIM)
    block_v_state = _state_forward_block_v(block_k_full, value_dim, stored, problem.num_sequences * value_heads,
                                           device)
    h0 = initial_state if initial_state is not None else plan.dummy
    h0_strides = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    ht = final_state if final_state is not None else plan.dummy
    ht_strides = final_state.stride() if final_state is not None else (0, 0, 0, 0)
    if problem.num_sequences and (final_state is not None or plan.num_chunks):
        plan.launch(_state_forward_kernel)[(problem.num_sequences, value_heads, triton.cdiv(value_dim, block_v_state))](
            k, cum_arg, w, u_tilde, h0, h, u, ht, *k.stride(), *h0_strides, *ht_strides,
            plan.chunk_offsets if plan.chunk_offsets is not None else plan.dummy, seqlens,
            time, nt, value_heads, group, key_dim, value_dim,
            GATE=plan.gate_code, BT=chunk, BKF=block_k_full, BV=block_v_state,
            HAS_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=final_state is not None,
            DOT_PRECISION=plan.dot_precision, **_state_launch_options(block_k_full, k.dtype), **common,
        )
    if o is not None and plan.num_chunks:
        plan.launch(_output_kernel)[(plan.num_chunks, value_heads, triton.cdiv(value_dim, block_v))](
            q, cum_arg, h, scores, u, o, *q.stride(), *o.stride(), table, seqlens,
            time, nt, value_heads, group, key_dim, value_dim, float(scale),
            GATE=plan.gate_code, BT=chunk, BK=block_k, BV=block_v, DOT_PRECISION=plan.dot_precision, **common,
        )
    return _Forward(q=q, k=k, cum=cum, kdot=kdot, scores=scores, inverse=inverse, w=w, u=u, h=h)


def _validate(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound, chunk_size,
              **extra):
    problem = check_delta_rule_inputs(
        q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound, **extra
    )
    _check_kernel_inputs(problem, chunk_size, q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state,
                         A_log=A_log, dt_bias=dt_bias, **extra)
    return problem


def chunk_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    gate: str | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    out: torch.Tensor | None = None,
    final_state_out: torch.Tensor | None = None,
    return_intermediates: bool = False,
    wrap: Callable | None = None,
    dummy: torch.Tensor | None = None,
):
    """Chunked delta rule forward; arguments as naive_recurrent_delta_rule, plus chunk_size (16, 32, 64).

    Returns (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] fp32 or None), written
    into `out` / `final_state_out` when given (final_state_out implies output_final_state).
    With return_intermediates, a third element: the (kdot, scores, inverse) intra-chunk matrices,
    each fp32 [B, T, HV, chunk_size], which chunk_delta_rule_bwd(intermediates=...) then reuses
    instead of recomputing them (FLA keeps its score matrices and solved A the same way).
    `wrap`: torch.library.wrap_triton when the launches are traced for Inductor (fixed-length rows);
    `dummy`: a float32 tensor of >= 2 elements standing in for absent optional tensors (never read).
    """
    problem = _validate(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound,
                        chunk_size)
    o_shape = (problem.batch, problem.time, problem.value_heads, problem.value_dim)
    if out is None:
        out = torch.empty(o_shape, dtype=v.dtype, device=v.device)
    else:
        _check_out("out", out, o_shape, v.dtype, v.device)
    state_shape = (problem.num_sequences, problem.value_heads, problem.key_dim, problem.value_dim)
    if final_state_out is not None:
        _check_out("final_state_out", final_state_out, state_shape, torch.float32, v.device)
    elif output_final_state:
        final_state_out = torch.empty(state_shape, dtype=torch.float32, device=v.device)
    _require_triton(q.device)
    scale = problem.key_dim**-0.5 if scale is None else scale
    plan = _make_plan(problem, chunk_size, cu_seqlens, q, wrap or direct, dummy)
    fwd = _forward(plan, q, k, v, beta, g, scale, initial_state, final_state_out, out, use_qk_l2norm_in_kernel,
                   A_log, dt_bias, lower_bound)
    if return_intermediates:
        return out, final_state_out, (fwd.kdot, fwd.scores, fwd.inverse)
    return out, final_state_out


GRADIENT_NAMES = ("q", "k", "v", "beta", "g", "initial_state", "A_log", "dt_bias")


def _sum_key_groups(heads: torch.Tensor, key_heads: int, group: int) -> torch.Tensor:
    """Value heads sharing a key head add their key gradients: [B, T, HV, K] -> [B, T, H, K].
    Without GVA there is nothing to add, and no pass over the fp32 gradients is spent on it."""
    if group == 1:
        return heads
    batch, time, _, key_dim = heads.shape
    return heads.view(batch, time, key_heads, group, key_dim).sum(3)


def _gate_activation_backward(g_raw, dg, A_log, dt_bias, lower_bound):
    """(dg_raw, dA_log, ddt_bias) through kda_gate by autograd: it is elementwise and cheap."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (g_raw, A_log, dt_bias)]
        gate = kda_gate(*leaves, lower_bound=lower_bound)
        return torch.autograd.grad(gate, leaves, dg)


def chunk_delta_rule_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    gate: str | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    out: dict[str, torch.Tensor] | None = None,
    intermediates: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    wrap: Callable | None = None,
    dummy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """Gradients of chunk_delta_rule_fwd given do = dL/do and dht = dL/d(final state) (optional).

    Takes the forward's inputs (it recomputes the forward intermediates) and returns a dict
    keyed by input name: "q", "k", "v", "beta", "g", "initial_state", "A_log", "dt_bias";
    a gradient is None where its input was None. Each has its input's dtype and shape ("g"
    is the gradient of the raw g_raw when A_log/dt_bias are given). Gradients are written
    into the tensors of `out` (same keys, any subset) when given. `intermediates`: the
    (kdot, scores, inverse) that chunk_delta_rule_fwd(return_intermediates=True) returned for
    the same inputs and chunk size; the recomputation then skips them. `wrap`, `dummy`: as the forward's.
    """
    problem = _validate(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound,
                        chunk_size, do=do, dht=dht)
    inputs = dict(zip(GRADIENT_NAMES, (q, k, v, beta, g, initial_state, A_log, dt_bias)))
    out = dict(out or {})
    for name, given in out.items():
        if name not in GRADIENT_NAMES:
            raise ValueError(f"out: unknown gradient {name!r}; expected keys among {GRADIENT_NAMES}")
        if inputs[name] is None:
            raise ValueError(f"out[{name!r}]: given, but input {name} is None")
        like = inputs[name]
        _check_out(f"out[{name!r}]", given, tuple(like.shape), like.dtype, like.device)
    _require_triton(q.device)
    scale = problem.key_dim**-0.5 if scale is None else scale
    if intermediates is not None:
        square = (problem.batch, problem.time, problem.value_heads, chunk_size)
        if len(intermediates) != 3:
            raise ValueError(f"intermediates: expected (kdot, scores, inverse), got {len(intermediates)} tensors")
        for name, given in zip(("kdot", "scores", "inverse"), intermediates):
            _check_out(f"intermediates {name}", given, square, torch.float32, q.device)
            if not given.is_contiguous():
                raise ValueError(f"intermediates {name}: expected a contiguous tensor")
    plan = _make_plan(problem, chunk_size, cu_seqlens, q, wrap or direct, dummy)
    fwd = _forward(plan, q, k, v, beta, g, scale, initial_state, None, None, use_qk_l2norm_in_kernel,
                   A_log, dt_bias, lower_bound, kept=None if intermediates is None else tuple(intermediates))

    batch, time, value_heads = problem.batch, problem.time, problem.value_heads
    key_dim, value_dim, chunk = problem.key_dim, problem.value_dim, plan.chunk_size
    device = q.device

    def buffer(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=device)

    def result(name):
        return out[name] if name in out else torch.empty_like(inputs[name], memory_format=torch.contiguous_format)

    dv, dbeta = result("v"), result("beta")
    dh0 = result("initial_state") if initial_state is not None else None
    dq_heads, dk_heads = buffer(batch, time, value_heads, key_dim), buffer(batch, time, value_heads, key_dim)
    gate_width = key_dim if problem.gate == "channel" else 1
    dcum = buffer(batch, time, value_heads, gate_width) if problem.gate != "none" else plan.dummy
    dh = buffer(max(plan.num_chunks, 1), value_heads, key_dim, value_dim, dtype=plan.intermediate_dtype)
    du = buffer(batch, time, value_heads, value_dim, dtype=plan.intermediate_dtype)
    dkdot, dscores = buffer(batch, time, value_heads, chunk), buffer(batch, time, value_heads, chunk)
    cum_arg = fwd.cum if fwd.cum is not None else plan.dummy
    table, seqlens = plan.chunk_args()
    group, nt = problem.group_size, plan.chunks_per_row
    block_k, block_v = _block(key_dim), _block(value_dim)
    block_k_full = _block(key_dim, MAX_HEAD_DIM)
    block_v_state = _state_backward_block_v(block_k_full, value_dim, problem.num_sequences * value_heads, device)
    common = dict(GATE=plan.gate_code, BT=chunk, IS_VARLEN=plan.varlen, DOT_PRECISION=plan.dot_precision)
    no_strides = (0, 0, 0, 0)

    if problem.num_sequences and (plan.num_chunks or dh0 is not None):
        plan.launch(_state_backward_kernel)[(problem.num_sequences, value_heads, triton.cdiv(value_dim, block_v_state))](
            fwd.q, fwd.k, cum_arg, fwd.w, fwd.scores, do, dht if dht is not None else plan.dummy, dh, du,
            dh0 if dh0 is not None else plan.dummy,
            *fwd.q.stride(), *fwd.k.stride(), *do.stride(),
            *(dht.stride() if dht is not None else no_strides), *(dh0.stride() if dh0 is not None else no_strides),
            plan.chunk_offsets if plan.chunk_offsets is not None else plan.dummy, seqlens,
            time, nt, value_heads, group, key_dim, value_dim, float(scale),
            BKF=block_k_full, BV=block_v_state,
            HAS_FINAL_STATE_GRAD=dht is not None, STORE_INITIAL_STATE_GRAD=dh0 is not None,
            **_state_launch_options(block_k_full, fwd.k.dtype), **common,
        )
    if plan.num_chunks:
        plan.launch(_wy_backward_kernel)[(plan.num_chunks, value_heads)](
            fwd.q, fwd.k, v, beta, do, cum_arg, fwd.inverse, fwd.kdot, fwd.u, du, fwd.h, dh,
            dv, dbeta, dq_heads, dk_heads, dcum, dkdot, dscores,
            *fwd.q.stride(), *fwd.k.stride(), *v.stride(), *beta.stride(), *do.stride(), *dv.stride(),
            *dbeta.stride(), table, seqlens,
            time, nt, value_heads, group, key_dim, value_dim, float(scale),
            BK=block_k, BV=block_v, **WY_BACKWARD_OPTIONS, **common,
        )
        _launch_scores_backward(plan, fwd.q, fwd.k, cum_arg, dkdot, dscores, dq_heads, dk_heads, dcum,
                                plan.num_chunks, table, seqlens)
    else:
        dq_heads.zero_()
        dk_heads.zero_()
        if problem.gate != "none":
            dcum.zero_()

    dq_sum = _sum_key_groups(dq_heads, problem.key_heads, group)
    dk_sum = _sum_key_groups(dk_heads, problem.key_heads, group)
    grads: dict[str, torch.Tensor | None] = dict.fromkeys(GRADIENT_NAMES)
    for name, x, dx_sum in (("q", q, dq_sum), ("k", k, dk_sum)):
        dx = result(name)
        if use_qk_l2norm_in_kernel:
            _l2norm_backward(x, dx_sum, dx, plan.launch)
        else:
            dx.copy_(dx_sum)
        grads[name] = dx
    grads["v"], grads["beta"], grads["initial_state"] = dv, dbeta, dh0

    if problem.gate != "none":
        # d(loss)/dg_t is the sum of d(loss)/dG over the rest of t's chunk.
        dg_out = result("g")
        # The reverse sum writes g's gradient in place when nothing follows it (no gate activation)
        # and it has the sum's dtype and layout: no copy of a [B, T, HV, K] tensor.
        in_place = (plan.num_chunks and not problem.gate_in_kernel and dg_out.dtype == torch.float32
                  and dg_out.is_contiguous())
        if plan.num_chunks:
            dg = _gate_cumsum(plan, dcum, ACTIVATION_NONE, None, None, None, reverse=True,
                              out=dg_out.view(batch, time, value_heads, gate_width) if in_place else None)
        else:
            dg = torch.zeros(batch, time, value_heads, gate_width, dtype=torch.float32, device=device)
        dg = dg.view(g.shape) if problem.gate == "channel" else dg.view(batch, time, value_heads)
        if problem.gate_in_kernel:
            dg, dA_log, ddt_bias = _gate_activation_backward(g, dg, A_log, dt_bias, lower_bound)
            for name, grad in (("A_log", dA_log), ("dt_bias", ddt_bias)):
                grads[name] = out[name].copy_(grad) if name in out else grad.to(inputs[name].dtype)
        grads["g"] = dg_out if in_place else dg_out.copy_(dg)
    return grads
