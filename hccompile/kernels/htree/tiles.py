"""Triton pieces shared by the htree forward and backward kernels, and the host-side plan they run.

Both kernels walk one (batch, KV head, query position) work item at a time through the tree, top
layer first, over the candidate buffer of that layer in tiles of BLOCK_C buffer positions. The
same helpers compute the scores, the per-head log-sum-exp, the shared-GQA importance and the
top-k selection in both kernels, with the same tile sizes and warp counts, so that the backward
recomputes exactly the selection the forward made (nothing per layer is stored between them).

RoPE: the score of the candidate at buffer position p is scale * <R(n-1) q, R(p) k>. A tile
starting at p0 rotates the query by n-1-p0 and each key by its offset p-p0 < BLOCK_C inside the
tile, which gives the same dot product (rotations compose) while the key-side table stays one
small [BLOCK_C, K/2] block. Rows of the cos/sin table are computed in float64 on the host.

Selection: for a layer above the tokens, pass A computes each head's log-sum-exp over the
candidates (the rightmost one left out when causal), pass B writes the importance of every
candidate as an int32 sort key into the work item's scratch row, and the selection loads the
whole row into registers and finds the top_k-th largest key by a 31-step bitwise search (radix
select): the keys of non-negative floats order like their bit patterns. Keys equal to that
threshold are ties, resolved towards the smaller buffer position (an exclusive prefix count),
which is the stable descending sort of the reference. Exact mode: the key is the float32
importance (the rightmost candidate +inf). Packed mode: the seed's key, the importance with its
low INDEX_BITS bits replaced by ~position (the rightmost candidate 1e3); all keys then differ.
The selected nodes are compacted, ascending, into the scratch parents row of the next layer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .._triton import cdiv, direct, dot, tl, triton
from .reference import HTreeConfig, htree_layer_sizes, packed_index_bits, rope_cos_sin

__all__ = [
    "MAX_HEAD_DIM",
    "MAX_SELECT_WIDTH",
    "SUPPORTED_DTYPES",
    "HTreePlan",
    "check_kernel_limits",
    "make_plan",
    "max_layers",
    "pool_tree",
    "selection_slots",
    "tree_depth",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# The selection holds one layer's keys in registers: 16384 int32 over 8 warps is 64 per thread.
MAX_SELECT_WIDTH = 16384
# Tile of the candidate buffer, warps per program and persistent programs per SM (each owns a scratch
# row for the selection). A walk is latency-bound (one query's tiles one after another), so what pays
# is walks in flight. H100, bf16, K=V=128, G=8, T 32K, 1024 candidates per layer (htree-tune, 59b735c):
# 64 / 4 / 4 give a forward of 112 ms and fwd+bwd of 301 ms, against 190 / 433 ms at 32 / 8 / 2 and
# 169 / 405 at 16 / 4 / 4; H200 (779e58a): 128-wide tiles 233 ms forward, 8 warps 155, 2 or 8 programs
# per SM as 4. The public regime's 8192-wide selection too (H200, T 128K forward): 2.67 s, against
# 5.16 s at 32 / 8 / 2 and 3.28 s at 32 / 4 / 4. ptxas reports spills at 4 warps (the selection's keys,
# the tiles); they cost less than the idle SMs they replace. The forward and the backward must use the
# same tile to select the same nodes: both take it from make_plan.
DEFAULT_BLOCK_C = 64
DEFAULT_NUM_WARPS = 4
PROGRAMS_PER_SM = 4
# tl.dot needs every block dim to be at least 16.
MIN_DOT_DIM = 16
# The backward's node (key and value) gradients: node-stationary from the selections
# (node_gradients.py), or float32 atomics from every query (False). Node-stationary is the default:
# H100, bf16, T 32K, r 16, top_k 64: fwd+bwd 433 ms against 852 ms with atomics, and 2.12 s against
# 4.50 s at 128K (benchmarks/results/htree_2026-11-27_h100x1_59b735c.jsonl).
# HCCOMPILE_HTREE_NODE_GRADIENTS=0 selects the atomics.
NODE_GRADIENTS = os.environ.get("HCCOMPILE_HTREE_NODE_GRADIENTS", "1") != "0"
INTERPRETER_PROGRAMS = 4
# Plan every call as a traced one is planned (for every length: the deepest tree's layers, the widths'
# bounds; make_plan). Tests set it so that the interpreter runs the launch plans that on the GPU only
# compiled graphs (torch.compile(dynamic=True)) use.
PLAN_EVERY_LENGTH = False
# Under the interpreter, widths up to this select by counting ranks (fewer, larger ops) instead
# of the 31-step search the GPU runs; both select the same. Tests set it to 0 to run the search.
INTERPRETER_RANK_SELECT_WIDTH = 256
EXACT_FORCED_KEY = 0x7F800000  # bits of float32 +inf
PACKED_FORCED_IMPORTANCE = 1000.0  # the seed's forced importance of the rightmost candidate
if tl is not None:
    _EXACT_FORCED_KEY = tl.constexpr(EXACT_FORCED_KEY)
    _PACKED_FORCED_IMPORTANCE = tl.constexpr(PACKED_FORCED_IMPORTANCE)


def _pow2(value: int, minimum: int = MIN_DOT_DIM) -> int:
    return max(minimum, 1 << max(0, (int(value) - 1).bit_length()))


def _concrete(size):
    """`size` as an int where it has one value (a SymInt that the shape environment fixed)."""
    if isinstance(size, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        if is_concrete_int(size):
            return int(size)
    return size


def max_layers(cfg: HTreeConfig) -> int:
    """Layers of the deepest tree the kernels take: check_kernel_limits bounds T * top_k below 2**31."""
    return len(htree_layer_sizes(max(1, (2**31 - 1) // cfg.top_k), cfg.compression_rate, cfg.max_top_nodes))


def tree_depth(time, r: int, max_top_nodes: int, layers: int):
    """The tree's depth L (htree_layer_sizes' length) for `time` tokens, if it is at most `layers`: 1
    plus one term min(1, max(0, N_l - max_top_nodes)) per layer that could grow another above it. For
    a symbolic T (a call traced under torch.compile(dynamic=True)) that is an expression of T, not a
    guard on each depth's threshold (T <= max_top_nodes * r^l), so one graph serves every length."""
    depth, size = 1, time
    for _ in range(1, layers):
        depth = depth + torch.sym_min(1, torch.sym_max(0, size - max_top_nodes))
        size = (size + r - 1) // r
    return depth


def selection_slots(time, cfg: HTreeConfig):
    """Layers of the ops' selections [slots, B, T, H_kv, top_k]: the depth L (slot 0, the tokens, stays
    -1), at least 2. A size that can be 1 would make torch ask whether it is (a traced launch clones
    what it writes, and the clone's layout depends on it): a guard on T's depth thresholds."""
    time = _concrete(time)
    if isinstance(time, torch.SymInt):
        depth = tree_depth(time, cfg.compression_rate, cfg.max_top_nodes, max_layers(cfg))
    else:
        depth = len(htree_layer_sizes(time, cfg.compression_rate, cfg.max_top_nodes))
    return torch.sym_max(depth, 2)


def int_table(rows: list[tuple], device) -> torch.Tensor:
    """An int64 device table of ints or SymInts. Ints are copied to the device at once; a table with
    SymInts (a traced launch plan) is built by torch.full per entry, each an expression of the sizes
    (torch.tensor would fix every symbol at its traced value)."""
    if all(isinstance(value, int) for row in rows for value in row):
        return torch.tensor(rows, dtype=torch.int64, device=device)
    return torch.stack([torch.stack([torch.full((), value, dtype=torch.int64, device=device) for value in row])
                        for row in rows])


@dataclass(frozen=True)
class HTreePlan:
    """Everything the launchers derive from the shapes and the configuration.

    A symbolic T (a traced call) plans for every length at once (every_length): `layers` is then the
    deepest tree's (max_layers) and `depth` an expression of T; sizes and offsets are SymInts, the
    kernels compute the depth themselves (num_tree_layers) and read the first `depth` rows of the
    tables, and the widths that must be compile-time constants (the selection's, the RoPE table's) are
    their bounds over every depth. A concrete T plans its own tree: layers == depth."""

    every_length: bool
    depth: object  # L: int, or a SymInt of T
    layers: int  # rows of the tables
    layer_sizes: tuple  # N_0 = T, ..., N_{layers-1}: ceil(T / r^l)
    pooled_offsets: tuple  # each layer's first row in the pooled buffer (layers >= 1)
    all_offsets: tuple  # each layer's offset over all layers, tokens included
    layer_table: torch.Tensor  # int64 [layers, 4]: size, offset in the pooled buffer, offset over all layers, r^l
    pooled_nodes: object  # rows of the pooled layers (layers >= 1)
    pooled_rows: object  # rows of the pooled buffer per (batch, KV head): pooled_nodes, at least 1 (2 traced)
    all_nodes: object  # rows over every layer, tokens included
    select_width: int  # widest candidate buffer of a layer that selects (0: no such layer)
    table_rows: object
    g_pad: int
    kh_pad: int
    v_pad: int
    select_pad: int
    block_c: int
    num_warps: int
    programs_per_sm: int
    index_bits: int

    @property
    def record_slots(self):
        """Layers of the selections a launch records itself: L, at least 2 when planned for every
        length (selection_slots)."""
        return torch.sym_max(self.depth, 2) if self.every_length else self.depth


def make_plan(time, group: int, key_dim: int, value_dim: int, cfg: HTreeConfig, device,
              block_c: int | None = None) -> HTreePlan:
    r, top_k, max_top_nodes = cfg.compression_rate, cfg.top_k, cfg.max_top_nodes
    block_c = DEFAULT_BLOCK_C if block_c is None else block_c
    time = _concrete(time)
    every_length = isinstance(time, torch.SymInt) or PLAN_EVERY_LENGTH
    if every_length:
        layers = max_layers(cfg)
        depth = tree_depth(time, r, max_top_nodes, layers)
        # Bounds over every depth: the top layer offers at most max_top_nodes candidates (T of them in
        # a one-layer tree), every other layer top_k * r.
        select_width = max(max_top_nodes if layers > 1 else 0, top_k * r if layers > 2 else 0)
        table_rows = max(max_top_nodes, top_k * r, block_c) if layers > 1 else torch.sym_max(time, block_c)
    else:
        sizes = htree_layer_sizes(time, r, max_top_nodes)
        layers = depth = len(sizes)
        # Candidate widths: the top layer offers up to its node count, every other layer top_k * r.
        widths = [sizes[-1] if layer == layers - 1 else top_k * r for layer in range(layers)]
        select_width = max(widths[1:], default=0)
        table_rows = max(max(widths), block_c)
    sizes, pooled_offsets, all_offsets, rows = [time], [], [], []
    for _ in range(1, layers):
        sizes.append((sizes[-1] + r - 1) // r)
    pooled = all_nodes = 0
    for layer, size in enumerate(sizes):
        pooled_offsets.append(pooled if layer > 0 else 0)
        all_offsets.append(all_nodes)
        rows.append((size, pooled_offsets[-1], all_nodes, r**layer))
        if layer > 0:
            pooled = pooled + size
        all_nodes = all_nodes + size
    pooled_rows = torch.sym_max(pooled, 2) if every_length and layers > 1 else max(pooled, 1)
    select_pad = _pow2(select_width) if select_width else MIN_DOT_DIM
    return HTreePlan(
        every_length=every_length,
        depth=depth,
        layers=layers,
        layer_sizes=tuple(sizes),
        pooled_offsets=tuple(pooled_offsets),
        all_offsets=tuple(all_offsets),
        layer_table=int_table(rows, device),
        pooled_nodes=pooled,
        pooled_rows=pooled_rows,
        all_nodes=all_nodes,
        select_width=select_width,
        table_rows=table_rows,
        g_pad=_pow2(group),
        kh_pad=_pow2(key_dim // 2),
        v_pad=_pow2(value_dim),
        select_pad=select_pad,
        block_c=block_c,
        num_warps=DEFAULT_NUM_WARPS,
        programs_per_sm=PROGRAMS_PER_SM,
        index_bits=packed_index_bits(r, top_k, max_top_nodes),
    )


def check_kernel_limits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: HTreeConfig) -> None:
    """Limits of the Triton kernels beyond the reference's (resolve_htree_config) checks."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {tensor.dtype} is not supported by the htree kernels "
                            f"(float16, bfloat16, float32)")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim K={q.shape[3]} exceeds the kernels' maximum {MAX_HEAD_DIM}")
    if v.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"v: head dim V={v.shape[3]} exceeds the kernels' maximum {MAX_HEAD_DIM}")
    if v.shape[3] < 1:
        raise ValueError(f"v: head dim V must be at least 1, got {v.shape[3]}")
    time = _concrete(q.shape[1])
    if isinstance(time, torch.SymInt):  # every length at once (make_plan): the widths' bounds
        layers, top = max_layers(cfg), f"up to {cfg.max_top_nodes}"
        top_width = cfg.max_top_nodes
    else:
        sizes = htree_layer_sizes(time, cfg.compression_rate, cfg.max_top_nodes)
        layers, top, top_width = len(sizes), sizes[-1], sizes[-1]
    if layers > 1 and top_width > MAX_SELECT_WIDTH:
        raise ValueError(f"max_top_nodes: the top layer has {top} nodes; the kernels select among "
                         f"at most {MAX_SELECT_WIDTH} candidates (lower max_top_nodes)")
    if layers > 2 and cfg.top_k * cfg.compression_rate > MAX_SELECT_WIDTH:
        raise ValueError(f"top_k*compression_rate: {cfg.top_k * cfg.compression_rate} candidates per layer "
                         f"exceed the kernels' maximum {MAX_SELECT_WIDTH}")
    if q.shape[1] * max(1, q.shape[0]) * k.shape[2] >= 2**31:
        raise ValueError(f"q: B*T*H_kv={q.shape[0] * q.shape[1] * k.shape[2]} work items exceed int32")
    if q.shape[1] * cfg.top_k >= 2**31:  # node_gradients.selection_index packs t * top_k + rank in int32
        raise ValueError(f"top_k: T*top_k={q.shape[1] * cfg.top_k} exceeds int32 (the inverted index's entries)")


def rope_table(plan: HTreePlan, key_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_cos_sin(plan.table_rows, key_dim, base, torch.float32, device)
    return cos.contiguous(), sin.contiguous()


# Nodes per program of the pooling kernel.
POOL_NODES = 32


def pool_tree(x: torch.Tensor, plan: HTreePlan, r: int, wrap=direct) -> torch.Tensor:
    """Pooled layers 1..L-1 of x [B, T, H_kv, D] as one float32 buffer [B, H_kv, pooled_rows, D], layer l
    at rows pooled_offsets[l].

    A node is the mean of its existing children one layer down (a ragged tail's parent is the mean
    of its children's means), computed in float32 as the reference does for half inputs: one launch
    of _pool_kernel per layer. `wrap`: torch.library.wrap_triton when the launches are traced.
    """
    batch, _, kv_heads, dim = x.shape
    tree = torch.empty((batch, kv_heads, plan.pooled_rows, dim), dtype=torch.float32, device=x.device)
    for layer in range(1, plan.layers):
        size = plan.layer_sizes[layer]
        blocks = cdiv(size, POOL_NODES)
        wrap(_pool_kernel)[(batch * kv_heads * blocks,)](
            x, tree, *x.stride(), kv_heads, dim, r, plan.pooled_offsets[layer - 1], plan.layer_sizes[layer - 1],
            plan.pooled_offsets[layer], size, plan.pooled_rows, blocks,
            FROM_TOKENS=layer == 1, BLOCK_N=POOL_NODES, D_PAD=_pow2(dim, 1),
        )
    return tree


def num_programs(plan: HTreePlan, device: torch.device, items, interpreted: bool):
    """Persistent programs for `items` work items (at least 1): torch.sym_min keeps a symbolic count
    (a traced call) an expression of the sizes."""
    if interpreted or device.type != "cuda":
        return torch.sym_max(1, torch.sym_min(items, INTERPRETER_PROGRAMS))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.sym_max(1, torch.sym_min(items, sms * plan.programs_per_sm))


def rank_select(plan: HTreePlan, is_interpreted: bool) -> bool:
    return is_interpreted and plan.select_pad <= INTERPRETER_RANK_SELECT_WIDTH


def dot_dtype(dtype: torch.dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


if triton is not None:

    @triton.jit
    def num_tree_layers(T, r, max_top_nodes):
        """The tree's depth L for T tokens (htree_layer_sizes' length), in the kernel: a traced launch
        plans for every length, so its tables hold the deepest tree's layers and the kernels read the
        first L rows."""
        size = (tl.program_id(0) * 0 + T).to(tl.int64)
        depth = tl.program_id(0) * 0 + 1
        while size > max_top_nodes:
            size = (size + r - 1) // r
            depth += 1
        return depth

    @triton.jit
    def _pool_kernel(x_ptr, tree_ptr, stride_xb, stride_xt, stride_xh, stride_xd, H_KV, D, r, child_offset,
                     child_size, offset, size, pooled_rows, blocks,
                     FROM_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):
        """One pooled layer of one (batch, KV head), BLOCK_N nodes per program: node p is the mean of its
        existing children p*r .. p*r + r-1 one layer down (the tokens x, or the pooled layer at rows
        child_offset of tree_ptr), summed in float32 in child order."""
        pid = tl.program_id(0)
        bh = pid // blocks
        nodes = (pid % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, D_PAD)
        node_ok = nodes < size
        col_ok = cols < D
        b = bh // H_KV
        h = bh % H_KV
        tree_rows = tree_ptr + bh.to(tl.int64) * pooled_rows * D
        total = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        for c in range(0, r):
            child = nodes * r + c
            exists = node_ok & (child < child_size)
            child = tl.where(exists, child, 0).to(tl.int64)  # in-bounds addresses for the masked rows too
            mask = exists[:, None] & col_ok[None, :]
            if FROM_TOKENS:
                ptrs = (x_ptr + b.to(tl.int64) * stride_xb + h * stride_xh + child[:, None] * stride_xt
                        + cols[None, :] * stride_xd)
            else:
                ptrs = tree_rows + (child_offset + child)[:, None] * D + cols[None, :]
            total += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        count = tl.maximum(tl.minimum(child_size - nodes * r, r), 1).to(tl.float32)
        out_rows = (offset + tl.where(node_ok, nodes, 0)).to(tl.int64)
        tl.store(tree_rows + out_rows[:, None] * D + cols[None, :], total / count[:, None],
                 mask=node_ok[:, None] & col_ok[None, :])

    @triton.jit
    def load_values(layer, nodes, mask_rows, v_ptr, stride_vt, stride_vd, tree_v_ptr, pooled_offset, cols_v, V,
                    DOT_DTYPE: tl.constexpr):
        """Values [BLOCK_C, V_PAD] of the given nodes, in the dot dtype (zeros where masked)."""
        mask = mask_rows[:, None] & (cols_v[None, :] < V)
        rows = nodes[:, None].to(tl.int64)
        if layer == 0:
            token_ptrs = v_ptr + rows * stride_vt + cols_v[None, :] * stride_vd
            values = tl.load(token_ptrs, mask=mask, other=0.0).to(DOT_DTYPE)
        else:
            node_ptrs = tree_v_ptr + (pooled_offset + rows) * V + cols_v[None, :]
            values = tl.load(node_ptrs, mask=mask, other=0.0).to(DOT_DTYPE)
        return values

    @triton.jit
    def tile_nodes(p0, n, is_top, parents_ptr, r, BLOCK_C: tl.constexpr):
        """Buffer positions p0.., whether they are candidates, and their node indices.

        Top layer: node = position. Lower layers: position j*r + c is child c of the j-th parent
        selected one layer up (ascending in the scratch parents row).
        """
        positions = p0 + tl.arange(0, BLOCK_C)
        valid = positions < n
        # valid below the top layer, nothing at the top, as one block comparison: `valid & (is_top == 0)`
        # would splat a scalar condition into the mask, which Triton's interpreter types as an integer
        # (Triton 3.9's rejects such masks).
        parent = tl.load(parents_ptr + positions // r, mask=positions < tl.where(is_top == 0, n, 0), other=0)
        nodes = tl.where(is_top != 0, positions, parent * r + positions % r)
        return positions, valid, nodes

    @triton.jit
    def candidate_tile(p0, n, nodes, valid, layer, q1, q2,
                       k_ptr, stride_kt, stride_kd, tree_k_ptr, pooled_offset,
                       cos_ptr, sin_ptr, cols_k, KH,
                       BLOCK_C: tl.constexpr, DOT_DTYPE: tl.constexpr):
        """The rotated query and key halves of one tile of the candidate buffer (positions p0..;
        `nodes`, `valid`: tile_nodes' for it), ready for tl.dot, and the rotations, which the
        backward needs to rotate gradients back.

        Layer 0 reads the token keys (input dtype, strided); pooled layers the float32 tree.
        The caller takes the tile's positions and nodes from tile_nodes, not from here: torch's
        mutation analysis takes what a call returns as derived from every pointer passed to it, so
        a store at a position returned by a call given k would count as a write to k, an input,
        which Inductor would copy before every launch (tests/kernels/test_launch_writes.py).
        """
        mask = valid[:, None] & (cols_k[None, :] < KH)
        rows = nodes[:, None].to(tl.int64)
        # Names assigned in both branches must have one type: the pointers differ, so two names.
        if layer == 0:
            token_ptrs = k_ptr + rows * stride_kt + cols_k[None, :] * stride_kd
            k1 = tl.load(token_ptrs, mask=mask, other=0.0).to(tl.float32)
            k2 = tl.load(token_ptrs + KH * stride_kd, mask=mask, other=0.0).to(tl.float32)
        else:
            node_ptrs = tree_k_ptr + (pooled_offset + rows) * (2 * KH) + cols_k[None, :]
            k1 = tl.load(node_ptrs, mask=mask, other=0.0)
            k2 = tl.load(node_ptrs + KH, mask=mask, other=0.0)
        # The query at n-1 and the key at p, both moved by -p0: the same dot product. The key
        # side is the table's first BLOCK_C rows, reloaded per tile (cached) to spare registers.
        k_rows = tl.arange(0, BLOCK_C)[:, None] * KH + cols_k[None, :]
        k_mask = (tl.arange(0, BLOCK_C)[:, None] >= 0) & (cols_k[None, :] < KH)
        cos_k = tl.load(cos_ptr + k_rows, mask=k_mask, other=0.0)
        sin_k = tl.load(sin_ptr + k_rows, mask=k_mask, other=0.0)
        # Clamped at 0: Triton's software pipeliner runs this tile for iterations past the loop's end
        # (p0 >= n) with only the loop-invariant column mask below (an scf.if it speculates takes its
        # condition ANDed with the stage predicate, so this branch runs in every layer), and an unclamped
        # row went up to 1 KiB below the cos/sin tables: the intermittent illegal memory access of the
        # forward on the H100 (read from the sm_90 TTGIR/PTX of Triton 3.6 and 3.9, session 22). Real
        # iterations have p0 <= n - 1, so this changes nothing there.
        q_row = tl.maximum(n - 1 - p0, 0) * KH + cols_k
        cos_q = tl.load(cos_ptr + q_row, mask=cols_k < KH, other=0.0)[None, :]
        sin_q = tl.load(sin_ptr + q_row, mask=cols_k < KH, other=0.0)[None, :]
        qr1 = (q1 * cos_q - q2 * sin_q).to(DOT_DTYPE)
        qr2 = (q1 * sin_q + q2 * cos_q).to(DOT_DTYPE)
        kr1 = (k1 * cos_k - k2 * sin_k).to(DOT_DTYPE)
        kr2 = (k1 * sin_k + k2 * cos_k).to(DOT_DTYPE)
        return qr1, qr2, kr1, kr2, cos_q, sin_q, cos_k, sin_k

    @triton.jit
    def tile_scores(qr1, qr2, kr1, kr2, scale, DOT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr):
        """scale * <R(n-1) q, R(p) k>: scores [G_PAD, BLOCK_C] in float32."""
        scores = dot(qr1, tl.trans(kr1), DOT_PRECISION, UPCAST_OPERANDS)
        scores += dot(qr2, tl.trans(kr2), DOT_PRECISION, UPCAST_OPERANDS)
        return scores * scale

    @triton.jit
    def safe_max(m):
        """A finite shift for exp(): rows with nothing yet (-inf) use 0."""
        return tl.where(m == float("-inf"), 0.0, m)

    @triton.jit
    def score_layer(layer, is_top, n, q1, q2, parents_ptr, r,
                    k_ptr, stride_kt, stride_kd, tree_k_ptr, pooled_offset,
                    cos_ptr, sin_ptr, cols_k, KH, scale, row_ok, scores_ptr,
                    CAUSAL: tl.constexpr, G_PAD: tl.constexpr, BLOCK_C: tl.constexpr, SELECT_PAD: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr):
        """Pass A: every candidate's scores into the scratch rows scores_ptr[g * SELECT_PAD + p]
        (the importance and the merge read them back: each key tile is loaded once), and each
        head's log-sum-exp over the candidates (causal: without the rightmost)."""
        g_rows = tl.arange(0, G_PAD)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        for p0 in range(0, n, BLOCK_C):
            positions, valid, nodes = tile_nodes(p0, n, is_top, parents_ptr, r, BLOCK_C)
            qr1, qr2, kr1, kr2, cos_q, sin_q, cos_k, sin_k = candidate_tile(
                p0, n, nodes, valid, layer, q1, q2, k_ptr, stride_kt, stride_kd, tree_k_ptr,
                pooled_offset, cos_ptr, sin_ptr, cols_k, KH, BLOCK_C, DOT_DTYPE)
            scores = tile_scores(qr1, qr2, kr1, kr2, scale, DOT_PRECISION, UPCAST_OPERANDS)
            tl.store(scores_ptr + g_rows[:, None] * SELECT_PAD + positions[None, :], scores,
                     mask=row_ok[:, None] & valid[None, :])
            in_lse = valid
            if CAUSAL:
                in_lse = in_lse & (positions != n - 1)
            scores = tl.where(in_lse[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            shift = safe_max(m_new)
            total = total * tl.exp(m - shift) + tl.sum(tl.exp(scores - shift[:, None]), axis=1)
            m = m_new
        return tl.where(total > 0, m + tl.log(tl.maximum(total, 1e-30)), float("-inf"))

    @triton.jit
    def load_scores(scores_ptr, positions, valid, row_ok, G_PAD: tl.constexpr, SELECT_PAD: tl.constexpr):
        """Scores [G_PAD, BLOCK_C] that pass A stored (zeros outside the heads and candidates)."""
        g_rows = tl.arange(0, G_PAD)
        return tl.load(scores_ptr + g_rows[:, None] * SELECT_PAD + positions[None, :],
                       mask=row_ok[:, None] & valid[None, :], other=0.0)

    @triton.jit
    def store_keys(n, lse, row_ok, scores_ptr, keys_ptr,
                   CAUSAL: tl.constexpr, PACKED: tl.constexpr, INDEX_BITS: tl.constexpr, G_PAD: tl.constexpr,
                   BLOCK_C: tl.constexpr, SELECT_PAD: tl.constexpr):
        """Pass B: the int32 sort key of every candidate's shared importance, into keys_ptr[p]."""
        for p0 in range(0, n, BLOCK_C):
            positions = p0 + tl.arange(0, BLOCK_C)
            valid = positions < n
            scores = load_scores(scores_ptr, positions, valid, row_ok, G_PAD, SELECT_PAD)
            rightmost = positions == n - 1
            in_lse = valid
            if CAUSAL:
                in_lse = in_lse & (positions != n - 1)
            # Masked before exp(): a row whose lse is over nothing (-inf) would give +inf.
            keep = row_ok[:, None] & in_lse[None, :]
            shifted = tl.where(keep, scores - lse[:, None], float("-inf"))
            importance = tl.sum(tl.exp(shifted), axis=0)
            if PACKED:
                importance = tl.where(rightmost, _PACKED_FORCED_IMPORTANCE, importance)
                bits = importance.to(tl.int32, bitcast=True)
                keys = (bits & ~((1 << INDEX_BITS) - 1)) | (~positions & ((1 << INDEX_BITS) - 1))
            else:
                keys = tl.where(rightmost, _EXACT_FORCED_KEY, importance.to(tl.int32, bitcast=True))
            tl.store(keys_ptr + positions, keys, mask=valid)

    @triton.jit
    def select_top_k(n, is_top, top_k, keys_ptr, flags_ptr, parents_ptr, next_parents_ptr, r,
                     record_ptr, RECORD: tl.constexpr, SELECT_PAD: tl.constexpr, RANK_SELECT: tl.constexpr):
        """Top-k of the keys (ties to the smaller position): flags per position, and the selected
        nodes ascending in next_parents_ptr[0 .. min(top_k, n)) (and record_ptr when RECORD).

        RANK_SELECT (small widths under the interpreter, where every op is slow) counts, for each
        candidate, the candidates that sort before it; it selects exactly what the search does.
        """
        positions = tl.arange(0, SELECT_PAD)
        valid = positions < n
        keys = tl.load(keys_ptr + positions, mask=valid, other=-1)
        if RANK_SELECT:
            before = (keys[None, :] > keys[:, None]) | (
                (keys[None, :] == keys[:, None]) & (positions[None, :] < positions[:, None]))
            selected = valid & (tl.sum(before.to(tl.int32), axis=1) < top_k)
        else:
            # Largest threshold with at least top_k keys >= it: the top_k-th largest key (0 when
            # fewer than top_k candidates; invalid keys are -1 and never count).
            threshold = n * 0
            for bit in range(30, -1, -1):
                trial = threshold | (1 << bit)
                count = tl.sum((keys >= trial).to(tl.int32), axis=0)
                threshold = tl.where(count >= top_k, trial, threshold)
            above = keys > threshold
            ties = (keys == threshold).to(tl.int32)
            room = top_k - tl.sum(above.to(tl.int32), axis=0)
            tie_rank = tl.cumsum(ties, axis=0) - ties
            selected = above | ((ties != 0) & (tie_rank < room))
        rank = tl.cumsum(selected.to(tl.int32), axis=0) - 1
        # selected below the top layer, nothing at the top (no scalar splat, as in tile_nodes).
        below_top = positions < tl.where(is_top == 0, SELECT_PAD, 0)
        parent = tl.load(parents_ptr + positions // r, mask=selected & below_top, other=0)
        nodes = tl.where(is_top != 0, positions, parent * r + positions % r)
        tl.store(next_parents_ptr + rank, nodes, mask=selected)
        tl.store(flags_ptr + positions, selected.to(tl.int32), mask=valid)
        if RECORD:
            tl.store(record_ptr + rank, nodes, mask=selected)

    @triton.jit
    def select_layer(layer, is_top, n, top_k, q1, q2, parents_ptr, next_parents_ptr, r,
                     k_ptr, stride_kt, stride_kd, tree_k_ptr, pooled_offset,
                     cos_ptr, sin_ptr, cols_k, KH, scale, row_ok, scores_ptr, keys_ptr, flags_ptr, record_ptr,
                     CAUSAL: tl.constexpr, PACKED: tl.constexpr, INDEX_BITS: tl.constexpr,
                     RECORD: tl.constexpr, G_PAD: tl.constexpr, BLOCK_C: tl.constexpr, SELECT_PAD: tl.constexpr,
                     RANK_SELECT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     UPCAST_OPERANDS: tl.constexpr):
        """Passes A and B and the selection of one layer above the tokens. Barriers: the scratch
        rows are written and read by different threads of the program."""
        tl.debug_barrier()  # the layer above may still be reading the scores row
        lse = score_layer(layer, is_top, n, q1, q2, parents_ptr, r, k_ptr, stride_kt, stride_kd, tree_k_ptr,
                          pooled_offset, cos_ptr, sin_ptr, cols_k, KH, scale, row_ok, scores_ptr,
                          CAUSAL, G_PAD, BLOCK_C, SELECT_PAD, DOT_DTYPE, DOT_PRECISION, UPCAST_OPERANDS)
        tl.debug_barrier()
        store_keys(n, lse, row_ok, scores_ptr, keys_ptr, CAUSAL, PACKED, INDEX_BITS, G_PAD, BLOCK_C, SELECT_PAD)
        tl.debug_barrier()
        select_top_k(n, is_top, top_k, keys_ptr, flags_ptr, parents_ptr, next_parents_ptr, r,
                     record_ptr, RECORD, SELECT_PAD, RANK_SELECT)
        # The flags and the next parents are read next by other threads: the merge of this layer
        # reads the flags, and the layer below (the token layer has no select_layer, hence no
        # leading barrier) reads the parents. (fd8f791 doubled this barrier against the forward's
        # out-of-bounds reads; Triton merges two adjacent barriers into one, and the reads were the
        # pipeliner's speculative RoPE rows, see candidate_tile.)
        tl.debug_barrier()

else:
    num_tree_layers = _pool_kernel = None
    load_values = tile_nodes = candidate_tile = tile_scores = safe_max = None
    score_layer = load_scores = store_keys = select_top_k = select_layer = None
