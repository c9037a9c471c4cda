"""The @triton.jit helpers the delta-rule kernels share (every step file's and cp.py's).

A program addresses token rows of [B, T, H, D] tensors and of the [B, T, HV, BT] intra-chunk
matrices: _row_chunk_coords finds its chunk in a fixed-length batch, _varlen_chunk_coords from the
varlen chunk table's entry and its sequence's cu_seqlens span (of batch 0), which the kernel loads
(see the note above _varlen_bounds), _gate_offset its head's cumulative gates. Loads are
zero outside the valid rows and columns, so partial chunks and head dims below the tile width need no
special case.
_dot is every product over K, V or the chunk: fp32 accumulation, operands rounded to the dtype of the
stored intermediates (plan.py says which).

Gates are natural-log decays, assumed <= 0 as FLA does. Every decay factor in the kernels
is e^x with x <= 0: pairwise decays come from differences G_t - G_s (s <= t), never from
e^G_t / e^G_s, so a strongly decaying chunk underflows to 0 instead of overflowing
(_chunk_end_decays: e^(G_last - G_t)).

Kernels import these with `from .tiles import _dot, ...` and call them by these names, never under
another: Inductor copies a traced kernel's source with the source of each jit function it calls, found
by name in the caller's module globals (tests/test_architecture.py checks it).
"""

from __future__ import annotations

import os

from .._triton import dot, tl, triton

if triton is not None:

    # Triton's interpreter multiplies half operands wrongly (see _triton.dot); it decides at
    # kernel definition time, as this does.
    UPCAST_DOT_OPERANDS = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

    @triton.jit
    def _dot(a, b, dtype, DOT_PRECISION: tl.constexpr):
        """a @ b accumulated in fp32, operands rounded to `dtype`: the dtype of the stored
        intermediates (half for half inputs: tensor-core rate; fp32 with ieee otherwise)."""
        return dot(a.to(dtype), b.to(dtype), DOT_PRECISION, UPCAST_DOT_OPERANDS)

    # torch's mutation analysis (a traced launch) walks back from each store's address through every
    # op it is computed from, a jit helper's call included, but not through a load. A table or
    # cu_seqlens pointer passed into a helper whose results index a store thus counts as written,
    # and Inductor copies that argument before every launch (11 extra kernels per GDN step). So no
    # helper takes a pointer to them: each kernel loads the entries itself and passes the values
    # (tests/kernels/test_delta_rule_launch_writes.py checks every launch on the CPU).

    @triton.jit
    def _varlen_bounds(seq, bos, eos):
        """(batch, bos, eos) of sequence `seq` of a varlen batch, from its cu_seqlens entries
        (`bos`, `eos`, loaded by the kernel): a span of batch 0."""
        return (seq * 0).to(tl.int64), bos.to(tl.int64), eos.to(tl.int64)

    @triton.jit
    def _row_bounds(seq, T):
        """(batch, bos, eos) of sequence `seq` of a fixed-length batch: its row."""
        bos = (seq * 0).to(tl.int64)
        return seq.to(tl.int64), bos, bos + T

    @triton.jit
    def _varlen_chunk_coords(chunk, bos, eos, BT: tl.constexpr):
        """(batch, first token, valid rows) of chunk `chunk` of the sequence [bos, eos) of a
        varlen batch: the kernel loads the chunk table's entry and the sequence's cu_seqlens."""
        batch, bos, eos = _varlen_bounds(chunk, bos, eos)
        start = bos + chunk.to(tl.int64) * BT
        return batch, start, tl.minimum(eos - start, BT)

    @triton.jit
    def _row_chunk_coords(pid_chunk, T, NT, BT: tl.constexpr):
        """(batch, first token, valid rows) of global chunk `pid_chunk` of a fixed-length batch."""
        batch, bos, eos = _row_bounds(pid_chunk // NT, T)
        start = bos + (pid_chunk % NT).to(tl.int64) * BT
        return batch, start, tl.minimum(eos - start, BT)

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
    def _gate_offset(batch, head, T, HV, K, GATE: tl.constexpr):
        """Offset of (batch, token 0, head) in the fp32 gate buffers [B, T, HV, K] or [B, T, HV, 1]."""
        width = 1
        if GATE == 2:
            width = K
        return (batch * T * HV + head) * width

    @triton.jit
    def _pair_decays(cum_ptr, tokens, valid, HV, BT: tl.constexpr):
        """e^(G_t - G_s) [BT, BT] of a scalar gate's chunk for the valid pairs s <= t, 0 elsewhere:
        the decays of Kdot and P, one tile for the whole chunk."""
        local = tl.arange(0, BT)
        g = tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0)
        visible = (local[:, None] >= local[None, :]) & valid[:, None] & valid[None, :]
        return tl.exp(tl.where(visible, g[:, None] - g[None, :], float("-inf")))

    @triton.jit
    def _chunk_end_decay(cum_ptr, last_token, kc, HV, K):
        """e^G_last [BK] of a channel gate's chunk: the state's decay over the chunk."""
        return tl.exp(_load_vector(cum_ptr, last_token, kc, HV * K, 1, last_token >= 0, K))

    @triton.jit
    def _channel_decays(cum_ptr, tokens, valid, last_token, kc, HV, K):
        """(G [BT, BK], e^(G_last - G) [BT, BK], e^G_last [BK]) of a channel gate's chunk: G as
        loaded, for a caller that also needs e^G (the backward sweeps' decayed queries), so that the
        [BT, BK] fp32 tile is read once a step, not twice."""
        g = _load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K)
        g_last = _load_vector(cum_ptr, last_token, kc, HV * K, 1, last_token >= 0, K)
        return g, tl.exp(tl.where(valid[:, None], g_last[None, :] - g, 0.0)), tl.exp(g_last)

    @triton.jit
    def _chunk_end_decays(cum_ptr, tokens, valid, last_token, kc, HV, K, GATE: tl.constexpr):
        """(e^(G_last - G_t) per row [BT, BK] or [BT, 1], e^G_last [BK] or [1]) of one chunk."""
        if GATE == 2:
            _, to_end, whole = _channel_decays(cum_ptr, tokens, valid, last_token, kc, HV, K)
        else:
            g = tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0)
            g_last = tl.load(cum_ptr + tl.maximum(last_token, 0) * HV)  # in bounds in speculated iterations too
            to_end = tl.exp(tl.where(valid, g_last - g, 0.0))[:, None]
            whole = tl.exp(g_last + tl.zeros([1], dtype=tl.float32))
        return to_end, whole
