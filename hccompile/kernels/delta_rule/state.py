"""Step 4 of the forward (state_forward) and the backward's first kernel (state_backward): the only
sequential work. One program per (sequence, value head, value tile) walks the sequence's chunks,
forward or in reverse, with the fp32 state of the whole key dim and one value tile in registers:

    forward:   h_c = S (stored),  U = U~ - W h_c,  S <- e^G_last S + (K e^(G_last - G))^T U
    backward:  dh_c = dS (stored),  dU = scale P^T dO + (K e^(G_last - G)) dS,
               dS <- scale (Q e^G)^T dO + e^G_last dS - W^T dU

The tile widths here trade registers and shared memory against the number of programs, which few
sequences x heads leave too small for the GPU (plan.narrow_for_occupancy).
"""

from __future__ import annotations

import torch

from .plan import MIN_DOT_DIM, block_size, narrow_for_occupancy

from .._triton import tl, triton

# The sequential state kernels hold the whole key dim and at most this many elements of the state
# per program.
STATE_TILE_ELEMENTS = 64 * 64
# state_forward with half intermediates holds half [BT, K] tiles: compiled for sm_90 (Triton 3.8,
# fp16, l2norm), BV = 64 at K = 128 took 188-236 registers, no spills, 88-121 KiB shared memory
# with two stages (none, scalar, channel gates); state_backward at BV = 64 spilled 56-168 bytes
# (scalar, channel) where BV = 32 spilled none, so it keeps STATE_TILE_ELEMENTS. At K = 256,
# BV = 32: state_forward 162-252 registers, no spills, 52 KiB.
HALF_STATE_FORWARD_TILE_ELEMENTS = 128 * 64
# The narrowest value tile of state_backward (CP's summary sweeps keep cp.SUMMARY_MIN_TILE). It was 32
# from f86152b: on the H100 (Triton 3.6) 16-wide state_backward tiles at K = 100/128 with bf16 inputs
# returned a wrong initial-state gradient (relative RMS 0.27-0.33, T = 70, two chunks). On one H200
# (Triton 3.6, 146d178, benchmarks/analysis/narrow_backward_tile.py) 16-wide tiles were right in every
# kernel-test case narrowed to the floor, twice each, that one included, and at B1 T32768 H16 D128 (128
# programs instead of 64) state_backward took 0.855 ms against 0.998 (GDN fwd+bwd 4.514 against 4.656
# ms) and 2.176 against 2.551 (KDA 9.534 against 9.889). The narrowed-tile tests in
# tests/kernels/test_delta_rule_chunk.py (that case among them, and its repeat test) run at this floor.
MIN_BACKWARD_SWEEP_TILE = MIN_DOT_DIM


if triton is not None:
    from .tiles import (_channel_decays, _chunk_end_decay, _chunk_end_decays, _dot, _gate_offset, _load_rows,
                        _load_stored_rows, _row_bounds, _store_rows, _varlen_bounds)

    @triton.jit
    def _state_forward_kernel(
        k_ptr, kg_ptr, cum_ptr, w_ptr, u_tilde_ptr, h0_ptr, h_ptr, u_ptr, ht_ptr,
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
        the products' operands are in the intermediates' dtype (h's). A channel gate's decayed
        keys K e^(G_last - G) come from wy_solve (kg_ptr, [B, T, HV, K]); k_ptr is unused then.
        """
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        if IS_VARLEN:
            batch, bos, eos = _varlen_bounds(seq, tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1))
        else:
            batch, bos, eos = _row_bounds(seq, T)
        if IS_VARLEN:
            first_chunk = tl.load(chunk_offsets_ptr + seq).to(tl.int64)
        else:
            first_chunk = seq.to(tl.int64) * NT
        key_head = head // GROUP
        k_ptr += batch * stride_kb + key_head * stride_kh
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        w_ptr += (batch * T) * HV * K + head * K
        kg_ptr += (batch * T) * HV * K + head * K
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
            if GATE == 2:
                k_tile = _load_stored_rows(kg_ptr, tokens, kc, HV * K, 1, valid, K)
                state *= _chunk_end_decay(cum_ptr, start + length - 1, kc, HV, K)[:, None]
            else:
                k_tile = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            if GATE == 1:
                to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K, GATE)
                state *= whole[:, None]
                # A scalar gate's row decay scales the [BT, BV] values rather than the [BT, K] keys:
                # (K e^(G_last - G))^T U = K^T (e^(G_last - G) U), a BV/K share of the elementwise
                # work in the sequential loop, and k stays in its stored dtype.
                u *= to_end
            state += _dot(tl.trans(k_tile), u, dot_dtype, DOT_PRECISION)
        if STORE_FINAL_STATE:
            _store_rows(ht_ptr + seq * stride_htn + head * stride_hth, state, kc, vc, stride_htk, stride_htv,
                        kc < K, V)

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
        qg_ptr,
        kg_ptr,
        PREPARED: tl.constexpr,
        LOCAL_DU: tl.constexpr,
    ):
        """Walks one sequence's chunks backwards for one value head and value tile.

        With dS the gradient of a chunk's end state: stores dS per chunk (dh), the full
        gradient of the corrected values dU = scale P^T dO + (K e^(G_last - G)) dS, and
        passes dS_start = scale (Q e^G)^T dO + e^G_last dS - W^T dU to the chunk before.
        dS is fp32; dh, dU and the products' operands are in the intermediates' dtype (w's).
        A channel gate's decayed queries and keys are formed here, or with PREPARED read from
        decayed_keys.py's qg and kg ([B, T, HV, K], the intermediates' dtype), leaving only e^G_last to
        load per step (plan.PREPARED_CHANNEL_SWEEP). Reading wy_solve's kg alone, while still loading G to
        form Q e^G, measured 44 % slower on the H100 (B1 T32768 KDA, 2.52 -> 3.64 ms, 12b5e54).
        With LOCAL_DU, du_ptr already holds dU's local part scale P^T dO (local_du.py, plan.LOCAL_DU_KERNEL):
        each step loads it from the rows it then overwrites, instead of loading P and forming the product.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        pid_v = tl.program_id(2)
        if IS_VARLEN:
            batch, bos, eos = _varlen_bounds(seq, tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1))
        else:
            batch, bos, eos = _row_bounds(seq, T)
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
        if PREPARED:
            tl.static_assert(GATE == 2, "the prepared decayed queries and keys are the per-channel gates'")
            qg_ptr += (batch * T) * HV * K + head * K
            kg_ptr += (batch * T) * HV * K + head * K

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
            # Clamped: Triton's pipeliner may issue a later iteration's loads before the loop ends, where
            # an unclamped chunk -1 or -2 would put every row of the tile before the sequence (see
            # htree's candidate_tile). Real iterations have chunk >= 0.
            chunk = tl.maximum(num_chunks - 1 - step, 0)
            start = bos + chunk * BT
            length = tl.minimum(eos - start, BT)
            tokens = start + local
            valid = local < length
            _store_rows(dh_ptr + ((first_chunk + chunk) * HV + head) * K * V, dstate, kc, vc, V, 1, kc < K, V)
            do_tile = _load_stored_rows(do_ptr, tokens, vc, stride_dot, stride_dov, valid, V)
            if LOCAL_DU:
                du = _load_rows(du_ptr, tokens, vc, HV * V, 1, valid, V)
            else:
                scores = _load_rows(scores_ptr, tokens, local, HV * BT, 1, valid, BT)
                scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
                du = scale * _dot(tl.trans(scores), do_tile, dot_dtype, DOT_PRECISION)
            if PREPARED:
                k_tile = _load_stored_rows(kg_ptr, tokens, kc, HV * K, 1, valid, K)
                q_tile = _load_stored_rows(qg_ptr, tokens, kc, HV * K, 1, valid, K)
            elif GATE == 2:
                k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            else:
                k_tile = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
                q_tile = _load_stored_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            q_do = do_tile
            if PREPARED:
                whole = _chunk_end_decay(cum_ptr, start + length - 1, kc, HV, K)
            elif GATE == 2:
                g, to_end, whole = _channel_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K)
                k_tile *= to_end
                q_tile *= tl.exp(g)
            elif GATE == 1:
                to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K, GATE)
            k_dstate = _dot(k_tile, dstate, dot_dtype, DOT_PRECISION)
            if GATE == 1:
                # A scalar gate's row factors move to the [BT, BV] side, as in state_forward:
                # (K e^(G_last - G)) dS = e^(G_last - G) (K dS), (Q e^G)^T dO = Q^T (e^G dO).
                k_dstate *= to_end
                q_do = do_tile * tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))[:, None]
            du += k_dstate
            _store_rows(du_ptr, du, tokens, vc, HV * V, 1, valid, V)
            w = _load_stored_rows(w_ptr, tokens, kc, HV * K, 1, valid, K)
            if GATE != 0:
                dstate *= whole[:, None]
            dstate += scale * _dot(tl.trans(q_tile), q_do, dot_dtype, DOT_PRECISION)
            dstate -= _dot(tl.trans(w), du, dot_dtype, DOT_PRECISION)
        if STORE_INITIAL_STATE_GRAD:
            _store_rows(dh0_ptr + seq * stride_dh0n + head * stride_dh0h, dstate, kc, vc, stride_dh0k, stride_dh0v,
                        kc < K, V)


def state_forward_block_v(block_k_full: int, value_dim: int, intermediate_dtype: torch.dtype, walks: int,
                          device: torch.device) -> int:
    """BV of state_forward (and CP's forward sweep) for `walks` = sequences x value heads."""
    elements = STATE_TILE_ELEMENTS if intermediate_dtype == torch.float32 else HALF_STATE_FORWARD_TILE_ELEMENTS
    widest = min(block_size(value_dim), max(MIN_DOT_DIM, elements // block_k_full))
    return narrow_for_occupancy(widest, walks, value_dim, device)


def state_backward_block_v(block_k_full: int, value_dim: int, walks: int, device: torch.device) -> int:
    """BV of state_backward (and CP's backward sweep)."""
    widest = min(block_size(value_dim), max(MIN_DOT_DIM, STATE_TILE_ELEMENTS // block_k_full))
    return narrow_for_occupancy(widest, walks, value_dim, device, floor=MIN_BACKWARD_SWEEP_TILE)


def state_launch_options(block_k_full: int, dtype: torch.dtype, *, timed_sweep: tuple[bool, str] | None = None,
                         intermediates: torch.dtype | None = None) -> dict[str, int]:
    """num_warps and num_stages of the sequential state kernels; `dtype` is the one of the k they read
    (the input's, or the intermediates' after the in-kernel l2norm). `timed_sweep` = (per-channel gate,
    "forward" or "backward") for chunk.py's two sweeps, whose options at K = 128 with half inputs and
    half `intermediates` (w, u, h) were timed on the H100; CP's summary kernels, fp32 and K > 128 take
    the untimed rule, and so do fp32 intermediates (BF16_INTERMEDIATES off), untimed: with them three
    stages took 245 KiB of shared memory (KDA forward) and 4 warps spilled 0.9-1.1 KiB per thread (GDN
    backward) on sm_90.

    They hold [chunk, K] tiles of the whole key dim: more warps mean fewer spills. Each
    software-pipelining stage keeps another copy of those tiles in shared memory; compiled
    for sm_90 (Triton 3.8), two stages at K = 128 took 148-173 KiB for half inputs and up to
    217 KiB for fp32, three stages over 227 KiB (an H100's limit), so deeper ones are avoided
    where untimed.
    """
    two_stages = block_k_full <= 64 or (block_k_full == 128 and dtype != torch.float32)
    untimed = {"num_warps": 4 if block_k_full <= 64 else 8, "num_stages": 2 if two_stages else 1}
    if timed_sweep is None or block_k_full != 128 or not two_stages or intermediates == torch.float32:
        return untimed
    channel, direction = timed_sweep
    # A sweep is a chain of dependent [BT, K] x [K, BV] steps whose per-step latency, not its spills, sets
    # the time. Timed on the H100 (Triton 3.6, B1 T32768 H16 K128 bf16, fwd+bwd, do_bench):
    # - no per-channel gate (GDN): 4 warps, two stages 6.20-6.22 ms against 8 warps' 6.42-6.47 (one stage
    #   7.6-7.8; session 21); then three stages 5.47 against 5.82 (forward sweep alone 5.56, backward alone
    #   5.71; B4 T4096 2.47 against 2.57-2.65; o and every gradient bitwise equal; session 22).
    # - per-channel gate (KDA, session 22): 4 warps 12.95 ms against 8 warps' 11.60; the forward sweep
    #   at three stages 11.39 against 11.62, the backward at three 11.99 (slower).
    # Shared memory at three stages (sm_90, Triton 3.6 and 3.9 alike): GDN forward 139 KiB, backward
    # 204-208 KiB of 227 (four stages took 276 KiB for the backward).
    if not channel:
        return {"num_warps": 4, "num_stages": 3}
    return {"num_warps": 8, "num_stages": 3 if direction == "forward" else 2}
