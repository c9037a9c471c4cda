"""Key and value gradients of the tree's nodes, node-stationary, from the selections: no atomics.

The query-stationary backward (backward.py) adds every (query, merged candidate) pair's dk and dv
into the node buffers with float32 atomics: at T 32K, r 16, top_k 64 that is about 2 000
candidates x 256 columns per query and KV head, 67 G atomic adds per step, most of them on the
token layer. Here each node's gradient has one writer, which loops over the queries that merged it:

* the top layer: node s is a candidate of every query t with s <= t // span (span = r^layer); a
  program takes a block of BLOCK_N consecutive nodes and walks the queries from the block's first
  one on, in tiles of QUERIES queries;
* a layer l below: node s is a candidate of t when its parent j (one layer up) is in t's selection
  there; a program takes one parent, its r children, and walks the queries that selected j: an
  inverted index (CSR, built here with torch from the recorded selections) lists them, each with
  j's rank in that selection (the children's buffer positions are rank * r + c).

Where those programs are few (the top layer: B * H_kv * ceil(top nodes / BLOCK_N) of them; a layer
whose parents are few), each group's query range is cut into `splits` contiguous parts, one program
each, that write partial sums which backward._unpool_kernel adds (query_splits).

A candidate merges (contributes here) unless it was itself selected, which a bitmask of each
selecting layer's selections [B, H_kv, T, nodes / 8] answers. The rows of one tile's dots are the
QUERIES x G_ROWS (query, head) pairs; the scores, probabilities and gradients are those of
backward.py's `_gradient_layer`, with the query rotated per row (each query has its own position
n - 1 and tile start rank * r) and the key by its child offset c.

Memory beyond the query-stationary backward: the selections [S, B, T, H_kv, top_k] int32 (S: the
depth, at least 2) that the dq kernel records, one int32 CSR entry per (query, selected node) and the
bitmasks. selection_bits and selection_index are the per-layer torch versions of the bitmask kernel
and of inverted_index (tests compare them).
"""
from __future__ import annotations

import torch

from .._triton import direct, dot, tl, triton
from .tiles import HTreePlan, int_table, num_tree_layers

__all__ = ["gradient_layout", "inverted_index", "node_gradients", "query_splits", "selection_bitmasks",
           "selection_bits", "selection_index"]

# Queries per tile, as rows of the dots: QUERIES * G_ROWS of them (G_ROWS = G rounded up to a power
# of two). H200, T 32K, G 8 (779e58a): fwd+bwd 280 ms at 128 rows, 301 at 64.
TILE_ROWS = 128
# Entries that selection_index sorts at once (its int64 order: 256 MB).
SORT_ENTRIES = 1 << 25
# Transient bytes of the int64 indices that selection_bits scatters at once.
STAGING_BYTES = 256 << 20
# Warps per node-gradient program: at 4, 64 rows x K 128 spill 64-232 bytes on sm_90 (compile_check).
NODE_WARPS = 8
# Programs per SM that query_splits aims for on a layer whose groups are few (its query ranges are
# then split over several programs): TARGET_PROGRAMS_PER_SM * multiprocessors in all.
TARGET_PROGRAMS_PER_SM = 4
# The multiprocessors query_splits assumes under the interpreter or off CUDA: few, so that the
# interpreter's small tests split the top layer's queries too.
INTERPRETER_SMS = 2


if triton is not None:

    @triton.jit
    def _node_gradients_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, tree_k_ptr, tree_v_ptr, layer_table_ptr, cos_ptr, sin_ptr,
        offsets_ptr, entries_ptr, bits_ptr, bits_table_ptr, dk_ptr, dv_ptr,
        stride_qb, stride_qt, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_dob, stride_dot, stride_doh, stride_dod,
        B, T, H_KV, G, KH, V, max_top_nodes, layer, r, top_k, pooled_nodes, groups, splits, grad_base,
        index_rows, index_nodes, scale,
        TOKENS: tl.constexpr, IS_TOP: tl.constexpr, SELECTS: tl.constexpr, G_ROWS: tl.constexpr,
        QUERIES: tl.constexpr,
        BLOCK_N: tl.constexpr, KH_PAD: tl.constexpr, V_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr,
    ):
        # One program: (batch, KV head, group, split), a group being a block of top nodes or one parent,
        # a split one of the `splits` parts of the group's queries. The layer's role (IS_TOP: the top
        # layer, else one below it) holds when T's depth (read here) gives it: a traced launch plans
        # for every depth, launching both roles for each layer of the deepest tree, and a program whose
        # role the layer has not has no nodes and no queries.
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        pid = tl.program_id(0)
        split = pid % splits
        group = (pid // splits) % groups
        h = (pid // (splits * groups)) % H_KV
        b = pid // (splits * groups * H_KV)
        num_layers = num_tree_layers(T, r, max_top_nodes)
        if IS_TOP:
            role = layer == num_layers - 1
        else:
            role = layer < num_layers - 1
        size = tl.load(layer_table_ptr + layer * 4).to(tl.int32)
        pooled_offset = tl.load(layer_table_ptr + layer * 4 + 1)
        span = tl.load(layer_table_ptr + layer * 4 + 3).to(tl.int32)
        c = tl.arange(0, BLOCK_N)
        # Masks as block comparisons with scalar bounds: a scalar condition splatted into a mask is typed
        # as an integer by Triton's interpreter (Triton 3.9's rejects such masks).
        if IS_TOP:
            first = group * BLOCK_N
            node_ok = (first + c) < tl.where(role, size, 0)
        else:
            first = group * r
            node_ok = (c < r) & ((first + c) < tl.where(role, size, 0))
        nodes = first + c
        cols_k = tl.arange(0, KH_PAD)
        cols_v = tl.arange(0, V_PAD)

        # The block's keys and values, rotated by each node's offset c in the tile: loaded once.
        k_mask = node_ok[:, None] & (cols_k[None, :] < KH)
        v_mask = node_ok[:, None] & (cols_v[None, :] < V)
        node_rows = tl.where(node_ok, nodes, 0)[:, None].to(tl.int64)  # in bounds for the masked rows too
        tree_row = (b * H_KV + h).to(tl.int64) * pooled_nodes + pooled_offset
        if TOKENS:
            token_k = k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh + node_rows * stride_kt
            k1 = tl.load(token_k + cols_k[None, :] * stride_kd, mask=k_mask, other=0.0).to(tl.float32)
            k2 = tl.load(token_k + (KH + cols_k[None, :]) * stride_kd, mask=k_mask, other=0.0).to(tl.float32)
            token_v = v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh + node_rows * stride_vt
            values = tl.load(token_v + cols_v[None, :] * stride_vd, mask=v_mask, other=0.0).to(DOT_DTYPE)
        else:
            node_k = tree_k_ptr + (tree_row + node_rows) * (2 * KH)
            k1 = tl.load(node_k + cols_k[None, :], mask=k_mask, other=0.0)
            k2 = tl.load(node_k + KH + cols_k[None, :], mask=k_mask, other=0.0)
            values = tl.load(tree_v_ptr + (tree_row + node_rows) * V + cols_v[None, :], mask=v_mask,
                             other=0.0).to(DOT_DTYPE)
        table_k = c[:, None] * KH + cols_k[None, :]
        table_k_mask = k_mask  # rows c < r <= the table's rows (top: c < the top layer's width)
        cos_k = tl.load(cos_ptr + table_k, mask=table_k_mask, other=0.0)
        sin_k = tl.load(sin_ptr + table_k, mask=table_k_mask, other=0.0)
        kr1 = (k1 * cos_k - k2 * sin_k).to(DOT_DTYPE)
        kr2 = (k1 * sin_k + k2 * cos_k).to(DOT_DTYPE)

        # The queries: the top layer's from the block's first node on; a lower layer's from the index
        # (inverted_index's layout: row `layer` * B + b of KV head h lists the parents one layer up,
        # read at a valid address whatever the depth); none where the role does not hold.
        if IS_TOP:
            begin = tl.where(role, first * span, 0)
            end = tl.where(role, T, 0)
        else:
            parent = (h * index_rows + layer * B + b).to(tl.int64) * index_nodes + group
            begin = tl.where(role, tl.load(offsets_ptr + tl.where(role, parent, 0)), 0)
            end = tl.where(role, tl.load(offsets_ptr + tl.where(role, parent + 1, 0)), 0)
        # This split's share: whole tiles of the range, `splits` contiguous parts of nearly equal
        # tile counts (possibly none); one split: all of it.
        tiles = (end - begin + QUERIES - 1) // QUERIES
        lo = begin + (split * tiles // splits) * QUERIES
        hi = tl.minimum(begin + ((split + 1) * tiles // splits) * QUERIES, end)
        rows = tl.arange(0, QUERIES * G_ROWS)
        g = rows % G_ROWS
        head_ok = g < G
        head = h * G + tl.minimum(g, G - 1)  # padded rows address a real head (they are masked)
        dkr1 = tl.zeros([BLOCK_N, KH_PAD], tl.float32)
        dkr2 = tl.zeros([BLOCK_N, KH_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, V_PAD], tl.float32)
        for e0 in range(lo, hi, QUERIES):
            entry = e0 + rows // G_ROWS
            row_ok = (entry < hi) & head_ok
            if IS_TOP:
                # Clamped: rows past T are masked, but their addresses must stay in bounds too (a
                # pipeliner's speculative load, see tiles.candidate_tile).
                t = tl.minimum(entry, T - 1).to(tl.int32)
                tile_start = t * 0 + first  # buffer positions are node indices at the top
            else:
                listed = tl.where(entry < hi, entry, lo)  # an address in the list for masked rows
                packed = tl.load(entries_ptr + listed, mask=row_ok, other=0)  # t * top_k + rank
                t = packed // top_k
                tile_start = (packed % top_k) * r
            # n - 1, the query's buffer position at this layer: the top offers t // span + 1
            # candidates, each layer below (parents kept - 1) * r + its own offset + 1.
            top_span = tl.load(layer_table_ptr + (num_layers - 1) * 4 + 3).to(tl.int32)
            n = t // top_span + 1
            for step in range(1, num_layers - layer):
                below_span = tl.load(layer_table_ptr + (num_layers - 1 - step) * 4 + 3).to(tl.int32)
                n = (tl.minimum(n, top_k) - 1) * r + (t // below_span) % r + 1
            # Clamped at 0 as in candidate_tile: masked rows must not read before the table.
            angle = tl.maximum(n - 1 - tile_start, 0)
            q_mask = row_ok[:, None] & (cols_k[None, :] < KH)
            q_rows = (q_ptr + b.to(tl.int64) * stride_qb + t.to(tl.int64)[:, None] * stride_qt
                      + head[:, None] * stride_qh)
            q1 = tl.load(q_rows + cols_k[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
            q2 = tl.load(q_rows + (KH + cols_k[None, :]) * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
            table_q = angle[:, None] * KH + cols_k[None, :]
            cos_q = tl.load(cos_ptr + table_q, mask=q_mask, other=0.0)
            sin_q = tl.load(sin_ptr + table_q, mask=q_mask, other=0.0)
            qr1 = (q1 * cos_q - q2 * sin_q).to(DOT_DTYPE)
            qr2 = (q1 * sin_q + q2 * cos_q).to(DOT_DTYPE)
            scores = dot(qr1, tl.trans(kr1), DOT_PRECISION, UPCAST_OPERANDS)
            scores += dot(qr2, tl.trans(kr2), DOT_PRECISION, UPCAST_OPERANDS)
            scores = scores * scale
            # Merged: a candidate (s <= t // span) of this layer that t did not select.
            merge = row_ok[:, None] & node_ok[None, :] & (nodes[None, :] <= (t // span)[:, None])
            if SELECTS:  # this layer's bitmask rows (selection_bitmasks' table: byte offset, bytes per query)
                bit_bytes = tl.load(bits_table_ptr + layer * 2 + 1)
                bit_rows = tl.load(bits_table_ptr + layer * 2) + ((b * H_KV + h).to(tl.int64) * T + t) * bit_bytes
                in_row = tl.where(node_ok, nodes, 0) // 8  # in bounds for the masked columns too
                byte = tl.load(bits_ptr + bit_rows[:, None] + in_row[None, :], mask=merge, other=0)
                merge = merge & (((byte.to(tl.int32) >> (nodes % 8)[None, :]) & 1) == 0)
            stat_rows = (b.to(tl.int64) * T + t) * (H_KV * G) + head
            lse = tl.load(lse_ptr + stat_rows, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + stat_rows, mask=row_ok, other=0.0)
            probs = tl.where(merge, tl.exp(tl.where(merge, scores - lse[:, None], 0.0)), 0.0)
            do_mask = row_ok[:, None] & (cols_v[None, :] < V)
            do_rows = (do_ptr + b.to(tl.int64) * stride_dob + t.to(tl.int64)[:, None] * stride_dot
                       + head[:, None] * stride_doh)
            do = tl.load(do_rows + cols_v[None, :] * stride_dod, mask=do_mask, other=0.0).to(DOT_DTYPE)
            dprobs = dot(do, tl.trans(values), DOT_PRECISION, UPCAST_OPERANDS)
            dscores_t = tl.trans((probs * (dprobs - delta[:, None]) * scale).to(DOT_DTYPE))
            dkr1 += dot(dscores_t, qr1, DOT_PRECISION, UPCAST_OPERANDS)
            dkr2 += dot(dscores_t, qr2, DOT_PRECISION, UPCAST_OPERANDS)
            dv += dot(tl.trans(probs.to(DOT_DTYPE)), do, DOT_PRECISION, UPCAST_OPERANDS)

        # Rotated back by each node's offset, as backward.py's key side. An empty share stores zeros.
        dk1 = dkr1 * cos_k + dkr2 * sin_k
        dk2 = dkr2 * cos_k - dkr1 * sin_k
        # This split's row of the layer's partial sums [splits, B, H_kv, size, D], at row grad_base.
        grad_rows = grad_base + ((split * B + b) * H_KV + h).to(tl.int64) * size + node_rows
        tl.store(dk_ptr + grad_rows * (2 * KH) + cols_k[None, :], dk1, mask=k_mask)
        tl.store(dk_ptr + grad_rows * (2 * KH) + KH + cols_k[None, :], dk2, mask=k_mask)
        tl.store(dv_ptr + grad_rows * V + cols_v[None, :], dv, mask=v_mask)

    @triton.jit
    def _selection_bits_kernel(record_ptr, bits_ptr, bits_table_ptr, B, T, H_KV, top_k, r, max_top_nodes,
                               BLOCK_K: tl.constexpr):
        """Every selecting layer's bitmask row of one (batch, query, KV head): bit n of row
        ((b * H_kv + h) * T + t) of layer l (at bits_table's byte offset, of its bytes per query) is set
        when the query selected node n there (record [S, B, T, H_kv, top_k], ascending, -1 padded; the
        rows start zeroed). The selected nodes of a byte are neighbours in the record's row (at most 8,
        ascending), so each entry ORs its neighbours' bits of its byte in registers and stores the whole
        byte: entries sharing one store the same value, no atomics."""
        item = tl.program_id(0)
        h = item % H_KV
        t = (item // H_KV) % T
        b = item // (H_KV * T)
        num_layers = num_tree_layers(T, r, max_top_nodes)
        near = tl.arange(0, 16) - 7  # the entries i-7 .. i+8 around entry i
        for layer in range(1, num_layers):
            row = record_ptr + (((layer * B + b).to(tl.int64) * T + t) * H_KV + h) * top_k
            bit_row = (bits_ptr + tl.load(bits_table_ptr + layer * 2)
                       + ((b * H_KV + h).to(tl.int64) * T + t) * tl.load(bits_table_ptr + layer * 2 + 1))
            for i0 in range(0, top_k, BLOCK_K):
                i = i0 + tl.arange(0, BLOCK_K)
                node = tl.load(row + tl.minimum(i, top_k - 1), mask=i < top_k, other=-1)
                j = i[:, None] + near[None, :]
                inside = (j >= 0) & (j < top_k)
                neighbour = tl.load(row + tl.minimum(tl.maximum(j, 0), top_k - 1), mask=inside, other=-1)
                same = (neighbour >= 0) & (neighbour // 8 == node[:, None] // 8)
                byte = tl.sum(tl.where(same, 1 << (tl.maximum(neighbour, 0) % 8), 0), axis=1)
                tl.store(bit_row + tl.maximum(node, 0) // 8, byte.to(tl.uint8), mask=node >= 0)

else:
    _node_gradients_kernel = _selection_bits_kernel = None


def selection_bits(selected: torch.Tensor, nodes: int) -> torch.Tensor:
    """[B, T, H_kv, top_k] node indices (-1: none) -> [B, H_kv, T, ceil(nodes / 8)] uint8 bitmasks."""
    batch, time, kv_heads, top_k = selected.shape
    width = (nodes + 7) // 8
    out = torch.zeros((batch, kv_heads, time, width), dtype=torch.uint8, device=selected.device)
    # A block of queries at a time: scatter_add_ wants int64 indices, 8 bytes per (query, selected
    # node), 2 GB at once in the public regime at T 128K (H_kv 4, top_k 512).
    step = max(1, STAGING_BYTES // max(1, batch * kv_heads * top_k * 8 * 2))
    for t0 in range(0, time, step):
        chosen = selected[:, t0 : t0 + step].permute(0, 2, 1, 3).long()
        valid = chosen >= 0
        index = torch.where(valid, chosen // 8, 0)
        bit = torch.where(valid, 1 << (chosen % 8), 0).to(torch.uint8)
        # A query selects a node at most once, so adding the bits is or-ing them (no carries).
        out[:, :, t0 : t0 + step].scatter_add_(3, index, bit)
    return out


def selection_index(selected: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverted index of one layer's selections [B, T, H_kv, top_k] (node indices, -1 none): for each
    (b, h, node j), the queries t that selected j, ascending, each with j's rank in its selection.

    Returns offsets [B * H_kv * (nodes + 1)] int64: node j of slice i = b * H_kv + h owns the entries
    offsets[i * (nodes + 1) + j] .. offsets[i * (nodes + 1) + j + 1]; and entries [B * H_kv * T * top_k]
    int32, each t * top_k + rank (check_kernel_limits bounds T * top_k below 2**31). A slice's unused
    slots sort to its end. Sorted a few slices at a time (at most SORT_ENTRIES entries), so that the
    sort's transients (its int64 order above all) stay bounded: all slices at once took 2 GB more in
    the public regime at T 128K. Fixed shapes, no boolean indexing: nothing waits for the GPU."""
    batch, time, kv_heads, top_k = selected.shape
    device = selected.device
    per_slice = time * top_k
    offsets = torch.empty(batch * kv_heads * (nodes + 1), dtype=torch.int64, device=device)
    entries = torch.empty(batch * kv_heads * per_slice, dtype=torch.int32, device=device)
    heads = max(1, min(kv_heads, SORT_ENTRIES // max(1, per_slice)))
    for b in range(batch):
        for h0 in range(0, kv_heads, heads):
            count = min(heads, kv_heads - h0)
            first = b * kv_heads + h0
            chosen = selected[b, :, h0 : h0 + count].permute(1, 0, 2).reshape(count, per_slice)  # (t, rank) order
            # Slice-local keys: slice ls's nodes at ls * (nodes + 1) + j, its unused slots at + nodes.
            # Stable: within a node, queries stay ascending.
            shift = torch.arange(count, device=device, dtype=torch.int32)[:, None] * (nodes + 1)
            keys, order = torch.sort((torch.where(chosen >= 0, chosen, nodes) + shift).flatten(), stable=True)
            # Node j's entries start where the sorted keys reach j (no bincount: it reads the maximum back).
            bounds = (shift + torch.arange(nodes + 1, device=device, dtype=torch.int32)).flatten()
            offsets[first * (nodes + 1) : (first + count) * (nodes + 1)] = (
                torch.searchsorted(keys, bounds) + first * per_slice)
            entries[first * per_slice : (first + count) * per_slice] = order % per_slice
    return offsets, entries


def query_splits(programs, device: torch.device, interpreted: bool):
    """Parts to cut each group's query range into, for a layer of `programs` groups over all (batch,
    KV head) slices: 1 (each program writes its nodes' gradients) when they fill TARGET_PROGRAMS_PER_SM
    programs per multiprocessor, else enough parts to reach about that many: ceil(target / programs),
    which a symbolic program count (a traced call) keeps an expression.

    A group's program walks its queries one tile after another, so a layer of few groups is latency-
    bound: H200, B 1, T 32K, HQ 32, H_kv 4, D 128, r 16, top_k 64 (08794b7): the top layer's 32 programs
    (each walking every query from its block's first on) took 24.9 ms and layer 1's 512 (one per parent,
    ~16K queries each) 42.0 ms, against 37.8 ms for the 8192 of the token layer, on 132 SMs.
    From the shapes only: nothing waits for the GPU."""
    if interpreted or device.type != "cuda":
        sms = INTERPRETER_SMS
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    target = TARGET_PROGRAMS_PER_SM * sms
    return (target + programs - 1) // programs


def block_nodes(r: int) -> int:
    """Top-layer nodes per node-gradient program (a power of two >= 16, >= r)."""
    return max(16, 1 << max(0, (r - 1).bit_length()))


def gradient_layout(plan: HTreePlan, batch, kv_heads: int, device: torch.device, interpreted: bool,
                    node_stationary: bool, r: int) -> tuple[list[tuple], object]:
    """Where each layer's node gradients go in one float32 buffer of rows (dk [rows, K], dv [rows, V]),
    and the node-gradient launches that write them. Per layer: (first row, splits if it is the top
    layer, splits if it is below it, launches [(is_top, groups, splits)]); and the rows in all. Layer l
    holds [splits, B, H_kv, N_l] rows, the partial sums of its query splits (the atomics' backward:
    one split, no launch).

    Groups: the top layer's blocks of block_nodes(r) nodes, or one per parent below it. A plan for
    every length does not know which layer is the top: it launches both roles for each layer (the
    kernel reads the depth; the role a layer has not writes nothing), their partial sums in one block
    of the larger split count."""
    layout, rows = [], 0
    for layer, size in enumerate(plan.layer_sizes):
        if not node_stationary:
            layout.append((rows, 1, 1, []))
            rows = rows + batch * kv_heads * size
            continue
        roles = (True, False) if plan.every_length else (layer == plan.depth - 1,)
        launches = []
        for is_top in roles:
            width = block_nodes(r) if is_top else r
            groups = (size + width - 1) // width
            launches.append((is_top, groups, query_splits(batch * kv_heads * groups, device, interpreted)))
        splits = {is_top: count for is_top, _, count in launches}
        top, below = splits.get(True, splits.get(False)), splits.get(False, splits.get(True))
        layout.append((rows, top, below, launches))
        rows = rows + torch.sym_max(top, below) * batch * kv_heads * size
    return layout, rows


def selection_bitmasks(record: torch.Tensor, plan: HTreePlan, r: int, max_top_nodes: int, wrap=direct
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every selecting layer's bitmasks (selection_bits' rows) in one uint8 buffer, and a table [layers,
    2] int64 of (byte offset, bytes per query) per layer; layer 0 selects nothing: (0, 0). Layer l's
    rows [B, H_kv, T, ceil(N_l / 8)] start at its offset. One launch of _selection_bits_kernel; a layer
    that the tree has not (a traced plan's layers past the depth) takes no bytes."""
    _, batch, time, kv_heads, top_k = record.shape
    rows, offset = [(0, 0)], 0
    for layer in range(1, plan.layers):
        width = (plan.layer_sizes[layer] + 7) // 8
        rows.append((offset, width))
        selects = torch.sym_min(1, torch.sym_max(0, plan.layer_sizes[layer - 1] - max_top_nodes))
        offset = offset + selects * batch * kv_heads * time * width
    symbolic = any(isinstance(x, torch.SymInt) for row in rows for x in row) or isinstance(offset, torch.SymInt)
    bits = torch.zeros(torch.sym_max(offset, 2) if symbolic else max(offset, 1), dtype=torch.uint8,
                       device=record.device)
    table = int_table(rows, record.device)
    if plan.layers > 1:
        block = min(64, max(16, 1 << max(0, (top_k - 1).bit_length())))
        wrap(_selection_bits_kernel)[(batch * time * kv_heads,)](
            record, bits, table, batch, time, kv_heads, top_k, r, max_top_nodes, BLOCK_K=block)
    return bits, table


def inverted_index(record: torch.Tensor, nodes, whole: bool = False) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Inverted index of every selecting layer's selections at once: record [S, B, T, H_kv, top_k]
    (slot s >= 1: layer s's selected nodes, -1 none; slot 0 is not read) -> for each KV head h, row
    i = (s - 1) * B + b and node j < `nodes` (the widest selecting layer's node count), the queries t
    that selected j, ascending, each with j's rank in its selection.

    Returns (offsets int64 [H_kv * R * (nodes + 1)]: row i of head h owns entries offsets[(h * R + i)
    * (nodes + 1) + j] .. that + 1; entries int32 [H_kv * R * T * top_k], each t * top_k + rank; R).
    A row's unused slots sort to its end. One stable sort per KV head: of every row at once when the
    sizes are symbolic or `whole` (a traced call: no Python loop over a symbolic count, no tensor with a
    size that can be 1), else of row blocks of at most SORT_ENTRIES entries. The arrays are flat so that no size
    torch reasons about can be 1 (its layout would depend on it: a guard on the depth). Fixed shapes, no
    boolean indexing: nothing waits for the GPU."""
    slots, batch, time, kv_heads, top_k = record.shape
    device = record.device
    per_row = time * top_k
    rows = (slots - 1) * batch
    stride = nodes + 1
    symbolic = any(isinstance(x, torch.SymInt) for x in (rows, per_row, stride))
    if not symbolic and rows == 0:  # a one-layer tree's record: nothing selected
        return torch.zeros(2, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int32, device=device), 1
    symbolic = symbolic or whole
    selected = record.view(slots * batch * time, kv_heads, top_k)[batch * time:]  # slots 1 ..
    block = rows if symbolic else max(1, min(rows, SORT_ENTRIES // max(1, per_row)))
    offsets, entries = [], []
    for h in range(kv_heads):
        for first in ([0] if symbolic else range(0, rows, block)):
            count = rows if symbolic else min(block, rows - first)
            chosen = (selected[:, h] if symbolic else selected[first * time:(first + count) * time, h]).reshape(-1)
            # Row-local keys: row i's nodes at i * (nodes + 1) + j, its unused slots at + nodes. Stable: within
            # a node, queries stay ascending.
            row = torch.arange(count * per_row, device=device) // per_row
            keys, order = torch.sort(row * stride + torch.where(chosen >= 0, chosen, nodes), stable=True)
            base = (h * rows + first) * per_row
            offsets.append(torch.searchsorted(keys, torch.arange(count * stride, device=device)) + base)
            entries.append((order % per_row).to(torch.int32))
    return torch.cat(offsets), torch.cat(entries), rows


def node_gradients(q, k, v, do, lse, delta, tree_k, tree_v, cos, sin, record, bits, bits_table, plan: HTreePlan,
                   r: int, top_k: int, max_top_nodes: int, scale: float, layout: list, dk_nodes: torch.Tensor,
                   dv_nodes: torch.Tensor, launch: dict, wrap=direct) -> None:
    """Writes every layer's node gradients into dk_nodes [rows, K] and dv_nodes [rows, V] (float32, at
    gradient_layout's rows: the partial sums of each layer's query splits), from the selections
    `record` [S, B, T, H_kv, top_k] (the forward's, or those the dq kernel recorded) and their bitmasks
    (selection_bitmasks: buffer and table); lse, delta [B, T, H] float32 (delta = <do, o> - dlse).

    Each element is written by one program (a split's share of a group's queries, zeros for none);
    unpool_gradient adds the splits in a fixed order: deterministic from run to run. The launches are
    gradient_layout's: one per layer, two (one per role) in a plan for every length."""
    batch, time, heads, key_dim = q.shape
    kv_heads, value_dim = k.shape[2], v.shape[3]
    group_size = heads // kv_heads
    g_rows = 1 << max(0, (group_size - 1).bit_length())
    queries_per_tile = max(1, TILE_ROWS // g_rows)
    # tl.dot needs 16 rows at least.
    queries_per_tile = max(queries_per_tile, -(-16 // g_rows))
    # The lower layers' parents are at most layer 1's nodes.
    offsets, entries, index_rows = inverted_index(record, plan.layer_sizes[1] if plan.layers > 1 else 1,
                                                  whole=plan.every_length)
    index_nodes = (plan.layer_sizes[1] if plan.layers > 1 else 1) + 1
    for layer, (first_row, _, _, launches) in enumerate(layout):
        for is_top, groups, splits in launches:
            wrap(_node_gradients_kernel)[(batch * kv_heads * groups * splits,)](
                q, k, v, do, lse, delta, tree_k, tree_v, plan.layer_table, cos, sin,
                offsets, entries, bits, bits_table, dk_nodes, dv_nodes,
                *q.stride(), *k.stride(), *v.stride(), *do.stride(),
                batch, time, kv_heads, group_size, key_dim // 2, value_dim, max_top_nodes, layer, r, top_k,
                plan.pooled_rows, groups, splits, first_row, index_rows, index_nodes, scale,
                TOKENS=layer == 0, IS_TOP=is_top, SELECTS=layer > 0, G_ROWS=g_rows, QUERIES=queries_per_tile,
                BLOCK_N=block_nodes(r), KH_PAD=plan.kh_pad, V_PAD=plan.v_pad, num_warps=NODE_WARPS, **launch,
            )
