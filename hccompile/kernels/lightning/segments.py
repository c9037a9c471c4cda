"""Segments: the unit of parallelism along time for the lightning kernels.

One program per (batch, head) sweeping the whole sequence leaves most of a GPU idle (B1 T32768 H16 is 16 programs). Time is therefore cut into segments
of whole blocks, and each sweep program starts from its segment's state, made by two small
passes: a parallel summary (what each segment adds to the state: one matrix product per
segment) and a prefix over the segments of each sequence (not over blocks; a scan). This
is the affine-summary idea of context parallelism (seed 002) inside one GPU; it is exact for any
segment length, and the block and micro-chunk split inside a segment stays chunk.py's.
Variable-length batches (FLA's cu_seqlens) are segments that never cross a sequence boundary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..value_checks import cached_by_tensor, host_ints
from .tiles import _block_dim, _dot_options, _state_strides

from .._triton import cdiv, direct, dot, kept_rows, load_tile, next_power_of_2, tl, triton, zero_padding_rows

# Segments: the auto length aims at this many sweep programs per streaming multiprocessor, and
# never goes below MIN_SEGMENT rows, where the fp32 summaries would outweigh q, k, v. Kernel time per
# fwd+bwd on one H200 (session 43, diag_lightning-segments_2026-11-30_h200x1_2bb0177.txt, H16 D128):
# 4 waves 1.053 ms at B1 T32768 and 0.597 at B4 T4096, 8 waves 1.075 / 0.619, 16 1.170 / 0.668.
SWEEP_WAVES = 4
MIN_SEGMENT = 256
# Summary pass: rows per step and the state tile per program. A whole 128 x 128 state a program took
# 86.5 us a launch at B1 T32768 H16 D128 on the H200 against 96.1 for two 128 x 64 halves (4 warps,
# 3 stages: diag_lightning-states_2026-11-30_h200x2_aeb744d.txt; 32 or 128 rows a step, 8 warps or 2
# stages no faster).
SUMMARY_CHUNK = 64
SUMMARY_ROW_TILE = 128
SUMMARY_COLUMN_TILE = 128
# The prefix pass is a scan: PREFIX_SEGMENTS segments' summaries of PREFIX_TILE state elements loaded at
# once and combined in one product (_segment_prefix_kernel). A loop over the segments, one dependent round
# trip to memory each, took 0.12 ms a launch at B1 T32768 H16 D128 (32 segments) on the H200, a
# tl.associative_scan 0.025 ms (diag_lightning-scan_2026-11-30_h200x1_e78730e.txt). The closed form at
# 32 segments, 128 elements and 4 warps took 43 us alone; at 16 segments (two dependent blocks), 128
# elements and 2 warps 26 us (diag_lightning-prefix_2026-11-30_h200x2_6a1e516.txt: 1 warp 25 us, 8 warps 37).
PREFIX_SEGMENTS = 16  # at least 16: tl.dot's least dimension
PREFIX_TILE = 128
PREFIX_WARPS = 2
# The states may instead come from one sequential pass per (sequence, head, state tile) over the
# whole sequence (_sequential_states_kernel: FLA's chunk-state walk, storing only the
# segments' states): one launch instead of two and no summaries in memory, but sequences * H * tiles
# programs only, each walking a whole sequence. On the H200 at f98f16c (BENCHMARKS.md, session 31) it took
# lightning's fwd+bwd from 1.523 to 1.313 ms at B4 T4096 H16 D128 (256 programs, 64 chunks a walk) and
# from 2.284 to 2.682 ms at B1 T32768 (64 programs, 512 chunks): so it runs where its programs fill
# the GPU and the longest walk is at most SEQUENTIAL_MAX_CHUNKS chunks, with sizes known at the launch
# (a symbolic length keeps the two passes: no guard, one graph for every length; a varlen batch's
# sizes are always known, read from cu_seqlens).
# HCCOMPILE_LIGHTNING_SEQUENTIAL_STATES=1 / =0 (read at import) force it on / off; the attribute
# (None: that choice) is read at each call.
SEQUENTIAL_STATES = {"1": True, "0": False}.get(os.environ.get("HCCOMPILE_LIGHTNING_SEQUENTIAL_STATES", ""))
SEQUENTIAL_MAX_CHUNKS = 128
SEQUENTIAL_TILE = 64


if triton is not None:

    @triton.jit
    def _fixed_segment(seg, time, seg_length, per_sequence):
        """(batch index, first token, length) of segment `seg` of fixed-length rows of `time`
        tokens cut into `per_sequence` segments of `seg_length`: from the index itself, no table,
        so the plan needs no tensor values and can be traced.

        A varlen kernel loads its row of the table itself (batch, first token, length) rather than
        through a helper given the table: torch's mutation analysis takes what a call returns as
        derived from every pointer passed to it, so a store at an address built from the batch
        index would count as a write to the table, and Inductor would copy it before every launch
        (tests/kernels/test_launch_writes.py)."""
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
        # a (segment, head)'s state tiles are neighbours in launch order: they read the same rows at
        # about the same time, all but the first from L2
        tiles_c = tl.cdiv(DIM_C, BLOCK_C)
        tiles = tl.cdiv(DIM_B, BLOCK_B) * tiles_c
        pid_sh = tl.program_id(0) // tiles
        pid_b = tl.program_id(0) % tiles // tiles_c
        pid_c = tl.program_id(0) % tiles_c
        seg = pid_sh // H
        head = (pid_sh % H).to(tl.int64)
        if IS_VARLEN:
            row = table_ptr + seg * 4  # loaded here, not in a helper (see _fixed_segment)
            batch, start, seg_len = tl.load(row).to(tl.int64), tl.load(row + 1).to(tl.int64), tl.load(row + 2)
        else:
            batch, start, seg_len = _fixed_segment(seg, time, seg_length, per_sequence)
        b_ptr += batch * stride_bb + start * stride_bt + head * stride_bh
        c_ptr += batch * stride_cb + start * stride_ct + head * stride_ch
        gamma = tl.load(decay_ptr + head * stride_decay).to(tl.float32)

        rows = tl.arange(0, CHUNK)
        b_cols = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        c_cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
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
        SEGMENTS: tl.constexpr,
        TILE: tl.constexpr,
    ):
        """Turns one sequence's segment summaries, in place, into the state each segment's sweep
        starts from: X = x0, then per segment (first to last; last to first if REVERSE)
        x[s] <- X and X <- exp(g L_s) X + x[s]. The last X is the final state (forward) or the
        initial state's gradient (reverse), stored when STORE_XT.

        A program holds TILE state elements (flattened) of one sequence and head; SEGMENTS segments'
        summaries are loaded together and combined at once, so the chain of dependent memory round
        trips is one per SEGMENTS segments, not one per segment. The combination is the scan's closed
        form: with C the running sum of the steps' log decays, the state leaving step s is
        exp(C_s) X + sum_{j <= s} exp(C_s - C_j) x[j], one [SEGMENTS, SEGMENTS] x [SEGMENTS, TILE]
        product (tl.associative_scan computes the same, but Triton's interpreter runs a scan with
        a custom combine one element at a time in Python: 25x slower CPU tests)."""
        tl.static_assert(SEGMENTS >= 16 and TILE >= 16, "tl.dot needs 16 rows and columns at least")
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
        elems = tl.program_id(1) * TILE + tl.arange(0, TILE)
        in_state = elems < DIM_B * DIM_C
        offsets = (elems // DIM_C) * stride_xr + (elems % DIM_C) * stride_xc
        seq = seq.to(tl.int64)
        if HAS_X0:
            x0 = x0_ptr + seq * stride_x0n + head * stride_x0h
            state = tl.load(x0 + (elems // DIM_C) * stride_x0r + (elems % DIM_C) * stride_x0c,
                            mask=in_state, other=0.0).to(tl.float32)
        else:
            state = tl.zeros([TILE], dtype=tl.float32)
        x_ptr += head * stride_xh
        steps = tl.arange(0, SEGMENTS)
        for block_start in range(0, count, SEGMENTS):
            step = block_start + steps
            taken = step < count
            if REVERSE:
                seg = tl.where(taken, first + count - 1 - step, first)
                after = seg - 1
            else:
                seg = tl.where(taken, first + step, first)
                after = seg + 1
            if IS_VARLEN:
                seg_len = tl.load(table_ptr + seg * 4 + 2, mask=taken, other=0)  # not in a helper: _fixed_segment
            else:
                _, _, seg_len = _fixed_segment(seg, time, seg_length, per_sequence)
            through = tl.cumsum(tl.where(taken, gamma * seg_len.to(tl.float32), 0.0), 0)
            ptrs = x_ptr + seg.to(tl.int64)[:, None] * stride_xs + offsets[None, :]
            mask = taken[:, None] & in_state[None, :]
            summary = tl.load(ptrs, mask=mask, other=0.0)
            # the decay from step j's end to step s's end; exp(-inf) = 0 where j comes after s
            gap = tl.where(steps[None, :] <= steps[:, None], through[:, None] - through[None, :], float("-inf"))
            leaving = (tl.exp(through)[:, None] * state[None, :]  # the state leaving each step
                       + tl.dot(tl.exp(gap), summary, input_precision="ieee"))
            last = tl.minimum(count - block_start, SEGMENTS) - 1
            # every summary of this block read (by any thread) before the first is overwritten
            tl.debug_barrier()
            # step s + 1 starts from the state leaving step s; the block's first from the carry
            after_ptrs = x_ptr + after.to(tl.int64)[:, None] * stride_xs + offsets[None, :]
            tl.store(after_ptrs, leaving, mask=mask & (steps < last)[:, None])
            tl.store(x_ptr + seg.to(tl.int64)[:, None] * stride_xs + offsets[None, :],
                     tl.broadcast_to(state[None, :], (SEGMENTS, TILE)), mask=mask & (steps == 0)[:, None])
            state = tl.sum(tl.where((steps == last)[:, None], leaving, 0.0), axis=0)
        if STORE_XT:
            xt = xt_ptr + seq * stride_xtn + head * stride_xth
            tl.store(xt + (elems // DIM_C) * stride_xtr + (elems % DIM_C) * stride_xtc,
                     state.to(xt_ptr.dtype.element_ty), mask=in_state)

    @triton.jit
    def _sequential_states_kernel(
        b_ptr, c_ptr, decay_ptr, table_ptr, first_ptr, x0_ptr, xt_ptr, x_ptr,
        stride_bb, stride_bt, stride_bh, stride_bd,
        stride_cb, stride_ct, stride_ch, stride_cd,
        stride_x0n, stride_x0h, stride_x0r, stride_x0c,
        stride_xtn, stride_xth, stride_xtr, stride_xtc,
        stride_xs, stride_xh, stride_xr, stride_xc,
        stride_decay,
        H, DIM_B, DIM_C, scale, time, seg_length, per_sequence,
        IS_VARLEN: tl.constexpr,
        REVERSE: tl.constexpr,
        HAS_X0: tl.constexpr,
        STORE_XT: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_OPERANDS: tl.constexpr,
    ):
        """Every segment's starting state of one sequence (a fixed-length row, or a varlen sequence:
        its segments first[n] .. first[n + 1] - 1 of the table), walking it chunk by chunk (the
        summary and prefix passes in one): forward, X = x0, x[s] <- X at each segment's first chunk,
        X <- exp(g L) X + sum_m exp(g (L-1-m)) b_m^T c_m over each chunk of L rows; reverse, from the
        last chunk, x[s] <- X at each segment's last chunk, X <- exp(g L) X +
        scale sum_m exp(g (m+1)) b_m^T c_m. The last X is stored in xt when STORE_XT. CHUNK divides
        seg_length, so segment bounds are chunk bounds."""
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        pid_nh = tl.program_id(0)
        sequence = (pid_nh // H).to(tl.int64)
        head = (pid_nh % H).to(tl.int64)
        if IS_VARLEN:
            # the table's rows loaded here, not in a helper (see _fixed_segment)
            first_segment = tl.load(first_ptr + sequence).to(tl.int64)
            last_row = table_ptr + (tl.load(first_ptr + sequence + 1).to(tl.int64) - 1) * 4
            batch = tl.load(table_ptr + first_segment * 4).to(tl.int64)
            start = tl.load(table_ptr + first_segment * 4 + 1).to(tl.int64)
            T = tl.load(last_row + 1).to(tl.int64) + tl.load(last_row + 2) - start
        else:
            first_segment = sequence * per_sequence
            batch, start, T = sequence, 0, time
        gamma = tl.load(decay_ptr + head * stride_decay).to(tl.float32)
        b_ptr += batch * stride_bb + start * stride_bt + head * stride_bh
        c_ptr += batch * stride_cb + start * stride_ct + head * stride_ch
        rows = tl.arange(0, CHUNK)
        b_cols = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        c_cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (b_cols[:, None] < DIM_B) & (c_cols[None, :] < DIM_C)
        if HAS_X0:
            x0 = x0_ptr + sequence * stride_x0n + head * stride_x0h
            state = tl.load(x0 + b_cols[:, None] * stride_x0r + c_cols[None, :] * stride_x0c,
                            mask=mask, other=0.0).to(tl.float32)
        else:
            state = tl.zeros([BLOCK_B, BLOCK_C], dtype=tl.float32)
        x_ptr += head * stride_xh + b_cols[:, None] * stride_xr + c_cols[None, :] * stride_xc
        n_chunks = tl.cdiv(T, CHUNK)
        # scalars broadcast into a tile before they meet the mask: a boolean tile mask on every
        # Triton version's interpreter
        zeros = b_cols[:, None] * 0 + c_cols[None, :] * 0
        for index in range(0, n_chunks):
            if REVERSE:
                chunk_start = (n_chunks - 1 - index) * CHUNK
                # the segment's last chunk: the state leaving it is the segment's
                end = zeros + (chunk_start + CHUNK)
                bound = (end % seg_length == 0) | (end >= T)
            else:
                chunk_start = index * CHUNK
                bound = (zeros + chunk_start) % seg_length == 0
            segment = first_segment + chunk_start // seg_length
            tl.store(x_ptr + segment * stride_xs, state, mask=mask & bound)
            local = chunk_start + rows
            chunk_len = tl.minimum(T - chunk_start, CHUNK)
            b = load_tile(b_ptr, local, b_cols, stride_bt, stride_bd, T, DIM_B)
            c = load_tile(c_ptr, local, c_cols, stride_ct, stride_cd, T, DIM_C)
            if REVERSE:
                weights = tl.exp(gamma * (rows + 1).to(tl.float32)) * scale
            else:
                weights = tl.exp(gamma * tl.maximum(chunk_len - 1 - rows, 0).to(tl.float32))
            b = (b * tl.where(rows < chunk_len, weights, 0.0)[:, None]).to(c.dtype)
            state = state * tl.exp(gamma * chunk_len.to(tl.float32)) + dot(
                tl.trans(b), c, DOT_PRECISION, UPCAST_OPERANDS)
        # an empty row keeps one segment, whose state is x0
        tl.store(x_ptr + first_segment * stride_xs, state, mask=mask & ((zeros + n_chunks) == 0))
        if STORE_XT:
            xt = xt_ptr + sequence * stride_xtn + head * stride_xth
            tl.store(xt + b_cols[:, None] * stride_xtr + c_cols[None, :] * stride_xtc,
                     state.to(xt_ptr.dtype.element_ty), mask=mask)


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
    longest: int = 0  # the longest sequence's tokens (fixed-length rows: time)

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
    bounds = torch.tensor(host_ints(cu_seqlens), dtype=torch.int64)  # one host sync per cu_seqlens
    count = bounds.numel() - 1
    return torch.zeros(count, dtype=torch.int64), bounds[:-1], bounds[1:] - bounds[:-1]


def _auto_segment_length(longest, total, heads: int, column_tiles: int, block: int, device: torch.device):
    """Long enough that the summaries stay small next to q, k, v; short enough that the
    sweeps fill the GPU: about SWEEP_WAVES programs per streaming multiprocessor. `longest` and
    `total` are the longest sequence's and all sequences' token counts, possibly symbolic
    (torch.sym_max / sym_min keep them so: one traced graph serves every length)."""
    # block * (a count of blocks): a symbolic length stays visibly a multiple of the block, which
    # Inductor must see to mark it so for the kernels (the launcher sees it from the value)
    whole = cdiv(torch.sym_max(longest, 1), block)
    if device.type != "cuda":
        return block * whole  # the interpreter runs programs one by one: parallelism buys nothing
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = cdiv(SWEEP_WAVES * sms, max(1, heads * column_tiles))
    length = torch.sym_max(torch.sym_max(cdiv(total, wanted), MIN_SEGMENT), block)
    return block * torch.sym_min(cdiv(length, block), whole)


def _plan_segments(q: torch.Tensor, cu_seqlens, segment: int | None, block: int, column_tiles: int) -> _Segments:
    if cu_seqlens is None:
        return _fixed_segments(q, segment, block, column_tiles)
    return _build_segments(q, cu_seqlens, segment, block, column_tiles)


def _fixed_segments(q: torch.Tensor, segment: int | None, block: int, column_tiles: int) -> _Segments:
    """Segments of fixed-length rows, from the sizes alone (symbolic sizes stay symbolic)."""
    batch, time, heads = q.shape[:3]
    if segment is None:
        segment = _auto_segment_length(time, batch * time, heads, column_tiles, block, q.device)
    per_sequence = torch.sym_max(cdiv(time, segment), 1)  # an empty row keeps one empty segment
    return _Segments(None, None, batch, segment, batch * per_sequence, time, per_sequence, time)


def _build_segments(q: torch.Tensor, cu_seqlens, segment: int | None, block: int, column_tiles: int) -> _Segments:
    """A varlen batch's segment tables, built once per cu_seqlens tensor and segment length (the
    forward's and the backward's calls, and every layer's, share them: cached_by_tensor)."""
    if segment is None:
        bounds = host_ints(cu_seqlens)
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        segment = _auto_segment_length(max(lengths, default=0), bounds[-1] - bounds[0], q.shape[2], column_tiles,
                                       block, q.device)
    what = ("lightning segments", q.shape[1], str(q.device), int(segment))
    return cached_by_tensor(cu_seqlens, what, lambda: _built_segments(q, cu_seqlens, int(segment)))


def _built_segments(q: torch.Tensor, cu_seqlens, segment: int) -> _Segments:
    batch_index, starts, lengths = _sequence_bounds(q, cu_seqlens)
    longest = int(lengths.max()) if lengths.numel() else 0
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
                     table.shape[0], longest=longest)


def _sequential_states_chosen(walks, time, chunk: int, device: torch.device) -> bool:
    """Whether the segments' states come from _sequential_states_kernel: SEQUENTIAL_STATES when set,
    else when `walks` programs fill the GPU and each walks at most SEQUENTIAL_MAX_CHUNKS chunks
    (both sizes plain ints: a symbolic one keeps the two passes rather than guard on it)."""
    if SEQUENTIAL_STATES is not None:
        return SEQUENTIAL_STATES
    if device.type != "cuda" or not isinstance(walks, int) or not isinstance(time, int):
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return walks >= sms and cdiv(time, chunk) <= SEQUENTIAL_MAX_CHUNKS


def prefix_tile(dim_b: int, dim_c: int) -> int:
    """State elements per prefix program: PREFIX_TILE, or the state's size rounded up to a power of
    two when smaller, never under 16 (tl.dot's least dimension)."""
    return max(16, min(PREFIX_TILE, next_power_of_2(dim_b * dim_c)))


def _segment_states(segments: _Segments, b: torch.Tensor, c: torch.Tensor, decay: torch.Tensor, scale: float,
                    reverse: bool, x0: torch.Tensor | None = None, xt: torch.Tensor | None = None,
                    wrap: Callable = direct, block: int = SUMMARY_CHUNK, zero_padding: bool = False) -> torch.Tensor:
    """[S, H, DIM_B, DIM_C] fp32: the state each segment's sweep starts from (forward: the state
    entering it, from x0; reverse: the gradient state leaving it, from x0 = dht). Writes the
    last state (final state or dh0) into xt. `wrap`: torch's wrap_triton when traced. `block`: the
    sweeps' block (a power of two dividing the segment length). `zero_padding`: the rows past the
    segment count are zeros (the states are an op's output, kept for its backward)."""
    heads, dim_b, dim_c = b.shape[2], b.shape[3], c.shape[3]
    states = torch.empty((kept_rows(segments.count), heads, dim_b, dim_c), dtype=torch.float32, device=b.device)
    if zero_padding:
        zero_padding_rows(states, segments.count)
    if heads == 0 or dim_b == 0 or dim_c == 0:
        return states
    block_b, block_c = _block_dim(dim_b, SUMMARY_ROW_TILE), _block_dim(dim_c, SUMMARY_COLUMN_TILE)
    tiles = (cdiv(dim_b, block_b), cdiv(dim_c, block_c))
    table, first, time, length, per_sequence = segments.kernel_args(decay)
    block_b_walk, block_c_walk = _block_dim(dim_b, SEQUENTIAL_TILE), _block_dim(dim_c, SEQUENTIAL_TILE)
    walks = segments.num_sequences * heads * cdiv(dim_b, block_b_walk) * cdiv(dim_c, block_c_walk)
    if _sequential_states_chosen(walks, segments.longest, min(SUMMARY_CHUNK, block), b.device):
        block_b, block_c = block_b_walk, block_c_walk
        wrap(_sequential_states_kernel)[(segments.num_sequences * heads, cdiv(dim_b, block_b),
                                         cdiv(dim_c, block_c))](
            b, c, decay, table, first, x0 if x0 is not None else states, xt if xt is not None else states, states,
            *b.stride(), *c.stride(), *_state_strides(x0, False), *_state_strides(xt, False), *states.stride(),
            decay.stride(0), heads, dim_b, dim_c, float(scale), time, length, per_sequence,
            IS_VARLEN=segments.varlen, REVERSE=reverse, HAS_X0=x0 is not None, STORE_XT=xt is not None, CHUNK=min(SUMMARY_CHUNK, block),
            BLOCK_B=block_b, BLOCK_C=block_c, **_dot_options(b.dtype),
        )
        return states
    wrap(_segment_summary_kernel)[(segments.count * heads * tiles[0] * tiles[1],)](
        b, c, decay, table, states,
        *b.stride(), *c.stride(), *states.stride(), decay.stride(0),
        heads, dim_b, dim_c, float(scale), time, length, per_sequence, IS_VARLEN=segments.varlen,
        REVERSE=reverse, CHUNK=SUMMARY_CHUNK, BLOCK_B=block_b, BLOCK_C=block_c, **_dot_options(b.dtype),
    )
    tile = prefix_tile(dim_b, dim_c)
    wrap(_segment_prefix_kernel)[(segments.num_sequences * heads, cdiv(dim_b * dim_c, tile))](
        states, decay, table, first,
        x0 if x0 is not None else states, xt if xt is not None else states,
        *states.stride(), *_state_strides(x0, False), *_state_strides(xt, False), decay.stride(0),
        heads, dim_b, dim_c, time, length, per_sequence, IS_VARLEN=segments.varlen,
        REVERSE=reverse, HAS_X0=x0 is not None, STORE_XT=xt is not None, SEGMENTS=PREFIX_SEGMENTS, TILE=tile,
        num_warps=PREFIX_WARPS,
    )
    return states
