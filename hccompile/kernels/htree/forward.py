"""Triton forward of htree attention (seed 003): streaming selection and online softmax per query.

Semantics are those of `reference.py` (read its docstring); the shared tile helpers and the plan
are in `tiles.py`. One persistent program walks work items (batch, KV head, query position t),
and for each item the layers from the top down:

    layer above the tokens:  pass A (scores into a scratch row, log-sum-exp per head), pass B
                             (importance keys into a scratch row), selection (top_k in registers,
                             selected nodes ascending into the scratch parents row of the next
                             layer), then pass C over the others, reading the stored scores
    token layer:             pass C over every candidate
    pass C:                  scores and values of the merged candidates into the running
                             (max, sum, weighted values) of the G query heads

Nothing of size [B, T, H_kv, candidates, G] exists: the memory is q, k, v, o, the float32
log-sum-exp [B, T, H], the float32 pooled tree (layers >= 1) and scratch rows per program of the
persistent grid (G x selection width floats for one layer's scores, selection width ints for keys
and flags, 2 top_k ints for parents). Each key tile of a layer is loaded once. The G query heads
of a KV head share every key tile (rows of one tl.dot, padded to 16).
"""
from __future__ import annotations

import torch

from .._triton import direct, dot, interpreted, require_triton, tl, triton
from . import tiles
from .reference import HTreeConfig, HTreeLayerSelection
from .tiles import (candidate_tile, check_kernel_limits, dot_dtype, load_scores, load_values, make_plan,
                    num_programs, num_tree_layers, pool_tree, rank_select, rope_table, safe_max, select_layer,
                    tile_nodes, tile_scores)

__all__ = ["htree_forward", "selections_from_record"]


if triton is not None:

    @triton.jit
    def _merge_layer(layer, is_top, n, q1, q2, parents_ptr, flags_ptr, scores_ptr, r,
                     k_ptr, stride_kt, stride_kd, v_ptr, stride_vt, stride_vd,
                     tree_k_ptr, tree_v_ptr, pooled_offset, cos_ptr, sin_ptr,
                     cols_k, KH, cols_v, V, scale, row_ok, m_run, l_run, acc,
                     G_PAD: tl.constexpr, BLOCK_C: tl.constexpr, SELECT_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr):
        """Pass C: online-softmax merge of the layer's candidates that were not selected. A layer
        that selected has its scores in the scratch rows; the token layer computes them."""
        for p0 in range(0, n, BLOCK_C):
            positions, valid, nodes = tile_nodes(p0, n, is_top, parents_ptr, r, BLOCK_C)
            if layer > 0:
                scores = load_scores(scores_ptr, positions, valid, row_ok, G_PAD, SELECT_PAD)
            else:
                qr1, qr2, kr1, kr2, cos_q, sin_q, cos_k, sin_k = candidate_tile(
                    p0, n, nodes, valid, layer, q1, q2, k_ptr, stride_kt, stride_kd, tree_k_ptr,
                    pooled_offset, cos_ptr, sin_ptr, cols_k, KH, BLOCK_C, DOT_DTYPE)
                scores = tile_scores(qr1, qr2, kr1, kr2, scale, DOT_PRECISION, UPCAST_OPERANDS)
            # Token layer: no selection, every candidate merges. Above it, the flags of the candidates
            # (positions < n), masked by one block comparison: `valid & (layer > 0)` would splat a scalar
            # condition into the mask, which Triton's interpreter types as an integer (Triton 3.9's
            # rejects such masks).
            selected = tl.load(flags_ptr + positions, mask=positions < tl.where(layer > 0, n, 0), other=0)
            merge = valid & (selected == 0)
            scores = tl.where(merge[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_run, tl.max(scores, axis=1))
            shift = safe_max(m_new)
            weights = tl.exp(scores - shift[:, None])
            rescale = tl.exp(m_run - shift)
            values = load_values(layer, nodes, merge, v_ptr, stride_vt, stride_vd, tree_v_ptr, pooled_offset, cols_v,
                                 V, DOT_DTYPE)
            l_run = l_run * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + dot(weights.to(DOT_DTYPE), values, DOT_PRECISION, UPCAST_OPERANDS)
            m_run = m_new
        return m_run, l_run, acc

    @triton.jit
    def _htree_forward_kernel(
        q_ptr, k_ptr, v_ptr, tree_k_ptr, tree_v_ptr, layer_table_ptr, cos_ptr, sin_ptr,
        o_ptr, lse_ptr, scores_ptr, keys_ptr, flags_ptr, parents_ptr, record_ptr,
        stride_qb, stride_qt, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_ob, stride_ot, stride_oh, stride_od,
        B, T, H_KV, G, KH, V, max_top_nodes, r, top_k, pooled_nodes, n_items, n_programs, scale,
        CAUSAL: tl.constexpr, PACKED: tl.constexpr, INDEX_BITS: tl.constexpr, RECORD: tl.constexpr,
        G_PAD: tl.constexpr, KH_PAD: tl.constexpr, V_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
        SELECT_PAD: tl.constexpr, RANK_SELECT: tl.constexpr, DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr,
    ):
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64, which would
        # make the loop-carried maxima fp64: a compile error)
        scale = tl.cast(scale, tl.float32)
        pid = tl.program_id(0)
        g_rows = tl.arange(0, G_PAD)
        row_ok = g_rows < G
        cols_k = tl.arange(0, KH_PAD)
        cols_v = tl.arange(0, V_PAD)
        scores_row = scores_ptr + pid.to(tl.int64) * G * SELECT_PAD
        keys_row = keys_ptr + pid.to(tl.int64) * SELECT_PAD
        flags_row = flags_ptr + pid.to(tl.int64) * SELECT_PAD
        parents_row = parents_ptr + pid.to(tl.int64) * (2 * top_k)
        num_layers = num_tree_layers(T, r, max_top_nodes)

        for item in range(pid, n_items, n_programs):
            t = item % T
            h = (item // T) % H_KV
            b = item // (T * H_KV)
            heads = h * G + g_rows
            q_rows = q_ptr + b.to(tl.int64) * stride_qb + t.to(tl.int64) * stride_qt
            q_mask = row_ok[:, None] & (cols_k[None, :] < KH)
            q_offsets = heads[:, None] * stride_qh + cols_k[None, :] * stride_qd
            q1 = tl.load(q_rows + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
            q2 = tl.load(q_rows + KH * stride_qd + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
            k_item = k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh
            v_item = v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh
            tree_row = (b * H_KV + h).to(tl.int64) * pooled_nodes
            tree_k_item = tree_k_ptr + tree_row * (2 * KH)
            tree_v_item = tree_v_ptr + tree_row * V

            m_run = tl.full([G_PAD], float("-inf"), tl.float32)
            l_run = tl.zeros([G_PAD], tl.float32)
            acc = tl.zeros([G_PAD, V_PAD], tl.float32)
            n_parents = t * 0
            for step in range(0, num_layers):
                layer = num_layers - 1 - step
                pooled_offset = tl.load(layer_table_ptr + layer * 4 + 1)
                span = tl.load(layer_table_ptr + layer * 4 + 3).to(tl.int32)
                rightmost = t // span
                is_top = 1 - tl.minimum(step, 1)
                # Top layer: nodes 0..rightmost. Below: the parents' children, the rightmost parent's
                # only up to the child holding t.
                n = tl.where(is_top != 0, rightmost + 1, (n_parents - 1) * r + rightmost % r + 1)
                parents_prev = parents_row + ((step + 1) % 2) * top_k
                parents_next = parents_row + (step % 2) * top_k
                if layer > 0:
                    record_row = record_ptr + (((layer * B + b).to(tl.int64) * T + t) * H_KV + h) * top_k
                    select_layer(layer, is_top, n, top_k, q1, q2, parents_prev, parents_next, r,
                                 k_item, stride_kt, stride_kd, tree_k_item, pooled_offset,
                                 cos_ptr, sin_ptr, cols_k, KH, scale, row_ok, scores_row, keys_row, flags_row,
                                 record_row, CAUSAL, PACKED, INDEX_BITS, RECORD, G_PAD, BLOCK_C, SELECT_PAD,
                                 RANK_SELECT, DOT_DTYPE, DOT_PRECISION, UPCAST_OPERANDS)
                m_run, l_run, acc = _merge_layer(
                    layer, is_top, n, q1, q2, parents_prev, flags_row, scores_row, r,
                    k_item, stride_kt, stride_kd, v_item, stride_vt, stride_vd,
                    tree_k_item, tree_v_item, pooled_offset, cos_ptr, sin_ptr,
                    cols_k, KH, cols_v, V, scale, row_ok, m_run, l_run, acc,
                    G_PAD, BLOCK_C, SELECT_PAD, DOT_DTYPE, DOT_PRECISION, UPCAST_OPERANDS)
                n_parents = tl.minimum(n, top_k)

            # Layer 0 always merges the token t itself, so the sum is positive.
            out = acc / tl.maximum(l_run, 1.1754943508222875e-38)[:, None]
            o_rows = o_ptr + b.to(tl.int64) * stride_ob + t.to(tl.int64) * stride_ot
            o_mask = row_ok[:, None] & (cols_v[None, :] < V)
            tl.store(o_rows + heads[:, None] * stride_oh + cols_v[None, :] * stride_od,
                     out.to(o_ptr.dtype.element_ty), mask=o_mask)
            lse_rows = lse_ptr + (b.to(tl.int64) * T + t) * (H_KV * G)
            tl.store(lse_rows + heads, m_run + tl.log(l_run), mask=row_ok)
            # The next item's pass B must not overwrite rows still being read.
            tl.debug_barrier()


def _require_triton(device: torch.device) -> None:
    require_triton(device, _htree_forward_kernel, "hccompile.kernels.htree.forward", "htree_attention_ref")


def launch_config(q: torch.Tensor) -> dict:
    """Dot settings shared by the forward and the backward (they must select identically)."""
    is_interpreted = interpreted(_htree_forward_kernel)
    return dict(
        DOT_DTYPE=dot_dtype(q.dtype),
        # The default for fp32 is tf32 on GPUs, which would cost about three digits.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_OPERANDS=is_interpreted and q.dtype != torch.float32,
    )


def htree_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: HTreeConfig,
    *,
    block_c: int | None = None,
    record_selections: bool = False,
    record_out: torch.Tensor | None = None,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """htree forward; q [B, T, H, K], k [B, T, H_kv, K], v [B, T, H_kv, V] (one dtype of float16,
    bfloat16, float32, on CUDA or on CPU under TRITON_INTERPRET=1); cfg from resolve_htree_config.

    Returns (o [B, T, H, V] in v's dtype, lse [B, T, H] float32 — the log of each output row's
    softmax normaliser, which the backward needs — and, with record_selections, the selected
    nodes [L, B, T, H_kv, top_k] int32, ascending, -1 padded, layer 0's row all -1).

    record_out: where to record them (int32 [S, B, T, H_kv, top_k] filled with -1, S >= L; the ops'
    selections, tiles.selection_slots), returned as the record. `wrap`:
    torch.library.wrap_triton when the launches are traced for Inductor (hccompile.lowering.htree);
    T may then be symbolic (tiles.make_plan plans for every length).
    """
    check_kernel_limits(q, k, v, cfg)
    _require_triton(q.device)
    wrap = wrap or direct
    if block_c is not None and (block_c < tiles.MIN_DOT_DIM or block_c & (block_c - 1)):
        raise ValueError(f"block_c: must be a power of two >= {tiles.MIN_DOT_DIM}, got {block_c}")
    batch, time, heads, key_dim = q.shape
    kv_heads, value_dim = k.shape[2], v.shape[3]
    group = heads // kv_heads
    o = torch.full((batch, time, heads, value_dim), float("nan"), dtype=v.dtype, device=q.device)
    lse = torch.full((batch, time, heads), float("nan"), dtype=torch.float32, device=q.device)
    if batch * time * heads == 0:
        return o, lse, record_out
    plan = make_plan(time, group, key_dim, value_dim, cfg, q.device, block_c)
    tree_k = pool_tree(k, plan, cfg.compression_rate, wrap)
    tree_v = pool_tree(v, plan, cfg.compression_rate, wrap)
    cos, sin = rope_table(plan, key_dim, cfg.rope_base, q.device)
    items = batch * kv_heads * time
    programs = num_programs(plan, q.device, items, interpreted(_htree_forward_kernel))
    scores = torch.empty((programs, group, plan.select_pad), dtype=torch.float32, device=q.device)
    keys = torch.empty((programs, plan.select_pad), dtype=torch.int32, device=q.device)
    flags = torch.empty((programs, plan.select_pad), dtype=torch.int32, device=q.device)
    parents = torch.empty((programs, 2 * cfg.top_k), dtype=torch.int32, device=q.device)
    record = record_out
    if record is None and record_selections:
        record = torch.full((plan.record_slots, batch, time, kv_heads, cfg.top_k), -1, dtype=torch.int32,
                            device=q.device)
    wrap(_htree_forward_kernel)[(programs,)](
        q, k, v, tree_k, tree_v, plan.layer_table, cos, sin,
        o, lse, scores, keys, flags, parents, record if record is not None else keys,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        batch, time, kv_heads, group, key_dim // 2, value_dim, cfg.max_top_nodes, cfg.compression_rate, cfg.top_k,
        plan.pooled_rows, items, programs, cfg.scale,
        CAUSAL=cfg.causal, PACKED=cfg.sort_mode == "packed", INDEX_BITS=plan.index_bits,
        RECORD=record is not None, G_PAD=plan.g_pad, KH_PAD=plan.kh_pad, V_PAD=plan.v_pad,
        BLOCK_C=plan.block_c, SELECT_PAD=plan.select_pad,
        RANK_SELECT=rank_select(plan, interpreted(_htree_forward_kernel)),
        num_warps=plan.num_warps, **launch_config(q),
    )
    return o, lse, record


def selections_from_record(record: torch.Tensor) -> tuple[HTreeLayerSelection, ...]:
    """A recorded [L, B, T, H_kv, top_k] selection as the reference's `selections=` argument
    (only `selected` is read there; candidates are not recorded)."""
    layers = []
    for layer in range(record.shape[0]):
        selected = record[layer].long() if layer > 0 else None
        empty = torch.empty(0, dtype=torch.long, device=record.device)
        layers.append(HTreeLayerSelection(layer, empty, empty, selected, None))
    return tuple(layers)
