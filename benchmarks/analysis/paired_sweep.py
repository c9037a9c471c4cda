"""Whether the delta rule's forward state sweep pays walking two chunks per step (issue 20: GDN B1 T32768 H16 D128
at 0.751x FLA's time, 0.6 wanted; the two sequential sweeps take 1.38 of GDN's 3.84 ms busy there, ~1 us per
chunk step over 64 programs, session 45's profile).

Today's step is a chain of two products per chunk: U = U~ - W h, then h' = d h + Kd^T U (Kd: the keys decayed
to the chunk's end, d its whole decay). For two chunks that is four products in a row. With both chunks'
tiles loaded, the second chunk's terms can be rewritten in h, the first chunk's start state:

    M = W2 Kd1^T                      [BT, BT], independent of h
    U2 = (U~2 - M U~1) - (W2 d1 - M W1) h
    h'' = d1 d2 h + (d2 Kd1)^T U1 + Kd2^T U2

so a step for two chunks is two rounds of two independent products (U1 and U2 from h; then h'' from both),
half the dependent rounds; M, U~2 - M U~1 and W2 d1 - M W1 are formed off the chain. h' = d1 h + Kd1^T U1, the
second chunk's start state, is still stored (a product beside the chain). Same stored results (h per chunk, U,
the final state), rounded differently: W2 d1 - M W1 and U~2 - M U~1 go to the products' dtype once formed.

The backward sweep pairs the same way (_state_backward_paired_kernel): with S the later chunk's end-state
gradient and N = Kd1 W2^T off the chain, dU1 = (a1 + Kd1 b2 - N a2) + (Kd1 d2 - N Kd2) S beside dU2 = a2 + Kd2 S,
then W2^T dU2 and W1^T dU1 side by side (a = scale P^T dO, b = scale (Q e^G)^T dO).

Each sweep is one kernel with a PREPARED switch, launched in place of today's kernel by a stand-in that reads
chunk.py's arguments. Variants:

    single                 today's kernels
    paired[-wN][-sS]       the forward sweep two chunks per step (N warps, S stages; today's options otherwise)
    paired-bwd[-wN][-sS]   the backward sweep two chunks per step
    paired-both[-wN][-sS]  both
    paired-prep[-wN][-sS]  the paired forward sweep with the second chunk's terms formed by a chunk-parallel
                           kernel first (stored: W2 d1 - M W1 and U~2 - M U~1), so that the sweep only loads
    paired-prep-bwd, paired-prep-both  likewise for the backward sweep (stored: Kd1 d2 - N Kd2 and
                           a1 + Kd1 b2 - N a2), and for both

Compiled for sm_90 on the CPU (Triton 3.6, K = V = 128 bf16, the narrowest 16-wide value tiles, as at B1 H16):
today's kernel 139 registers (GDN, 4 warps 3 stages) and 106 (KDA, 8 warps), no spills; paired at 8 warps 2 stages
255 registers and 216-416 bytes of spills, 4 warps 2 stages 312-360, 8 warps 1 stage 384-480 (at 64-wide tiles
700-1400). The paired backward: at today's options 263-296 KiB of shared memory (over the 227 an H100 block
gets), 8 warps 2 stages 177-193 KiB (GDN) but 260 (KDA); 8 warps 1 stage 86 KiB, 255 registers, 432-504 bytes
of spills (today's backward: 162 registers GDN, 255 KDA, no spills). Whether spills in this latency-bound
loop cost more than the halved chain is what the run measures. The prep form spills nothing: its sweep at 8 warps
2 stages 149-203 registers, 143 KiB (4 warps 3 stages 178-255, 212 KiB), its prep kernel 159-166 at 8 warps.
The backward's prep form: its sweep at 8 warps 1 stage 255 registers and 0-32 bytes (2 stages 0-40 bytes, KDA
225 KiB of shared memory), its prep kernel 136-304 bytes of spills (chunk-parallel, full 128-wide value tiles).

Each is checked on the kernel tests' cases (every gate) against float64, then timed: GDN and KDA fwd+bwd
(do_bench) with both sweeps' GPU time (profiler):

    python benchmarks/analysis/paired_sweep.py [--variants single,paired-w8-s2,...] [--time-shapes ...]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import check_cases, check_then_time, delta_rule_step, time_step, use_kernel_tests  # noqa: E402

use_kernel_tests()

import torch  # noqa: E402

from hccompile.kernels import _triton as triton_helpers  # noqa: E402
from hccompile.kernels._triton import cdiv, tl, triton  # noqa: E402
from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule.tiles import (_channel_decays, _chunk_end_decay, _chunk_end_decays,  # noqa: E402
                                                _dot, _gate_offset, _load_rows, _load_stored_rows, _row_bounds,
                                                _store_rows, _varlen_bounds)


@triton.jit
def _chunk_terms(k_ptr, kg_ptr, cum_ptr, w_ptr, u_tilde_ptr, start, length, kc, vc, stride_kt, stride_kk, HV, K, V,
                 GATE: tl.constexpr, BT: tl.constexpr):
    """One chunk's W [BT, BKF] and keys [BT, BKF] in their stored dtype (a channel gate's already decayed to
    the chunk's end: wy_solve's kg), U~ [BT, BV] fp32, the keys' row decay to the chunk's end [BT, 1] (a
    scalar gate's, applied on the values' side as state.py does; 1 otherwise) and the chunk's whole decay
    ([BKF, 1] per channel, or a [1, 1] scalar; 1 for an empty chunk, whose tiles are zero)."""
    local = tl.arange(0, BT)
    tokens = start + local
    valid = local < length
    w = _load_stored_rows(w_ptr, tokens, kc, HV * K, 1, valid, K)
    u_tilde = _load_rows(u_tilde_ptr, tokens, vc, HV * V, 1, valid, V)
    last = tl.where(length > 0, start + length - 1, 0)
    if GATE == 2:
        keys = _load_stored_rows(kg_ptr, tokens, kc, HV * K, 1, valid, K)
        row_decay = tl.full([BT, 1], 1.0, dtype=tl.float32)
        decay = tl.where(length > 0, _chunk_end_decay(cum_ptr, last, kc, HV, K), 1.0)[:, None]
    else:
        keys = _load_stored_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
        if GATE == 1:
            row_decay, whole = _chunk_end_decays(cum_ptr, tokens, valid, last, kc, HV, K, GATE)
            decay = tl.where(length > 0, whole, 1.0)[:, None]
        else:
            row_decay = tl.full([BT, 1], 1.0, dtype=tl.float32)
            decay = tl.full([1, 1], 1.0, dtype=tl.float32)
    return w, u_tilde, keys, row_decay, decay


@triton.jit
def _second_chunk_terms(w1, u1_tilde, k1, r1, d1, w2, u2_tilde, dot_dtype, GATE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """The second chunk's forward terms rewritten in the first chunk's start state, off the chain:
    (W2 d1 - M W1 in the products' dtype, U~2 - M U~1 fp32) with M = W2 Kd1^T = (W2 K1^T) diag(r1)."""
    coupling = _dot(w2, tl.trans(k1), dot_dtype, DOT_PRECISION) * tl.trans(r1)
    u2_start = u2_tilde - _dot(coupling, u1_tilde, dot_dtype, DOT_PRECISION)
    if GATE == 2:
        w2_start = w2.to(tl.float32) * tl.trans(d1)
    else:
        w2_start = w2.to(tl.float32) * d1
    w2_start -= _dot(coupling, w1, dot_dtype, DOT_PRECISION)
    return w2_start.to(dot_dtype), u2_start


@triton.jit
def _state_forward_paired_kernel(
    k_ptr, kg_ptr, cum_ptr, w_ptr, u_tilde_ptr, w_pair_ptr, u_pair_ptr, h0_ptr, h_ptr, u_ptr, ht_ptr,
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
    PREPARED: tl.constexpr,
):
    """state.py's _state_forward_kernel, two chunks per step (see the module docstring). PREPARED: the second
    chunk's rewritten terms are read from w_pair and u_pair (_pair_prep_forward_kernel's), not formed here."""
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
    key_offset = (batch * T) * HV * K + head * K
    value_offset = (batch * T) * HV * V + head * V
    w_ptr += key_offset
    kg_ptr += key_offset
    w_pair_ptr += key_offset
    u_tilde_ptr += value_offset
    u_pair_ptr += value_offset
    u_ptr += value_offset

    dot_dtype = h_ptr.dtype.element_ty
    kc = tl.arange(0, BKF)
    vc = pid_v * BV + tl.arange(0, BV)
    local = tl.arange(0, BT)
    if HAS_INITIAL_STATE:
        state = _load_rows(h0_ptr + seq * stride_h0n + head * stride_h0h, kc, vc, stride_h0k, stride_h0v, kc < K, V)
    else:
        state = tl.zeros([BKF, BV], dtype=tl.float32)
    num_chunks = tl.cdiv(eos - bos, BT)
    for pair in range(0, tl.cdiv(num_chunks, 2)):
        chunk1 = 2 * pair
        start1 = bos + chunk1 * BT
        start2 = start1 + BT
        length1 = tl.minimum(eos - start1, BT)
        length2 = tl.maximum(tl.minimum(eos - start2, BT), 0)
        w1, u1_tilde, k1, r1, d1 = _chunk_terms(k_ptr, kg_ptr, cum_ptr, w_ptr, u_tilde_ptr, start1, length1, kc,
                                                vc, stride_kt, stride_kk, HV, K, V, GATE, BT)
        if PREPARED:
            w2_start, u2_start, k2, r2, d2 = _chunk_terms(k_ptr, kg_ptr, cum_ptr, w_pair_ptr, u_pair_ptr, start2,
                                                          length2, kc, vc, stride_kt, stride_kk, HV, K, V, GATE, BT)
        else:
            w2, u2_tilde, k2, r2, d2 = _chunk_terms(k_ptr, kg_ptr, cum_ptr, w_ptr, u_tilde_ptr, start2, length2, kc,
                                                    vc, stride_kt, stride_kk, HV, K, V, GATE, BT)
            w2_start, u2_start = _second_chunk_terms(w1, u1_tilde, k1, r1, d1, w2, u2_tilde, dot_dtype, GATE,
                                                     DOT_PRECISION)
        # The chain: two rounds of two independent products.
        _store_rows(h_ptr + ((first_chunk + chunk1) * HV + head) * K * V, state, kc, vc, V, 1, kc < K, V)
        u1 = u1_tilde - _dot(w1, state, dot_dtype, DOT_PRECISION)
        u2 = u2_start - _dot(w2_start, state, dot_dtype, DOT_PRECISION)
        _store_rows(u_ptr, u1, start1 + local, vc, HV * V, 1, local < length1, V)
        _store_rows(u_ptr, u2, start2 + local, vc, HV * V, 1, local < length2, V)
        # The second chunk's start state (stored when that chunk exists), then the next pair's:
        # h' = d1 h + Kd1^T U1, h'' = d2 h' + Kd2^T U2 (d2 scales rows of h'; the two products are independent).
        mid = d1 * state + _dot(tl.trans(k1), u1 * r1, dot_dtype, DOT_PRECISION)
        # (one block comparison for the mask, no scalar joined to a block: see tiles._load_vector)
        _store_rows(h_ptr + ((first_chunk + chunk1 + 1) * HV + head) * K * V, mid, kc, vc, V, 1,
                    kc < tl.where(length2 > 0, K, 0), V)
        state = d2 * mid + _dot(tl.trans(k2), u2 * r2, dot_dtype, DOT_PRECISION)
    if STORE_FINAL_STATE:
        _store_rows(ht_ptr + seq * stride_htn + head * stride_hth, state, kc, vc, stride_htk, stride_htv, kc < K, V)


@triton.jit
def _pair_prep_forward_kernel(
    k_ptr, kg_ptr, cum_ptr, w_ptr, u_tilde_ptr, w_pair_ptr, u_pair_ptr,
    stride_kb, stride_kt, stride_kh, stride_kk,
    cu_seqlens_ptr, T, HV, GROUP, K, V,
    GATE: tl.constexpr, BT: tl.constexpr, BKF: tl.constexpr, BVF: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Chunk-parallel, for the prepared paired forward sweep: per (sequence, pair, value head) with a second
    chunk, _second_chunk_terms over the whole value width into w_pair and u_pair at that chunk's rows."""
    seq = tl.program_id(0).to(tl.int64)
    pair = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    if IS_VARLEN:
        batch, bos, eos = _varlen_bounds(seq, tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1))
    else:
        batch, bos, eos = _row_bounds(seq, T)
    start1 = bos + 2 * pair * BT
    start2 = start1 + BT
    if start2 < eos:
        length2 = tl.minimum(eos - start2, BT)
        key_head = head // GROUP
        k_ptr += batch * stride_kb + key_head * stride_kh
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        key_offset = (batch * T) * HV * K + head * K
        value_offset = (batch * T) * HV * V + head * V
        dot_dtype = w_ptr.dtype.element_ty
        kc = tl.arange(0, BKF)
        vc = tl.arange(0, BVF)
        local = tl.arange(0, BT)
        w1, u1_tilde, k1, r1, d1 = _chunk_terms(k_ptr, kg_ptr + key_offset, cum_ptr, w_ptr + key_offset,
                                                u_tilde_ptr + value_offset, start1, BT, kc, vc, stride_kt,
                                                stride_kk, HV, K, V, GATE, BT)
        w2, u2_tilde, _, _, _ = _chunk_terms(k_ptr, kg_ptr + key_offset, cum_ptr, w_ptr + key_offset,
                                             u_tilde_ptr + value_offset, start2, length2, kc, vc, stride_kt,
                                             stride_kk, HV, K, V, GATE, BT)
        w2_start, u2_start = _second_chunk_terms(w1, u1_tilde, k1, r1, d1, w2, u2_tilde, dot_dtype, GATE,
                                                 DOT_PRECISION)
        valid2 = local < length2
        _store_rows(w_pair_ptr + key_offset, w2_start, start2 + local, kc, HV * K, 1, valid2, K)
        _store_rows(u_pair_ptr + value_offset, u2_start, start2 + local, vc, HV * V, 1, valid2, V)


@triton.jit
def _backward_chunk_terms(q_ptr, k_ptr, cum_ptr, w_ptr, scores_ptr, do_ptr, start, length, kc, vc, stride_qt,
                          stride_qk, stride_kt, stride_kk, stride_dot, stride_dov, HV, K, V, scale, dot_dtype,
                          GATE: tl.constexpr, BT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One chunk's terms of the backward sweep that do not depend on the state gradient S: its W [BT, BKF]
    (stored dtype), keys decayed to its end Kd [BT, BKF] (the products' dtype), a = scale P^T dO [BT, BV],
    b = scale (Q e^G)^T dO [BKF, BV] and its whole decay ([BKF, 1] or [1, 1]; 1 for an empty chunk), so that
    dU = a + Kd S and the previous chunk's S = d S + b - W^T dU."""
    local = tl.arange(0, BT)
    tokens = start + local
    valid = local < length
    last = tl.where(length > 0, start + length - 1, 0)
    w = _load_stored_rows(w_ptr, tokens, kc, HV * K, 1, valid, K)
    do_tile = _load_stored_rows(do_ptr, tokens, vc, stride_dot, stride_dov, valid, V)
    scores = _load_rows(scores_ptr, tokens, local, HV * BT, 1, valid, BT)
    scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
    a = scale * _dot(tl.trans(scores), do_tile, dot_dtype, DOT_PRECISION)
    k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
    q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
    if GATE == 2:
        g, to_end, whole = _channel_decays(cum_ptr, tokens, valid, last, kc, HV, K)
        k_tile *= to_end
        q_tile *= tl.exp(g)
        decay = tl.where(length > 0, whole, 1.0)[:, None]
    elif GATE == 1:
        to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, last, kc, HV, K, GATE)
        k_tile *= to_end
        q_tile *= tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))[:, None]
        decay = tl.where(length > 0, whole, 1.0)[:, None]
    else:
        decay = tl.full([1, 1], 1.0, dtype=tl.float32)
    b = scale * _dot(tl.trans(q_tile), do_tile, dot_dtype, DOT_PRECISION)
    return w, k_tile.to(dot_dtype), a, b, decay


@triton.jit
def _first_chunk_terms(kd1, a1, w2, kd2, a2, b2, d2, dot_dtype, GATE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The first chunk's backward terms rewritten in the later chunk's end-state gradient, off the chain:
    (Kd1 d2 - N Kd2 in the products' dtype, a1 + Kd1 b2 - N a2 fp32) with N = Kd1 W2^T."""
    coupling = _dot(kd1, tl.trans(w2), dot_dtype, DOT_PRECISION)
    du1_base = a1 + _dot(kd1, b2, dot_dtype, DOT_PRECISION) - _dot(coupling, a2, dot_dtype, DOT_PRECISION)
    if GATE == 2:
        kd1_start = kd1.to(tl.float32) * tl.trans(d2)
    else:
        kd1_start = kd1.to(tl.float32) * d2
    kd1_start -= _dot(coupling, kd2, dot_dtype, DOT_PRECISION)
    return kd1_start.to(dot_dtype), du1_base


@triton.jit
def _state_backward_paired_kernel(
    q_ptr, k_ptr, cum_ptr, w_ptr, scores_ptr, do_ptr, kd_pair_ptr, du_pair_ptr, dht_ptr, dh_ptr, du_ptr, dh0_ptr,
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
    PREPARED: tl.constexpr,
):
    """state.py's _state_backward_kernel, two chunks per step. With S the gradient of the later chunk's end
    state, dU2 = a2 + Kd2 S, S1 = d2 S + b2 - W2^T dU2 and dU1 = a1 + Kd1 S1: with N = Kd1 W2^T (off the
    chain), dU1 = (a1 + Kd1 b2 - N a2) + (Kd1 d2 - N Kd2) S, so dU1 and dU2 both come from S, and the next S
    = d1 S1 + b1 - W1^T dU1 takes W2^T dU2 and W1^T dU1 side by side. PREPARED: the first chunk's rewritten
    terms are read from kd_pair and du_pair (_pair_prep_backward_kernel's), not formed here."""
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
    kd_pair_ptr += (batch * T) * HV * K + head * K
    scores_ptr += (batch * T) * HV * BT + head * BT
    du_ptr += (batch * T) * HV * V + head * V
    du_pair_ptr += (batch * T) * HV * V + head * V

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
    num_pairs = tl.cdiv(num_chunks, 2)
    for step in range(0, num_pairs):
        # clamped, as state.py's loop (the pipeliner may issue a later iteration's loads)
        pair = tl.maximum(num_pairs - 1 - step, 0)
        chunk1 = 2 * pair
        start1 = bos + chunk1 * BT
        start2 = start1 + BT
        length1 = tl.minimum(eos - start1, BT)
        length2 = tl.maximum(tl.minimum(eos - start2, BT), 0)
        valid1 = local < length1
        w1, kd1, a1, b1, d1 = _backward_chunk_terms(q_ptr, k_ptr, cum_ptr, w_ptr, scores_ptr, do_ptr, start1,
                                                    length1, kc, vc, stride_qt, stride_qk, stride_kt, stride_kk,
                                                    stride_dot, stride_dov, HV, K, V, scale, dot_dtype, GATE, BT,
                                                    DOT_PRECISION)
        w2, kd2, a2, b2, d2 = _backward_chunk_terms(q_ptr, k_ptr, cum_ptr, w_ptr, scores_ptr, do_ptr, start2,
                                                    length2, kc, vc, stride_qt, stride_qk, stride_kt, stride_kk,
                                                    stride_dot, stride_dov, HV, K, V, scale, dot_dtype, GATE, BT,
                                                    DOT_PRECISION)
        if PREPARED:
            kd1_start = _load_stored_rows(kd_pair_ptr, start1 + local, kc, HV * K, 1, valid1, K)
            du1_base = _load_rows(du_pair_ptr, start1 + local, vc, HV * V, 1, valid1, V)
        else:
            kd1_start, du1_base = _first_chunk_terms(kd1, a1, w2, kd2, a2, b2, d2, dot_dtype, GATE, DOT_PRECISION)
        # The chain: dU2 and dU1 from S, then W2^T dU2 and W1^T dU1 side by side.
        _store_rows(dh_ptr + ((first_chunk + chunk1 + 1) * HV + head) * K * V, dstate, kc, vc, V, 1,
                    kc < tl.where(length2 > 0, K, 0), V)
        du2 = a2 + _dot(kd2, dstate, dot_dtype, DOT_PRECISION)
        du1 = du1_base + _dot(kd1_start, dstate, dot_dtype, DOT_PRECISION)
        _store_rows(du_ptr, du2, start2 + local, vc, HV * V, 1, local < length2, V)
        _store_rows(du_ptr, du1, start1 + local, vc, HV * V, 1, valid1, V)
        mid = d2 * dstate + b2 - _dot(tl.trans(w2), du2, dot_dtype, DOT_PRECISION)
        _store_rows(dh_ptr + ((first_chunk + chunk1) * HV + head) * K * V, mid, kc, vc, V, 1, kc < K, V)
        dstate = d1 * mid + b1 - _dot(tl.trans(w1), du1, dot_dtype, DOT_PRECISION)
    if STORE_INITIAL_STATE_GRAD:
        _store_rows(dh0_ptr + seq * stride_dh0n + head * stride_dh0h, dstate, kc, vc, stride_dh0k, stride_dh0v,
                    kc < K, V)


@triton.jit
def _pair_prep_backward_kernel(
    q_ptr, k_ptr, cum_ptr, w_ptr, scores_ptr, do_ptr, kd_pair_ptr, du_pair_ptr,
    stride_qb, stride_qt, stride_qh, stride_qk,
    stride_kb, stride_kt, stride_kh, stride_kk,
    stride_dob, stride_dot, stride_doh, stride_dov,
    cu_seqlens_ptr, T, HV, GROUP, K, V, scale,
    GATE: tl.constexpr, BT: tl.constexpr, BKF: tl.constexpr, BVF: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Chunk-parallel, for the prepared paired backward sweep: per (sequence, pair, value head),
    _first_chunk_terms over the whole value width into kd_pair and du_pair at the first chunk's rows (a
    second chunk past the end gives N = 0)."""
    scale = tl.cast(scale, tl.float32)
    seq = tl.program_id(0).to(tl.int64)
    pair = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    if IS_VARLEN:
        batch, bos, eos = _varlen_bounds(seq, tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1))
    else:
        batch, bos, eos = _row_bounds(seq, T)
    start1 = bos + 2 * pair * BT
    if start1 < eos:
        start2 = start1 + BT
        length1 = tl.minimum(eos - start1, BT)
        length2 = tl.maximum(tl.minimum(eos - start2, BT), 0)
        key_head = head // GROUP
        q_ptr += batch * stride_qb + key_head * stride_qh
        k_ptr += batch * stride_kb + key_head * stride_kh
        do_ptr += batch * stride_dob + head * stride_doh
        cum_ptr += _gate_offset(batch, head, T, HV, K, GATE)
        key_offset = (batch * T) * HV * K + head * K
        value_offset = (batch * T) * HV * V + head * V
        w_ptr += key_offset
        scores_ptr += (batch * T) * HV * BT + head * BT
        dot_dtype = w_ptr.dtype.element_ty
        kc = tl.arange(0, BKF)
        vc = tl.arange(0, BVF)
        local = tl.arange(0, BT)
        _, kd1, a1, _, _ = _backward_chunk_terms(q_ptr, k_ptr, cum_ptr, w_ptr, scores_ptr, do_ptr, start1,
                                                 length1, kc, vc, stride_qt, stride_qk, stride_kt, stride_kk,
                                                 stride_dot, stride_dov, HV, K, V, scale, dot_dtype, GATE, BT,
                                                 DOT_PRECISION)
        w2, kd2, a2, b2, d2 = _backward_chunk_terms(q_ptr, k_ptr, cum_ptr, w_ptr, scores_ptr, do_ptr, start2,
                                                    length2, kc, vc, stride_qt, stride_qk, stride_kt, stride_kk,
                                                    stride_dot, stride_dov, HV, K, V, scale, dot_dtype, GATE, BT,
                                                    DOT_PRECISION)
        kd1_start, du1_base = _first_chunk_terms(kd1, a1, w2, kd2, a2, b2, d2, dot_dtype, GATE, DOT_PRECISION)
        valid1 = local < length1
        _store_rows(kd_pair_ptr + key_offset, kd1_start, start1 + local, kc, HV * K, 1, valid1, K)
        _store_rows(du_pair_ptr + value_offset, du1_base, start1 + local, vc, HV * V, 1, valid1, V)


class PairedForward:
    """Stands in for chunk.py's _state_forward_kernel (its positional arguments): the paired sweep, after the
    chunk-parallel prep when `prepared`. plan.launch hands an object that is not a JITFunction back as is."""

    def __init__(self, prepared: bool):
        self.prepared = prepared

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            k, kg, cum, w, u_tilde, h0, h, u, ht = args[:9]
            strides = args[9:21]
            chunk_offsets, seqlens, T, NT, HV, GROUP, K, V = args[21:29]
            w_pair, u_pair = w, u_tilde  # never read unless prepared
            if self.prepared:
                w_pair, u_pair = torch.empty_like(w), torch.empty_like(u_tilde)
                common = {n: kwargs[n] for n in ("GATE", "BT", "IS_VARLEN", "DOT_PRECISION")}
                triton_helpers.direct(_pair_prep_forward_kernel)[(grid[0], cdiv(cdiv(T, kwargs["BT"]), 2), HV)](
                    k, kg, cum, w, u_tilde, w_pair, u_pair, *strides[:4], seqlens, T, HV, GROUP, K, V,
                    BKF=kwargs["BKF"], BVF=max(16, triton.next_power_of_2(V)), num_warps=8, **common)
            triton_helpers.direct(_state_forward_paired_kernel)[grid](
                k, kg, cum, w, u_tilde, w_pair, u_pair, h0, h, u, ht, *strides, chunk_offsets, seqlens, T, NT, HV,
                GROUP, K, V, PREPARED=self.prepared, **kwargs)
        return launch


class PairedBackward:
    """Stands in for chunk.py's _state_backward_kernel (its positional arguments): the paired backward sweep,
    after the chunk-parallel prep when `prepared`."""

    def __init__(self, prepared: bool):
        self.prepared = prepared

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            q, k, cum, w, scores, do, dht, dh, du, dh0 = args[:10]
            strides = args[10:30]
            chunk_offsets, seqlens, T, NT, HV, GROUP, K, V, scale = args[30:39]
            kd_pair, du_pair = w, du  # never read unless prepared
            if self.prepared:
                kd_pair = torch.empty(w.shape, dtype=w.dtype, device=w.device)
                du_pair = torch.empty(du.shape, dtype=torch.float32, device=du.device)
                common = {n: kwargs[n] for n in ("GATE", "BT", "IS_VARLEN", "DOT_PRECISION")}
                triton_helpers.direct(_pair_prep_backward_kernel)[(grid[0], cdiv(cdiv(T, kwargs["BT"]), 2), HV)](
                    q, k, cum, w, scores, do, kd_pair, du_pair, *strides[:12], seqlens, T, HV, GROUP, K, V, scale,
                    BKF=kwargs["BKF"], BVF=max(16, triton.next_power_of_2(V)), num_warps=8, **common)
            triton_helpers.direct(_state_backward_paired_kernel)[grid](
                q, k, cum, w, scores, do, kd_pair, du_pair, dht, dh, du, dh0, *strides, chunk_offsets, seqlens, T,
                NT, HV, GROUP, K, V, scale, PREPARED=self.prepared, **kwargs)
        return launch


ORIGINAL_KERNEL = chunk_kernels._state_forward_kernel
ORIGINAL_BACKWARD_KERNEL = chunk_kernels._state_backward_kernel
ORIGINAL_OPTIONS = chunk_kernels.sweep_launch_options


def apply(variant: str) -> None:
    """single, paired (forward sweep), paired-bwd (backward sweep) or paired-both, with -wN / -sS options for
    the paired sweeps."""
    parts = variant.split("-")
    kind = parts[0] if parts[0] == "single" else "-".join(p for p in parts if p[0] not in "ws" or not p[1:].isdigit())
    if kind not in ("single", "paired", "paired-bwd", "paired-both", "paired-prep", "paired-prep-bwd",
                    "paired-prep-both"):
        raise ValueError(variant)
    forward = kind in ("paired", "paired-both", "paired-prep", "paired-prep-both")
    backward = kind in ("paired-bwd", "paired-both", "paired-prep-bwd", "paired-prep-both")
    prep = kind.startswith("paired-prep")
    chunk_kernels._state_forward_kernel = PairedForward(prep) if forward else ORIGINAL_KERNEL
    chunk_kernels._state_backward_kernel = PairedBackward(prep) if backward else ORIGINAL_BACKWARD_KERNEL
    override = {("num_warps" if p[0] == "w" else "num_stages"): int(p[1:]) for p in parts[1:]
                if p[0] in "ws" and p[1:].isdigit()}
    paired_directions = {d for d, on in (("forward", forward), ("backward", backward)) if on}

    def options(plan, block_k_full, dtype, direction):
        chosen = ORIGINAL_OPTIONS(plan, block_k_full, dtype, direction)
        if direction in paired_directions:
            chosen = {**chosen, **override}
        return chosen

    chunk_kernels.sweep_launch_options = options


def check(repeats: int) -> list[str]:
    """The kernel tests' cases with K and V up to 128: the paired kernels hold two chunks' [BT, K] tiles, which
    at K 256 may not fit a block's resources, and a variant is judged (and timed) at K 128."""
    import test_delta_rule_chunk as t

    cases = [c for c in t.KERNEL_CASES + t.NARROW_SWEEP_CASES if max(c[1][4], c[1][5]) <= 128]
    return check_cases(cases, repeats)


def time_variant(shape: str) -> str:
    out = []
    for op in ("gdn", "kda"):
        ms, sweeps = time_step(*delta_rule_step(op, shape), ("state_forward", "state_backward"))
        out.append(f"{op} fwd+bwd {ms:.3f} ms, state_forward {sweeps['state_forward']:.3f} ms, "
                   f"state_backward {sweeps['state_backward']:.3f} ms")
    return "; ".join(out)

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # every variant compiles its kernels once per test case in the check: a few, so the run fits one call
    p.add_argument("--variants", default="single,paired-prep-w8-s2,paired-prep-bwd-w8-s1,paired-w8-s2")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--time-shapes", default="B1T32768H16D128,B4T4096H16D128")
    a = p.parse_args()
    check_then_time(a.variants.split(","), apply, lambda: check(a.repeats), time_variant, a.time_shapes.split(","),
                    reference="single")

if __name__ == "__main__":
    main()
