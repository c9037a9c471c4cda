"""Causal linear attention written the plain way, O = scale·tril(QKᵀ)V, and a tiny model using it."""
from __future__ import annotations

import torch
from torch import nn


class PlainCausalLinearAttention(nn.Module):
    """Multi-head causal linear attention without decay, in plain PyTorch.

    layout="bhtd" transposes to [B, H, T, D] and uses `@`; layout="bthd" keeps FLA's [B, T, H, D]
    and uses einsum.
    """

    def __init__(self, dim: int, num_heads: int, layout: str = "bhtd", bias: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not a multiple of num_heads {num_heads}")
        if layout not in ("bhtd", "bthd"):
            raise ValueError(f"layout must be 'bhtd' or 'bthd', got {layout!r}")
        self.num_heads, self.head_dim, self.layout = num_heads, dim // num_heads, layout
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        scale = self.head_dim ** -0.5
        if self.layout == "bhtd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            y = torch.tril(q @ k.transpose(-2, -1) * scale) @ v
            y = y.transpose(1, 2)
        else:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            s = torch.einsum("bthd,bshd->bhts", q, k) * scale
            y = torch.einsum("bhts,bshd->bthd", s.masked_fill(~mask, 0.0), v)
        return self.out(y.reshape(B, T, C))


class TinyLinearTransformer(nn.Module):
    """Pre-norm blocks of linear attention and a GELU MLP; the demo and tests compile this."""

    def __init__(self, dim: int = 64, num_heads: int = 4, layers: int = 2, layout: str = "bhtd"):
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "norm1": nn.LayerNorm(dim),
                "attn": PlainCausalLinearAttention(dim, num_heads, layout),
                "norm2": nn.LayerNorm(dim),
                "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
            }))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm1"](x))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.norm(x)
