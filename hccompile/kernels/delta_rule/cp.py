"""Context parallelism (CP) for the chunked delta rule: summary and merge kernels, and the per-rank
forward and backward that run chunk.py's steps around one exchange of summaries.

Math (per value head; plain, GDN and KDA alike). Over a segment of tokens, the chunk recurrence
S_end = diag(gamma) S + K~^T (U~ - W S) is affine in the segment's initial state:

    S_out = M S_in + H                     (forward summary; M in R^{KxK}, H in R^{KxV})
    dS_in = M^T dS_out + dH                (backward summary; dH = dL_local/dS_in with dS_out = 0)

Both are the same recurrence run on more columns, which is how the summary kernels fuse them:
H is the state reached from S_in = 0; column j of M is the state reached from S_in = e_j with the
values removed (U~ = 0). Likewise dH is the state gradient swept back from dS_out (the caller's
gradient of the segment's end state, 0 when none), and column j of M^T the one swept back from e_j
with dO = 0. Summaries are fp32 (the kernels' state precision); the products take the operands of
chunk.py's kernels (half for half inputs, with fp32 accumulation).

A rank's local tokens are segments (hccompile.distributed.layout.SegmentPlan): whole sequences,
and pieces of sequences that continue from (incoming) or into (outgoing) other ranks. The forward:

  prepare   intra-chunk kernels (chunk-parallel, all tokens); the state sweep of the segments
            that send and need nothing (outgoing, not incoming): their end state *is* their
            forward summary H; the summary kernel for middle segments: [H | M] from S_in = 0,
            storing every chunk's [H | M] and [U_H | U_M] on the way.
  overlap   while the summaries travel: the sweep of purely local segments, and the output
            kernel on the chunks of every segment that does not wait (not incoming).
  finish    (the exchange has written the merged S_in of incoming segments) for middle segments
            h = H + M S_in and U = U_H + U_M S_in per chunk (chunk-parallel), for the others
            their state sweep; then their output.

The backward mirrors it: prepare recomputes the forward summaries and runs the state-gradient sweep
of the segments that send their gradient and need none (incoming, not outgoing): their dh0 *is*
their backward summary dH; middle segments get dH from the backward summary kernel; one exchange
carries [H | M] and dH; overlap runs everything of the purely local segments (both sweeps and the
chunk-parallel backward kernels); finish, after the merge gave S_in and dS_out, the rest. M of a middle segment is sent once, with the forward summary, and used
transposed by the backward merge.

The merge folds a chain of summaries, S = H_0, then S = M_j S + H_j (forward) or S = M_j^T S + dH_j
(backward), in one kernel launch for all chains.

This module builds on the step files' kernels and launchers (gate_cumsum.py, scores.py, wy.py,
state.py, output.py, qk_l2norm.py) and plan.py's Plan, imported below from the modules that define
them and never changed here; it knows nothing of torch.distributed: the exchange is an object with
start() and finish().
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .._triton import cdiv, direct, require_triton, scratch_rows, tl, triton
from .chunk import (ChunkLocal, Kept, chunk_local_steps, launch_split_wy_backward, sum_key_groups,
                    sweep_launch_options)
from .gate_cumsum import ACTIVATION_NONE, gate_activation, gate_activation_backward, gate_backward, launch_gate_cumsum
from .plan import (GATE_CODES, MAX_HEAD_DIM, MIN_DOT_DIM, Plan, block_size, check_kernel_inputs,
                   narrow_for_occupancy)
from .qk_l2norm import l2norm_backward
from .reference import DeltaRuleProblem, check_delta_rule_inputs
from .scores import launch_scores_backward
from .state import (STATE_TILE_ELEMENTS, state_backward_block_v, state_forward_block_v,
                    state_launch_options)
from .wy import WY_BACKWARD_OPTIONS

if triton is not None:
    from .output import _output_kernel, launch_output
    from .state import _state_backward_kernel, _state_forward_kernel
    from .tiles import (_channel_decays, _chunk_end_decays, _dot, _load_rows, _load_stored_rows, _store_rows,
                        _varlen_chunk_coords)
    from .wy import _wy_backward_kernel

__all__ = [
    "CPBackward",
    "CPForward",
    "keeps_forward",
    "merge_chains",
    "summary_backward",
    "summary_forward",
]

# Debugging aid for tests: fill every buffer a kernel should write with NaN first.
POISON = os.environ.get("HCCOMPILE_CP_POISON") == "1"
# A middle segment's summary walk ([H | M], K more columns than a state sweep) stores its chunks,
# and after the merge its h and U are H + M S_in chunk-parallel instead of a second walk. Only
# middle segments: a segment that only waits (the last rank's) walks after the merge, since a
# wide walk of it before the merge was measured slower on two H200 (fwd+bwd 44.3 against 39.1 ms,
# GDN, one 256K sequence: the state sweeps already fill the GPU by narrowing their tiles, so twice
# the columns cost twice the time). False: middle segments walk again after the merge. Read at
# call time (benchmarks/cp.py times both).
MIDDLE_WALK_STORES_CHUNKS = True


if triton is not None:

    @triton.jit
    def _summary_forward_kernel(
        k_ptr, cum_ptr, w_ptr, u_tilde_ptr, out_ptr, h_ptr, u_ptr,
        stride_kt, stride_kh, stride_kk,
        stride_os, stride_oh, stride_ok, stride_oc,
        job_segment_ptr, job_slot_ptr, cu_seqlens_ptr, chunk_offsets_ptr,
        HV, GROUP, K, V, V_TILES,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BKF: tl.constexpr,
        BC: tl.constexpr,
        STORE_CHUNKS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One column tile of [H | M] of one segment and value head; tiles below V_TILES are H's.

        Both parts run S <- diag(gamma) S + (K e^(G_last - G))^T (U~ - W S) over the segment's
        chunks: H's columns from S = 0 with the values U~, M's from the identity's columns without.
        Stored into out[slot, head, :, col] with M's columns after V's. With STORE_CHUNKS, also
        every chunk's starting [H | M] (h [chunks, HV, K, V + K]) and corrected values [U_H | U_M]
        (u [T, HV, V + K]): once S_in is known, h = H + M S_in and U = U_H + U_M S_in are the
        state sweep's h and U, chunk-parallel (_incoming_state_kernel).
        """
        job = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2)
        segment = tl.load(job_segment_ptr + job).to(tl.int64)
        slot = tl.load(job_slot_ptr + job).to(tl.int64)
        bos = tl.load(cu_seqlens_ptr + segment).to(tl.int64)
        eos = tl.load(cu_seqlens_ptr + segment + 1).to(tl.int64)
        k_ptr += (head // GROUP) * stride_kh
        if GATE == 2:
            cum_ptr += head * K
        else:
            cum_ptr += head
        w_ptr += head * K
        u_tilde_ptr += head * V

        dot_dtype = w_ptr.dtype.element_ty
        is_value = tile < V_TILES
        cols = tl.where(is_value, tile, tile - V_TILES) * BC + tl.arange(0, BC)
        width = tl.where(is_value, V, K)
        # Value columns read: V in H's tiles, none in M's (U~ = 0). A column count rather than
        # `& is_value` on the masks: that would splat a scalar condition into a block mask, which
        # Triton's interpreter types as an integer (Triton 3.9's rejects such masks).
        value_width = tl.where(is_value, V, 0)
        kc = tl.arange(0, BKF)
        local = tl.arange(0, BT)
        identity = tl.where((kc[:, None] == cols[None, :]) & (kc[:, None] < K), 1.0, 0.0)
        state = tl.where(is_value, 0.0, identity)
        column_offset = tl.where(is_value, 0, V)
        if STORE_CHUNKS:
            first_chunk = tl.load(chunk_offsets_ptr + segment).to(tl.int64)
            h_ptr += head * K * (V + K) + column_offset
            u_ptr += head * (V + K) + column_offset
        for chunk in range(0, tl.cdiv(eos - bos, BT)):
            start = bos + chunk * BT
            length = tl.minimum(eos - start, BT)
            tokens = start + local
            valid = local < length
            if STORE_CHUNKS:
                _store_rows(h_ptr + (first_chunk + chunk) * HV * K * (V + K), state, kc, cols, V + K, 1, kc < K,
                            width)
            w = _load_stored_rows(w_ptr, tokens, kc, HV * K, 1, valid, K)
            u = _load_rows(u_tilde_ptr, tokens, cols, HV * V, 1, valid, value_width)
            u -= _dot(w, state, dot_dtype, DOT_PRECISION)
            if STORE_CHUNKS:
                _store_rows(u_ptr, u, tokens, cols, HV * (V + K), 1, valid, width)
            if GATE != 0:
                to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K, GATE)
                state *= whole[:, None]
            if GATE == 2:
                k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                k_tile *= to_end
            else:
                k_tile = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                if GATE == 1:
                    # The row decays scale the [BT, BC] values, not the [BT, K] keys (as state_forward).
                    u *= to_end
            state += _dot(tl.trans(k_tile), u, dot_dtype, DOT_PRECISION)
        _store_rows(out_ptr + slot * stride_os + head * stride_oh + column_offset * stride_oc, state, kc, cols,
                    stride_ok, stride_oc, kc < K, width)

    @triton.jit
    def _summary_backward_kernel(
        q_ptr, k_ptr, cum_ptr, w_ptr, scores_ptr, do_ptr, dht_ptr, out_ptr,
        stride_qt, stride_qh, stride_qk,
        stride_kt, stride_kh, stride_kk,
        stride_dot, stride_doh, stride_dov,
        stride_dhtn, stride_dhth, stride_dhtk, stride_dhtv,
        stride_os, stride_oh, stride_ok, stride_oc,
        job_segment_ptr, job_slot_ptr, cu_seqlens_ptr,
        HV, GROUP, K, V, V_TILES, scale,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BKF: tl.constexpr,
        BC: tl.constexpr,
        HAS_FINAL_STATE_GRAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One column tile of [dH | M^T] of one segment and value head; tiles below V_TILES are dH's.

        Both run the state-gradient sweep backwards over the segment's chunks,
        dU = scale P^T dO + K~ dS,  dS <- diag(gamma) dS + scale (Q e^G)^T dO - W^T dU,
        dH's columns from dS = dht[segment] with the real dO, M^T's from the identity with dO = 0.
        """
        job = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2)
        segment = tl.load(job_segment_ptr + job).to(tl.int64)
        slot = tl.load(job_slot_ptr + job).to(tl.int64)
        bos = tl.load(cu_seqlens_ptr + segment).to(tl.int64)
        eos = tl.load(cu_seqlens_ptr + segment + 1).to(tl.int64)
        key_head = head // GROUP
        q_ptr += key_head * stride_qh
        k_ptr += key_head * stride_kh
        do_ptr += head * stride_doh
        if GATE == 2:
            cum_ptr += head * K
        else:
            cum_ptr += head
        w_ptr += head * K
        scores_ptr += head * BT

        dot_dtype = w_ptr.dtype.element_ty
        is_value = tile < V_TILES
        cols = tl.where(is_value, tile, tile - V_TILES) * BC + tl.arange(0, BC)
        width = tl.where(is_value, V, K)
        # Value columns read: V in dH's tiles, none in M^T's (dO = 0, no dht); a column count, as
        # in _summary_forward_kernel.
        value_width = tl.where(is_value, V, 0)
        kc = tl.arange(0, BKF)
        local = tl.arange(0, BT)
        identity = tl.where((kc[:, None] == cols[None, :]) & (kc[:, None] < K), 1.0, 0.0)
        dstate = tl.where(is_value, 0.0, identity)
        if HAS_FINAL_STATE_GRAD:
            dstate += _load_rows(dht_ptr + segment * stride_dhtn + head * stride_dhth, kc, cols, stride_dhtk,
                                 stride_dhtv, kc < K, value_width)
        num_chunks = tl.cdiv(eos - bos, BT)
        for step in range(0, num_chunks):
            start = bos + tl.maximum(num_chunks - 1 - step, 0) * BT  # clamped as in state.py's backward sweep
            length = tl.minimum(eos - start, BT)
            tokens = start + local
            valid = local < length
            do_tile = _load_stored_rows(do_ptr, tokens, cols, stride_dot, stride_dov, valid, value_width)
            scores = _load_rows(scores_ptr, tokens, local, HV * BT, 1, valid, BT)
            scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
            du = scale * _dot(tl.trans(scores), do_tile, dot_dtype, DOT_PRECISION)
            if GATE != 0:
                k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
                if GATE == 2:
                    g, to_end, whole = _channel_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K)
                    k_tile *= to_end
                    q_tile *= tl.exp(g)
                else:
                    to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K, GATE)
                    k_tile *= to_end
                    q_tile *= tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))[:, None]
            else:
                k_tile = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                q_tile = _load_stored_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            du += _dot(k_tile, dstate, dot_dtype, DOT_PRECISION)
            w = _load_stored_rows(w_ptr, tokens, kc, HV * K, 1, valid, K)
            if GATE != 0:
                dstate *= whole[:, None]
            dstate += scale * _dot(tl.trans(q_tile), do_tile, dot_dtype, DOT_PRECISION)
            dstate -= _dot(tl.trans(w), du, dot_dtype, DOT_PRECISION)
        column_offset = tl.where(is_value, 0, V)
        _store_rows(out_ptr + slot * stride_os + head * stride_oh + column_offset * stride_oc, dstate, kc, cols,
                    stride_ok, stride_oc, kc < K, width)

    @triton.jit
    def _incoming_state_kernel(
        h_wide_ptr, u_wide_ptr, s_ptr, h_ptr, u_ptr,
        stride_sn, stride_sh, stride_sk, stride_sv,
        chunk_table_ptr, cu_seqlens_ptr,
        HV, K, V,
        BT: tl.constexpr,
        BKF: tl.constexpr,
        BV: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """One chunk, value head and value tile of an incoming segment, once the merge gave its
        initial state S: h = H + M S and U = U_H + U_M S from _summary_forward_kernel's chunk
        stores ([H | M] per chunk, [U_H | U_M] per token), which makes the state sweep's outputs
        without a second walk along the segment."""
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        # the chunk table's sequence is the segment (one varlen row of segments)
        segment = tl.load(chunk_table_ptr + 2 * pid_chunk).to(tl.int64)
        chunk = tl.load(chunk_table_ptr + 2 * pid_chunk + 1)
        _, start, length = _varlen_chunk_coords(chunk, tl.load(cu_seqlens_ptr + segment),
                                                tl.load(cu_seqlens_ptr + segment + 1), BT)
        kc = tl.arange(0, BKF)
        vc = pid_v * BV + tl.arange(0, BV)
        local = tl.arange(0, BT)
        tokens = start + local
        valid = local < length
        dot_dtype = h_ptr.dtype.element_ty
        state = _load_rows(s_ptr + segment * stride_sn + head * stride_sh, kc, vc, stride_sk, stride_sv, kc < K, V)
        wide = h_wide_ptr + (pid_chunk.to(tl.int64) * HV + head) * K * (V + K)
        h = _load_rows(wide, kc, vc, V + K, 1, kc < K, V)
        h += _dot(_load_stored_rows(wide + V, kc, kc, V + K, 1, kc < K, K), state, dot_dtype, DOT_PRECISION)
        _store_rows(h_ptr + (pid_chunk.to(tl.int64) * HV + head) * K * V, h, kc, vc, V, 1, kc < K, V)
        u_wide_ptr += head * (V + K)
        u = _load_rows(u_wide_ptr, tokens, vc, HV * (V + K), 1, valid, V)
        u += _dot(_load_stored_rows(u_wide_ptr + V, tokens, kc, HV * (V + K), 1, valid, K), state, dot_dtype,
                  DOT_PRECISION)
        _store_rows(u_ptr + head * V, u, tokens, vc, HV * V, 1, valid, V)

    @triton.jit
    def _merge_kernel(
        h_ptr, m_ptr, chain_h_ptr, chain_m_ptr, chain_length_ptr, destination_ptr, out_ptr,
        stride_hs, stride_hh, stride_hk, stride_hv,
        stride_ms, stride_mh, stride_mr, stride_mc,
        stride_os, stride_oh, stride_ok, stride_ov,
        HV, K, V, MAX_CHAIN,
        BKF: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        ACCUMULATE: tl.constexpr,
    ):
        """Folds one chain for one value head and value tile: S = H[c_0], then S = M[m_j] S + H[c_j].

        H rows and M matrices are addressed by flat slot through the chain tables; passing M with
        its row and column strides swapped folds with M^T. The result goes to out[destination]
        (added to it with ACCUMULATE). M is read in row blocks of BK; each block's product lands
        in the full [BKF, BV] state through a 0/1 placement product, which keeps the registers
        at [BK, BKF] for M however large K is.
        """
        chain = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        kc = tl.arange(0, BKF)
        vc = pid_v * BV + tl.arange(0, BV)
        length = tl.load(chain_length_ptr + chain)
        first = tl.load(chain_h_ptr + chain * MAX_CHAIN).to(tl.int64)
        state = _load_rows(h_ptr + first * stride_hs + head * stride_hh, kc, vc, stride_hk, stride_hv, kc < K, V)
        for j in range(1, length):
            # j clamped: a pipelined loop may load the index of an iteration past its end (see state.py).
            entry = chain * MAX_CHAIN + tl.minimum(j, length - 1)
            source = tl.load(chain_h_ptr + entry).to(tl.int64)
            matrix = tl.load(chain_m_ptr + entry).to(tl.int64)
            folded = _load_rows(h_ptr + source * stride_hs + head * stride_hh, kc, vc, stride_hk, stride_hv,
                                kc < K, V)
            m_base = m_ptr + matrix * stride_ms + head * stride_mh
            if BK == BKF:
                m_tile = _load_rows(m_base, kc, kc, stride_mr, stride_mc, kc < K, K)
                folded += tl.dot(m_tile, state, input_precision="ieee")
            else:
                for block in tl.static_range(BKF // BK):
                    rows = block * BK + tl.arange(0, BK)
                    m_rows = _load_rows(m_base, rows, kc, stride_mr, stride_mc, rows < K, K)
                    part = tl.dot(m_rows, state, input_precision="ieee")
                    placement = tl.where(kc[:, None] == rows[None, :], 1.0, 0.0)
                    folded += tl.dot(placement, part, input_precision="ieee")
            state = folded
        destination = tl.load(destination_ptr + chain).to(tl.int64)
        out_base = out_ptr + destination * stride_os + head * stride_oh
        if ACCUMULATE:
            state += _load_rows(out_base, kc, vc, stride_ok, stride_ov, kc < K, V)
        _store_rows(out_base, state, kc, vc, stride_ok, stride_ov, kc < K, V)


# ----------------------------------------------------------------------------------------
# Buffers and launch geometry


def _empty(*shape, dtype=torch.float32, device) -> torch.Tensor:
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


def _device_tensor(values, dtype, device) -> torch.Tensor:
    """A host list on `device` without a device sync (pinned, non-blocking copy on CUDA)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _segments_where(plan, incoming: bool | None, outgoing: bool | None) -> list[tuple[int, int]]:
    """Runs of segments with the given roles (None: either)."""
    return _runs((incoming is None or a == incoming) and (outgoing is None or b == outgoing)
                 for a, b in zip(plan.incoming, plan.outgoing))


def _runs(flags) -> list[tuple[int, int]]:
    """Maximal [lo, hi) index ranges where flags is true."""
    runs, start = [], None
    for i, flag in enumerate(list(flags) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


@dataclass
class _Geometry:
    """Device tables of a segment plan for one chunk size (cached on the plan)."""

    cu_seqlens: torch.Tensor  # int64 [segments + 1], local flattened tokens
    chunk_table: torch.Tensor  # int32 [chunks, 2] (segment, chunk)
    chunk_offsets: torch.Tensor  # int32 [segments] first chunk of each segment
    chunk_starts: list[int]  # host copy of chunk_offsets, plus the total at the end
    num_chunks: int
    dummy: torch.Tensor


def _geometry(plan, chunk_size: int, device: torch.device) -> _Geometry:
    key = ("geometry", chunk_size, str(device))
    if key not in plan.cache:
        counts = [cdiv(hi - lo, chunk_size) for lo, hi in plan.bounds]
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        pairs = [(seq, chunk) for seq, count in enumerate(counts) for chunk in range(count)]
        plan.cache[key] = _Geometry(
            cu_seqlens=_device_tensor(plan.cu_seqlens(), torch.int64, device),
            chunk_table=_device_tensor(pairs or [(0, 0)], torch.int32, device),
            chunk_offsets=_device_tensor(starts[:-1] or [0], torch.int32, device),
            chunk_starts=starts,
            num_chunks=starts[-1],
            dummy=torch.zeros(2, dtype=torch.float32, device=device),
        )
    return plan.cache[key]


def _index(plan, name: str, values, device) -> torch.Tensor:
    """A cached int64 device tensor of plan-derived indices."""
    key = ("index", name, str(device))
    if key not in plan.cache:
        plan.cache[key] = _device_tensor(list(values), torch.int64, device)
    return plan.cache[key]


def _chains(plan, direction: str, device) -> tuple[torch.Tensor, ...]:
    """(h slots, m slots, lengths, destinations) int32 tables of the plan's merge chains.

    forward: one chain per incoming segment over forward slots; backward: one per outgoing segment,
    H from backward slots and M from forward slots.
    """
    key = ("chains", direction, str(device))
    if key not in plan.cache:
        rows_h, rows_m, destinations = [], [], []
        for segment in range(plan.num_segments):
            if direction == "forward" and plan.incoming[segment]:
                chain = plan.fwd_chain[segment]
                rows_h.append(list(chain))
                rows_m.append([-1] + list(chain[1:]))
            elif direction == "backward" and plan.outgoing[segment]:
                chain = plan.bwd_chain[segment]
                rows_h.append([h for h, _ in chain])
                rows_m.append([m for _, m in chain])
            else:
                continue
            destinations.append(segment)
        width = max((len(r) for r in rows_h), default=1)
        pad = lambda rows: [r + [0] * (width - len(r)) for r in rows] or [[0] * width]  # noqa: E731
        plan.cache[key] = (
            _device_tensor(pad(rows_h), torch.int32, device),
            _device_tensor([[max(m, 0) for m in r] for r in pad(rows_m)], torch.int32, device),
            _device_tensor([len(r) for r in rows_h] or [0], torch.int32, device),
            _device_tensor(destinations or [0], torch.int32, device),
        )
    return plan.cache[key]


# ----------------------------------------------------------------------------------------
# Launchers of the CP kernels


def merge_chains(plan, direction: str, summaries_out: torch.Tensor, summaries_in: torch.Tensor | None,
                 out: torch.Tensor, value_dim: int) -> None:
    """Writes (forward) or adds (backward) every chain's fold into out[destination].

    summaries_out: gathered forward summaries [world * out_slots, HV, K, V (+ K)] ([H | M]);
    summaries_in: gathered backward summaries [world * in_slots, HV, K, V] (dH), backward only.
    out: [segments, HV, K, V] initial states (forward) or end-state gradients (backward).
    """
    count = sum(plan.incoming if direction == "forward" else plan.outgoing)
    if count == 0:
        return
    chain_h, chain_m, lengths, destinations = _chains(plan, direction, out.device)
    value_heads, key_dim = out.shape[1], out.shape[2]
    h_source = summaries_out if direction == "forward" else summaries_in
    m_source = summaries_out[..., value_dim:] if plan.with_transition else summaries_out[..., :0]
    m_strides = list(m_source.stride())
    if direction == "backward":  # fold with M^T
        m_strides[2], m_strides[3] = m_strides[3], m_strides[2]
    block_k_full = block_size(key_dim, MAX_HEAD_DIM)
    block_v = min(block_size(value_dim), max(MIN_DOT_DIM, STATE_TILE_ELEMENTS // block_k_full))
    direct(_merge_kernel)[(count, value_heads, cdiv(value_dim, block_v))](
        h_source, m_source if m_source.numel() else h_source, chain_h, chain_m, lengths, destinations, out,
        *h_source.stride(), *m_strides, *out.stride(),
        value_heads, key_dim, value_dim, chain_h.shape[1],
        BKF=block_k_full, BK=min(block_k_full, 64), BV=block_v, ACCUMULATE=direction == "backward",
    )


# The narrowest column tile of the summary sweeps: the backward sweeps' floor before state_backward's
# 16-wide tiles were checked on one H200 (state.MIN_BACKWARD_SWEEP_TILE); the summary kernels' 16-wide
# tiles wait for a check on two GPUs (their backward shares these blocks).
SUMMARY_MIN_TILE = 32


def _summary_blocks(problem, segments: int, with_transition: bool, device) -> tuple[int, int]:
    """(BKF, BC) of the summary sweeps; BC narrowed for occupancy like state.py's sweeps, not
    below SUMMARY_MIN_TILE."""
    block_k_full = block_size(problem.key_dim, MAX_HEAD_DIM)
    widest = max(MIN_DOT_DIM, min(64, STATE_TILE_ELEMENTS // block_k_full))
    columns = problem.value_dim + (problem.key_dim if with_transition else 0)
    return block_k_full, narrow_for_occupancy(widest, segments * problem.value_heads, columns, device,
                                              floor=SUMMARY_MIN_TILE)


def _launch_summary_forward(kplan, intra, geometry, segments, slots, out, with_transition: bool,
                            chunks: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Summary forward kernel for the segments (int64 device tensor) into out[slots]; with
    `chunks` = (h_wide [chunks, HV, K, V + K], u_wide [1, T, HV, V + K]), every chunk's [H | M]
    and [U_H | U_M] too (with_transition must be on)."""
    problem = kplan.problem
    if segments.numel() == 0:
        return
    assert chunks is None or with_transition
    block_k_full, block_c = _summary_blocks(problem, segments.numel(), with_transition, out.device)
    value_tiles = cdiv(problem.value_dim, block_c)
    tiles = value_tiles + (cdiv(problem.key_dim, block_c) if with_transition else 0)
    cum = intra.cum if intra.cum is not None else geometry.dummy
    h_wide, u_wide = chunks if chunks is not None else (geometry.dummy, geometry.dummy)
    direct(_summary_forward_kernel)[(segments.numel(), problem.value_heads, tiles)](
        intra.k, cum, intra.w, intra.u_tilde, out, h_wide, u_wide, *intra.k.stride()[1:], *out.stride(), segments,
        slots, geometry.cu_seqlens, geometry.chunk_offsets, problem.value_heads, problem.group_size,
        problem.key_dim, problem.value_dim, value_tiles, GATE=kplan.gate_code, BT=kplan.chunk_size,
        BKF=block_k_full, BC=block_c, STORE_CHUNKS=chunks is not None, DOT_PRECISION=kplan.dot_precision,
        **state_launch_options(block_k_full, intra.k.dtype),
    )


def _launch_incoming_state(kplan, geometry, h_wide, u_wide, initial_states, h, u, lo: int, hi: int) -> None:
    """_incoming_state_kernel on the chunks of segments [lo, hi)."""
    problem = kplan.problem
    first, last = geometry.chunk_starts[lo], geometry.chunk_starts[hi]
    if last == first:
        return
    block_k_full = block_size(problem.key_dim, MAX_HEAD_DIM)
    block_v = block_size(problem.value_dim)
    direct(_incoming_state_kernel)[(last - first, problem.value_heads, cdiv(problem.value_dim, block_v))](
        h_wide[first:], u_wide, initial_states, h[first:], u, *initial_states.stride(), geometry.chunk_table[first:],
        geometry.cu_seqlens, problem.value_heads, problem.key_dim, problem.value_dim,
        BT=kplan.chunk_size, BKF=block_k_full, BV=block_v, DOT_PRECISION=kplan.dot_precision,
        num_warps=8 if block_k_full > 64 else 4,
    )


def _launch_summary_backward(kplan, intra, geometry, do, final_grads, segments, slots, out, scale,
                             with_transition: bool) -> None:
    """Summary backward kernel for the segments (int64 device tensor) into out[slots]."""
    problem = kplan.problem
    if segments.numel() == 0:
        return
    block_k_full, block_c = _summary_blocks(problem, segments.numel(), with_transition, out.device)
    value_tiles = cdiv(problem.value_dim, block_c)
    tiles = value_tiles + (cdiv(problem.key_dim, block_c) if with_transition else 0)
    cum = intra.cum if intra.cum is not None else geometry.dummy
    dht = final_grads if final_grads is not None else geometry.dummy
    dht_strides = final_grads.stride() if final_grads is not None else (0, 0, 0, 0)
    direct(_summary_backward_kernel)[(segments.numel(), problem.value_heads, tiles)](
        intra.q, intra.k, cum, intra.w, intra.scores, do, dht, out,
        *intra.q.stride()[1:], *intra.k.stride()[1:], *do.stride()[1:], *dht_strides, *out.stride(), segments, slots,
        geometry.cu_seqlens, problem.value_heads, problem.group_size, problem.key_dim, problem.value_dim,
        value_tiles, float(scale), GATE=kplan.gate_code, BT=kplan.chunk_size, BKF=block_k_full, BC=block_c,
        HAS_FINAL_STATE_GRAD=final_grads is not None, DOT_PRECISION=kplan.dot_precision,
        **state_launch_options(block_k_full, intra.k.dtype),
    )


# ----------------------------------------------------------------------------------------
# The local problem: a rank's tokens flattened into one varlen row of segments


_Intra = ChunkLocal  # a rank's chunk-parallel intermediates


@dataclass
class _Local:
    """The caller's tensors flattened to [1, B*T, ...] and the launch plan of their segments."""

    plan: Any  # SegmentPlan
    kplan: Plan
    geometry: _Geometry
    batch: int
    time: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    g: torch.Tensor | None
    initial_state: torch.Tensor | None
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float | None
    scale: float
    use_qk_l2norm_in_kernel: bool

    @property
    def problem(self) -> DeltaRuleProblem:
        return self.kplan.problem


def _flatten(x: torch.Tensor | None, batch: int, time: int) -> torch.Tensor | None:
    if x is None or batch == 1:
        return x
    return x.reshape(1, batch * time, *x.shape[2:])


def _local_problem(plan, q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound, scale,
                   use_qk_l2norm_in_kernel, chunk_size, **extra) -> _Local:
    batch, time = q.shape[0], q.shape[1]
    if batch * time != plan.num_tokens:
        raise ValueError(f"q: {batch} x {time} local tokens, but the context parallel plan of rank {plan.rank} "
                         f"holds {plan.num_tokens}")
    flat = {name: _flatten(x, batch, time) for name, x in dict(q=q, k=k, v=v, beta=beta, g=g, **extra).items()}
    problem = check_delta_rule_inputs(flat["q"], flat["k"], flat["v"], flat["beta"], flat["g"], gate, None, None,
                                      A_log, dt_bias, lower_bound,
                                      **{n: t for n, t in flat.items() if n not in ("q", "k", "v", "beta", "g")})
    problem = replace(problem, varlen=True, sequences=tuple((0, lo, hi) for lo, hi in plan.bounds))
    if initial_state is not None:
        expected = (plan.user_rows, problem.value_heads, problem.key_dim, problem.value_dim)
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state: shape {tuple(initial_state.shape)} differs from the expected "
                             f"{expected} (one row per local sequence)")
    check_kernel_inputs(problem, chunk_size, q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state,
                        A_log=A_log, dt_bias=dt_bias)
    require_triton(q.device, _output_kernel, "hccompile.kernels.delta_rule.cp", "the CP reference engine")
    geometry = _geometry(plan, chunk_size, q.device)
    kplan = Plan(
        problem=problem, chunk_size=chunk_size, num_chunks=geometry.num_chunks,
        chunks_per_row=cdiv(max(problem.time, 1), chunk_size), chunk_table=geometry.chunk_table,
        chunk_offsets=geometry.chunk_offsets, cu_seqlens=geometry.cu_seqlens, gate_code=GATE_CODES[problem.gate],
        input_dtype=q.dtype, dummy=geometry.dummy,
    )
    return _Local(plan=plan, kplan=kplan, geometry=geometry, batch=batch, time=time, q=flat["q"], k=flat["k"],
                  v=flat["v"], beta=flat["beta"], g=flat["g"], initial_state=initial_state, A_log=A_log,
                  dt_bias=dt_bias, lower_bound=lower_bound,
                  scale=problem.key_dim ** -0.5 if scale is None else float(scale),
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _intra(local: _Local, scores_now: bool) -> _Intra:
    """The forward's chunk-parallel steps (chunk.chunk_local_steps) on the rank's segments; P in
    memory after them with `scores_now` (the backward's sweeps read it), else (the forward) formed by
    the output kernel where plan.fused_scores_forward."""
    device = local.q.device
    return chunk_local_steps(local.kplan, local.q, local.k, local.v, local.beta, local.g,
                             local.use_qk_l2norm_in_kernel, local.A_log, local.dt_bias, local.lower_bound,
                             empty=lambda *shape, dtype: _empty(*shape, dtype=dtype, device=device),
                             scores_now=scores_now)


def _sweep_forward(local: _Local, intra: _Intra, initial_states, h, u, final_states, lo: int, hi: int) -> None:
    """state_forward (state.py) on segments [lo, hi)."""
    kplan, problem, geometry = local.kplan, local.problem, local.geometry
    block_k_full = block_size(problem.key_dim, MAX_HEAD_DIM)
    block_v = state_forward_block_v(block_k_full, problem.value_dim, kplan.intermediate_dtype,
                                    (hi - lo) * problem.value_heads, intra.k.device)
    direct(_state_forward_kernel)[(hi - lo, problem.value_heads, cdiv(problem.value_dim, block_v))](
        intra.k, intra.k_decayed, intra.cum if intra.cum is not None else kplan.dummy, intra.w, intra.u_tilde,
        initial_states[lo:],
        h, u, final_states[lo:], *intra.k.stride(), *initial_states.stride(), *final_states.stride(),
        geometry.chunk_offsets[lo:], geometry.cu_seqlens[lo:],
        problem.time, kplan.chunks_per_row, problem.value_heads, problem.group_size, problem.key_dim,
        problem.value_dim, GATE=kplan.gate_code, BT=kplan.chunk_size, BKF=block_k_full, BV=block_v,
        HAS_INITIAL_STATE=True, STORE_FINAL_STATE=True, IS_VARLEN=True, DOT_PRECISION=kplan.dot_precision,
        **sweep_launch_options(kplan, block_k_full, intra.k.dtype, "forward"),
    )


def _output(local: _Local, intra: _Intra, h, u, o, lo: int, hi: int, scores_kept=None) -> None:
    """The output kernel (output.py) on the chunks of segments [lo, hi); with `scores_kept` (a
    forward that keeps its intermediates, where the kernel forms P) it stores P there too."""
    kplan, geometry = local.kplan, local.geometry
    first, last = geometry.chunk_starts[lo], geometry.chunk_starts[hi]
    if last == first:
        return
    form_scores = intra.scores is None  # kplan.fused_scores_forward: the kernel forms P from q and k
    scores = scores_kept if form_scores and scores_kept is not None else intra.scores
    launch_output(kplan, intra.q, intra.k, intra.cum if intra.cum is not None else kplan.dummy, h[first:],
                  scores if scores is not None else kplan.dummy, u, o, last - first, geometry.chunk_table[first:],
                  geometry.cu_seqlens, local.scale, form_scores=form_scores,
                  store_scores=form_scores and scores_kept is not None)


def _sweep_backward(local: _Local, intra: _Intra, do, final_grads, dh, du, initial_grads, lo: int, hi: int) -> None:
    """state_backward (state.py) on segments [lo, hi)."""
    kplan, problem, geometry = local.kplan, local.problem, local.geometry
    block_k_full = block_size(problem.key_dim, MAX_HEAD_DIM)
    block_v = state_backward_block_v(block_k_full, problem.value_dim, (hi - lo) * problem.value_heads,
                                     intra.k.device)
    direct(_state_backward_kernel)[(hi - lo, problem.value_heads, cdiv(problem.value_dim, block_v))](
        intra.q, intra.k, intra.cum if intra.cum is not None else kplan.dummy, intra.w, intra.scores, do,
        final_grads[lo:], dh, du, initial_grads[lo:],
        *intra.q.stride(), *intra.k.stride(), *do.stride(), *final_grads.stride(), *initial_grads.stride(),
        geometry.chunk_offsets[lo:], geometry.cu_seqlens[lo:],
        problem.time, kplan.chunks_per_row, problem.value_heads, problem.group_size, problem.key_dim,
        problem.value_dim, local.scale, BKF=block_k_full, BV=block_v,
        HAS_FINAL_STATE_GRAD=True, STORE_INITIAL_STATE_GRAD=True,
        GATE=kplan.gate_code, BT=kplan.chunk_size, IS_VARLEN=True, DOT_PRECISION=kplan.dot_precision,
        **sweep_launch_options(kplan, block_k_full, intra.k.dtype, "backward"),
        qg_ptr=kplan.dummy, kg_ptr=kplan.dummy, PREPARED=False, LOCAL_DU=False,
    )


# ----------------------------------------------------------------------------------------
# Forward and backward of one rank


def keeps_forward(plan, num_chunks: int, state_rows) -> bool:
    """Whether a rank's forward keeps its intermediates, and its backward reuses them: asked for
    (`state_rows`, the op's kept h rows), no transition in the plan (a middle segment's backward
    merge needs M, which only a forward walk forms; the same on every rank), and the rank's chunks
    fit those rows (one rank holding both zigzag pieces of a row can have more). Forward and
    backward decide alike from the same plan and rows, so a declined forward's zero placeholders
    are never read as kept."""
    return state_rows is not None and not plan.with_transition and num_chunks <= state_rows


class CPForward:
    """One rank's forward in three steps around the exchange (see the module docstring).

        run = CPForward(plan, q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound, scale,
                        use_qk_l2norm_in_kernel, chunk_size)
        run.prepare();  exchange.start(run)        # sends run.summaries_out
        run.overlap();  exchange.finish(run)       # writes run.initial_states[incoming]
        o, final_state = run.finish(output_final_state)
        kept = run.kept()                          # with keep_state_rows: for CPBackward(intermediates=...)

    Tensors are the caller's local ones ([B, T_local, ...]; B > 1 only for fixed-length sequences).
    `keep_state_rows` (the forward op's kept h rows, plan.kept_state_rows): keep what the backward
    would recompute, as the single-device forward does (chunk.Kept: the intra-chunk matrices, the
    l2-normed q and k, the gate's sum, w, u and the chunk states h), so that CPBackward runs neither
    the chunk-parallel steps nor a forward state sweep, and its exchange waits on no forward
    summary; where keeps_forward allows (no transition in the plan, the chunks fit the rows).
    """

    merge = staticmethod(merge_chains)
    # Whether the chunk-parallel steps leave P in memory: the forward's output kernel forms it itself
    # (plan.fused_scores_forward), the backward's sweeps read it.
    _scores_now = False

    def __init__(self, plan, q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound, scale,
                 use_qk_l2norm_in_kernel, chunk_size, keep_state_rows=None, **extra):
        self.plan = plan
        self.scores_kept = None
        self.local = _local_problem(plan, q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound,
                                    scale, use_qk_l2norm_in_kernel, chunk_size, **extra)
        self.keep_state_rows = keep_state_rows if keeps_forward(plan, self.local.geometry.num_chunks,
                                                                keep_state_rows) else None
        problem = self.local.problem
        self.value_dim = problem.value_dim
        self.state_shape = (problem.value_heads, problem.key_dim, problem.value_dim)
        self.summaries_out = None
        self.summaries_in = None

    # -- shared by the backward

    def _forward_summaries(self) -> None:
        local, plan, problem = self.local, self.plan, self.local.problem
        device = local.q.device
        self.intra = _intra(local, scores_now=self._scores_now)
        segments = plan.num_segments
        self.initial_states = torch.zeros(segments, *self.state_shape, dtype=torch.float32, device=device)
        if local.initial_state is not None:
            starts = [s for s in range(segments) if plan.initial_row[s] >= 0]
            if starts:
                rows = _index(plan, "initial_rows", [plan.initial_row[s] for s in starts], device)
                self.initial_states.index_copy_(0, _index(plan, "initial_segments", starts, device),
                                                local.initial_state.index_select(0, rows).float())
        stored = local.kplan.intermediate_dtype
        num_chunks = local.geometry.num_chunks
        if self.keep_state_rows is not None:
            # An op output of the op's row count (keeps_forward: the chunks fit); rows past the chunk
            # count are zeros (deterministic), never read.
            self.h = _empty(self.keep_state_rows, *self.state_shape, dtype=stored, device=device)
            self.h[num_chunks:].zero_()
            if self.intra.scores is None:  # the output kernel forms P: it stores it for the backward too
                self.scores_kept = _empty(1, problem.time, problem.value_heads, local.kplan.chunk_size,
                                          dtype=local.kplan.scores_dtype, device=device)
        else:
            self.h = _empty(scratch_rows(num_chunks), *self.state_shape, dtype=stored, device=device)
        self.u = _empty(1, problem.time, problem.value_heads, problem.value_dim, dtype=stored, device=device)
        self.final_states = _empty(segments, *self.state_shape, device=device)
        # First the segments whose end state is sent; the purely local ones wait for overlap().
        self._sweep_forward(incoming=False, outgoing=True)
        width = problem.value_dim + (problem.key_dim if plan.with_transition else 0)
        self.summaries_out = torch.zeros(plan.out_slots, problem.value_heads, problem.key_dim, width,
                                         dtype=torch.float32, device=device)
        ready = [s for s in range(segments) if plan.outgoing[s] and not plan.incoming[s]]
        if ready:
            slots = _index(plan, "ready_out_slots", [plan.out_slot[s] for s in ready], device)
            self.summaries_out[slots, :, :, :problem.value_dim] = self.final_states.index_select(
                0, _index(plan, "ready_out_segments", ready, device))
        middle = [s for s in range(segments) if plan.incoming[s] and plan.outgoing[s]]
        self.middle_chunks = None
        if middle and MIDDLE_WALK_STORES_CHUNKS:
            # The summary walk of a middle segment stores its chunks' [H | M] and [U_H | U_M], so
            # that after the merge its h and U take one chunk-parallel kernel (_incoming_states)
            # instead of a second walk.
            wide = problem.value_dim + problem.key_dim
            self.middle_chunks = (
                _empty(scratch_rows(local.geometry.num_chunks), problem.value_heads, problem.key_dim, wide,
                       dtype=stored, device=device),
                _empty(1, problem.time, problem.value_heads, wide, dtype=stored, device=device))
            self.middle_ends = _empty(segments, problem.value_heads, problem.key_dim, wide, device=device)
            index = _index(plan, "middle", middle, device)
            _launch_summary_forward(local.kplan, self.intra, local.geometry, index, index, self.middle_ends,
                                    with_transition=True, chunks=self.middle_chunks)
            self.summaries_out.index_copy_(
                0, _index(plan, "middle_out_slots", [plan.out_slot[s] for s in middle], device),
                self.middle_ends.index_select(0, index))
        elif middle:
            _launch_summary_forward(local.kplan, self.intra, local.geometry, _index(plan, "middle", middle, device),
                                    _index(plan, "middle_out_slots", [plan.out_slot[s] for s in middle], device),
                                    self.summaries_out, with_transition=True)

    def _sweep_forward(self, incoming, outgoing) -> None:
        for lo, hi in _segments_where(self.plan, incoming, outgoing):
            _sweep_forward(self.local, self.intra, self.initial_states, self.h, self.u, self.final_states, lo, hi)

    def _incoming_states(self) -> None:
        """h, U and the end state of every incoming segment, once the merge wrote its S_in: a walk,
        or for middle segments whose summary walk stored its chunks, h = H + M S_in and
        U = U_H + U_M S_in chunk by chunk."""
        if self.middle_chunks is None:
            self._sweep_forward(incoming=True, outgoing=None)
            return
        self._sweep_forward(incoming=True, outgoing=False)
        plan, local = self.plan, self.local
        h_wide, u_wide = self.middle_chunks
        for lo, hi in _segments_where(plan, incoming=True, outgoing=True):
            _launch_incoming_state(local.kplan, local.geometry, h_wide, u_wide, self.initial_states, self.h, self.u,
                                   lo, hi)
        middle = _index(plan, "middle", [s for s in range(plan.num_segments) if plan.incoming[s] and plan.outgoing[s]],
                        self.h.device)
        ends, value_dim = self.middle_ends.index_select(0, middle), self.value_dim
        self.final_states.index_copy_(
            0, middle, ends[..., :value_dim] + ends[..., value_dim:] @ self.initial_states.index_select(0, middle))
        self.middle_chunks = self.middle_ends = None  # the wide buffers are dead from here

    # -- forward steps

    def prepare(self) -> None:
        self._forward_summaries()
        problem = self.local.problem
        self.o = _empty(1, problem.time, problem.value_heads, problem.value_dim, dtype=self.local.v.dtype,
                        device=self.local.q.device)

    def overlap(self) -> None:
        self._sweep_forward(incoming=False, outgoing=False)
        for lo, hi in _segments_where(self.plan, incoming=False, outgoing=None):
            _output(self.local, self.intra, self.h, self.u, self.o, lo, hi, self.scores_kept)

    def finish(self, output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._incoming_states()
        for lo, hi in _segments_where(self.plan, incoming=True, outgoing=None):
            _output(self.local, self.intra, self.h, self.u, self.o, lo, hi, self.scores_kept)
        local = self.local
        o = self.o.view(local.batch, local.time, *self.o.shape[2:])
        return o, (_user_final_states(self.plan, self.final_states) if output_final_state else None)

    def kept(self) -> Kept | None:
        """After finish: what this forward kept for CPBackward(intermediates=...), in the caller's
        [B, T_local, ...] shapes (h: keep_state_rows rows), or None where it keeps nothing."""
        if self.keep_state_rows is None:
            return None
        local, intra = self.local, self.intra

        def user(t):
            return None if t is None else t.view(local.batch, local.time, *t.shape[2:])

        scores = intra.scores if intra.scores is not None else self.scores_kept
        normed = (user(intra.q), user(intra.k)) if local.use_qk_l2norm_in_kernel else (None, None)
        return Kept(user(intra.kdot), user(scores), user(intra.inverse), *normed, user(intra.cum), user(intra.w),
                    user(self.u), self.h)


def _user_final_states(plan, final_states: torch.Tensor) -> torch.Tensor:
    rows = [s for s in plan.final_segment]
    if all(s >= 0 for s in rows):
        return final_states.index_select(0, _index(plan, "final_segments", rows, final_states.device))
    # A user row without local tokens (empty local sequence list) keeps a zero state.
    out = torch.zeros(len(rows), *final_states.shape[1:], dtype=final_states.dtype, device=final_states.device)
    present = [i for i, s in enumerate(rows) if s >= 0]
    if present:
        out[present] = final_states[[rows[i] for i in present]]
    return out


class CPBackward(CPForward):
    """One rank's backward (it recomputes the forward's intermediates unless given the ones
    CPForward kept), in the same three steps:

        run = CPBackward(plan, ..., do=do, dht=dht[, intermediates=forward_run.kept()])
        run.prepare();  exchange.start(run)        # sends run.summaries_out and run.summaries_in
        run.overlap();  exchange.finish(run)       # writes initial_states[incoming], adds to final_grads[outgoing]
        grads = run.finish()                       # dict like chunk_delta_rule_bwd's

    Gradients of A_log and dt_bias are this rank's share (sum them over the CP group, as for any
    parameter under CP); rows of initial_state whose sequence starts on another rank get zeros.
    """

    _scores_now = True

    def __init__(self, plan, q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound, scale,
                 use_qk_l2norm_in_kernel, chunk_size, *, do, dht=None, intermediates: Kept | None = None):
        super().__init__(plan, q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound, scale,
                         use_qk_l2norm_in_kernel, chunk_size, do=do)
        # What CPForward(keep_state_rows=...).kept() gave, used where keeps_forward says the forward
        # kept (else, e.g. its zero placeholders: None, recompute).
        self.intermediates = None
        rows = None if intermediates is None or intermediates.h is None else intermediates.h.shape[0]
        if keeps_forward(plan, self.local.geometry.num_chunks, rows):
            batch, time = q.shape[0], q.shape[1]
            self.intermediates = Kept(*(t if name == "h" else _flatten(t, batch, time)
                                        for name, t in zip(Kept._fields, intermediates)))
        if dht is not None:
            expected = (plan.user_rows, *self.state_shape)
            if tuple(dht.shape) != expected:
                raise ValueError(f"dht: shape {tuple(dht.shape)} differs from the expected {expected}")
        self.inputs = dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state, A_log=A_log,
                           dt_bias=dt_bias)
        self.do = _flatten(do, q.shape[0], q.shape[1])
        self.dht = dht

    def _kept_forward(self) -> None:
        """The forward's state from its kept intermediates: nothing recomputed, no forward summary
        to send (the exchange still carries the forward part, zeros, unused)."""
        local, plan, problem, kept = self.local, self.plan, self.local.problem, self.intermediates
        device = local.q.device
        self.intra = chunk_local_steps(local.kplan, local.q, local.k, local.v, local.beta, local.g,
                                       local.use_qk_l2norm_in_kernel, local.A_log, local.dt_bias, local.lower_bound,
                                       kept=kept, empty=lambda *shape, dtype: _empty(*shape, dtype=dtype, device=device))
        self.h, self.u = kept.h, kept.u
        self.initial_states = torch.zeros(plan.num_segments, *self.state_shape, dtype=torch.float32, device=device)
        self.summaries_out = torch.zeros(plan.out_slots, *self.state_shape, dtype=torch.float32, device=device)
        self.middle_chunks = None

    def prepare(self) -> None:
        plan, local, problem = self.plan, self.local, self.local.problem
        device = local.q.device
        if self.intermediates is not None:
            self._kept_forward()
        else:
            self._forward_summaries()
        segments = plan.num_segments
        self.final_grads = torch.zeros(segments, *self.state_shape, dtype=torch.float32, device=device)
        if self.dht is not None:
            rows = [i for i, s in enumerate(plan.final_segment) if s >= 0]
            self.final_grads.index_copy_(
                0, _index(plan, "final_segments_present", [plan.final_segment[i] for i in rows], device),
                self.dht.index_select(0, _index(plan, "final_rows_present", rows, device)).float())
        stored = local.kplan.intermediate_dtype
        self.dh = _empty(scratch_rows(local.geometry.num_chunks), *self.state_shape, dtype=stored, device=device)
        self.du = _empty(1, problem.time, problem.value_heads, problem.value_dim, dtype=stored, device=device)
        self.initial_grads = _empty(segments, *self.state_shape, device=device)
        # First the segments whose initial-state gradient is sent (the backward summary dH).
        self._sweep_backward(incoming=True, outgoing=False)
        self.summaries_in = torch.zeros(plan.in_slots, *self.state_shape, dtype=torch.float32, device=device)
        ready = [s for s in range(segments) if plan.incoming[s] and not plan.outgoing[s]]
        if ready:
            self.summaries_in.index_copy_(0, _index(plan, "ready_in_slots", [plan.in_slot[s] for s in ready], device),
                                          self.initial_grads.index_select(0, _index(plan, "ready_in_segments", ready,
                                                                                    device)))
        middle = [s for s in range(segments) if plan.incoming[s] and plan.outgoing[s]]
        if middle:
            _launch_summary_backward(local.kplan, self.intra, local.geometry, self.do, self.final_grads,
                                     _index(plan, "middle", middle, device),
                                     _index(plan, "middle_in_slots", [plan.in_slot[s] for s in middle], device),
                                     self.summaries_in, local.scale, with_transition=False)
        self._allocate_gradients()

    def _allocate_gradients(self) -> None:
        local, problem = self.local, self.local.problem
        device = local.q.device
        time, value_heads = problem.time, problem.value_heads
        self.dq_heads = _empty(1, time, value_heads, problem.key_dim, device=device)
        self.dk_heads = _empty(1, time, value_heads, problem.key_dim, device=device)
        gate_width = problem.key_dim if problem.gate == "channel" else 1
        self.dcum = _empty(1, time, value_heads, gate_width, device=device) if problem.gate != "none" \
            else local.kplan.dummy
        # Decided once for all of this backward's _chunk_backward launches (the flag is read at call time).
        self.fused_scores = local.kplan.fused_scores_backward
        self.split_wy = local.kplan.split_wy_backward
        self.dkdot, self.dscores = local.kplan.score_gradients(self.fused_scores, 1, time, value_heads,
                                                               lambda *shape: _empty(*shape, device=device))
        self.dv = torch.empty_like(local.v, memory_format=torch.contiguous_format)
        self.dbeta = torch.empty_like(local.beta, memory_format=torch.contiguous_format)
        if POISON:
            self.dv.fill_(float("nan"))
            self.dbeta.fill_(float("nan"))

    def _chunk_backward(self, lo: int, hi: int) -> None:
        """wy_backward (wy.py, or split in dqkw.py and wy_bwd.py: kplan.split_wy_backward) and, unless
        wy_backward takes its work, decayed_scores_backward (scores.py) on the chunks of segments [lo, hi)."""
        local, intra, kplan, problem, geometry = self.local, self.intra, self.local.kplan, self.local.problem, \
            self.local.geometry
        first, last = geometry.chunk_starts[lo], geometry.chunk_starts[hi]
        if last == first:
            return
        cum = intra.cum if intra.cum is not None else kplan.dummy
        chunk = kplan.chunk_size
        block_k, block_v = block_size(problem.key_dim), block_size(problem.value_dim)
        common = dict(GATE=kplan.gate_code, BT=chunk, IS_VARLEN=True, DOT_PRECISION=kplan.dot_precision)
        table = geometry.chunk_table[first:]
        if self.split_wy:
            launch_split_wy_backward(kplan, intra.q, intra.k, local.v, local.beta, self.do, cum, intra.inverse,
                                     self.u, self.du, self.h[first:], self.dh[first:], self.dv, self.dbeta,
                                     self.dq_heads, self.dk_heads, self.dcum, last - first, table,
                                     geometry.cu_seqlens, local.scale)
            return
        # kplan.fused_scores_forward only with the split: the single kernel's forward kept Kdot
        assert intra.kdot is not None, "wy.py's wy_backward reads Kdot (decayed_scores writes it)"
        direct(_wy_backward_kernel)[(last - first, problem.value_heads)](
            intra.q, intra.k, local.v, local.beta, self.do, cum, intra.inverse, intra.kdot, self.u, self.du,
            self.h[first:], self.dh[first:], self.dv, self.dbeta, self.dq_heads, self.dk_heads, self.dcum,
            self.dkdot, self.dscores,
            *intra.q.stride(), *intra.k.stride(), *local.v.stride(), *local.beta.stride(), *self.do.stride(),
            *self.dv.stride(), *self.dbeta.stride(), table, geometry.cu_seqlens,
            problem.time, kplan.chunks_per_row, problem.value_heads, problem.group_size, problem.key_dim,
            problem.value_dim, local.scale, BK=block_k, BV=block_v, FUSE_SCORES=self.fused_scores,
            **WY_BACKWARD_OPTIONS, **common,
        )
        if not self.fused_scores:
            launch_scores_backward(kplan, intra.q, intra.k, cum, self.dkdot, self.dscores, self.dq_heads,
                                   self.dk_heads, self.dcum, last - first, table, geometry.cu_seqlens)

    def _sweep_backward(self, incoming, outgoing) -> None:
        for lo, hi in _segments_where(self.plan, incoming, outgoing):
            _sweep_backward(self.local, self.intra, self.do, self.final_grads, self.dh, self.du, self.initial_grads,
                            lo, hi)

    def overlap(self) -> None:
        # Segments that neither wait for nor send a state: everything.
        if self.intermediates is None:
            self._sweep_forward(incoming=False, outgoing=False)
        self._sweep_backward(incoming=False, outgoing=False)
        for lo, hi in _segments_where(self.plan, incoming=False, outgoing=False):
            self._chunk_backward(lo, hi)

    def finish(self) -> dict[str, torch.Tensor | None]:
        plan = self.plan
        if self.intermediates is None:
            self._incoming_states()
        self._sweep_backward(incoming=None, outgoing=True)
        for lo, hi in _runs(a or b for a, b in zip(plan.incoming, plan.outgoing)):
            self._chunk_backward(lo, hi)
        return self._gradients()

    def _gradients(self) -> dict[str, torch.Tensor | None]:
        """The tail of chunk_delta_rule_bwd: head sums, l2norm, gate cumsum and activation backward."""
        plan, local, problem = self.plan, self.local, self.local.problem
        inputs, device = self.inputs, local.q.device
        if local.geometry.num_chunks == 0:
            self.dq_heads.zero_()
            self.dk_heads.zero_()
            if problem.gate != "none":
                self.dcum.zero_()
        group = problem.group_size
        grads: dict[str, torch.Tensor | None] = dict.fromkeys(inputs)
        q, k = local.q, local.k
        dq_sum, dk_sum = (sum_key_groups(heads, problem.key_heads, group) for heads in (self.dq_heads, self.dk_heads))
        dq, dk = (torch.empty(x.shape, dtype=x.dtype, device=device) for x in (q, k))
        if local.use_qk_l2norm_in_kernel:
            l2norm_backward(q, k, dq_sum, dk_sum, dq, dk)
        else:
            dq.copy_(dq_sum)
            dk.copy_(dk_sum)
        grads["q"], grads["k"] = dq.view(inputs["q"].shape), dk.view(inputs["k"].shape)
        grads["v"] = self.dv.view(inputs["v"].shape)
        grads["beta"] = self.dbeta.view(inputs["beta"].shape)
        if inputs["initial_state"] is not None:
            dh0 = torch.zeros(inputs["initial_state"].shape, dtype=inputs["initial_state"].dtype, device=device)
            starts = [s for s in range(plan.num_segments) if plan.initial_row[s] >= 0]
            if starts:
                dh0.index_copy_(0, _index(plan, "initial_rows", [plan.initial_row[s] for s in starts], device),
                                self.initial_grads.index_select(0, _index(plan, "initial_segments", starts, device))
                                .to(dh0.dtype))
            grads["initial_state"] = dh0
        if problem.gate != "none":
            gate_width = problem.key_dim if problem.gate == "channel" else 1
            if problem.gate_in_kernel and local.geometry.num_chunks:
                dg, dA_log, ddt_bias = gate_backward(local.kplan, self.dcum, local.g,
                                                     gate_activation(problem, local.lower_bound), local.A_log,
                                                     local.dt_bias, local.lower_bound)
                grads["A_log"] = dA_log.to(inputs["A_log"].dtype)
                grads["dt_bias"] = ddt_bias.to(inputs["dt_bias"].dtype)
            elif local.geometry.num_chunks:
                dg = launch_gate_cumsum(local.kplan, self.dcum, ACTIVATION_NONE, None, None, None, reverse=True)
            else:
                dg = torch.zeros(1, problem.time, problem.value_heads, gate_width, dtype=torch.float32, device=device)
            dg = dg.view(local.g.shape) if problem.gate == "channel" else dg.view(1, problem.time, problem.value_heads)
            if problem.gate_in_kernel and not local.geometry.num_chunks:
                dg, dA_log, ddt_bias = gate_activation_backward(local.g, dg, local.A_log, local.dt_bias,
                                                                local.lower_bound)
                grads["A_log"] = dA_log.to(inputs["A_log"].dtype)
                grads["dt_bias"] = ddt_bias.to(inputs["dt_bias"].dtype)
            grads["g"] = dg.to(inputs["g"].dtype).view(inputs["g"].shape)
        return grads


# ----------------------------------------------------------------------------------------
# Standalone summaries (what the tests check against cp_reference)


@dataclass
class _StandalonePlan:
    """The part of a SegmentPlan the standalone launchers read: one segment per sequence."""

    cu: list[int]
    rank: int = 0
    cache: dict = field(default_factory=dict)

    @property
    def bounds(self):
        return tuple(zip(self.cu[:-1], self.cu[1:]))

    @property
    def num_tokens(self) -> int:
        return self.cu[-1]

    @property
    def num_segments(self) -> int:
        return len(self.cu) - 1

    user_rows = num_segments

    def cu_seqlens(self) -> list[int]:
        return list(self.cu)


def _standalone_bounds(q, cu_seqlens) -> list[int]:
    if cu_seqlens is None:  # one sequence per batch row
        return list(range(0, q.shape[0] * q.shape[1] + 1, q.shape[1])) if q.shape[1] else [0] * (q.shape[0] + 1)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: requires B == 1, got B={q.shape[0]}")
    return [int(x) for x in cu_seqlens]


def summary_forward(q, k, v, beta, g=None, gate=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                    A_log=None, dt_bias=None, lower_bound=None, chunk_size=64, with_transition=True):
    """[H | M] of every sequence (varlen: B = 1 and cu_seqlens, a host list or tensor; else one row):
    fp32 [N, HV, K, V + K] (M's columns present with with_transition)."""
    plan = _StandalonePlan(_standalone_bounds(q, cu_seqlens))
    local = _local_problem(plan, q, k, v, beta, g, gate, None, A_log, dt_bias, lower_bound, None,
                           use_qk_l2norm_in_kernel, chunk_size)
    intra = _intra(local, scores_now=False)
    problem = local.problem
    width = problem.value_dim + (problem.key_dim if with_transition else 0)
    out = _empty(plan.num_segments, problem.value_heads, problem.key_dim, width, device=q.device)
    segments = _index(plan, "all", range(plan.num_segments), q.device)
    _launch_summary_forward(local.kplan, intra, local.geometry, segments, segments, out, with_transition)
    return out


def summary_backward(q, k, v, beta, g=None, gate=None, scale=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                     A_log=None, dt_bias=None, lower_bound=None, chunk_size=64, with_transition=True, *, do,
                     dht=None):
    """[dH | M^T] of every sequence: dH = dL/dS_in of L = <o, do> + <S_out, dht> (dht [N, HV, K, V]
    or None), fp32 [N, HV, K, V + K] (M^T's columns present with with_transition)."""
    plan = _StandalonePlan(_standalone_bounds(q, cu_seqlens))
    local = _local_problem(plan, q, k, v, beta, g, gate, None, A_log, dt_bias, lower_bound, scale,
                           use_qk_l2norm_in_kernel, chunk_size, do=do)
    intra = _intra(local, scores_now=True)
    problem = local.problem
    width = problem.value_dim + (problem.key_dim if with_transition else 0)
    out = _empty(plan.num_segments, problem.value_heads, problem.key_dim, width, device=q.device)
    segments = _index(plan, "all", range(plan.num_segments), q.device)
    dht = None if dht is None else dht.float()
    _launch_summary_backward(local.kplan, intra, local.geometry, _flatten(do, q.shape[0], q.shape[1]), dht,
                             segments, segments, out, local.scale, with_transition)
    return out
