"""Loop-by-loop transcription of the htree forward of seed 003; a test oracle only.

Python loops over batch, KV head, query position, layer, candidate and query head, in the order
of the seed's "forward pseudo-code"; slow, for tiny shapes. It shares no code with `reference.py`
on purpose (RoPE, pooling, sorting and the packed key are written again here, the key with
`struct` instead of tensor bit views), so that agreement between the two means something.
Always computes in float64 and returns the input dtype.

Decisions where the seed is open (the same ones `reference.py` documents):

* RoPE pairing: half-split, x[i] rotates with x[i + K/2] at angle pos * base^(-2i/K), as in the
  public code; the seed does not name a pairing.
* Ragged tail: a parent is the mean of its c existing children at the layer below (the seed's
  c < r rule), so a tail parent is the mean of its children's means, not of the tokens it covers.
* Top layer: the seed's "virtual parents": nodes 0..i* grouped r per virtual parent, the
  rightmost virtual parent truncated at the child holding t; this offers exactly [0, i*].
* Sort: sort_mode="exact" orders by importance, ties to the smaller buffer position.
  sort_mode="packed" is the seed's key: float32(importance), its low LOG_N bits replaced by ~pos
  (pos for a negative value), sorted descending then decoded; LOG_N = ceil(log2(max(max_top_nodes,
  top_k * r))), the seed's log2(MAX_CANDIDATES). The rightmost candidate is forced with +inf
  (exact) or 1e3 (packed, the seed's value).
* Next parents: buffer position -> node through the seed's 32-parent tiles (BC = 32 r), which is
  parent slot pos // r, child pos % r.
* causal=True leaves the rightmost candidate out of each head's log-sum-exp (and of the
  importance); causal=False is the seed.
* Output: U / max(S, eps) with eps the float64 tiny.
"""

from __future__ import annotations

import math
import struct

import torch

__all__ = ["htree_attention_transcribed"]

PARENTS_PER_TILE = 32  # the seed's BC = 32 * r tiling of the candidate buffer


def _rope(x: torch.Tensor, position: int, base: float) -> torch.Tensor:
    half = x.shape[0] // 2
    y = torch.empty_like(x)
    for i in range(half):
        angle = position * base ** (-(2 * i) / x.shape[0])
        c, s = math.cos(angle), math.sin(angle)
        y[i] = x[i] * c - x[i + half] * s
        y[i + half] = x[i] * s + x[i + half] * c
    return y


def _build_tree(x: torch.Tensor, r: int, max_top_nodes: int) -> list[torch.Tensor]:
    """x [B, T, H_kv, D] -> layers; node i of layer l = mean of its existing children (c <= r)."""
    layers = [x]
    while layers[-1].shape[1] > max_top_nodes:
        below = layers[-1]
        count = math.ceil(below.shape[1] / r)
        nodes = []
        for i in range(count):
            children = [below[:, j] for j in range(i * r, (i + 1) * r) if j < below.shape[1]]
            nodes.append(sum(children) / len(children))
        layers.append(torch.stack(nodes, dim=1))
    return layers


def _packed_key(value: float, position: int, index_bits: int) -> float:
    mask = (1 << index_bits) - 1
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    index_code = (~position if value >= 0 else position) & mask
    return struct.unpack("<f", struct.pack("<I", (bits & ~mask & 0xFFFFFFFF) | index_code))[0]


def _unpack_position(key: float, index_bits: int) -> int:
    mask = (1 << index_bits) - 1
    bits = struct.unpack("<I", struct.pack("<f", key))[0]
    clean = struct.unpack("<f", struct.pack("<I", bits & ~mask & 0xFFFFFFFF))[0]
    return (~bits if clean >= 0 else bits) & mask


def _stable_top_k(importance: list[float], top_k: int, sort_mode: str, index_bits: int) -> list[int]:
    """Buffer positions of the top_k importances (rightmost already forced), best first."""
    if sort_mode == "exact":
        order = sorted(range(len(importance)), key=lambda p: (-importance[p], p))
    else:
        keys = [_packed_key(value, p, index_bits) for p, value in enumerate(importance)]
        order = [_unpack_position(key, index_bits) for key in sorted(keys, reverse=True)]
    return order[: min(top_k, len(importance))]


def htree_attention_transcribed(
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
    return_selections: bool = False,
):
    """Output [B, T, H, V]; with return_selections also a dict (b, t, h_kv) -> per layer, top first,
    (layer, candidate nodes, selected nodes ascending or None at layer 0)."""
    r = compression_rate
    if max_top_nodes is None:
        max_top_nodes = top_k * r
    batch, time, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    if scale is None:
        scale = head_dim**-0.5
    max_candidates = max(max_top_nodes, top_k * r)
    index_bits = max(1, (max_candidates - 1).bit_length())

    q64, k64, v64 = q.double(), k.double(), v.double()
    layers_k = _build_tree(k64, r, max_top_nodes)
    layers_v = _build_tree(v64, r, max_top_nodes)
    num_layers = len(layers_k)
    output = torch.zeros(batch, time, heads, v.shape[3], dtype=torch.float64)
    trace = {}

    for b in range(batch):
        for h_kv in range(kv_heads):
            head_ids = [h_kv * group + g for g in range(group)]
            for t in range(time):
                # Online-softmax state (m, S, U) per query head of the group.
                m = [-math.inf] * group
                S = [0.0] * group
                U = [torch.zeros(v.shape[3], dtype=torch.float64) for _ in range(group)]
                prev_selected_parents = None
                trace[(b, t, h_kv)] = []

                for layer in range(num_layers - 1, -1, -1):
                    rightmost_node = t // r**layer
                    rightmost_child_idx = rightmost_node % r
                    if prev_selected_parents is None:
                        parents = list(range(rightmost_node // r + 1))  # virtual parents of the top layer
                    else:
                        parents = [p for p in prev_selected_parents if p >= 0]
                    rightmost_parent = rightmost_node // r

                    candidates = []
                    for parent in parents:
                        num_valid_children = rightmost_child_idx + 1 if parent == rightmost_parent else r
                        for child_offset in range(num_valid_children):
                            candidates.append(parent * r + child_offset)
                    n_cand = len(candidates)
                    assert n_cand == (len(parents) - 1) * r + rightmost_child_idx + 1
                    assert candidates[-1] == rightmost_node

                    # Scores with candidate-local RoPE: key at its buffer position, query at n_cand - 1.
                    keys_rot = [_rope(layers_k[layer][b, c, h_kv], p, rope_base) for p, c in enumerate(candidates)]
                    scores = []
                    for g in range(group):
                        q_rot = _rope(q64[b, t, head_ids[g]], n_cand - 1, rope_base)
                        scores.append([scale * float(torch.dot(q_rot, key)) for key in keys_rot])

                    if layer > 0:
                        rightmost_pos = n_cand - 1
                        lse_positions = [p for p in range(n_cand) if not (causal and p == rightmost_pos)]
                        importance = [0.0] * n_cand
                        for g in range(group):
                            if not lse_positions:
                                continue
                            peak = max(scores[g][p] for p in lse_positions)
                            lse = peak + math.log(sum(math.exp(scores[g][p] - peak) for p in lse_positions))
                            for p in lse_positions:
                                importance[p] += math.exp(scores[g][p] - lse)
                        importance[rightmost_pos] = math.inf if sort_mode == "exact" else 1e3
                        topk_positions = _stable_top_k(importance, top_k, sort_mode, index_bits)
                        merge_positions = [p for p in range(n_cand) if p not in topk_positions]

                        tile = PARENTS_PER_TILE * r
                        selected_nodes = []
                        for pos in topk_positions:
                            batch_id, within_batch = divmod(pos, tile)
                            parent_slot, child_slot = divmod(within_batch, r)
                            selected_nodes.append(parents[batch_id * PARENTS_PER_TILE + parent_slot] * r + child_slot)
                        selected_nodes.sort()
                        prev_selected_parents = selected_nodes + [-1] * (top_k - len(selected_nodes))
                        trace[(b, t, h_kv)].append((layer, candidates, selected_nodes))
                    else:
                        merge_positions = list(range(n_cand))
                        trace[(b, t, h_kv)].append((layer, candidates, None))

                    if not merge_positions:
                        continue
                    for g in range(group):
                        new_m = max(m[g], max(scores[g][p] for p in merge_positions))
                        S[g] = S[g] * math.exp(m[g] - new_m) + sum(
                            math.exp(scores[g][p] - new_m) for p in merge_positions
                        )
                        U[g] = U[g] * math.exp(m[g] - new_m)
                        for p in merge_positions:
                            U[g] = U[g] + math.exp(scores[g][p] - new_m) * layers_v[layer][b, candidates[p], h_kv]
                        m[g] = new_m

                for g in range(group):
                    output[b, t, head_ids[g]] = U[g] / max(S[g], torch.finfo(torch.float64).tiny)

    output = output.to(q.dtype)
    return (output, trace) if return_selections else output
