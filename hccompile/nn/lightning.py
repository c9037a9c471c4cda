"""Lightning attention (causal linear attention with a constant per-head decay) as a module, written
either in plain PyTorch — the way model code writes it, for the pass to find — or as a call to our
op, and a tiny model built from it.

Per head h with log-decay γ_h ≤ 0 (a buffer of ALiBi-like slopes, `alibi_decay`):

    o_t = scale · Σ_{s≤t} exp(γ_h (t−s)) (q_t · k_s) v_s

mode="plain", form="quadratic": the [H, T, T] decay matrix exp(γ_h (t−s)) masked to s ≤ t,
    multiplied into the scores (O(T²) memory; the pass lowers it to hccompile::lightning_attn).
mode="plain", form="block": lightning attention 2's reference loop over blocks of `block_size`
    positions with a carried [H, D, D] state (Dynamo unrolls it; the pass replaces the loop).
mode="op": `hccompile.lightning_attn` directly.

With decay=False the buffer is all zeros and the plain forms write no decay at all (plain causal
linear attention, which the pass lowers to hccompile::lightning_attn with decay 0).
"""
from __future__ import annotations

import torch
from torch import nn

from ..lowering.lightning import alibi_decay, lightning_attn

MODES = ("plain", "op")
FORMS = ("quadratic", "block")


class LightningAttention(nn.Module):
    """Multi-head lightning attention on x [B, T, dim] -> [B, T, dim].

    q, k, v, o projections; `num_heads` heads of dim // num_heads; `scale` defaults to
    head_dim**-0.5; `output_norm` applies RMSNorm to the attention output before the output
    projection (TransNormer-style); `decay` False gives plain causal linear attention.
    """

    def __init__(self, dim: int, num_heads: int, *, mode: str = "plain", form: str = "quadratic",
                 block_size: int = 64, decay: bool = True, output_norm: bool = True,
                 scale: float | None = None, bias: bool = False):
        super().__init__()
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f"dim {dim} is not a multiple of num_heads {num_heads}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.mode, self.form, self.block_size, self.use_decay = mode, form, block_size, decay
        self.scale = self.head_dim ** -0.5 if scale is None else float(scale)
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.o_proj = nn.Linear(dim, dim, bias=bias)
        self.norm = nn.RMSNorm(dim) if output_norm else nn.Identity()
        # log-decays, a constant (not trained): the op takes no gradient for them
        self.register_buffer("decay", alibi_decay(num_heads) if decay else torch.zeros(num_heads))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, mode={self.mode!r}, "
                f"form={self.form!r}, block_size={self.block_size}, decay={self.use_decay}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.num_heads, self.head_dim)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # [B, T, H, D]
        if self.mode == "op":
            o, _ = lightning_attn(q, k, v, decay=self.decay, scale=self.scale)
        elif self.form == "quadratic":
            o = self._quadratic(q, k, v)
        else:
            o = self._block_loop(q, k, v)
        return self.o_proj(self.norm(o.reshape(B, T, C)))

    def _quadratic(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.shape[1]
        scores = torch.einsum("bthd,bshd->bhts", q, k) * self.scale
        if self.use_decay:
            pos = torch.arange(T, device=q.device, dtype=torch.float32)
            distance = pos[:, None] - pos[None, :]
            # clamping before exp keeps the future entries finite before tril zeroes them
            weights = torch.exp(self.decay[:, None, None] * distance.clamp_min(0)).tril()
            scores = scores * weights.to(scores.dtype)
        else:
            scores = scores.tril()
        return torch.einsum("bhts,bshe->bthe", scores, v)

    def _block_loop(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, Hh, D = q.shape
        n = self.block_size
        gamma = self.decay
        pos = torch.arange(n, device=q.device, dtype=torch.float32)
        distance = pos[:, None] - pos[None, :]
        if self.use_decay:
            diag = torch.exp(gamma[:, None, None] * distance.clamp_min(0)).tril()  # [H, n, n]
        else:
            diag = torch.ones(n, n, device=q.device).tril()
        state = q.new_zeros(B, Hh, D, v.shape[-1], dtype=torch.float32)  # fp32 KV state
        outs = []
        for start in range(0, T, n):
            qi, ki, vi = (t[:, start:start + n] for t in (q, k, v))
            L = qi.shape[1]
            scores = torch.einsum("bthd,bshd->bhts", qi, ki) * self.scale
            o = torch.einsum("bhts,bshe->bthe", scores * diag[..., :L, :L].to(scores.dtype), vi)
            if self.use_decay:
                q_decay = torch.exp(gamma[None, :] * (pos[:L, None] + 1))  # [L, H]
                k_decay = torch.exp(gamma[None, :] * (L - 1 - pos[:L, None]))  # [L, H]
                inter = torch.einsum("bthd,bhde->bthe", qi.float() * q_decay[None, :, :, None], state)
                update = torch.einsum("bshd,bshe->bhde", ki.float() * k_decay[None, :, :, None],
                                      vi.float())
                state = torch.exp(gamma * L)[None, :, None, None] * state + update
            else:
                inter = torch.einsum("bthd,bhde->bthe", qi.float(), state)
                state = state + torch.einsum("bshd,bshe->bhde", ki.float(), vi.float())
            outs.append(o + (inter * self.scale).to(o.dtype))
        return torch.cat(outs, dim=1)


class TinyLightningTransformer(nn.Module):
    """Pre-norm blocks of LightningAttention and a GELU MLP, for examples and tests."""

    def __init__(self, dim: int = 64, num_heads: int = 4, layers: int = 2, **attention: object):
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "norm1": nn.RMSNorm(dim),
                "attn": LightningAttention(dim, num_heads, **attention),
                "norm2": nn.RMSNorm(dim),
                "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
            }))
        self.norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm1"](x))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.norm(x)
