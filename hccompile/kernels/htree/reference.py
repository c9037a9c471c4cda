"""Vectorised PyTorch reference for htree attention (seed 003), forward and autograd backward.

Layout is FLA's: q [B, T, H, K], k [B, T, H_kv, K], v [B, T, H_kv, V], output [B, T, H, V]; query
head h = h_kv * G + g with G = H // H_kv. Per layer, every query position is processed at once
(batched gathers over a fixed-width candidate buffer); only layers and chunks of query positions
are Python loops. Work is about T * top_k * r * (G + 1) * (K + V) per KV head and layer: T of a few
thousand with top_k * r of a few hundred runs on a CPU in seconds.

Semantics (seed 003, decisions shared with `transcription.py`, which is the loop-by-loop oracle):

* Tree: N_0 = T, N_{l+1} = ceil(N_l / r) while N_l > max_top_nodes. A node's K/V is the mean of its
  existing children at the layer below, so a ragged tail's parent is the mean of its children's
  means (the seed's c < r rule), not the mean of the tokens it covers.
* Candidates of query t at layer l: the top layer offers nodes [0, t // r^l]; lower layers expand
  the parents selected above (ascending) into r children each, the rightmost parent (the one
  holding t) only up to its child holding t. Valid candidates fill buffer positions 0..n-1 in
  ascending node order; the last one is the rightmost node t // r^l.
* Scores: scale * <RoPE(q, n-1), RoPE(k_node, p)> at candidate-local positions p; RoPE is the
  half-split pairing (x[i] with x[i + K/2]) as in the public code, angles p * base^(-2i/K).
* Selection (layers above 0): lse_g = logsumexp over candidates of s_g, importance
  imp_p = sum_g exp(s_gp - lse_g), shared by the G heads of a KV head; top_k by importance with the
  rightmost candidate forced in; the selected nodes are expanded below, all other candidates are
  merged into the softmax at this layer. Layer 0 merges every candidate.
* sort_mode="exact": stable sort on the importance, ties go to the smaller buffer position.
  sort_mode="packed": the seed's float32 key, importance rounded to float32 with its low LOG_N
  mantissa bits replaced by the (complemented) buffer position, so values that agree above those
  bits tie and go to the smaller position; LOG_N = ceil(log2(max(max_top_nodes, top_k * r))),
  which is log2(MAX_CANDIDATES) = 13 in the public regime. Subnormal flush-to-zero of a GPU is not
  emulated.
* causal=False is the seed: the rightmost candidate, a pooled node that also covers tokens after
  t, enters each head's lse, so with G > 1 future keys can re-rank the past candidates.
  causal=True leaves the rightmost candidate out of the lse (and so out of the importance: it is
  forced in anyway). Chosen over "score it from its causal prefix" because it needs no extra
  pooled tensors per query, has no gradient path, keeps the candidate buffer of the seed, and
  is a one-line mask in a kernel; with G = 1 and the exact sort it selects exactly as the seed
  (the packed key truncates, which is not scale-invariant, so there near-ties could still differ).
  Outputs at t then depend on tokens <= t only, for a fixed T: the depth of the tree depends on T,
  so a prefix of a longer sequence can get a different tree (and output) than the prefix alone.
* Lower layers score blocks: keys are pre-rotated by their offset inside their parent and the
  query by n-1 - j*r per parent slot j (the same dot products, the rotation moved), and
  children are gathered as r-node blocks per selected parent.
* Selection is constant for autograd (computed from detached scores under no_grad); gradients
  flow through the gathered scores, the merged values and the mean pooling into k and v.

Constraints that remain: H % H_kv == 0, K even (half-split RoPE), r >= 2, top_k >= 1,
max_top_nodes >= 1 (default top_k * r); packed mode also needs LOG_N <= 23 and G < 1000 (the
forced importance 1e3 must beat a sum of G probabilities). T, r, top_k and max_top_nodes need not
be powers of two, and max_top_nodes need not equal top_k * r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "HTreeConfig",
    "HTreeLayerSelection",
    "SORT_MODES",
    "apply_half_split_rope",
    "htree_attention_ref",
    "htree_layer_sizes",
    "htree_selections",
    "packed_index_bits",
    "resolve_htree_config",
    "rope_cos_sin",
]

SORT_MODES = ("exact", "packed")
# The seed forces the rightmost candidate with this importance; packed keys must keep it on top.
PACKED_FORCED_IMPORTANCE = 1e3
MAX_PACKED_INDEX_BITS = 23  # float32 mantissa width: more index bits would overwrite the exponent
# Bound on the elements of one gathered [B, H_kv, chunk, W, D] tensor, so memory stays flat in T.
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class HTreeConfig:
    compression_rate: int
    top_k: int
    max_top_nodes: int
    scale: float
    rope_base: float
    causal: bool
    sort_mode: str


@dataclass(frozen=True)
class HTreeLayerSelection:
    """What query positions saw at one layer (indices are node indices of that layer).

    candidates: [B, T, H_kv, W] in buffer order, -1 past num_candidates (W: the top layer's node
    count at the top layer, top_k * r below). num_candidates: [B, T, H_kv].
    selected: [B, T, H_kv, top_k] nodes expanded below, ascending, -1 padded; None at layer 0.
    selected_positions: [B, T, H_kv, top_k] their buffer positions in importance order (the seed's
    topk_positions), -1 padded; None at layer 0.
    """

    layer: int
    candidates: torch.Tensor
    num_candidates: torch.Tensor
    selected: torch.Tensor | None
    selected_positions: torch.Tensor | None


def _require_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def packed_index_bits(compression_rate: int, top_k: int, max_top_nodes: int) -> int:
    """LOG_N of the packed sort: bits needed for any buffer position (the seed's log2(MAX_CANDIDATES))."""
    max_candidates = max(max_top_nodes, top_k * compression_rate)
    return max(1, (max_candidates - 1).bit_length())


def resolve_htree_config(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    compression_rate: int,
    top_k: int,
    max_top_nodes: int | None = None,
    scale: float | None = None,
    rope_base: float = 10000.0,
    causal: bool = False,
    sort_mode: str = "exact",
) -> HTreeConfig:
    """Validate inputs and options; raise ValueError naming the argument and the limit."""
    named = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name}: expected a 4-D tensor [batch, time, heads, dim], got shape {tuple(tensor.shape)}"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {tensor.dtype} differs from q's {q.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name}: device {tensor.device} differs from q's {q.device}")
        if tuple(tensor.shape[:2]) != tuple(q.shape[:2]):
            raise ValueError(f"{name}: batch, time {tuple(tensor.shape[:2])} differ from q's {tuple(q.shape[:2])}")
    heads, head_dim = q.shape[2], q.shape[3]
    kv_heads = k.shape[2]
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"k: query heads H={heads} must be a multiple of key/value heads H_kv={kv_heads}")
    if v is not None and v.shape[2] != kv_heads:
        raise ValueError(f"v: {v.shape[2]} heads differ from k's H_kv={kv_heads}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k: head dim {k.shape[3]} differs from q's head dim {head_dim}")
    if head_dim % 2 != 0 or head_dim == 0:
        raise ValueError(f"q: head dim K={head_dim} must be even and > 0 (half-split RoPE pairs x[i] with x[i + K/2])")
    _require_int("compression_rate", compression_rate, 2)
    _require_int("top_k", top_k, 1)
    if max_top_nodes is None:
        max_top_nodes = top_k * compression_rate
    _require_int("max_top_nodes", max_top_nodes, 1)
    if scale is None:
        scale = head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: must be a finite number, got {scale!r}")
    if isinstance(rope_base, bool) or not isinstance(rope_base, (int, float)) or not (
        math.isfinite(rope_base) and rope_base > 0
    ):
        raise ValueError(f"rope_base: must be a finite number > 0, got {rope_base!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal: must be a bool, got {causal!r}")
    if sort_mode not in SORT_MODES:
        raise ValueError(f"sort_mode: must be one of {SORT_MODES}, got {sort_mode!r}")
    if sort_mode == "packed":
        bits = packed_index_bits(compression_rate, top_k, max_top_nodes)
        if bits > MAX_PACKED_INDEX_BITS:
            raise ValueError(
                f"max_top_nodes/top_k*compression_rate: packed sort needs buffer positions in "
                f"<= {MAX_PACKED_INDEX_BITS} bits, got {bits} (use sort_mode='exact')"
            )
        if heads // kv_heads >= PACKED_FORCED_IMPORTANCE:
            raise ValueError(
                f"q: packed sort needs group size G=H/H_kv < {PACKED_FORCED_IMPORTANCE:g}, got {heads // kv_heads}"
            )
    return HTreeConfig(
        compression_rate=compression_rate,
        top_k=top_k,
        max_top_nodes=max_top_nodes,
        scale=float(scale),
        rope_base=float(rope_base),
        causal=causal,
        sort_mode=sort_mode,
    )


def htree_layer_sizes(time: int, compression_rate: int, max_top_nodes: int) -> list[int]:
    """Node counts N_0 = T, ..., N_{L-1} <= max_top_nodes (one layer when T <= max_top_nodes)."""
    sizes = [time]
    while sizes[-1] > max_top_nodes:
        sizes.append(-(-sizes[-1] // compression_rate))
    return sizes


def _mean_pool_tree(x: torch.Tensor, compression_rate: int, layer_sizes: list[int]) -> list[torch.Tensor]:
    """x [B, H_kv, N, D] -> one tensor per layer; a parent is the mean of its existing children."""
    layers = [x]
    for size in layer_sizes[1:]:
        child = layers[-1]
        pad = size * compression_rate - child.shape[2]
        sums = F.pad(child, (0, 0, 0, pad)).unflatten(2, (size, compression_rate)).sum(3)
        first_child = torch.arange(size, device=x.device) * compression_rate
        counts = (child.shape[2] - first_child).clamp(max=compression_rate).to(x.dtype)
        layers.append(sums / counts[:, None])
    return layers


def rope_cos_sin(
    num_positions: int, head_dim: int, base: float, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_positions, head_dim / 2]; angles computed in float64 whatever the dtype."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = 1.0 / (base**exponents)
    angles = torch.arange(num_positions, dtype=torch.float64, device=device)[:, None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_half_split_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) by the angles whose cos/sin broadcast against x[..., :D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _prerotate_keys(tree_k: list[torch.Tensor], r: int, cos, sin) -> list[torch.Tensor]:
    """Pre-rotated keys: the top layer's node i at position i (its buffer position); a lower
    layer's node c at c % r, its offset inside its parent block.

    A lower candidate at buffer position p = j * r + c % r (j: its parent's slot) then scores
    <R(n-1) q, R(j r) R(c % r) k> = <R(n-1-j r) q, R(c % r) k>: the per-slot rotation moves to
    the query (top_k rotations per query instead of top_k * r).
    """
    rotated = []
    for layer, keys in enumerate(tree_k):
        nodes = torch.arange(keys.shape[2], device=keys.device)
        position = nodes if layer == len(tree_k) - 1 else nodes % r
        rotated.append(apply_half_split_rope(keys, cos[position], sin[position]))
    return rotated


def _gather_blocks(layer: torch.Tensor, parents: torch.Tensor, r: int) -> torch.Tensor:
    """Children blocks of the given parents: layer [B, H_kv, N, D], parents [B, H_kv, Tc, P] (-1 allowed)
    -> [B, H_kv, Tc, P, r, D] (padding parents give block 0, masked by the caller)."""
    batch, kv_heads, size, dim = layer.shape
    parent_count = -(-size // r)
    blocks = F.pad(layer, (0, 0, 0, parent_count * r - size)).reshape(batch * kv_heads * parent_count, r * dim)
    row_base = torch.arange(batch * kv_heads, device=layer.device).view(batch, kv_heads, 1, 1) * parent_count
    rows = (row_base + parents.clamp_min(0)).flatten()
    return blocks.index_select(0, rows).view(*parents.shape, r, dim)


def _packed_keys(importance: torch.Tensor, valid: torch.Tensor, index_bits: int) -> torch.Tensor:
    """The seed's float32 sort key: low index_bits of the importance replaced by ~position (>= 0)."""
    mask = (1 << index_bits) - 1
    keys = importance.to(torch.float32)
    bits = keys.view(torch.int32)
    positions = torch.arange(keys.shape[-1], dtype=torch.int32, device=keys.device)
    index_code = torch.where(keys >= 0, ~positions, positions) & mask
    packed = ((bits & ~mask) | index_code).view(torch.float32)
    return packed.masked_fill(~valid, float("-inf"))


def _select_top_k(
    scores: torch.Tensor, valid: torch.Tensor, num_candidates: torch.Tensor, cfg: HTreeConfig
) -> torch.Tensor:
    """Shared-GQA top-k buffer positions [B, H_kv, Tc, k'] in importance order, -1 where fewer valid.

    scores [B, H_kv, Tc, G, W] (detached), valid [B, H_kv, Tc, W], num_candidates [B, H_kv, Tc].
    """
    width = scores.shape[-1]
    positions = torch.arange(width, device=scores.device)
    is_rightmost = positions == (num_candidates - 1)[..., None]
    in_lse = valid & ~is_rightmost if cfg.causal else valid
    lse = scores.masked_fill(~in_lse[..., None, :], float("-inf")).logsumexp(-1, keepdim=True)
    # A row whose lse is over nothing (causal, n = 1) gives exp(+inf): masked out before the sum.
    probabilities = (scores - lse).exp().masked_fill(~in_lse[..., None, :], 0.0)
    importance = probabilities.sum(-2).masked_fill(~valid, -1.0)
    if cfg.sort_mode == "exact":
        importance = importance.masked_fill(is_rightmost, float("inf"))
        order = torch.sort(importance, dim=-1, descending=True, stable=True).indices
    else:
        importance = importance.masked_fill(is_rightmost, PACKED_FORCED_IMPORTANCE)
        bits = packed_index_bits(cfg.compression_rate, cfg.top_k, cfg.max_top_nodes)
        keys = _packed_keys(importance, valid, bits)
        order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    top = order[..., : min(cfg.top_k, width)]
    return torch.where(valid.gather(-1, top), top, -1)


def _next_parents(nodes: torch.Tensor, selected_positions: torch.Tensor, top_k: int) -> torch.Tensor:
    """Selected node indices ascending, -1 padded to top_k (the seed's prev_selected_parents)."""
    picked = nodes.gather(-1, selected_positions.clamp_min(0))
    sentinel = torch.iinfo(picked.dtype).max
    picked = torch.where(selected_positions >= 0, picked, sentinel).sort(-1).values
    picked = torch.where(picked == sentinel, -1, picked)
    if picked.shape[-1] < top_k:
        picked = F.pad(picked, (0, top_k - picked.shape[-1]), value=-1)
    return picked


def _positions_of_fixed(nodes: torch.Tensor, valid: torch.Tensor, fixed: torch.Tensor, layer: int) -> torch.Tensor:
    """Buffer positions of caller-given selected nodes; check they are candidates incl. the rightmost."""
    sentinel = torch.iinfo(nodes.dtype).max
    sorted_nodes = torch.where(valid, nodes, sentinel).contiguous()
    positions = torch.searchsorted(sorted_nodes, fixed.clamp_min(0).contiguous())
    positions = positions.clamp(max=nodes.shape[-1] - 1)
    found = sorted_nodes.gather(-1, positions) == fixed
    if not bool((found | (fixed < 0)).all()):
        raise ValueError(f"selections: layer {layer} selects nodes that are not candidates of their query")
    rightmost_position = valid.sum(-1, keepdim=True) - 1
    if not bool(((positions == rightmost_position) & (fixed >= 0)).any(-1).all()):
        raise ValueError(f"selections: layer {layer} misses the rightmost candidate of some query")
    return torch.where(fixed >= 0, positions, -1)


def _merge_layer(state, scores, merge, values, parents, cfg: HTreeConfig):
    """Online-softmax merge of one layer's merged candidates into (max, sum, weighted values).

    The running max is a detached shift (exact for the gradient), kept finite so that rows with
    nothing merged yet give no NaN. values: the layer's [B, H_kv, N, V]; parents as for the scores.
    """
    run_max, run_sum, run_out = state
    merged_scores = scores.masked_fill(~merge[..., None, :], float("-inf"))
    new_max = torch.maximum(run_max, merged_scores.detach().amax(-1))
    shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
    weights = (merged_scores - shift[..., None]).exp()
    rescale = (run_max - shift).exp()
    if parents is None:
        layer_out = torch.einsum("bhtgn,bhnv->bhtgv", weights, values)
    else:
        blocks = _gather_blocks(values, parents, cfg.compression_rate)
        layer_out = torch.einsum(
            "bhtgjc,bhtjcv->bhtgv", weights.unflatten(-1, (cfg.top_k, cfg.compression_rate)), blocks
        )
    return new_max, run_sum * rescale + weights.sum(-1), run_out * rescale[..., None] + layer_out


def _htree_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cfg: HTreeConfig,
    fixed_selections: tuple[HTreeLayerSelection, ...] | None = None,
    record: bool = False,
    lse_out: list | None = None,
    query_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, tuple[HTreeLayerSelection, ...] | None]:
    batch, time, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    r = cfg.compression_rate
    compute_dtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    device = q.device

    if time == 0:
        empty = torch.zeros(batch, 0, kv_heads, 0, dtype=torch.long, device=q.device)
        output = None if v is None else q.new_zeros(batch, 0, heads, v.shape[3])
        if lse_out is not None:
            lse_out.append(q.new_zeros(batch, 0, heads, dtype=compute_dtype))
        return output, (HTreeLayerSelection(0, empty, empty[..., 0], None, None),) if record else None

    queries = _check_query_positions(query_positions, time, device)
    layer_sizes = htree_layer_sizes(time, r, cfg.max_top_nodes)
    num_layers = len(layer_sizes)
    if fixed_selections is not None and len(fixed_selections) != num_layers:
        raise ValueError(f"selections: expected {num_layers} layers for T={time}, got {len(fixed_selections)}")

    # Internal layout [B, H_kv, T, (G,) D]: the KV head is a batch dimension for every gather.
    q_grouped = q.to(compute_dtype).unflatten(2, (kv_heads, group)).permute(0, 2, 1, 3, 4)
    tree_k = _mean_pool_tree(k.to(compute_dtype).transpose(1, 2), r, layer_sizes)
    tree_v = None if v is None else _mean_pool_tree(v.to(compute_dtype).transpose(1, 2), r, layer_sizes)
    value_dim = 0 if v is None else v.shape[3]

    widths = [layer_sizes[-1] if layer == num_layers - 1 else cfg.top_k * r for layer in range(num_layers)]
    cos, sin = rope_cos_sin(max(widths), head_dim, cfg.rope_base, compute_dtype, device)
    keys_rot = _prerotate_keys(tree_k, r, cos, sin)

    # Largest per-query tensors: gathered blocks W x D, scores G x W, rotated queries top_k x G x K.
    width_max = max(widths)
    per_query = batch * kv_heads * max(width_max * max(head_dim, value_dim, group), cfg.top_k * group * head_dim)
    chunk = max(1, min(queries.numel(), CHUNK_ELEMENTS // max(per_query, 1)))
    outputs = []
    log_sums = []
    records: list[list[tuple]] = [[] for _ in range(num_layers)]

    for start in range(0, queries.numel(), chunk):
        t = queries[start : start + chunk]
        q_chunk = q_grouped[:, :, t]
        row_shape = (batch, kv_heads, t.numel())
        run_max = torch.full((*row_shape, group), float("-inf"), dtype=compute_dtype, device=device)
        run_sum = torch.zeros((*row_shape, group), dtype=compute_dtype, device=device)
        run_out = torch.zeros((*row_shape, group, value_dim), dtype=compute_dtype, device=device)
        parents = None  # nodes selected one layer up, ascending, -1 padded; None at the top

        for layer in range(num_layers - 1, -1, -1):
            width = widths[layer]
            positions = torch.arange(width, device=device)
            rightmost = t // r**layer
            if parents is None:
                # Top layer: nodes 0..rightmost, buffer position = node index.
                nodes = positions.expand(*row_shape, width)
                num_candidates = (rightmost + 1).expand(row_shape)
            else:
                parent_count = (parents >= 0).sum(-1)
                num_candidates = (parent_count - 1) * r + (rightmost % r) + 1
                nodes = parents[..., positions // r] * r + positions % r
            valid = positions < num_candidates[..., None]
            nodes = torch.where(valid, nodes, -1)

            query_position = num_candidates - 1
            if parents is None:
                q_cos, q_sin = cos[query_position][..., None, :], sin[query_position][..., None, :]
                q_rot = apply_half_split_rope(q_chunk, q_cos, q_sin)
                scores = torch.einsum("bhtgk,bhnk->bhtgn", q_rot * cfg.scale, keys_rot[layer])
            else:
                block_start = torch.arange(cfg.top_k, device=device) * r
                relative = (query_position[..., None] - block_start).clamp_min(0)  # padding slots: any angle
                q_rot = apply_half_split_rope(
                    q_chunk[..., None, :, :], cos[relative][..., None, :], sin[relative][..., None, :]
                )
                blocks = _gather_blocks(keys_rot[layer], parents, r)
                scores = torch.einsum("bhtjgk,bhtjck->bhtgjc", q_rot * cfg.scale, blocks).flatten(-2)

            merge = valid
            selected_positions = next_parents = None
            if layer > 0:
                if fixed_selections is not None:
                    fixed = fixed_selections[layer].selected
                    fixed = fixed.permute(0, 2, 1, 3)[:, :, t.to(fixed.device)].to(device)
                    selected_positions = _positions_of_fixed(nodes, valid, fixed, layer)
                else:
                    with torch.no_grad():
                        selected_positions = _select_top_k(scores.detach(), valid, num_candidates, cfg)
                # Padding (-1) scatters into a spare last column, so it cannot clear a real hit.
                spare = torch.where(selected_positions >= 0, selected_positions, width)
                is_selected = F.pad(torch.zeros_like(valid), (0, 1)).scatter_(-1, spare, True)[..., :width]
                merge = valid & ~is_selected
                next_parents = _next_parents(nodes, selected_positions, cfg.top_k)
            if record:
                padded_positions = None
                if selected_positions is not None:
                    missing = cfg.top_k - selected_positions.shape[-1]
                    padded_positions = F.pad(selected_positions, (0, missing), value=-1)
                records[layer].append((nodes, num_candidates.expand(row_shape), next_parents, padded_positions))

            if tree_v is not None:
                run_max, run_sum, run_out = _merge_layer(
                    (run_max, run_sum, run_out), scores, merge, tree_v[layer], parents, cfg
                )
            parents = next_parents

        if tree_v is not None:
            outputs.append(run_out / run_sum.clamp_min(torch.finfo(compute_dtype).tiny)[..., None])
            if lse_out is not None:
                log_sums.append(run_max + run_sum.log())

    output = None
    if tree_v is not None:
        output = torch.cat(outputs, dim=2).permute(0, 2, 1, 3, 4).flatten(2, 3).to(q.dtype)
        if lse_out is not None:
            lse_out.append(torch.cat(log_sums, dim=2).permute(0, 2, 1, 3).flatten(2, 3))

    selections = tuple(_stack_records(layer, records[layer]) for layer in range(num_layers)) if record else None
    return output, selections


def _check_query_positions(query_positions: torch.Tensor | None, time: int, device) -> torch.Tensor:
    """The query positions to evaluate: all of 0..T-1, or the given ones (1-D, strictly
    increasing, in range), so that a check at a long T costs memory in the positions it looks at."""
    if query_positions is None:
        return torch.arange(time, device=device)
    positions = torch.as_tensor(query_positions, device=device)
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64) or positions.numel() == 0:
        raise ValueError(f"query_positions: expected a non-empty 1-D integer tensor, got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= time):
        raise ValueError(f"query_positions: values must lie in [0, {time}), got "
                         f"[{int(positions.min())}, {int(positions.max())}]")
    if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
        raise ValueError("query_positions: must be strictly increasing")
    return positions.long()


def _stack_records(layer: int, chunks: list[tuple]) -> HTreeLayerSelection:
    """Concatenate one layer's per-chunk records [B, H_kv, Tc, ...] into [B, T, H_kv, ...]."""

    def cat(index: int) -> torch.Tensor:
        return torch.cat([chunk[index] for chunk in chunks], dim=2).transpose(1, 2).contiguous()

    if layer == 0:
        return HTreeLayerSelection(layer, cat(0), cat(1), None, None)
    return HTreeLayerSelection(layer, cat(0), cat(1), cat(2), cat(3))


def htree_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    compression_rate: int,
    top_k: int,
    max_top_nodes: int | None = None,
    scale: float | None = None,
    rope_base: float = 10000.0,
    causal: bool = False,
    sort_mode: str = "exact",
    selections: tuple[HTreeLayerSelection, ...] | None = None,
    return_lse: bool = False,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """htree attention output [B, T, H, V]; differentiable with the selection held constant.

    selections: per-layer selections (as from `htree_selections`) to use instead of computing
    them, e.g. to hold them fixed under finite differences; only their `selected` is read.
    Computes in the inputs' dtype for float32/float64, in float32 for half types.
    return_lse: also return lse [B, T, H] (float32 for half inputs), the log of each output row's
    softmax normaliser over every merged candidate (differentiable too).
    query_positions: evaluate only these query positions (1-D, strictly increasing): the output
    is then [B, len(query_positions), H, V] (the tree is still built from every key, and
    `selections`, if given, still cover all T positions). Memory and time scale with the
    positions evaluated, so long sequences can be checked at sampled positions.
    """
    cfg = resolve_htree_config(
        q, k, v, compression_rate=compression_rate, top_k=top_k, max_top_nodes=max_top_nodes,
        scale=scale, rope_base=rope_base, causal=causal, sort_mode=sort_mode,
    )
    lse: list = []
    output, _ = _htree_forward(q, k, v, cfg, fixed_selections=selections, lse_out=lse if return_lse else None,
                               query_positions=query_positions)
    return (output, lse[0]) if return_lse else output


def htree_selections(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    compression_rate: int,
    top_k: int,
    max_top_nodes: int | None = None,
    scale: float | None = None,
    rope_base: float = 10000.0,
    causal: bool = False,
    sort_mode: str = "exact",
    query_positions: torch.Tensor | None = None,
) -> tuple[HTreeLayerSelection, ...]:
    """Per-layer candidates and selections, indexed by layer (0 = tokens, last = top); with
    query_positions, of those positions only (their T dimension has len(query_positions))."""
    cfg = resolve_htree_config(
        q, k, None, compression_rate=compression_rate, top_k=top_k, max_top_nodes=max_top_nodes,
        scale=scale, rope_base=rope_base, causal=causal, sort_mode=sort_mode,
    )
    with torch.no_grad():
        _, selections = _htree_forward(q, k, None, cfg, record=True, query_positions=query_positions)
    return selections
