"""htree attention (seed 003) written the plain way, and an attention module that uses it.

`htree_attention_plain` is what a user porting the seed's naive PyTorch code would write: build
the mean-pooled tree with a while loop, then walk the layers top-down with full-width candidate
buffers, gathers, RoPE at candidate-local positions, a stable sort for the shared-GQA top-k and an
online softmax. It has no graph breaks, so `torch.compile(backend="hc")` sees all of it, and the
htree pass (hccompile/passes/htree.py) replaces it with `hccompile::htree_attention`. Eager, it
materialises [B, H_kv, T, candidates, D] gathers: fine for small T, the reason for the kernels.

Semantics are those of hccompile/kernels/htree/reference.py (tests check the two agree).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HTreeAttention", "htree_attention_plain"]


def _mean_pool(x: torch.Tensor, r: int) -> torch.Tensor:
    """[B, H, N, D] -> [B, H, ceil(N / r), D]: each parent is the mean of its existing children."""
    batch, heads, size, dim = x.shape
    parents = (size + r - 1) // r
    sums = F.pad(x, (0, 0, 0, parents * r - size)).view(batch, heads, parents, r, dim).sum(3)
    counts = (size - torch.arange(parents, device=x.device) * r).clamp(max=r)
    return sums / counts[:, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE: x[i] rotates with x[i + D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _packed_sort_key(importance: torch.Tensor, index_bits: int) -> torch.Tensor:
    """The seed's float32 key: the low index_bits replaced by ~position (ties to the smaller one)."""
    mask = (1 << index_bits) - 1
    bits = importance.view(torch.int32)
    positions = torch.arange(importance.shape[-1], dtype=torch.int32, device=importance.device)
    code = torch.where(importance >= 0, ~positions, positions) & mask
    return ((bits & ~mask) | code).view(torch.float32)


def _sort_keys(importance: torch.Tensor, valid: torch.Tensor, is_rightmost: torch.Tensor, sort_mode: str,
               index_bits: int) -> torch.Tensor:
    """What the top-k sorts: the importance, the rightmost candidate forced first, padding last."""
    importance = importance.masked_fill(~valid, -1.0)
    if sort_mode == "packed":
        keys = _packed_sort_key(importance.masked_fill(is_rightmost, 1e3).float(), index_bits)
        return keys.masked_fill(~valid, float("-inf"))
    return importance.masked_fill(is_rightmost, float("inf"))


def htree_attention_plain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    compression_rate: int = 16,
    top_k: int = 64,
    max_top_nodes: int | None = None,
    scale: float | None = None,
    rope_base: float = 10000.0,
    causal: bool = False,
    sort_mode: str = "exact",
) -> torch.Tensor:
    """htree attention, q [B, T, H, K], k [B, T, H_kv, K], v [B, T, H_kv, V] -> [B, T, H, V].

    Computes in float32 (the inputs' dtype if float64); options as hccompile.htree_attention.
    """
    batch, time, heads, head_dim = q.shape
    kv_heads, value_dim = k.shape[2], v.shape[3]
    group = heads // kv_heads
    r = compression_rate
    if max_top_nodes is None:
        max_top_nodes = top_k * r
    if scale is None:
        scale = head_dim ** -0.5
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    device = q.device

    # [B, H_kv, T, G, K] queries; the tree of keys and values, [B, H_kv, N_l, D] per layer.
    queries = q.to(dtype).view(batch, time, kv_heads, group, head_dim).transpose(1, 2)
    keys = [k.to(dtype).transpose(1, 2)]
    values = [v.to(dtype).transpose(1, 2)]
    while keys[-1].shape[2] > max_top_nodes:
        keys.append(_mean_pool(keys[-1], r))
        values.append(_mean_pool(values[-1], r))
    top = len(keys) - 1

    width_max = max(keys[top].shape[2], top_k * r)
    inv_freq = 1.0 / rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(width_max, dtype=torch.float64, device=device)[:, None] * inv_freq
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    index_bits = max(1, (max(max_top_nodes, top_k * r) - 1).bit_length())

    t = torch.arange(time, device=device)
    b_index = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h_index = torch.arange(kv_heads, device=device).view(1, kv_heads, 1, 1)
    run_max = torch.full((batch, kv_heads, time, group), float("-inf"), dtype=dtype, device=device)
    run_sum = torch.zeros((batch, kv_heads, time, group), dtype=dtype, device=device)
    run_out = torch.zeros((batch, kv_heads, time, group, value_dim), dtype=dtype, device=device)
    parents = None
    for layer in range(top, -1, -1):
        rightmost = t // r**layer
        if parents is None:  # top layer: nodes 0 .. rightmost
            width = keys[layer].shape[2]
            positions = torch.arange(width, device=device)
            nodes = positions.expand(batch, kv_heads, time, width)
            count = (rightmost + 1).expand(batch, kv_heads, time)
        else:  # the children of the selected parents, the rightmost parent's up to t's
            width = top_k * r
            positions = torch.arange(width, device=device)
            count = ((parents >= 0).sum(-1) - 1) * r + rightmost % r + 1
            nodes = parents[..., positions // r] * r + positions % r
        valid = positions < count[..., None]
        nodes = torch.where(valid, nodes, 0)

        # RoPE at candidate-local positions: keys at their buffer position, the query at count - 1.
        key = _rope(keys[layer][b_index, h_index, nodes], cos[positions], sin[positions])
        query = _rope(queries, cos[count - 1][..., None, :], sin[count - 1][..., None, :])
        scores = torch.einsum("bhtgk,bhtwk->bhtgw", query, key) * scale

        merge = valid
        if layer > 0:
            is_rightmost = positions == (count - 1)[..., None]
            in_lse = valid & ~is_rightmost if causal else valid
            lse = scores.masked_fill(~in_lse[..., None, :], float("-inf")).logsumexp(-1, keepdim=True)
            importance = (scores - lse).exp().masked_fill(~in_lse[..., None, :], 0.0).sum(-2)
            key_values = _sort_keys(importance, valid, is_rightmost, sort_mode, index_bits)
            order = torch.sort(key_values, dim=-1, descending=True, stable=True).indices[..., :top_k]
            chosen = valid.gather(-1, order)
            selected = torch.zeros_like(valid).scatter(-1, order, chosen)
            merge = valid & ~selected
            picked = torch.where(chosen, nodes.gather(-1, order), time + 1).sort(-1).values
            parents = torch.where(picked > time, -1, picked)
            if parents.shape[-1] < top_k:
                parents = F.pad(parents, (0, top_k - parents.shape[-1]), value=-1)

        masked = scores.masked_fill(~merge[..., None, :], float("-inf"))
        # The running max is a constant shift for autograd (it cancels in the output).
        new_max = torch.maximum(run_max, masked.detach().amax(-1))
        shift = torch.where(torch.isfinite(new_max), new_max, 0.0)
        weights = (masked - shift[..., None]).exp()
        rescale = (run_max - shift).exp()
        value = values[layer][b_index, h_index, nodes]
        run_out = run_out * rescale[..., None] + torch.einsum("bhtgw,bhtwv->bhtgv", weights, value)
        run_sum = run_sum * rescale + weights.sum(-1)
        run_max = new_max

    out = run_out / run_sum[..., None]
    return out.transpose(1, 2).reshape(batch, time, heads, value_dim).to(v.dtype)


class HTreeAttention(nn.Module):
    """Attention block with htree sparse attention: q/k/v/o projections, GQA (num_kv_heads <
    num_heads), the plain-PyTorch htree core. Under torch.compile(backend="hc") the core is found
    and lowered to the Triton kernels; eager it runs as written."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, compression_rate: int = 16, top_k: int = 64,
                 max_top_nodes: int | None = None, rope_base: float = 10000.0, causal: bool = False,
                 sort_mode: str = "exact", bias: bool = False):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim: must be even and >= 2 (half-split RoPE), got {head_dim}")
        if sort_mode not in ("exact", "packed"):
            raise ValueError(f"sort_mode: must be 'exact' or 'packed', got {sort_mode!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.compression_rate, self.top_k, self.max_top_nodes = compression_rate, top_k, max_top_nodes
        self.rope_base, self.causal, self.sort_mode = rope_base, causal, sort_mode
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q = self.q_proj(x).view(batch, time, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, time, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, time, self.num_kv_heads, self.head_dim)
        o = htree_attention_plain(q, k, v, self.compression_rate, self.top_k, self.max_top_nodes,
                                  rope_base=self.rope_base, causal=self.causal, sort_mode=self.sort_mode)
        return self.o_proj(o.reshape(batch, time, self.num_heads * self.head_dim))
