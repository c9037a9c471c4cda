"""Triton backward of htree attention: recompute the tree and the selections, then the gradients.

Nothing per layer comes from the forward: the pooled tree is rebuilt, and each work item
(batch, KV head, query position t) re-runs the forward's selection passes (the same helpers, tile
sizes and warp counts as the forward, so the same top-k; see tiles.py). From the forward only o
and the log-sum-exp lse [B, T, H] are read. The selection is a constant: gradients flow through
the scores and values of the merged candidates, the RoPE and the mean pooling.

For each merged candidate of a query head (P = exp(s - lse), D = <do, o> - dlse):

    dP = <do, v_node>,   ds = P (dP - D)
    dq       += scale ds R(n-1)^T R(p) k_node            (one writer per (t, h): no atomics)
    dk_node  += scale ds R(p)^T R(n-1) q                  (float32 atomics, see below)
    dv_node  += P do                                      (float32 atomics)

Key and value gradients of the nodes go into float32 buffers over every layer (layer l's rows
[B, H_kv, N_l, D] one after another) with tl.atomic_add: which queries merge a node depends on every
query's selection, so there is no K-stationary order to visit them without an inverted index. The G
query heads of a KV head are reduced in registers first (one atomic per node row and item, not per
head). Then the pooling is undone top-down by _unpool_kernel: a child receives its parent's
gradient divided by the parent's child count, plus its own.

Everything between the launches is traceable (torch ops on sizes, no host synchronisation), so that
hccompile.lowering.htree traces the op into these launches under torch.compile (`wrap`).
"""
from __future__ import annotations

import torch

from .._triton import cdiv, direct, dot, interpreted, require_triton, tl, triton
from . import tiles
from .forward import launch_config
from .node_gradients import gradient_layout, node_gradients as write_node_gradients, selection_bitmasks
from .reference import HTreeConfig
from .tiles import (HTreePlan, candidate_tile, check_kernel_limits, int_table, load_values, make_plan,
                    num_programs, num_tree_layers, pool_tree, rank_select, rope_table, select_layer, tile_scores)

__all__ = ["htree_backward", "unpool_gradient"]


if triton is not None:

    @triton.jit
    def _gradient_layer(layer, is_top, n, q1, q2, do, lse, delta, parents_ptr, flags_ptr, bits_ptr, r,
                        k_ptr, stride_kt, stride_kd, v_ptr, stride_vt, stride_vd,
                        tree_k_ptr, tree_v_ptr, pooled_offset, dk_ptr, dv_ptr,
                        cos_ptr, sin_ptr, cols_k, KH, cols_v, V, scale, row_ok, dq1, dq2,
                        BLOCK_C: tl.constexpr, KEY_GRADS: tl.constexpr, FROM_RECORD: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr):
        """Gradients through the merged candidates of one layer; returns the updated dq halves.
        KEY_GRADS: also add the nodes' dk and dv (atomics) into the layer's rows at dk_ptr, dv_ptr
        (node n at row n); without it node_gradients.py does.
        FROM_RECORD: which candidates were selected comes from the forward's selections, as a
        bitmask over the layer's nodes at bits_ptr (this item's row), not from the flags row."""
        do_dot = do.to(DOT_DTYPE)
        for p0 in range(0, n, BLOCK_C):
            # tile_nodes' positions and nodes, computed here: torch's mutation analysis takes what a call
            # returns as derived from every pointer passed to it, and the atomics below store at these
            # nodes, so a call given parents_ptr (the forward's selections under FROM_RECORD, an input)
            # would count as writing it (tests/test_traced_launch.py). A loaded value is no address.
            positions = p0 + tl.arange(0, BLOCK_C)
            valid = positions < n
            parent = tl.load(parents_ptr + positions // r, mask=positions < tl.where(is_top == 0, n, 0), other=0)
            nodes = tl.where(is_top != 0, positions, parent * r + positions % r)
            qr1, qr2, kr1, kr2, cos_q, sin_q, cos_k, sin_k = candidate_tile(
                p0, n, nodes, valid, layer, q1, q2, k_ptr, stride_kt, stride_kd, tree_k_ptr,
                pooled_offset, cos_ptr, sin_ptr, cols_k, KH, BLOCK_C, DOT_DTYPE)
            scores = tile_scores(qr1, qr2, kr1, kr2, scale, DOT_PRECISION, UPCAST_OPERANDS)
            # Token layer: no selection. Above it, the flags of the candidates (positions < n), masked
            # by one block comparison: `valid & (layer > 0)` would splat a scalar condition into the
            # mask, which Triton's interpreter types as an integer (Triton 3.9's rejects such masks).
            above_tokens = positions < tl.where(layer > 0, n, 0)
            if FROM_RECORD:
                # Addresses in the row for masked positions too (see candidate_tile's clamp).
                byte = tl.load(bits_ptr + tl.where(above_tokens, nodes, 0) // 8, mask=above_tokens, other=0)
                selected = (byte.to(tl.int32) >> (nodes % 8)) & 1
            else:
                selected = tl.load(flags_ptr + positions, mask=above_tokens, other=0)
            merge = valid & (selected == 0)
            keep = row_ok[:, None] & merge[None, :]
            probs = tl.where(keep, tl.exp(tl.where(keep, scores - lse[:, None], 0.0)), 0.0)
            values = load_values(layer, nodes, merge, v_ptr, stride_vt, stride_vd, tree_v_ptr, pooled_offset, cols_v,
                                 V, DOT_DTYPE)
            dprobs = dot(do_dot, tl.trans(values.to(DOT_DTYPE)), DOT_PRECISION, UPCAST_OPERANDS)
            dscores = (probs * (dprobs - delta[:, None]) * scale).to(DOT_DTYPE)
            # Query side, rotated back by the tile's query rotation.
            dqr1 = dot(dscores, kr1, DOT_PRECISION, UPCAST_OPERANDS)
            dqr2 = dot(dscores, kr2, DOT_PRECISION, UPCAST_OPERANDS)
            dq1 += dqr1 * cos_q + dqr2 * sin_q
            dq2 += dqr2 * cos_q - dqr1 * sin_q
            if KEY_GRADS:
                # Key side, rotated back by each key's offset in the tile.
                dscores_t = tl.trans(dscores)
                dkr1 = dot(dscores_t, qr1, DOT_PRECISION, UPCAST_OPERANDS)
                dkr2 = dot(dscores_t, qr2, DOT_PRECISION, UPCAST_OPERANDS)
                dk1 = dkr1 * cos_k + dkr2 * sin_k
                dk2 = dkr2 * cos_k - dkr1 * sin_k
                dv = dot(tl.trans(probs.to(DOT_DTYPE)), do_dot, DOT_PRECISION, UPCAST_OPERANDS)
                rows = nodes.to(tl.int64)
                k_mask = merge[:, None] & (cols_k[None, :] < KH)
                k_offsets = rows[:, None] * (2 * KH) + cols_k[None, :]
                tl.atomic_add(dk_ptr + k_offsets, dk1, mask=k_mask)
                tl.atomic_add(dk_ptr + KH + k_offsets, dk2, mask=k_mask)
                v_mask = merge[:, None] & (cols_v[None, :] < V)
                tl.atomic_add(dv_ptr + rows[:, None] * V + cols_v[None, :], dv, mask=v_mask)
        return dq1, dq2

    @triton.jit
    def _htree_backward_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, do_ptr, dlse_ptr, tree_k_ptr, tree_v_ptr, layer_table_ptr,
        cos_ptr, sin_ptr, dq_ptr, dk_ptr, dv_ptr, delta_out_ptr, scores_ptr, keys_ptr, flags_ptr, parents_ptr,
        record_ptr, bits_ptr, bits_table_ptr,
        stride_qb, stride_qt, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_ob, stride_ot, stride_oh, stride_od,
        stride_dob, stride_dot, stride_doh, stride_dod,
        stride_dqb, stride_dqt, stride_dqh, stride_dqd,
        B, T, H_KV, G, KH, V, max_top_nodes, r, top_k, pooled_nodes, n_items, n_programs, scale,
        HAS_DLSE: tl.constexpr, CAUSAL: tl.constexpr, PACKED: tl.constexpr, INDEX_BITS: tl.constexpr,
        RECORD: tl.constexpr, KEY_GRADS: tl.constexpr, FROM_RECORD: tl.constexpr,
        G_PAD: tl.constexpr, KH_PAD: tl.constexpr, V_PAD: tl.constexpr,
        BLOCK_C: tl.constexpr, SELECT_PAD: tl.constexpr, RANK_SELECT: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
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
            v_mask = row_ok[:, None] & (cols_v[None, :] < V)
            o_rows = o_ptr + b.to(tl.int64) * stride_ob + t.to(tl.int64) * stride_ot
            out = tl.load(o_rows + heads[:, None] * stride_oh + cols_v[None, :] * stride_od, mask=v_mask,
                          other=0.0).to(tl.float32)
            do_rows = do_ptr + b.to(tl.int64) * stride_dob + t.to(tl.int64) * stride_dot
            do = tl.load(do_rows + heads[:, None] * stride_doh + cols_v[None, :] * stride_dod, mask=v_mask,
                         other=0.0).to(tl.float32)
            lse_rows = (b.to(tl.int64) * T + t) * (H_KV * G) + heads
            lse = tl.load(lse_ptr + lse_rows, mask=row_ok, other=0.0)
            # d lse / d s = P: a gradient into lse only shifts D.
            delta = tl.sum(do * out, axis=1)
            if HAS_DLSE:
                delta -= tl.load(dlse_ptr + lse_rows, mask=row_ok, other=0.0)
            if not KEY_GRADS:  # the node-gradient programs read it
                tl.store(delta_out_ptr + lse_rows, delta, mask=row_ok)
            k_item = k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh
            v_item = v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh
            tree_row = (b * H_KV + h).to(tl.int64) * pooled_nodes
            tree_k_item = tree_k_ptr + tree_row * (2 * KH)
            tree_v_item = tree_v_ptr + tree_row * V

            dq1 = tl.zeros([G_PAD, KH_PAD], tl.float32)
            dq2 = tl.zeros([G_PAD, KH_PAD], tl.float32)
            n_parents = t * 0
            for step in range(0, num_layers):
                layer = num_layers - 1 - step
                size = tl.load(layer_table_ptr + layer * 4)
                pooled_offset = tl.load(layer_table_ptr + layer * 4 + 1)
                all_offset = tl.load(layer_table_ptr + layer * 4 + 2)
                span = tl.load(layer_table_ptr + layer * 4 + 3).to(tl.int32)
                # The layer's node gradients [B, H_kv, size, D] start at row B * H_kv * all_offset.
                grad_row = B * H_KV * all_offset + (b * H_KV + h).to(tl.int64) * size
                rightmost = t // span
                is_top = 1 - tl.minimum(step, 1)
                n = tl.where(is_top != 0, rightmost + 1, (n_parents - 1) * r + rightmost % r + 1)
                if FROM_RECORD:
                    # This item's bitmask row of the layer's selections.
                    bits_row = (bits_ptr + tl.load(bits_table_ptr + layer * 2)
                                + ((b * H_KV + h).to(tl.int64) * T + t) * tl.load(bits_table_ptr + layer * 2 + 1))
                    # The parents are the forward's selection one layer up (ascending, as select_top_k
                    # writes them). The top layer reads none; its row index is clamped so that no
                    # address (a pipeliner's speculative load, see candidate_tile) leaves the record.
                    above = tl.minimum(layer + 1, num_layers - 1)
                    parents_prev = record_ptr + (((above * B + b).to(tl.int64) * T + t) * H_KV + h) * top_k
                else:
                    bits_row = bits_ptr  # unused
                    parents_prev = parents_row + ((step + 1) % 2) * top_k
                    parents_next = parents_row + (step % 2) * top_k
                    if layer > 0:
                        record_row = record_ptr + (((layer * B + b).to(tl.int64) * T + t) * H_KV + h) * top_k
                        select_layer(layer, is_top, n, top_k, q1, q2, parents_prev, parents_next, r,
                                     k_item, stride_kt, stride_kd, tree_k_item, pooled_offset,
                                     cos_ptr, sin_ptr, cols_k, KH, scale, row_ok, scores_row, keys_row, flags_row,
                                     record_row, CAUSAL, PACKED, INDEX_BITS, RECORD, G_PAD, BLOCK_C, SELECT_PAD,
                                     RANK_SELECT, DOT_DTYPE, DOT_PRECISION, UPCAST_OPERANDS)
                dq1, dq2 = _gradient_layer(
                    layer, is_top, n, q1, q2, do, lse, delta, parents_prev, flags_row, bits_row, r,
                    k_item, stride_kt, stride_kd, v_item, stride_vt, stride_vd,
                    tree_k_item, tree_v_item, pooled_offset, dk_ptr + grad_row * (2 * KH), dv_ptr + grad_row * V,
                    cos_ptr, sin_ptr, cols_k, KH, cols_v, V, scale, row_ok, dq1, dq2,
                    BLOCK_C, KEY_GRADS, FROM_RECORD, DOT_DTYPE, DOT_PRECISION, UPCAST_OPERANDS)
                n_parents = tl.minimum(n, top_k)

            dq_rows = dq_ptr + b.to(tl.int64) * stride_dqb + t.to(tl.int64) * stride_dqt
            dq_offsets = heads[:, None] * stride_dqh + cols_k[None, :] * stride_dqd
            tl.store(dq_rows + dq_offsets, dq1.to(dq_ptr.dtype.element_ty), mask=q_mask)
            tl.store(dq_rows + KH * stride_dqd + dq_offsets, dq2.to(dq_ptr.dtype.element_ty), mask=q_mask)
            tl.debug_barrier()

    @triton.jit
    def _unpool_kernel(grad_ptr, grad_table_ptr, layer_table_ptr, out_ptr,
                       stride_ob, stride_ot, stride_oh, stride_od,
                       B, T, H_KV, D, r, max_top_nodes, blocks,
                       BLOCK_T: tl.constexpr, D_PAD: tl.constexpr):
        """The tokens' gradients [B, T, H_kv, D] from every layer's node gradients, BLOCK_T tokens of one
        (batch, KV head) per program: top-down, a node's gradient reaches each of its c existing
        children divided by c. Layer l's node gradients are the partial sums of its query splits,
        [splits, B, H_kv, N_l, D] rows of grad_ptr from grad_table's row l (first row, splits if l is the
        top layer, splits if it is below), added in split order."""
        pid = tl.program_id(0)
        bh = pid // blocks
        b = bh // H_KV
        h = bh % H_KV
        t = (pid % blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, D_PAD)
        t_ok = t < T
        mask = t_ok[:, None] & (cols[None, :] < D)
        token = tl.where(t_ok, t, 0).to(tl.int64)  # in-bounds addresses for the masked rows too
        num_layers = num_tree_layers(T, r, max_top_nodes)
        acc = tl.zeros([BLOCK_T, D_PAD], tl.float32)
        for step in range(0, num_layers):
            layer = num_layers - 1 - step
            size = tl.load(layer_table_ptr + layer * 4)
            node = token // tl.load(layer_table_ptr + layer * 4 + 3)
            if step > 0:  # the gradient of the parent (one layer up), spread over its children
                count = tl.minimum(size - (node // r) * r, r).to(tl.float32)
                acc = acc / count[:, None]
            first = tl.load(grad_table_ptr + layer * 3)
            splits = tl.load(grad_table_ptr + layer * 3 + tl.where(step == 0, 1, 2))
            grad = tl.zeros([BLOCK_T, D_PAD], tl.float32)
            for split in range(0, splits):
                rows = first + ((split * B + b) * H_KV + h).to(tl.int64) * size + node
                grad += tl.load(grad_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
            acc = grad + acc
        out = (out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + token[:, None] * stride_ot
               + cols[None, :] * stride_od)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)

else:
    _htree_backward_kernel = _unpool_kernel = None


# Tokens per unpooling program.
UNPOOL_TOKENS = 32


def unpool_gradient(grads: torch.Tensor, grad_table: torch.Tensor, plan: HTreePlan, like: torch.Tensor, r: int,
                    max_top_nodes: int, wrap=direct) -> torch.Tensor:
    """Gradients of every layer's nodes (grads [rows, D] float32, gradient_layout's rows; grad_table its
    (first row, splits as the top layer, splits below it) per layer) -> of the tokens, [B, T, H_kv, D] in
    `like`'s dtype: top-down, a node's gradient reaches each of its c existing children divided by c
    (one _unpool_kernel launch)."""
    batch, time, kv_heads, dim = like.shape
    out = torch.empty((batch, time, kv_heads, dim), dtype=like.dtype, device=like.device)
    blocks = cdiv(time, UNPOOL_TOKENS)
    wrap(_unpool_kernel)[(batch * kv_heads * blocks,)](
        grads, grad_table, plan.layer_table, out, *out.stride(), batch, time, kv_heads, dim, r, max_top_nodes,
        blocks, BLOCK_T=UNPOOL_TOKENS, D_PAD=max(16, 1 << max(0, (dim - 1).bit_length())),
    )
    return out


def _require_triton(device: torch.device) -> None:
    require_triton(device, _htree_backward_kernel, "hccompile.kernels.htree.backward", "htree_attention_ref")


def htree_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    cfg: HTreeConfig,
    dlse: torch.Tensor | None = None,
    *,
    block_c: int | None = None,
    record_selections: bool = False,
    node_gradients: bool | None = None,
    selections: torch.Tensor | None = None,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv) in the inputs' dtypes, and with record_selections the selections the backward
    recomputed ([L, B, T, H_kv, top_k], as htree_forward records them).

    selections: the forward's (htree_forward(record_selections=True), or its record_out: [S, B, T,
    H_kv, top_k] with S >= L); given, the backward selects nothing again, reads them (and returns them
    as its record).

    node_gradients (default tiles.NODE_GRADIENTS): the nodes' dk and dv node-stationary from the
    recorded selections (node_gradients.py) instead of the float32 atomics of this kernel.

    o, lse: the forward's outputs for these inputs and this cfg (same block_c); do [B, T, H, V];
    dlse [B, T, H] optional gradient into lse. `wrap`: torch.library.wrap_triton when the launches are
    traced for Inductor; T may then be symbolic (tiles.make_plan plans for every length).
    """
    check_kernel_limits(q, k, v, cfg)
    _require_triton(q.device)
    wrap = wrap or direct
    batch, time, heads, key_dim = q.shape
    kv_heads, value_dim = k.shape[2], v.shape[3]
    group = heads // kv_heads
    r, top_k = cfg.compression_rate, cfg.top_k
    dq = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    if batch * time * heads == 0:
        return dq, torch.zeros_like(k), torch.zeros_like(v), None
    plan = make_plan(time, group, key_dim, value_dim, cfg, q.device, block_c)
    tree_k = pool_tree(k, plan, r, wrap)
    tree_v = pool_tree(v, plan, r, wrap)
    cos, sin = rope_table(plan, key_dim, cfg.rope_base, q.device)
    items = batch * kv_heads * time
    is_interpreted = interpreted(_htree_backward_kernel)
    programs = num_programs(plan, q.device, items, is_interpreted)
    from_record = selections is not None
    # The selection's scratch rows per program; reading the forward's selections needs none.
    rows = 1 if from_record else programs
    scores = torch.empty((rows, group, plan.select_pad), dtype=torch.float32, device=q.device)
    keys = torch.empty((rows, plan.select_pad), dtype=torch.int32, device=q.device)
    flags = torch.empty((rows, plan.select_pad), dtype=torch.int32, device=q.device)
    parents = torch.empty((rows, 2 * top_k), dtype=torch.int32, device=q.device)
    if node_gradients is None:
        node_gradients = tiles.NODE_GRADIENTS
    # Every layer's node gradients, float32 rows: the atomics add into zeros; node-stationary programs
    # write each element once: poisoned, so a node left unwritten fails the tests.
    layout, grad_rows = gradient_layout(plan, batch, kv_heads, q.device, is_interpreted, node_gradients, r)
    fill = float("nan") if node_gradients else 0.0
    dk_nodes = torch.full((grad_rows, key_dim), fill, dtype=torch.float32, device=q.device)
    dv_nodes = torch.full((grad_rows, value_dim), fill, dtype=torch.float32, device=q.device)
    grad_table = int_table([row[:3] for row in layout], q.device)
    record = None
    if from_record:
        expected = (batch, time, kv_heads, top_k)
        slots = selections.shape[0] if selections.dim() == 5 else 0
        if (selections.dim() != 5 or tuple(selections.shape[1:]) != expected or selections.dtype != torch.int32
                or (not isinstance(slots, torch.SymInt) and not plan.depth <= slots <= max(plan.depth, 2))):
            raise ValueError(f"selections: expected int32 {(plan.depth, *expected)} (the forward's record), got "
                             f"{selections.dtype} {tuple(selections.shape)}")
        record = selections.contiguous()
    elif record_selections or node_gradients:
        record = torch.full((plan.record_slots, batch, time, kv_heads, top_k), -1, dtype=torch.int32,
                            device=q.device)
    bits, bits_table = keys, plan.layer_table  # placeholders: read only when FROM_RECORD
    lse = lse.float().contiguous()
    if dlse is not None:
        dlse = dlse.float().contiguous()
    if from_record:
        bits, bits_table = selection_bitmasks(record, plan, r, cfg.max_top_nodes, wrap)
    # delta = <do, o> - dlse per (query, head), which the dq kernel computes in registers anyway: it
    # writes it for the node-gradient programs (in torch it took float32 copies of do and o: 6 GB
    # of transients at T 128K, HQ 32).
    delta = torch.full_like(lse, float("nan")) if node_gradients else lse
    wrap(_htree_backward_kernel)[(programs,)](
        q, k, v, o, lse, do, dlse if dlse is not None else lse, tree_k, tree_v, plan.layer_table,
        cos, sin, dq, dk_nodes, dv_nodes, delta, scores, keys, flags, parents, record if record is not None else keys,
        bits, bits_table,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(),
        batch, time, kv_heads, group, key_dim // 2, value_dim, cfg.max_top_nodes, r, top_k,
        plan.pooled_rows, items, programs, cfg.scale,
        HAS_DLSE=dlse is not None, CAUSAL=cfg.causal, PACKED=cfg.sort_mode == "packed",
        INDEX_BITS=plan.index_bits, RECORD=record is not None and not from_record, KEY_GRADS=not node_gradients,
        FROM_RECORD=from_record,
        G_PAD=plan.g_pad, KH_PAD=plan.kh_pad,
        V_PAD=plan.v_pad, BLOCK_C=plan.block_c, SELECT_PAD=plan.select_pad,
        RANK_SELECT=rank_select(plan, is_interpreted),
        num_warps=plan.num_warps, **launch_config(q),
    )
    if node_gradients:
        if not from_record:  # the dq kernel has recorded them now
            bits, bits_table = selection_bitmasks(record, plan, r, cfg.max_top_nodes, wrap)
        write_node_gradients(q, k, v, do, lse, delta, tree_k, tree_v, cos, sin, record, bits, bits_table, plan, r,
                             top_k, cfg.max_top_nodes, cfg.scale, layout, dk_nodes, dv_nodes, launch_config(q), wrap)
    dk = unpool_gradient(dk_nodes, grad_table, plan, k, r, cfg.max_top_nodes, wrap)
    dv = unpool_gradient(dv_nodes, grad_table, plan, v, r, cfg.max_top_nodes, wrap)
    return dq, dk, dv, record if record_selections else None
