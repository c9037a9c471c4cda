"""Chunked Triton kernels for lightning attention: causal linear attention with a constant
per-head decay (lightning attention 2 / FLA's ``g_gamma``), forward and backward.

Per head h with log-decay gamma <= 0, layout [B, T, H, D] (see decay_reference.py):

    o_t = scale * sum_{s <= t} exp(gamma (t - s)) (q_t . k_s) v_s + scale * exp(gamma (t + 1)) q_t S_0

Split (lightning attention 2): time is cut into blocks of BLOCK rows. For a block starting at t0
with L = min(BLOCK, T - t0) rows, local row l:

    inter:  o[t0 + l] += scale * exp(gamma (l + 1)) q[t0 + l] S_c        (S_c: state entering the block)
    intra:  o[t0 + l] += scale * sum_{m <= l} exp(gamma (l - m)) (q_l . k_m) v_m
    state:  S_{c+1} = exp(gamma L) S_c + sum_m exp(gamma (L - 1 - m)) k_m v_m^T      (fp32)

Backward (the design of seed 004, with decay): the intra-block terms are computed micro-chunk by
micro-chunk, CBLOCK rows at a time, recomputing each [CBLOCK, CBLOCK] score tile when it is needed;
no program ever holds a [BLOCK, BLOCK] tile and nothing is accumulated with atomics. The inter-block
terms come from a state sweep whose step is the SAME BLOCK as the intra-block split (the split is
exact only then; REFERENCE.md section 4): a forward sweep over the state S for dq, a reverse sweep
over dS = dL/dS_c for dk and dv:

    dq[t0 + l] = scale exp(gamma (l + 1)) do_l S_c^T + sum_{m <= l} scale exp(gamma (l - m)) (do_l . v_m) k_m
    dk[t0 + m] = exp(gamma (L - 1 - m)) v_m dS_{c+1}^T + sum_{l >= m} scale exp(gamma (l - m)) (do_l . v_m) q_l
    dv[t0 + m] = exp(gamma (L - 1 - m)) k_m dS_{c+1}   + sum_{l >= m} scale exp(gamma (l - m)) (q_l . k_m) do_l
    dS_c = exp(gamma L) dS_{c+1} + scale sum_l exp(gamma (l + 1)) q_l do_l^T,   dS_N = dht,   dh0 = dS_0

The forward and the dq computation have the same shape ("forward sweep": out_i from a_i, b_j, c_j
and a state X of b^T c), and so have dk and dv ("reverse sweep"), so there are two kernels:

    _forward_sweep_kernel:  o  = sweep(a=q,  b=k, c=v),  X = S   [K, V tile]   (+ final state)
                            dq = sweep(a=do, b=v, c=k),  X = S^T [V, K tile]
    _reverse_sweep_kernel:  dk = sweep(a=v,  b=do, c=q), X = dS^T [V, K tile]
                            dv = sweep(a=k,  b=q, c=do), X = dS   [K, V tile]  (+ dh0)

Parallelism along time (segments): one program per (batch, head) sweeping the whole sequence
leaves most of a GPU idle (B1 T32768 H16 is 16 programs). Time is therefore cut into segments
of whole blocks, and each sweep program starts from its segment's state, made by two small
passes: a parallel summary (what each segment adds to the state: one matrix product per
segment) and a sequential prefix over the segments of each sequence (not over blocks). This
is the affine-summary idea of context parallelism (seed 002) inside one GPU; it is exact for any
segment length, and the block and micro-chunk split inside a segment stays the one above.
Variable-length batches (FLA's cu_seqlens) are segments that never cross a sequence boundary.

The decay is a constant: no gradient is computed for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .decay_reference import check_cu_seqlens, check_decay_and_state
from .reference import check_attention_shapes
# The dtype, device and head-dim limits are the simple kernels' (same MAX_HEAD_DIM, same dtypes).
from .simple import MAX_HEAD_DIM, SUPPORTED_DTYPES, _check_kernel_inputs

from .._triton import direct, dot, interpreted, load_tile, require_triton, tl, triton, triton_available

__all__ = [
    "MAX_HEAD_DIM",
    "lightning_attn_fwd",
    "lightning_attn_bwd",
    "triton_available",
]

DEFAULT_BLOCK = 64
# The forward holds one [CBLOCK, CBLOCK] score tile at a time; the backward's micro-chunk keeps
# its shared memory small (seed 004: 64 KB at D=128 with these defaults, read off the compiled
# kernel by benchmarks/lightning.py). Both are exact for any power of two <= BLOCK. Defaults,
# column tiles and warps measured on an H100 (benchmarks/lightning_tune.py, BENCHMARKS.md).
DEFAULT_FORWARD_CBLOCK = 64
DEFAULT_BACKWARD_CBLOCK = 32
# The tiled (non-contracted) head dim: output columns are independent, so splitting them over
# programs costs recomputing the score tiles and rereading a, b; wider tiles add registers.
FORWARD_COLUMN_TILE, FORWARD_WARPS = 128, 8
BACKWARD_COLUMN_TILE, BACKWARD_WARPS = 64, 4
DEFAULT_CBLOCK = DEFAULT_BACKWARD_CBLOCK
MAX_BLOCK = 256
# tl.dot needs every block dim to be at least 16.
MIN_DOT_DIM = 16
# Triton software-pipelines the inner loops, keeping one copy of the loaded tiles per stage.
PIPELINE_SHARED_MEMORY_BUDGET = 96 * 1024
MAX_PIPELINE_STAGES = 3
# Segments: the auto length aims at this many sweep programs per streaming multiprocessor, and
# never goes below MIN_SEGMENT rows, where the fp32 summaries would outweigh q, k, v.
SWEEP_WAVES = 8
MIN_SEGMENT = 256
# Summary pass: rows per step and the state tile per program; prefix pass: its state tile.
SUMMARY_CHUNK = 64
SUMMARY_ROW_TILE = 128
SUMMARY_COLUMN_TILE = 64
PREFIX_TILE = 64


if triton is not None:

    @triton.jit
    def _decay_tile(gamma, distance, scale):
        """scale * exp(gamma * distance) where distance >= 0, else 0 (the causal mask)."""
        # Clamping first keeps the masked entries' exponent <= 0, so nothing overflows.
        weights = tl.exp(gamma * tl.maximum(distance, 0).to(tl.float32)) * scale
        return tl.where(distance >= 0, weights, 0.0)

    @triton.jit
    def _table_segment(table_ptr, seg):
        """(batch index, first token, length) of segment `seg`: a row of the varlen table."""
        row = table_ptr + seg * 4
        return tl.load(row).to(tl.int64), tl.load(row + 1).to(tl.int64), tl.load(row + 2)

    @triton.jit
    def _fixed_segment(seg, time, seg_length, per_sequence):
        """(batch index, first token, length) of segment `seg` of fixed-length rows of `time`
        tokens cut into `per_sequence` segments of `seg_length`: from the index itself, no table,
        so the plan needs no tensor values and can be traced.

        A kernel calls this one or _table_segment under its IS_VARLEN branch, never one helper
        given the table either way: torch's mutation analysis takes what a call returns as derived
        from every pointer passed to it, so a store at an address built from the batch index would
        count as a write to the table, whatever stands in for it (a traced graph input)."""
        within = seg % per_sequence
        start = within * seg_length
        return (seg // per_sequence).to(tl.int64), start.to(tl.int64), tl.minimum(time - start, seg_length)

    @triton.jit
    def _segment_summary_kernel(
        b_ptr, c_ptr, decay_ptr, table_ptr, x_ptr,
        stride_bb, stride_bt, stride_bh, stride_bd,
        stride_cb, stride_ct, stride_ch, stride_cd,
        stride_xs, stride_xh, stride_xr, stride_xc,
        stride_decay,
        H, DIM_B, DIM_C, scale, time, seg_length, per_sequence,
        IS_VARLEN: tl.constexpr,
        REVERSE: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_OPERANDS: tl.constexpr,
    ):
        """x[seg] = sum_m w_m b_m^T c_m over the rows m (local index) of one segment, with
        w_m = exp(g (L - 1 - m)) (forward: what the segment adds to the state at its end) or
        w_m = scale exp(g (m + 1)) (reverse: what it adds to the gradient state at its start).

        Every segment's summary is independent, so this pass is parallel over the whole sequence;
        only the small prefix pass below is sequential, and over segments, not blocks.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        pid_sh = tl.program_id(0)
        seg = pid_sh // H
        head = (pid_sh % H).to(tl.int64)
        if IS_VARLEN:
            batch, start, seg_len = _table_segment(table_ptr, seg)
        else:
            batch, start, seg_len = _fixed_segment(seg, time, seg_length, per_sequence)
        b_ptr += batch * stride_bb + start * stride_bt + head * stride_bh
        c_ptr += batch * stride_cb + start * stride_ct + head * stride_ch
        gamma = tl.load(decay_ptr + head * stride_decay).to(tl.float32)

        rows = tl.arange(0, CHUNK)
        b_cols = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        c_cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        acc = tl.zeros([BLOCK_B, BLOCK_C], dtype=tl.float32)
        for chunk_start in range(0, seg_len, CHUNK):
            local = chunk_start + rows
            b_rows = load_tile(b_ptr, local, b_cols, stride_bt, stride_bd, seg_len, DIM_B)
            c_rows = load_tile(c_ptr, local, c_cols, stride_ct, stride_cd, seg_len, DIM_C)
            if REVERSE:
                weights = tl.exp(gamma * (local + 1).to(tl.float32)) * scale
            else:
                weights = tl.exp(gamma * tl.maximum(seg_len - 1 - local, 0).to(tl.float32))
            weights = tl.where(local < seg_len, weights, 0.0)
            b_rows = (b_rows * weights[:, None]).to(c_rows.dtype)
            acc += dot(tl.trans(b_rows), c_rows, DOT_PRECISION, UPCAST_OPERANDS)
        x_ptr += seg.to(tl.int64) * stride_xs + head * stride_xh
        x_ptrs = x_ptr + b_cols[:, None] * stride_xr + c_cols[None, :] * stride_xc
        tl.store(x_ptrs, acc, mask=(b_cols[:, None] < DIM_B) & (c_cols[None, :] < DIM_C))

    @triton.jit
    def _segment_prefix_kernel(
        x_ptr, decay_ptr, table_ptr, first_segment_ptr, x0_ptr, xt_ptr,
        stride_xs, stride_xh, stride_xr, stride_xc,
        stride_x0n, stride_x0h, stride_x0r, stride_x0c,
        stride_xtn, stride_xth, stride_xtr, stride_xtc,
        stride_decay,
        H, DIM_B, DIM_C, time, seg_length, per_sequence,
        IS_VARLEN: tl.constexpr,
        REVERSE: tl.constexpr,
        HAS_X0: tl.constexpr,
        STORE_XT: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """Turns one sequence's segment summaries, in place, into the state each segment's sweep
        starts from: X = x0, then per segment (first to last; last to first if REVERSE)
        x[s] <- X and X <- exp(g L_s) X + x[s]. The last X is the final state (forward) or the
        initial state's gradient (reverse), stored when STORE_XT."""
        pid_nh = tl.program_id(0)
        seq = pid_nh // H
        head = (pid_nh % H).to(tl.int64)
        gamma = tl.load(decay_ptr + head * stride_decay).to(tl.float32)
        if IS_VARLEN:
            first = tl.load(first_segment_ptr + seq)
            count = tl.load(first_segment_ptr + seq + 1) - first
        else:
            first = seq * per_sequence
            count = per_sequence
        rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < DIM_B) & (cols[None, :] < DIM_C)
        seq = seq.to(tl.int64)
        if HAS_X0:
            x0_ptrs = x0_ptr + seq * stride_x0n + head * stride_x0h
            state = tl.load(x0_ptrs + rows[:, None] * stride_x0r + cols[None, :] * stride_x0c,
                            mask=mask, other=0.0).to(tl.float32)
        else:
            state = tl.zeros([BLOCK_B, BLOCK_C], dtype=tl.float32)
        for i in range(0, count):
            if REVERSE:
                seg = first + count - 1 - i
            else:
                seg = first + i
            if IS_VARLEN:
                _, _, seg_len = _table_segment(table_ptr, seg)
            else:
                _, _, seg_len = _fixed_segment(seg, time, seg_length, per_sequence)
            ptrs = x_ptr + seg.to(tl.int64) * stride_xs + head * stride_xh
            ptrs += rows[:, None] * stride_xr + cols[None, :] * stride_xc
            summary = tl.load(ptrs, mask=mask, other=0.0)
            tl.store(ptrs, state, mask=mask)
            state = state * tl.exp(gamma * seg_len.to(tl.float32)) + summary
        if STORE_XT:
            xt_ptrs = xt_ptr + seq * stride_xtn + head * stride_xth
            xt_ptrs += rows[:, None] * stride_xtr + cols[None, :] * stride_xtc
            tl.store(xt_ptrs, state.to(xt_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _forward_sweep_kernel(
        a_ptr, b_ptr, c_ptr, decay_ptr, table_ptr, x_ptr, out_ptr,
        stride_ab, stride_at, stride_ah, stride_ad,
        stride_bb, stride_bt, stride_bh, stride_bd,
        stride_cb, stride_ct, stride_ch, stride_cd,
        stride_ob, stride_ot, stride_oh, stride_od,
        stride_xs, stride_xh, stride_xr, stride_xc,
        stride_decay,
        H, DIM_AB, DIM_C, scale, time, seg_length, per_sequence,
        IS_VARLEN: tl.constexpr,
        BLOCK: tl.constexpr,
        CBLOCK: tl.constexpr,
        BLOCK_AB: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_OPERANDS: tl.constexpr,
    ):
        """out[t] = scale sum_{s<=t} exp(g (t-s)) (a_t . b_s) c_s + scale exp(g (t+1)) a_t X_seg
        for the rows t of one segment, X_seg its starting state (from the prefix pass).

        One program: one (segment, head) and one c-column tile, sequential over blocks of BLOCK
        rows; inside a block, micro-chunks of CBLOCK query rows against micro-chunks of CBLOCK
        key rows. Holds the fp32 state X [BLOCK_AB, BLOCK_C] (b^T c summed over past blocks).
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        pid_sh = tl.program_id(0)
        pid_c = tl.program_id(1)
        seg = pid_sh // H
        head = (pid_sh % H).to(tl.int64)
        if IS_VARLEN:
            batch, start, T = _table_segment(table_ptr, seg)
        else:
            batch, start, T = _fixed_segment(seg, time, seg_length, per_sequence)
        a_ptr += batch * stride_ab + start * stride_at + head * stride_ah
        b_ptr += batch * stride_bb + start * stride_bt + head * stride_bh
        c_ptr += batch * stride_cb + start * stride_ct + head * stride_ch
        out_ptr += batch * stride_ob + start * stride_ot + head * stride_oh
        gamma = tl.load(decay_ptr + head * stride_decay).to(tl.float32)

        micro = tl.arange(0, CBLOCK)
        ab_cols = tl.arange(0, BLOCK_AB)
        c_cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        x_ptr += seg.to(tl.int64) * stride_xs + head * stride_xh
        state = load_tile(x_ptr, ab_cols, c_cols, stride_xr, stride_xc, DIM_AB, DIM_C)

        for block_start in range(0, T, BLOCK):
            block_len = tl.minimum(T - block_start, BLOCK)
            n_micro = tl.cdiv(block_len, CBLOCK)
            # Intra-block terms plus the inter-block term from the state entering the block.
            for i in range(0, n_micro):
                local_i = i * CBLOCK + micro
                rows_i = block_start + local_i
                a_i = load_tile(a_ptr, rows_i, ab_cols, stride_at, stride_ad, T, DIM_AB)
                row_decay = tl.where(local_i < block_len, tl.exp(gamma * (local_i + 1).to(tl.float32)) * scale, 0.0)
                acc = dot(a_i, state.to(a_i.dtype), DOT_PRECISION, UPCAST_OPERANDS) * row_decay[:, None]
                for j in range(0, i + 1):
                    rows_j = block_start + j * CBLOCK + micro
                    b_j = load_tile(b_ptr, rows_j, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                    c_j = load_tile(c_ptr, rows_j, c_cols, stride_ct, stride_cd, T, DIM_C)
                    distance = (i - j) * CBLOCK + micro[:, None] - micro[None, :]
                    scores = dot(a_i, tl.trans(b_j), DOT_PRECISION, UPCAST_OPERANDS)
                    scores = scores * _decay_tile(gamma, distance, scale)
                    acc += dot(scores.to(c_j.dtype), c_j, DOT_PRECISION, UPCAST_OPERANDS)
                out_ptrs = out_ptr + rows_i[:, None] * stride_ot + c_cols[None, :] * stride_od
                out_mask = (rows_i[:, None] < T) & (c_cols[None, :] < DIM_C)
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
            # State step over the whole block: the same BLOCK as the intra split above. The
            # segment's last step is never read (the prefix pass made the next segment's state).
            if block_start + BLOCK < T:
                state = state * tl.exp(gamma * block_len.to(tl.float32))
                for j in range(0, n_micro):
                    local_j = j * CBLOCK + micro
                    rows_j = block_start + local_j
                    b_j = load_tile(b_ptr, rows_j, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                    c_j = load_tile(c_ptr, rows_j, c_cols, stride_ct, stride_cd, T, DIM_C)
                    key_decay = tl.where(
                        local_j < block_len, tl.exp(gamma * (block_len - 1 - local_j).to(tl.float32)), 0.0
                    )
                    b_j = (b_j * key_decay[:, None]).to(c_j.dtype)
                    state += dot(tl.trans(b_j), c_j, DOT_PRECISION, UPCAST_OPERANDS)

    @triton.jit
    def _reverse_sweep_kernel(
        a_ptr, b_ptr, c_ptr, decay_ptr, table_ptr, x_ptr, out_ptr,
        stride_ab, stride_at, stride_ah, stride_ad,
        stride_bb, stride_bt, stride_bh, stride_bd,
        stride_cb, stride_ct, stride_ch, stride_cd,
        stride_ob, stride_ot, stride_oh, stride_od,
        stride_xs, stride_xh, stride_xr, stride_xc,
        stride_decay,
        H, DIM_AB, DIM_C, scale, time, seg_length, per_sequence,
        IS_VARLEN: tl.constexpr,
        BLOCK: tl.constexpr,
        CBLOCK: tl.constexpr,
        BLOCK_AB: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_OPERANDS: tl.constexpr,
    ):
        """out[s] = scale sum_{t>=s} exp(g (t-s)) (b_t . a_s) c_t + exp(g (L-1-m)) a_s X_{c+1}.

        The reverse sweep over one segment: blocks from last to first, starting from the state
        X at the segment's end (from the reverse prefix pass), X_c = exp(g L) X_{c+1} +
        scale sum_l exp(g (l+1)) b_l^T c_l. Inside a block, each key micro-chunk j sums over
        query micro-chunks i >= j, recomputing the [CBLOCK, CBLOCK] score tile; one writer per
        output row.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        pid_sh = tl.program_id(0)
        pid_c = tl.program_id(1)
        seg = pid_sh // H
        head = (pid_sh % H).to(tl.int64)
        if IS_VARLEN:
            batch, start, T = _table_segment(table_ptr, seg)
        else:
            batch, start, T = _fixed_segment(seg, time, seg_length, per_sequence)
        a_ptr += batch * stride_ab + start * stride_at + head * stride_ah
        b_ptr += batch * stride_bb + start * stride_bt + head * stride_bh
        c_ptr += batch * stride_cb + start * stride_ct + head * stride_ch
        out_ptr += batch * stride_ob + start * stride_ot + head * stride_oh
        gamma = tl.load(decay_ptr + head * stride_decay).to(tl.float32)

        micro = tl.arange(0, CBLOCK)
        ab_cols = tl.arange(0, BLOCK_AB)
        c_cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        x_ptr += seg.to(tl.int64) * stride_xs + head * stride_xh
        state = load_tile(x_ptr, ab_cols, c_cols, stride_xr, stride_xc, DIM_AB, DIM_C)

        n_blocks = tl.cdiv(T, BLOCK)
        for reversed_index in range(0, n_blocks):
            block_start = (n_blocks - 1 - reversed_index) * BLOCK
            block_len = tl.minimum(T - block_start, BLOCK)
            n_micro = tl.cdiv(block_len, CBLOCK)
            # `state` is X_{c+1}: the gradient of the state leaving this block.
            for j in range(0, n_micro):
                local_j = j * CBLOCK + micro
                rows_j = block_start + local_j
                a_j = load_tile(a_ptr, rows_j, ab_cols, stride_at, stride_ad, T, DIM_AB)
                key_decay = tl.where(
                    local_j < block_len, tl.exp(gamma * (block_len - 1 - local_j).to(tl.float32)), 0.0
                )
                acc = dot(a_j, state.to(a_j.dtype), DOT_PRECISION, UPCAST_OPERANDS) * key_decay[:, None]
                for i in range(j, n_micro):
                    rows_i = block_start + i * CBLOCK + micro
                    b_i = load_tile(b_ptr, rows_i, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                    c_i = load_tile(c_ptr, rows_i, c_cols, stride_ct, stride_cd, T, DIM_C)
                    # scores[r, m] for query row r of micro-chunk i and key row m of micro-chunk j.
                    distance = (i - j) * CBLOCK + micro[:, None] - micro[None, :]
                    scores = dot(b_i, tl.trans(a_j), DOT_PRECISION, UPCAST_OPERANDS)
                    scores = scores * _decay_tile(gamma, distance, scale)
                    acc += dot(tl.trans(scores.to(c_i.dtype)), c_i, DOT_PRECISION, UPCAST_OPERANDS)
                out_ptrs = out_ptr + rows_j[:, None] * stride_ot + c_cols[None, :] * stride_od
                out_mask = (rows_j[:, None] < T) & (c_cols[None, :] < DIM_C)
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
            # State step over the whole block: the same BLOCK as the intra split above; the
            # segment's first block needs none (the prefix pass made the previous segment's).
            if block_start > 0:
                state = state * tl.exp(gamma * block_len.to(tl.float32))
                for i in range(0, n_micro):
                    local_i = i * CBLOCK + micro
                    rows_i = block_start + local_i
                    b_i = load_tile(b_ptr, rows_i, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                    c_i = load_tile(c_ptr, rows_i, c_cols, stride_ct, stride_cd, T, DIM_C)
                    row_decay = tl.where(local_i < block_len, tl.exp(gamma * (local_i + 1).to(tl.float32)) * scale, 0.0)
                    c_i = (c_i * row_decay[:, None]).to(c_i.dtype)
                    state += dot(tl.trans(b_i), c_i, DOT_PRECISION, UPCAST_OPERANDS)


    # The forward sweep under a second JIT handle for the backward's launch (same source, same
    # binary): a compiled graph names kernels, and hccompile.lowering tells the backward op's
    # launches from the forward op's by the handle.
    _forward_sweep_bwd_kernel = triton.jit(_forward_sweep_kernel.fn)


def _check_power_of_two(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < MIN_DOT_DIM or value & (value - 1):
        raise ValueError(f"{name}: must be a power of two >= {MIN_DOT_DIM}, got {value}")


def _check_blocks(block: int, cblock: int, segment: int | None) -> None:
    _check_power_of_two("block", block)
    _check_power_of_two("cblock", cblock)
    if block > MAX_BLOCK:
        raise ValueError(f"block: {block} exceeds the supported maximum {MAX_BLOCK}")
    if cblock > block:
        raise ValueError(f"cblock: micro-chunk {cblock} exceeds block {block}; need cblock <= block")
    if segment is not None:
        if isinstance(segment, bool) or not isinstance(segment, int):
            raise TypeError(f"segment: expected an int or None, got {type(segment).__name__}")
        if segment < block or segment % block:
            raise ValueError(f"segment: must be a positive multiple of block={block}, got {segment}")


def _check_out(name: str, out: torch.Tensor, dtype: torch.dtype, device: torch.device, shape: tuple) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(out.shape)} differs from the expected {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name}: dtype {out.dtype} differs from the expected {dtype}")
    if out.device != device:
        raise ValueError(f"{name}: device {out.device} differs from the expected {device}")


def _kernels_interpreted() -> bool:
    return interpreted(_forward_sweep_kernel)


def _require_triton(device: torch.device) -> None:
    require_triton(device, _forward_sweep_kernel, "hccompile.kernels.lightning.chunk", "lightning_attn_ref")


def _block_dim(dim: int, limit: int = MAX_BLOCK) -> int:
    return min(max(MIN_DOT_DIM, triton.next_power_of_2(dim)), limit)


def _state_strides(state: torch.Tensor | None, transpose: bool) -> tuple[int, int, int, int]:
    """(outer, head, row, col) strides of a [N, H, K, V] state, rows/cols swapped if `transpose`."""
    if state is None:
        return (0, 0, 0, 0)
    sn, sh, sk, sv = state.stride()
    return (sn, sh, sv, sk) if transpose else (sn, sh, sk, sv)


# ----------------------------------------------------------------------------------------
# Segments: the unit of parallelism along time


@dataclass(frozen=True)
class _Segments:
    """Time cut into segments, each swept by its own programs from a precomputed state.

    Varlen: table [S, 4] int32 rows (batch index, first token, length, sequence); first [N + 1]
    int32: the segments of sequence n are first[n] .. first[n + 1] - 1, in time order. Fixed-length
    rows have no tables: row b's segments are b * per_sequence + (0 .. per_sequence - 1), each
    `length` tokens but the last, and the kernels compute them from the segment index (sizes may
    be symbolic: the plan is then traced, issue 24)."""

    table: torch.Tensor | None
    first: torch.Tensor | None
    num_sequences: int
    length: int
    count: int
    time: int = 0
    per_sequence: int = 1

    @property
    def varlen(self) -> bool:
        return self.table is not None

    def kernel_args(self, placeholder: torch.Tensor) -> tuple:
        """(table, first) pointers, then time, segment length, segments per sequence; `placeholder`
        (any tensor, never read) stands in for the absent tables."""
        if self.varlen:
            return self.table, self.first, 0, self.length, 1
        return placeholder, placeholder, self.time, self.length, self.per_sequence


def _sequence_bounds(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch index, first token, length) of every sequence, as CPU int64 tensors."""
    batch, time = q.shape[:2]
    if cu_seqlens is None:
        return (torch.arange(batch), torch.zeros(batch, dtype=torch.int64),
                torch.full((batch,), time, dtype=torch.int64))
    bounds = cu_seqlens.to("cpu", torch.int64)  # one host sync, as FLA's varlen path
    count = bounds.numel() - 1
    return torch.zeros(count, dtype=torch.int64), bounds[:-1], bounds[1:] - bounds[:-1]


def _auto_segment_length(longest, total, heads: int, column_tiles: int, block: int, device: torch.device):
    """Long enough that the summaries stay small next to q, k, v; short enough that the
    sweeps fill the GPU: about SWEEP_WAVES programs per streaming multiprocessor. `longest` and
    `total` are the longest sequence's and all sequences' token counts, possibly symbolic
    (torch.sym_max / sym_min keep them so: one traced graph serves every length)."""
    whole = triton.cdiv(torch.sym_max(longest, 1), block) * block
    if device.type != "cuda":
        return whole  # the interpreter runs programs one by one: parallelism buys nothing
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(SWEEP_WAVES * sms, max(1, heads * column_tiles))
    length = torch.sym_max(torch.sym_max(triton.cdiv(total, wanted), MIN_SEGMENT), block)
    return torch.sym_min(triton.cdiv(length, block) * block, whole)


def _plan_segments(q: torch.Tensor, cu_seqlens, segment: int | None, block: int, column_tiles: int) -> _Segments:
    if cu_seqlens is None:
        return _fixed_segments(q, segment, block, column_tiles)
    return _build_segments(q, cu_seqlens, segment, block, column_tiles)


def _fixed_segments(q: torch.Tensor, segment: int | None, block: int, column_tiles: int) -> _Segments:
    """Segments of fixed-length rows, from the sizes alone (symbolic sizes stay symbolic)."""
    batch, time, heads = q.shape[:3]
    if segment is None:
        segment = _auto_segment_length(time, batch * time, heads, column_tiles, block, q.device)
    per_sequence = torch.sym_max(triton.cdiv(time, segment), 1)  # an empty row keeps one empty segment
    return _Segments(None, None, batch, segment, batch * per_sequence, time, per_sequence)


def _build_segments(q: torch.Tensor, cu_seqlens, segment: int | None, block: int, column_tiles: int) -> _Segments:
    batch_index, starts, lengths = _sequence_bounds(q, cu_seqlens)
    if segment is None:
        longest = int(lengths.max()) if lengths.numel() else 0
        segment = _auto_segment_length(longest, int(lengths.sum()), q.shape[2], column_tiles, block, q.device)
    # An empty sequence keeps one segment of length 0, so its state still passes through.
    per_sequence = torch.clamp((lengths + segment - 1) // segment, min=1)
    first = torch.zeros(per_sequence.numel() + 1, dtype=torch.int64)
    torch.cumsum(per_sequence, 0, out=first[1:])
    sequence = torch.repeat_interleave(torch.arange(per_sequence.numel()), per_sequence)
    within = torch.arange(int(first[-1])) - first[:-1][sequence]
    offset = within * segment
    seg_lengths = torch.clamp(torch.minimum(lengths[sequence] - offset, torch.tensor(segment)), min=0)
    table = torch.stack([batch_index[sequence], starts[sequence] + offset, seg_lengths, sequence], dim=1)
    device = q.device
    return _Segments(table.to(torch.int32).to(device, non_blocking=True),
                     first.to(torch.int32).to(device, non_blocking=True), per_sequence.numel(), segment,
                     table.shape[0])


# ----------------------------------------------------------------------------------------
# Launchers


def _dot_options(dtype: torch.dtype) -> dict:
    return dict(
        # The default for fp32 is tf32 on GPUs, which would cost about three digits.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        UPCAST_OPERANDS=_kernels_interpreted() and dtype == torch.bfloat16,
    )


def _segment_states(segments: _Segments, b: torch.Tensor, c: torch.Tensor, decay: torch.Tensor, scale: float,
                    reverse: bool, x0: torch.Tensor | None = None, xt: torch.Tensor | None = None,
                    wrap: Callable = direct) -> torch.Tensor:
    """[S, H, DIM_B, DIM_C] fp32: the state each segment's sweep starts from (forward: the state
    entering it, from x0; reverse: the gradient state leaving it, from x0 = dht). Writes the
    last state (final state or dh0) into xt. `wrap`: torch's wrap_triton when traced."""
    heads, dim_b, dim_c = b.shape[2], b.shape[3], c.shape[3]
    states = torch.empty((segments.count, heads, dim_b, dim_c), dtype=torch.float32, device=b.device)
    if heads == 0 or dim_b == 0 or dim_c == 0:
        return states
    block_b, block_c = _block_dim(dim_b, SUMMARY_ROW_TILE), _block_dim(dim_c, SUMMARY_COLUMN_TILE)
    tiles = (triton.cdiv(dim_b, block_b), triton.cdiv(dim_c, block_c))
    table, first, time, length, per_sequence = segments.kernel_args(decay)
    wrap(_segment_summary_kernel)[(segments.count * heads, *tiles)](
        b, c, decay, table, states,
        *b.stride(), *c.stride(), *states.stride(), decay.stride(0),
        heads, dim_b, dim_c, float(scale), time, length, per_sequence, IS_VARLEN=segments.varlen,
        REVERSE=reverse, CHUNK=SUMMARY_CHUNK, BLOCK_B=block_b, BLOCK_C=block_c, **_dot_options(b.dtype),
    )
    prefix_b, prefix_c = _block_dim(dim_b, PREFIX_TILE), _block_dim(dim_c, PREFIX_TILE)
    wrap(_segment_prefix_kernel)[(segments.num_sequences * heads, triton.cdiv(dim_b, prefix_b),
                                  triton.cdiv(dim_c, prefix_c))](
        states, decay, table, first,
        x0 if x0 is not None else states, xt if xt is not None else states,
        *states.stride(), *_state_strides(x0, False), *_state_strides(xt, False), decay.stride(0),
        heads, dim_b, dim_c, time, length, per_sequence, IS_VARLEN=segments.varlen,
        REVERSE=reverse, HAS_X0=x0 is not None, STORE_XT=xt is not None, BLOCK_B=prefix_b, BLOCK_C=prefix_c,
    )
    return states


def _launch_sweep(kernel, segments: _Segments, a, b, c, decay, out, states, states_transposed: bool,
                  scale: float, block: int, cblock: int, column_tile: int, num_warps: int | None,
                  wrap: Callable = direct) -> None:
    """One sweep; a, b: [B, T, H, DIM_AB] (contracted, held whole), c/out: [B, T, H, DIM_C] (tiled);
    states [S, H, ., .] holds the segments' starting states, read transposed if asked."""
    heads, dim_ab, dim_c = a.shape[2], a.shape[3], c.shape[3]
    if heads == 0 or dim_c == 0 or a.shape[1] == 0:
        return
    block_ab = _block_dim(dim_ab)
    block_c = _block_dim(dim_c, column_tile)
    stage_bytes = cblock * (block_ab + block_c) * a.element_size()
    num_stages = max(1, min(MAX_PIPELINE_STAGES, PIPELINE_SHARED_MEMORY_BUDGET // stage_bytes))
    if num_warps is None:
        num_warps = 8 if cblock * max(block_ab, block_c) >= 64 * 128 else 4
    table, _, time, length, per_sequence = segments.kernel_args(decay)
    wrap(kernel)[(segments.count * heads, triton.cdiv(dim_c, block_c))](
        a, b, c, decay, table, states, out,
        *a.stride(), *b.stride(), *c.stride(), *out.stride(),
        *_state_strides(states, states_transposed), decay.stride(0),
        heads, dim_ab, dim_c, float(scale), time, length, per_sequence, IS_VARLEN=segments.varlen,
        BLOCK=block, CBLOCK=cblock, BLOCK_AB=block_ab, BLOCK_C=block_c, **_dot_options(a.dtype),
        num_stages=num_stages, num_warps=num_warps,
    )


def _default_scale(scale: float | None, key_dim: int) -> float:
    return key_dim**-0.5 if scale is None else float(scale)


def _check_problem(q, k, v, decay, cu_seqlens, block, cblock, segment, **states) -> int:
    check_attention_shapes(q, k, v, **{n: t for n, t in states.items() if n == "do"})
    _check_kernel_inputs(q=q, k=k, v=v, **{n: t for n, t in states.items() if n == "do"})
    num_states = check_cu_seqlens(q, cu_seqlens)
    check_decay_and_state(q, v, decay, num_states=num_states,
                          **{n: t for n, t in states.items() if n != "do"})
    _check_blocks(block, cblock, segment)
    return num_states


def lightning_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    cblock: int = DEFAULT_FORWARD_CBLOCK,
    segment: int | None = None,
    column_tile: int = FORWARD_COLUMN_TILE,
    num_warps: int | None = FORWARD_WARPS,
    out: torch.Tensor | None = None,
    final_state_out: torch.Tensor | None = None,
    wrap: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning attention forward; q, k: [B, T, H, K], v: [B, T, H, V], decay: [H] log-decays <= 0.

    `scale` None means K**-0.5. Variable-length batches: B = 1 and cu_seqlens [N + 1] (FLA's
    convention); states are [N, H, K, V] (N = B without cu_seqlens). initial_state: any float
    dtype, read as fp32. Returns (o [B, T, H, V] in v's dtype, written into `out` when given;
    final state [N, H, K, V] fp32 when `output_final_state`, written into `final_state_out` when
    given, else None).

    Tuning (every choice is exact): `block` is the inter/intra split, `cblock` the micro-chunk
    (powers of two, 16 <= cblock <= block <= 256); `segment` the rows one program sweeps (a
    multiple of block; None picks one that fills the GPU); `column_tile` the widest V tile.
    `wrap`: torch.library.wrap_triton when the launches are traced for Inductor (fixed-length rows).
    """
    num_states = _check_problem(q, k, v, decay, cu_seqlens, block, cblock, segment, initial_state=initial_state)
    batch, time, heads, key_dim = q.shape
    value_dim = v.shape[3]
    scale = _default_scale(scale, key_dim)
    o_shape = (batch, time, heads, value_dim)
    if out is None:
        out = torch.empty(o_shape, dtype=v.dtype, device=v.device)
    else:
        _check_out("out", out, v.dtype, v.device, o_shape)
    final_state = None
    if output_final_state:
        state_shape = (num_states, heads, key_dim, value_dim)
        if final_state_out is None:
            final_state = torch.empty(state_shape, dtype=torch.float32, device=q.device)
        else:
            _check_out("final_state_out", final_state_out, torch.float32, q.device, state_shape)
            final_state = final_state_out
    elif final_state_out is not None:
        raise ValueError("final_state_out: given but output_final_state is False")
    _require_triton(q.device)
    segments = _plan_segments(q, cu_seqlens, segment, block, triton.cdiv(value_dim, min(column_tile, 256)))
    wrap = wrap or direct
    states = _segment_states(segments, k, v, decay, scale, reverse=False, x0=initial_state, xt=final_state,
                             wrap=wrap)
    _launch_sweep(_forward_sweep_kernel, segments, q, k, v, decay, out, states, False,
                  scale, block, cblock, column_tile, num_warps, wrap)
    return out, final_state


def lightning_attn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    do: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None = None,
    dht: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    cblock: int = DEFAULT_BACKWARD_CBLOCK,
    segment: int | None = None,
    column_tile: int = BACKWARD_COLUMN_TILE,
    num_warps: int | None = BACKWARD_WARPS,
    out: tuple | None = None,
    wrap: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients (dq, dk, dv, dh0) of lightning_attn_fwd given do = dL/do and dht = dL/dS_T.

    dh0 (in initial_state's dtype) is None when there is no initial_state; no gradient is
    computed for the decay (a constant). `out` = (dq, dk, dv) or (dq, dk, dv, dh0) to write into.
    The tuning arguments need not match the forward's: each is an exact split. `wrap`: as the
    forward's.
    """
    _check_problem(q, k, v, decay, cu_seqlens, block, cblock, segment, do=do, initial_state=initial_state, dht=dht)
    scale = _default_scale(scale, q.shape[3])
    want_dh0 = initial_state is not None
    expected = [("out[0] (dq)", q), ("out[1] (dk)", k), ("out[2] (dv)", v)]
    if out is None:
        grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for _, t in expected]
        dh0 = torch.empty(initial_state.shape, dtype=initial_state.dtype, device=q.device) if want_dh0 else None
    else:
        if not isinstance(out, (tuple, list)) or len(out) not in (3, 4):
            raise TypeError("out: expected a tuple (dq, dk, dv) or (dq, dk, dv, dh0)")
        grads = list(out[:3])
        for (name, like), grad in zip(expected, grads):
            _check_out(name, grad, like.dtype, like.device, tuple(like.shape))
        dh0 = out[3] if len(out) == 4 else None
        if want_dh0:
            if dh0 is None:
                dh0 = torch.empty(initial_state.shape, dtype=initial_state.dtype, device=q.device)
            else:
                _check_out("out[3] (dh0)", dh0, initial_state.dtype, q.device, tuple(initial_state.shape))
        elif dh0 is not None:
            raise ValueError("out[3] (dh0): given but there is no initial_state")
    dq, dk, dv = grads
    _require_triton(q.device)
    tiles = triton.cdiv(max(q.shape[3], v.shape[3]), min(column_tile, 256))
    segments = _plan_segments(q, cu_seqlens, segment, block, tiles)
    # S at each segment's start (the forward's states, recomputed) and dS at each segment's end.
    wrap = wrap or direct
    s_states = _segment_states(segments, k, v, decay, scale, reverse=False, x0=initial_state, wrap=wrap)
    ds_states = _segment_states(segments, q, do, decay, scale, reverse=True, x0=dht, xt=dh0, wrap=wrap)
    sweep = dict(scale=scale, block=block, cblock=cblock, column_tile=column_tile, num_warps=num_warps, wrap=wrap)
    # dq: forward sweep over S^T [V, K tile]; dk: reverse sweep over dS^T [V, K tile];
    # dv: reverse sweep over dS [K, V tile].
    _launch_sweep(_forward_sweep_bwd_kernel, segments, do, v, k, decay, dq, s_states, True, **sweep)
    _launch_sweep(_reverse_sweep_kernel, segments, v, do, q, decay, dk, ds_states, True, **sweep)
    _launch_sweep(_reverse_sweep_kernel, segments, k, q, do, decay, dv, ds_states, False, **sweep)
    return dq, dk, dv, dh0
