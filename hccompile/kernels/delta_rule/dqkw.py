"""The first half of the split wy_backward (plan.SPLIT_WY_BACKWARD; no gate or a scalar one): the
gradients that go through the chunk states and the pairwise-decayed scores, FLA's chunk_bwd_kernel_dqkwg.

One program per (chunk, value head, key tile), at most two key tiles (dqkw_key_block). One pass over the
value tiles accumulates together

    dS = scale dO U^T,   dQ_state = dO h^T,   dK_end = U dh^T,   dW = -dU h^T

(dS formed again by each key tile's program: the dO and U tiles are read once per program, not once for
dS and again per key tile). Then, with D[t, s] = e^(G_t - G_s) (s <= t) and gamma = e^G,

    dq = scale gamma dQ_state + (dS o D) K                          complete
    dk = (dS o D)^T Q + dK_end e^(G_last - G)                       the part wy_bwd.py completes
    dG = rowsum(q dq - k (dS o D)^T Q - k dK_end e^(G_last - G))
         + on the last row: sum(k dK_end e^(G_last - G)) + e^G_last sum(h o dh)

dW leaves in the products' dtype (wy_backward's dW only ever fed products, rounded to it), dk as fp32
partial sums that wy_bwd.py reads, adds its terms to and stores complete. dG's rows are sums over the key
tiles: the first tile's program stores its share in dcum, the second's in a buffer of its own, and
wy_bwd.py adds both to its terms in that order (no atomics: the gradients are bitwise repeatable). The
reference is reference.dqkw_ref.
"""

from __future__ import annotations

import torch

from .plan import Plan, block_size

from .._triton import cdiv, scratch_rows, tl, triton

if triton is not None:
    from .tiles import (_chunk_end_decays, _dot, _gate_offset, _load_rows, _load_stored_rows, _pair_decays,
                        _row_chunk_coords, _store_rows, _varlen_chunk_coords)

    @triton.jit
    def _dqkw_value_pass(do_ptr, u_ptr, du_ptr, h_ptr, dh_ptr, tokens, valid, kc, stride_dot, stride_dov, HV, K, V,
                         dot_dtype, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
        """One pass over the value tiles for key tile `kc`: (dO U^T, dO h^T, U dh^T, -dU h^T, and with a
        gate rowsum(h o dh) [BK] for e^G_last's share of dG, else zeros)."""
        d_scores = tl.zeros([BT, BT], dtype=tl.float32)
        dq_state = tl.zeros([BT, BK], dtype=tl.float32)
        dk_to_end = tl.zeros([BT, BK], dtype=tl.float32)
        dw = tl.zeros([BT, BK], dtype=tl.float32)
        dg_whole = tl.zeros([BK], dtype=tl.float32)
        key_valid = kc < K
        for v0 in range(0, V, BV):
            vc = v0 + tl.arange(0, BV)
            do_tile = _load_stored_rows(do_ptr, tokens, vc, stride_dot, stride_dov, valid, V)
            u = _load_stored_rows(u_ptr, tokens, vc, HV * V, 1, valid, V)
            du = _load_stored_rows(du_ptr, tokens, vc, HV * V, 1, valid, V)
            state = _load_stored_rows(h_ptr, kc, vc, V, 1, key_valid, V)
            dstate = _load_stored_rows(dh_ptr, kc, vc, V, 1, key_valid, V)
            d_scores += _dot(do_tile, tl.trans(u), dot_dtype, DOT_PRECISION)
            dq_state += _dot(do_tile, tl.trans(state), dot_dtype, DOT_PRECISION)
            dk_to_end += _dot(u, tl.trans(dstate), dot_dtype, DOT_PRECISION)
            dw -= _dot(du, tl.trans(state), dot_dtype, DOT_PRECISION)
            if GATE != 0:
                dg_whole += tl.sum(state.to(tl.float32) * dstate.to(tl.float32), axis=1)
        return d_scores, dq_state, dk_to_end, dw, dg_whole

    @triton.jit
    def _dqkw_finish_tile(q_ptr, k_ptr, cum_ptr, dq_ptr, dk_ptr, dw_ptr, d_scores, d_scores_t, dq_state, dk_to_end,
                          dw, dg_whole, tokens, valid, last, length, kc, stride_qt, stride_qk, stride_kt, stride_kk,
                          HV, K, scale, dot_dtype, BT: tl.constexpr, GATE: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, SCORES_VIA_MEMORY: tl.constexpr):
        """Key tile `kc`'s dq (complete), dk (partial) and dW stores; returns its share of dG's rows.
        d_scores_t: dS^T as read back from memory with SCORES_VIA_MEMORY, else unused (tl.trans of d_scores)."""
        local = tl.arange(0, BT)
        _store_rows(dw_ptr, dw, tokens, kc, HV * K, 1, valid, K)
        k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
        if GATE == 1:
            q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            gamma = tl.exp(tl.load(cum_ptr + tokens * HV, mask=valid, other=0.0))[:, None]
            dq = scale * gamma * dq_state
        else:
            q_tile = _load_stored_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            dq = scale * dq_state
        # P's row role (dq_t += sum_s dS[t,s] k_s) and column role (dk_s += sum_t dS[t,s] q_t)
        dq += _dot(d_scores, k_tile, dot_dtype, DOT_PRECISION)
        _store_rows(dq_ptr, dq, tokens, kc, HV * K, 1, valid, K)
        if SCORES_VIA_MEMORY:
            dk_scores = _dot(d_scores_t, q_tile, dot_dtype, DOT_PRECISION)
        else:
            dk_scores = _dot(tl.trans(d_scores), q_tile, dot_dtype, DOT_PRECISION)
        dg_rows = tl.zeros([BT], dtype=tl.float32)
        if GATE != 0:
            # Through S_end = e^G_last S + (K e^(G_last - G))^T U: dk_t's end-state term depends on
            # G through G_last - G_t; its G_last part and e^G_last S's land on the chunk's last row.
            to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, last, kc, HV, K, GATE)
            dk_to_end *= to_end
            k_to_end_grad = k_tile * dk_to_end
            dg_last = tl.sum(tl.sum(k_to_end_grad, axis=1), axis=0) + tl.sum(whole * dg_whole, axis=0)
            dg_rows = tl.sum(q_tile * dq - k_tile * dk_scores - k_to_end_grad, axis=1)
            dg_rows += tl.where(local == length - 1, dg_last, 0.0)
        _store_rows(dk_ptr, dk_scores + dk_to_end, tokens, kc, HV * K, 1, valid, K)
        return dg_rows

    @triton.jit
    def _dqkw_kernel(
        q_ptr, k_ptr, do_ptr, cum_ptr, u_ptr, du_ptr, h_ptr, dh_ptr,
        dq_ptr, dk_ptr, dw_ptr, dg_ptr, dg_second_ptr, ds_ptr,
        stride_qb, stride_qt, stride_qh, stride_qk,
        stride_kb, stride_kt, stride_kh, stride_kk,
        stride_dob, stride_dot, stride_doh, stride_dov,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K, V, scale,
        GATE: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        IS_VARLEN: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        SCORES_VIA_MEMORY: tl.constexpr,
        KEY_TILES_FASTEST: tl.constexpr,
    ):
        """One program per (chunk, value head, key tile): see the module docstring. KEY_TILES_FASTEST: the
        grid is (chunks x key tiles, value heads, 1), a chunk's key tiles neighbouring programs (so the second
        reads the chunk's dO, U and dU from L2), else (chunks, value heads, key tiles). dq, dk (partial) and
        dW are [B, T, HV, K] (dq, dk fp32, dW the intermediates' dtype); dG's partial rows, fp32
        [B, T, HV, 1], go to dg_ptr from the first key tile and to dg_second_ptr from the second.
        With SCORES_VIA_MEMORY, dS makes a round trip through ds_ptr ([chunks, HV, key tiles, BT, BT] in
        the products' dtype, this program's tile only) and both products read it from there, dS^T by a
        transposed load: no product takes dS from the registers of the product that formed it and no
        tl.trans of it (see DQKW_SCORES_VIA_MEMORY)."""
        tl.static_assert(GATE != 2, "per-channel gates take wy.py's wy_backward and scores.py's backward")
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        if KEY_TILES_FASTEST:
            key_tiles = (K + BK - 1) // BK
            pid_chunk = tl.program_id(0) // key_tiles
            key_tile = tl.program_id(0) % key_tiles
        else:
            key_tiles = tl.num_programs(2)
            pid_chunk = tl.program_id(0)
            key_tile = tl.program_id(2)
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
        do_ptr += batch * stride_dob + head * stride_doh
        gate_offset = _gate_offset(batch, head, T, HV, K, GATE)
        cum_ptr += gate_offset
        dg_ptr += gate_offset
        dg_second_ptr += gate_offset
        value_offset = (batch * T) * HV * V + head * V
        key_offset = (batch * T) * HV * K + head * K
        u_ptr += value_offset
        du_ptr += value_offset
        dq_ptr += key_offset
        dk_ptr += key_offset
        dw_ptr += key_offset
        h_ptr += (pid_chunk.to(tl.int64) * HV + head) * K * V
        dh_ptr += (pid_chunk.to(tl.int64) * HV + head) * K * V

        local = tl.arange(0, BT)
        valid = local < length
        tokens = start + local
        last = start + length - 1
        dot_dtype = h_ptr.dtype.element_ty

        kc = key_tile * BK + tl.arange(0, BK)
        d_scores, dq_state, dk_to_end, dw, dg_whole = _dqkw_value_pass(
            do_ptr, u_ptr, du_ptr, h_ptr, dh_ptr, tokens, valid, kc, stride_dot, stride_dov, HV, K, V,
            dot_dtype, BT, BK, BV, GATE, DOT_PRECISION)
        d_scores = tl.where((local[:, None] >= local[None, :]) & valid[:, None], scale * d_scores, 0.0)
        if GATE == 1:
            d_scores *= _pair_decays(cum_ptr, tokens, valid, HV, BT)
        d_scores = d_scores.to(dot_dtype)
        d_scores_t = d_scores
        if SCORES_VIA_MEMORY:
            ds_ptr += ((pid_chunk.to(tl.int64) * HV + head) * key_tiles + key_tile) * BT * BT
            tl.store(ds_ptr + local[:, None] * BT + local[None, :], d_scores)
            # the loads below read elements other threads of this program stored
            tl.debug_barrier()
            d_scores = tl.load(ds_ptr + local[:, None] * BT + local[None, :])
            d_scores_t = tl.load(ds_ptr + local[None, :] * BT + local[:, None])
        dg = _dqkw_finish_tile(q_ptr, k_ptr, cum_ptr, dq_ptr, dk_ptr, dw_ptr, d_scores, d_scores_t, dq_state,
                               dk_to_end, dw, dg_whole, tokens, valid, last, length, kc, stride_qt, stride_qk,
                               stride_kt, stride_kk, HV, K, scale, dot_dtype, BT, GATE, DOT_PRECISION,
                               SCORES_VIA_MEMORY)
        if GATE == 1:
            if key_tile == 0:
                tl.store(dg_ptr + tokens * HV, dg, mask=valid)
            else:
                tl.store(dg_second_ptr + tokens * HV, dg, mask=valid)


# Launch options. The one-pass kernel on one H200 (Triton 3.6, session 44,
# results/diag_dqkw-split_2026-11-30_h200x1_2ebcd75.txt), dqkw's GPU time at GDN B1 T32768 H16 D128 bf16 /
# the whole fwd+bwd: BK 64, BV 64, 4 warps, 2 stages 0.837 / 4.071 ms; BV 32, 3 stages 0.866 / 4.097; BK 128
# at 8 warps 0.871 / 4.108; BK 64 at 8 warps 1.331; BK = BV = 128 at 4 warps (FLA's dqkwg tiles) 3.129 (1944
# bytes of spills); the two-pass kernel before it (one program per chunk and value head walking both key
# tiles, 8 warps, 1 stage) 1.262 / 4.494. sm_90 (Triton 3.6, ptxas): BK 64 at 4 warps 2 stages 255
# registers and 56 bytes of spills, two programs per SM. Each variant was right on the kernel tests' cases
# and bitwise repeatable there. At those tiles (session 45, one H200, tune_delta_rule.py,
# results/diag_gdn-tune_2026-11-30_h200x1_e8b5009.jsonl, the whole fwd+bwd): 3 stages 4.247 ms, 2 stages
# 4.329, 1 stage 4.406, 8 warps 4.773; BK 128 5.326.
# BK 32 at 4 warps gave wrong dq and dk on the H100 (Triton 3.6) at bf16 and fp16, chunk 64, K 60 and 100
# with GVA in the two-pass kernel: rows 16-63 of each chunk, in dS K and its transpose (the wgmmas taking
# dS from registers against a 64-byte-swizzled key tile); right there (benchmarks/diag_wy_split.py,
# session 24): BK 64 at 4 warps, BK 32 at 8 or 2 warps. So a key tile narrower than 64 (K <= 32) takes
# DQKW_OTHER_WARPS, as does the 128-wide one of K > 128 (registers).
DQKW_BLOCK_K = 64
DQKW_BLOCK_V = 64
DQKW_STAGES = 3
DQKW_OPTIONS = {"num_warps": 4, "num_stages": DQKW_STAGES}
DQKW_OTHER_WARPS = 8
# Off: dS stays in registers, both products take it from there (dS^T through tl.trans). On: a round
# trip through a [chunks, HV, key tiles, BT, BT] scratch in the products' dtype (2 BT^2 bytes per program,
# read back from L2), as FLA's chunk_bwd_kernel_dqkwg does on Hopper against a Triton 3.4-3.7 miscompile
# of tl.trans on a wgmma result (fla-org/flash-linear-attention#640, #826). Not a workaround for the
# errors above: on the H100 (Triton 3.6, BK 32, 4 warps) it was wrong too (dq 1.3 relative RMS) and
# then made an illegal memory access (benchmarks/diag_wy_split.py, session 24). Read at launch time.
DQKW_SCORES_VIA_MEMORY = False
# A chunk's two key-tile programs next to each other in the launch (grid axis 0 chunks x key tiles), so that
# the second reads the chunk's dO, U and dU (3 of its ~16 bf16 [T, HV, 128]-sized reads at GDN B1) from L2:
# with the key tile as the grid's slowest axis the two are 8192 programs apart at B1 T32768 H16 and the
# second reads them from DRAM again (benchmarks/analysis/gdn_traffic_2026-11-30_h200.md, item 3: -0.05 to
# -0.09 ms predicted). The same results bit for bit. Timed on the H200 (tune_delta_rule.py's
# DQKW_KEY_TILES_FASTEST, GDN B1 T32768 H16 D128 fwd+bwd, session 48): 4.029 -> 3.947 ms (0.980x). Read at
# launch time.
DQKW_KEY_TILES_FASTEST = True


def dqkw_key_block(key_dim: int) -> int:
    """The key tile: DQKW_BLOCK_K's, widened until K takes at most two tiles (dG's rows are stored per
    key tile, and wy_bwd.py adds two)."""
    block = block_size(key_dim, DQKW_BLOCK_K)
    while cdiv(key_dim, block) > 2:
        block *= 2
    return block


def dqkw_launch_options(block_k: int) -> dict:
    if block_k == DQKW_BLOCK_K:
        return dict(DQKW_OPTIONS)
    return {**DQKW_OPTIONS, "num_warps": DQKW_OTHER_WARPS}


def launch_dqkw(plan: Plan, q, k, do, cum, u, du, h, dh, dq_heads, dk_heads, dw, dcum, num_chunks, table, seqlens,
                scale: float) -> torch.Tensor | None:
    """_dqkw_kernel on `num_chunks` chunks (the first `table` lists, varlen; h and dh start there):
    writes dq_heads (complete), dk_heads and dcum (partial, fp32) and dw (the intermediates' dtype).
    Returns the second key tile's rows of dG ([B, T, HV, 1] fp32, for launch_wy_bwd's dcum_second)
    where there is a gate and K takes two key tiles, else None."""
    problem = plan.problem
    block_k = dqkw_key_block(problem.key_dim)
    key_tiles = cdiv(problem.key_dim, block_k)
    via_memory = DQKW_SCORES_VIA_MEMORY
    scratch = (torch.empty(scratch_rows(num_chunks), problem.value_heads, key_tiles, plan.chunk_size,
                           plan.chunk_size, dtype=plan.intermediate_dtype, device=q.device)
               if via_memory else plan.dummy)
    second = (torch.empty(dcum.shape, dtype=torch.float32, device=q.device)
              if plan.gate_code == 1 and key_tiles == 2 else None)
    fastest = DQKW_KEY_TILES_FASTEST
    grid = (num_chunks * key_tiles, problem.value_heads, 1) if fastest else (num_chunks, problem.value_heads, key_tiles)
    plan.launch(_dqkw_kernel)[grid](
        q, k, do, cum, u, du, h, dh, dq_heads, dk_heads, dw, dcum, second if second is not None else plan.dummy,
        scratch, *q.stride(), *k.stride(), *do.stride(), table, seqlens,
        problem.time, plan.chunks_per_row, problem.value_heads, problem.group_size, problem.key_dim,
        problem.value_dim, scale,
        GATE=plan.gate_code, BT=plan.chunk_size, BK=block_k, BV=block_size(problem.value_dim, DQKW_BLOCK_V),
        IS_VARLEN=plan.varlen, DOT_PRECISION=plan.dot_precision, SCORES_VIA_MEMORY=via_memory,
        KEY_TILES_FASTEST=fastest, **dqkw_launch_options(block_k),
    )
    return second
