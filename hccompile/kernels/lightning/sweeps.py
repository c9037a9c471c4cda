"""The sweep kernels of lightning attention and their launcher.

The forward and the dq computation have the same shape ("forward sweep": out_i from a_i, b_j, c_j
and a state X of b^T c), and so have dk and dv ("reverse sweep"), so there are two kernels:

    _forward_sweep_kernel:  o  = sweep(a=q,  b=k, c=v),  X = S   [K, V tile]   (+ final state)
                            dq = sweep(a=do, b=v, c=k),  X = S^T [V, K tile]
    _reverse_sweep_kernel:  dk = sweep(a=v,  b=do, c=q), X = dS^T [V, K tile]
                            dv = sweep(a=k,  b=q, c=do), X = dS   [K, V tile]  (+ dh0)

Each kernel has two loop structures over a segment's blocks: nested micro-chunk loops (any cblock
dividing block), and, when a block is one micro-chunk and FLAT_SWEEPS is on (the default), one flat
loop whose tile loads the pipeliner can issue a block ahead.
"""

from __future__ import annotations

import os
from typing import Callable

from .segments import _Segments
from .tiles import _block_dim, _dot_options, _state_strides

from .._triton import cdiv, direct, dot, load_tile, tl, triton

# Triton software-pipelines the inner loops, keeping one copy of the loaded tiles per stage.
PIPELINE_SHARED_MEMORY_BUDGET = 96 * 1024
MAX_PIPELINE_STAGES = 3
# When a block is one micro-chunk (cblock == block), the sweeps run one flat loop over blocks (the
# kernels' FLAT branch) instead of the nested micro-chunk loops: the pipeliner issues a block's tile
# loads during the block before. On the H200 at f98f16c (benchmarks/lightning_tune.py, session 31,
# B4 T4096 and B1 T32768, H16 D128) the backward took 0.613 / 1.198 ms against the nested loops' best
# 0.945 / 2.187, the forward 0.26-0.39 / 0.498 against 0.342 / 0.848, with 64-column tiles and 4 warps
# (8 warps: 0.88 / 1.72 backward). HCCOMPILE_LIGHTNING_FLAT_SWEEPS=0 (read at import) keeps the nested
# loops; the attribute is read at each launch.
FLAT_SWEEPS = os.environ.get("HCCOMPILE_LIGHTNING_FLAT_SWEEPS", "1") == "1"
FLAT_WARPS = 4
# With the flat loop, the backward's dk and dv may come from one reverse sweep over the whole state
# (_reverse_pair_sweep_kernel) where the key and value dims are at most PAIR_MAX_DIM: fewer MACs, but
# at D 128 it spills (480-560 B a thread on sm_90) and measured slower than the two column-tiled sweeps
# (0.795 ms at 8 warps, 0.837 at 4, against 0.613 at B4 T4096; 1.57 against 1.20 at B1 T32768), so off
# unless HCCOMPILE_LIGHTNING_PAIRED_REVERSE=1 (untimed at D 64, where it does not spill).
PAIRED_REVERSE = os.environ.get("HCCOMPILE_LIGHTNING_PAIRED_REVERSE", "0") == "1"
PAIR_MAX_DIM = 128


if triton is not None:
    from .segments import _fixed_segment

    @triton.jit
    def _decay_tile(gamma, distance, scale):
        """scale * exp(gamma * distance) where distance >= 0, else 0 (the causal mask)."""
        # Clamping first keeps the masked entries' exponent <= 0, so nothing overflows.
        weights = tl.exp(gamma * tl.maximum(distance, 0).to(tl.float32)) * scale
        return tl.where(distance >= 0, weights, 0.0)

    @triton.jit
    def _flat_forward_block(a, b, c, state, row_decay, intra, DOT_PRECISION: tl.constexpr,
                            UPCAST_OPERANDS: tl.constexpr):
        """One block's rows of the forward sweep when the block is one micro-chunk: the inter term
        from the entering state plus the intra term, with `intra` the block's causal decay tile."""
        acc = dot(a, state.to(a.dtype), DOT_PRECISION, UPCAST_OPERANDS) * row_decay[:, None]
        scores = dot(a, tl.trans(b), DOT_PRECISION, UPCAST_OPERANDS) * intra
        return acc + dot(scores.to(c.dtype), c, DOT_PRECISION, UPCAST_OPERANDS)

    @triton.jit
    def _flat_reverse_block(a, b, c, state, key_decay, intra_t, DOT_PRECISION: tl.constexpr,
                            UPCAST_OPERANDS: tl.constexpr):
        """One block's rows of the reverse sweep when the block is one micro-chunk; the scores are
        formed transposed ([key row, query row], `intra_t` the decay tile so indexed) so that no
        register tile is transposed."""
        acc = dot(a, state.to(a.dtype), DOT_PRECISION, UPCAST_OPERANDS) * key_decay[:, None]
        scores_t = dot(a, tl.trans(b), DOT_PRECISION, UPCAST_OPERANDS) * intra_t
        return acc + dot(scores_t.to(c.dtype), c, DOT_PRECISION, UPCAST_OPERANDS)

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
        FLAT: tl.constexpr,
    ):
        """out[t] = scale sum_{s<=t} exp(g (t-s)) (a_t . b_s) c_s + scale exp(g (t+1)) a_t X_seg
        for the rows t of one segment, X_seg its starting state (from the prefix pass).

        One program: one (segment, head) and one c-column tile, sequential over blocks of BLOCK
        rows; inside a block, micro-chunks of CBLOCK query rows against micro-chunks of CBLOCK
        key rows. Holds the fp32 state X [BLOCK_AB, BLOCK_C] (b^T c summed over past blocks).
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        # a (segment, head)'s column tiles are neighbours in launch order: they stream the same a
        # and b rows at about the same time, all but the first from L2
        tiles = tl.cdiv(DIM_C, BLOCK_C)
        pid_sh = tl.program_id(0) // tiles
        pid_c = tl.program_id(0) % tiles
        seg = pid_sh // H
        head = (pid_sh % H).to(tl.int64)
        if IS_VARLEN:
            row = table_ptr + seg * 4  # loaded here, not in a helper (see _fixed_segment)
            batch, start, T = tl.load(row).to(tl.int64), tl.load(row + 1).to(tl.int64), tl.load(row + 2)
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

        if FLAT:
            # CBLOCK == BLOCK: one flat loop over blocks, whose tile loads Triton's pipeliner can
            # issue a block ahead (it cannot across the nested loops below); the state step
            # reuses the block's b and c tiles, and the decay tiles are formed once. Every block
            # but the last has a successor, so a state step, and is whole.
            causal = micro[:, None] - micro[None, :]
            row_decay = tl.exp(gamma * (micro + 1).to(tl.float32)) * scale
            key_decay = tl.exp(gamma * (BLOCK - 1 - micro).to(tl.float32))
            block_decay = tl.exp(gamma * BLOCK)
            for block_start in range(0, T - BLOCK, BLOCK):
                rows = block_start + micro
                a_i = load_tile(a_ptr, rows, ab_cols, stride_at, stride_ad, T, DIM_AB)
                b_i = load_tile(b_ptr, rows, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                c_i = load_tile(c_ptr, rows, c_cols, stride_ct, stride_cd, T, DIM_C)
                acc = _flat_forward_block(a_i, b_i, c_i, state, row_decay, _decay_tile(gamma, causal, scale),
                                          DOT_PRECISION, UPCAST_OPERANDS)
                out_ptrs = out_ptr + rows[:, None] * stride_ot + c_cols[None, :] * stride_od
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(c_cols[None, :] < DIM_C))
                b_i = (b_i * key_decay[:, None]).to(c_i.dtype)
                state = state * block_decay + dot(tl.trans(b_i), c_i, DOT_PRECISION, UPCAST_OPERANDS)
            rows = tl.maximum(tl.cdiv(T, BLOCK) - 1, 0) * BLOCK + micro
            a_i = load_tile(a_ptr, rows, ab_cols, stride_at, stride_ad, T, DIM_AB)
            b_i = load_tile(b_ptr, rows, ab_cols, stride_bt, stride_bd, T, DIM_AB)
            c_i = load_tile(c_ptr, rows, c_cols, stride_ct, stride_cd, T, DIM_C)
            acc = _flat_forward_block(a_i, b_i, c_i, state, row_decay, _decay_tile(gamma, causal, scale),
                                          DOT_PRECISION, UPCAST_OPERANDS)
            out_ptrs = out_ptr + rows[:, None] * stride_ot + c_cols[None, :] * stride_od
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (c_cols[None, :] < DIM_C))
        else:
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
        FLAT: tl.constexpr,
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
        # a (segment, head)'s column tiles are neighbours in launch order: they stream the same a
        # and b rows at about the same time, all but the first from L2
        tiles = tl.cdiv(DIM_C, BLOCK_C)
        pid_sh = tl.program_id(0) // tiles
        pid_c = tl.program_id(0) % tiles
        seg = pid_sh // H
        head = (pid_sh % H).to(tl.int64)
        if IS_VARLEN:
            row = table_ptr + seg * 4  # loaded here, not in a helper (see _fixed_segment)
            batch, start, T = tl.load(row).to(tl.int64), tl.load(row + 1).to(tl.int64), tl.load(row + 2)
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
        if FLAT:
            # CBLOCK == BLOCK: as the forward sweep's flat loop. Every block but the first has a
            # predecessor, so a state step; only the last block (the loop's first) may be partial.
            intra_t = _decay_tile(gamma, micro[None, :] - micro[:, None], scale)
            row_decay = tl.exp(gamma * (micro + 1).to(tl.float32)) * scale
            for reversed_index in range(0, n_blocks - 1):
                block_start = (n_blocks - 1 - reversed_index) * BLOCK
                block_len = tl.minimum(T - block_start, BLOCK)
                rows = block_start + micro
                a_j = load_tile(a_ptr, rows, ab_cols, stride_at, stride_ad, T, DIM_AB)
                b_j = load_tile(b_ptr, rows, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                c_j = load_tile(c_ptr, rows, c_cols, stride_ct, stride_cd, T, DIM_C)
                key_decay = tl.where(micro < block_len, tl.exp(gamma * (block_len - 1 - micro).to(tl.float32)), 0.0)
                acc = _flat_reverse_block(a_j, b_j, c_j, state, key_decay, intra_t, DOT_PRECISION, UPCAST_OPERANDS)
                out_ptrs = out_ptr + rows[:, None] * stride_ot + c_cols[None, :] * stride_od
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (c_cols[None, :] < DIM_C))
                c_j = (c_j * row_decay[:, None]).to(c_j.dtype)
                state = state * tl.exp(gamma * block_len.to(tl.float32)) + dot(
                    tl.trans(b_j), c_j, DOT_PRECISION, UPCAST_OPERANDS)
            block_len = tl.minimum(T, BLOCK)
            a_j = load_tile(a_ptr, micro, ab_cols, stride_at, stride_ad, T, DIM_AB)
            b_j = load_tile(b_ptr, micro, ab_cols, stride_bt, stride_bd, T, DIM_AB)
            c_j = load_tile(c_ptr, micro, c_cols, stride_ct, stride_cd, T, DIM_C)
            key_decay = tl.where(micro < block_len, tl.exp(gamma * (block_len - 1 - micro).to(tl.float32)), 0.0)
            acc = _flat_reverse_block(a_j, b_j, c_j, state, key_decay, intra_t, DOT_PRECISION, UPCAST_OPERANDS)
            out_ptrs = out_ptr + micro[:, None] * stride_ot + c_cols[None, :] * stride_od
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(micro[:, None] < T) & (c_cols[None, :] < DIM_C))
        else:
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


    @triton.jit
    def _reverse_pair_sweep_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, decay_ptr, table_ptr, x_ptr, dk_ptr, dv_ptr,
        stride_qb, stride_qt, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_ob, stride_ot, stride_oh, stride_od,
        stride_dkb, stride_dkt, stride_dkh, stride_dkd,
        stride_dvb, stride_dvt, stride_dvh, stride_dvd,
        stride_xs, stride_xh, stride_xr, stride_xc,
        stride_decay,
        H, DIM_K, DIM_V, scale, time, seg_length, per_sequence,
        IS_VARLEN: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_OPERANDS: tl.constexpr,
    ):
        """dk and dv of one segment in one reverse sweep (the flat loop: a block is one micro-chunk),
        from the whole gradient state dS [K, V] (x, from the reverse prefix pass):

            dv[m] = exp(g (L-1-m)) k_m dS   + scale sum_{l>=m} exp(g (l-m)) (q_l . k_m) do_l
            dk[m] = exp(g (L-1-m)) v_m dS^T + scale sum_{l>=m} exp(g (l-m)) (do_l . v_m) q_l
            dS_c  = exp(g L) dS_{c+1} + scale sum_l exp(g (l+1)) q_l^T do_l

        The two reverse sweeps of _reverse_sweep_kernel share their loads and the state step here,
        and no score tile is formed twice (a column-tiled sweep forms it once per tile)."""
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        pid_sh = tl.program_id(0)
        seg = pid_sh // H
        head = (pid_sh % H).to(tl.int64)
        if IS_VARLEN:
            row = table_ptr + seg * 4  # loaded here, not in a helper (see _fixed_segment)
            batch, start, T = tl.load(row).to(tl.int64), tl.load(row + 1).to(tl.int64), tl.load(row + 2)
        else:
            batch, start, T = _fixed_segment(seg, time, seg_length, per_sequence)
        q_ptr += batch * stride_qb + start * stride_qt + head * stride_qh
        k_ptr += batch * stride_kb + start * stride_kt + head * stride_kh
        v_ptr += batch * stride_vb + start * stride_vt + head * stride_vh
        do_ptr += batch * stride_ob + start * stride_ot + head * stride_oh
        dk_ptr += batch * stride_dkb + start * stride_dkt + head * stride_dkh
        dv_ptr += batch * stride_dvb + start * stride_dvt + head * stride_dvh
        gamma = tl.load(decay_ptr + head * stride_decay).to(tl.float32)

        micro = tl.arange(0, BLOCK)
        k_cols = tl.arange(0, BLOCK_K)
        v_cols = tl.arange(0, BLOCK_V)
        x_ptr += seg.to(tl.int64) * stride_xs + head * stride_xh
        state = load_tile(x_ptr, k_cols, v_cols, stride_xr, stride_xc, DIM_K, DIM_V)
        intra_t = _decay_tile(gamma, micro[None, :] - micro[:, None], scale)
        row_decay = tl.exp(gamma * (micro + 1).to(tl.float32)) * scale
        n_blocks = tl.cdiv(T, BLOCK)
        # every block but the first has a predecessor, so a state step; the loop's first block
        # (the segment's last) may be partial
        for reversed_index in range(0, n_blocks):
            block_start = (n_blocks - 1 - reversed_index) * BLOCK
            block_len = tl.minimum(T - block_start, BLOCK)
            rows = block_start + micro
            q = load_tile(q_ptr, rows, k_cols, stride_qt, stride_qd, T, DIM_K)
            k = load_tile(k_ptr, rows, k_cols, stride_kt, stride_kd, T, DIM_K)
            v = load_tile(v_ptr, rows, v_cols, stride_vt, stride_vd, T, DIM_V)
            do = load_tile(do_ptr, rows, v_cols, stride_ot, stride_od, T, DIM_V)
            key_decay = tl.where(micro < block_len, tl.exp(gamma * (block_len - 1 - micro).to(tl.float32)), 0.0)
            state_in = state.to(q.dtype)
            dv = _flat_reverse_block(k, q, do, state, key_decay, intra_t, DOT_PRECISION, UPCAST_OPERANDS)
            tl.store(dv_ptr + rows[:, None] * stride_dvt + v_cols[None, :] * stride_dvd,
                     dv.to(dv_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (v_cols[None, :] < DIM_V))
            dk = dot(v, tl.trans(state_in), DOT_PRECISION, UPCAST_OPERANDS) * key_decay[:, None]
            scores_t = dot(v, tl.trans(do), DOT_PRECISION, UPCAST_OPERANDS) * intra_t
            dk += dot(scores_t.to(q.dtype), q, DOT_PRECISION, UPCAST_OPERANDS)
            tl.store(dk_ptr + rows[:, None] * stride_dkt + k_cols[None, :] * stride_dkd,
                     dk.to(dk_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (k_cols[None, :] < DIM_K))
            if block_start > 0:
                do = (do * row_decay[:, None]).to(do.dtype)
                state = state * tl.exp(gamma * block_len.to(tl.float32)) + dot(
                    tl.trans(q), do, DOT_PRECISION, UPCAST_OPERANDS)

    # The forward sweep under a second JIT handle for the backward's launch (same source, same
    # binary): a compiled graph names kernels, and hccompile.lowering tells the backward op's
    # launches from the forward op's by the handle.
    _forward_sweep_bwd_kernel = triton.jit(_forward_sweep_kernel.fn)


def _launch_reverse_pair(segments: _Segments, q, k, v, do, decay, dk, dv, states, scale: float, block: int,
                         num_warps: int | None, wrap: Callable = direct) -> None:
    """dk and dv in one reverse sweep (_reverse_pair_sweep_kernel); states [S, H, K, V] hold dS at
    each segment's end. Key and value dims up to PAIR_MAX_DIM (the whole state is one tile)."""
    heads, dim_k, dim_v = q.shape[2], q.shape[3], v.shape[3]
    if heads == 0 or q.shape[1] == 0 or (dim_k == 0 and dim_v == 0):
        return
    block_k, block_v = _block_dim(dim_k), _block_dim(dim_v)
    stage_bytes = block * 2 * (block_k + block_v) * q.element_size()
    num_stages = max(1, min(MAX_PIPELINE_STAGES, PIPELINE_SHARED_MEMORY_BUDGET // stage_bytes))
    table, _, time, length, per_sequence = segments.kernel_args(decay)
    wrap(_reverse_pair_sweep_kernel)[(segments.count * heads,)](
        q, k, v, do, decay, table, states, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        *_state_strides(states, False), decay.stride(0),
        heads, dim_k, dim_v, float(scale), time, length, per_sequence, IS_VARLEN=segments.varlen,
        BLOCK=block, BLOCK_K=block_k, BLOCK_V=block_v, **_dot_options(q.dtype),
        num_stages=num_stages, num_warps=num_warps or 8,
    )


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
    flat = FLAT_SWEEPS and cblock == block
    # a stage holds the loop's tiles: b and c (the nested loops' inner one), a, b and c (flat)
    stage_bytes = cblock * ((2 if flat else 1) * block_ab + block_c) * a.element_size()
    num_stages = max(1, min(MAX_PIPELINE_STAGES, PIPELINE_SHARED_MEMORY_BUDGET // stage_bytes))
    if num_warps is None:
        num_warps = FLAT_WARPS if flat else 8 if cblock * max(block_ab, block_c) >= 64 * 128 else 4
    table, _, time, length, per_sequence = segments.kernel_args(decay)
    wrap(kernel)[(segments.count * heads * cdiv(dim_c, block_c),)](
        a, b, c, decay, table, states, out,
        *a.stride(), *b.stride(), *c.stride(), *out.stride(),
        *_state_strides(states, states_transposed), decay.stride(0),
        heads, dim_ab, dim_c, float(scale), time, length, per_sequence, IS_VARLEN=segments.varlen,
        BLOCK=block, CBLOCK=cblock, BLOCK_AB=block_ab, BLOCK_C=block_c, **_dot_options(a.dtype), FLAT=flat,
        num_stages=num_stages, num_warps=num_warps,
    )
