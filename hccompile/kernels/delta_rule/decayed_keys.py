"""The backward state sweep's decayed queries and keys for per-channel gates, formed chunk-parallel before
the sweep (plan.PREPARED_CHANNEL_SWEEP): Q e^G and K e^(G_last - G) per chunk, value head and key tile,
stored [B, T, HV, K] in the intermediates' dtype, as FLA's KDA backward hands its sweep qg and kg.

state_backward otherwise forms both in every chunk step of every value-tile program: an fp32 [BT, K] gate
tile and 2 BT K exps per step, which a head's value-tile programs (eight at 16-wide tiles) repeat for the
same chunk, off the sweep's chain but in its steps. Each product here is the fp32 one the sweep would form,
rounded to the intermediates' dtype as the sweep's products round their operands: the sweep's results are
the same either way.
"""

from __future__ import annotations

from .plan import Plan, block_size

from .._triton import tl, triton

if triton is not None:
    from .tiles import _channel_decays, _gate_offset, _load_rows, _row_chunk_coords, _store_rows, _varlen_chunk_coords

    @triton.jit
    def _decayed_keys_kernel(
        q_ptr, k_ptr, cum_ptr, qg_ptr, kg_ptr,
        stride_qb, stride_qt, stride_qh, stride_qk,
        stride_kb, stride_kt, stride_kh, stride_kk,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GROUP, K,
        BT: tl.constexpr,
        BK: tl.constexpr,
        IS_VARLEN: tl.constexpr,
    ):
        """qg = Q e^G and kg = K e^(G_last - G) of one chunk and value head ([B, T, HV, K] outputs; q and k
        [B, T, H, K]; G the chunk-local cumulative per-channel gate)."""
        pid_chunk = tl.program_id(0)
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
        cum_ptr += _gate_offset(batch, head, T, HV, K, 2)
        offset = (batch * T) * HV * K + head * K
        local = tl.arange(0, BT)
        tokens = start + local
        valid = local < length
        for k0 in range(0, K, BK):
            kc = k0 + tl.arange(0, BK)
            q = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
            k = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
            g, to_end, _ = _channel_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K)
            _store_rows(qg_ptr + offset, q * tl.exp(g), tokens, kc, HV * K, 1, valid, K)
            _store_rows(kg_ptr + offset, k * to_end, tokens, kc, HV * K, 1, valid, K)


def launch_decayed_keys(plan: Plan, q, k, cum, qg, kg, num_chunks, table, seqlens) -> None:
    """_decayed_keys_kernel on `num_chunks` chunks (the first `table` lists, varlen): qg and kg
    ([B, T, HV, K], their dtype) from q, k and the per-channel cumulative gate `cum`."""
    problem = plan.problem
    plan.launch(_decayed_keys_kernel)[(num_chunks, problem.value_heads)](
        q, k, cum, qg, kg, *q.stride(), *k.stride(), table, seqlens, problem.time, plan.chunks_per_row,
        problem.value_heads, problem.group_size, problem.key_dim,
        BT=plan.chunk_size, BK=block_size(problem.key_dim), IS_VARLEN=plan.varlen,
    )
