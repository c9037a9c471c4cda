"""mHC (Manifold-Constrained Hyper-Connections) written in plain PyTorch, in the layouts found in
real code, and a small GPT built from it. The passes find these by what they compute, never by
these class names.

Per token the residual stream is x ∈ R^{n×C}; per sublayer F (attention or MLP):
    x_next = H_res·x + H_postᵀ·F(H_pre·x)
with mappings from the flattened stream v = vec(x): r = ‖v‖/√(nC), one projection v·φ to n²+2n
values, each part α-scaled, divided by r, plus a bias; H_pre = σ(·) (+ε), H_post = 2σ(·),
H_res = Sinkhorn-Knopp(·) over `sinkhorn_iters` alternating row/column normalisations.

Layouts:
  "bsnc"   [B, S, n, C], einsum, mixing with H_resᵀ (DeepSeek-V4 reference style)
  "sbnc"   [S, B, n·C], bmm on [S·B, n, n] × [S·B, n, C] (Megatron style)
  "folded" streams folded into the batch, [(B·n), S, C], aggregate/contract by sum (the public
           hyper-connections package style)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

LAYOUTS = ("bsnc", "sbnc", "folded")


class MHCMapping(nn.Module):
    """compute_mappings: flattened RMS, one projection, α gating, σ / 2σ, Sinkhorn-Knopp."""

    def __init__(self, n: int, dim: int, sinkhorn_iters: int = 20, eps: float = 0.0,
                 sinkhorn_init: str = "exp"):
        super().__init__()
        if sinkhorn_init not in ("exp", "softmax"):
            raise ValueError(f"sinkhorn_init must be 'exp' or 'softmax', got {sinkhorn_init!r}")
        self.n, self.dim, self.iters, self.eps, self.init = n, dim, sinkhorn_iters, eps, sinkhorn_init
        self.phi = nn.Linear(n * dim, n * n + 2 * n, bias=False)
        nn.init.normal_(self.phi.weight, std=0.02)
        self.alpha_pre = nn.Parameter(torch.tensor(0.01))
        self.alpha_post = nn.Parameter(torch.tensor(0.01))
        self.alpha_res = nn.Parameter(torch.tensor(0.01))
        self.bias_pre = nn.Parameter(torch.zeros(n))
        self.bias_post = nn.Parameter(torch.zeros(n))
        self.bias_res = nn.Parameter(torch.eye(n).flatten() * 2.0)  # start near identity mixing

    def forward(self, v: torch.Tensor):
        """v: [..., n·C] flattened streams -> (h_pre [..., n], h_post [..., n], h_res [..., n, n])."""
        n = self.n
        r = v.float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt().to(v.dtype)
        proj = self.phi(v)
        pre, post, res = proj[..., :n], proj[..., n:2 * n], proj[..., 2 * n:]
        h_pre = torch.sigmoid(self.alpha_pre * pre / r + self.bias_pre)
        if self.eps:
            h_pre = h_pre + self.eps
        h_post = 2 * torch.sigmoid(self.alpha_post * post / r + self.bias_post)
        logits = (self.alpha_res * res / r + self.bias_res).unflatten(-1, (n, n))
        if self.init == "exp":
            m = torch.exp(logits.float())
        else:
            m = torch.softmax(logits.float(), dim=-1) + 1e-6
        for _ in range(self.iters):
            m = m / m.sum(-1, keepdim=True)
            m = m / m.sum(-2, keepdim=True)
        return h_pre, h_post, m.to(v.dtype)


class HyperConnection(nn.Module):
    """Wraps one sublayer F with an mHC hyper-connection; n=1 is a plain residual."""

    def __init__(self, n: int, dim: int, sublayer: nn.Module, dropout: float = 0.0,
                 layout: str = "bsnc", sinkhorn_iters: int = 20, eps: float = 0.0,
                 sinkhorn_init: str = "exp"):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.n, self.dim, self.layout = n, dim, layout
        self.sublayer = sublayer
        self.dropout = nn.Dropout(dropout)
        self.mapping = MHCMapping(n, dim, sinkhorn_iters, eps, sinkhorn_init) if n > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.n == 1:
            return x + self.dropout(self.sublayer(x))
        return getattr(self, f"_forward_{self.layout}")(x)

    def as_recompute_sublayer(self, name: str):
        """This hyper-connection as the eager manager's plain functions (layout "bsnc")."""
        from ..recompute import MHCSublayer

        sub = self.sublayer
        return MHCSublayer(
            compute_mappings=lambda x: self.mapping(x.flatten(-2)),
            aggregate=lambda x, h_pre: torch.einsum("bsn,bsnc->bsc", h_pre, x),
            apply_h_res=lambda h_res, x: torch.einsum("bsmn,bsmc->bsnc", h_res, x),
            norm=sub.norm,
            fn=lambda z: self.dropout(sub.forward_normed(z)),
            apply_h_post=lambda f, h_post: h_post.unsqueeze(-1) * f.unsqueeze(-2),
            bda=lambda post, mixed: mixed + post,
            name=name)

    def _forward_bsnc(self, x):  # [B, S, n, C]
        h_pre, h_post, h_res = self.mapping(x.flatten(-2))
        y = torch.einsum("bsn,bsnc->bsc", h_pre, x)
        f = self.dropout(self.sublayer(y))
        mixed = torch.einsum("bsmn,bsmc->bsnc", h_res, x)  # H_resᵀ·x
        return mixed + h_post.unsqueeze(-1) * f.unsqueeze(-2)

    def _forward_sbnc(self, x):  # [S, B, n·C]
        S, B, _ = x.shape
        n, C = self.n, self.dim
        h_pre, h_post, h_res = self.mapping(x)
        xs = x.view(S * B, n, C)
        y = torch.bmm(h_pre.view(S * B, 1, n), xs).view(S, B, C)
        f = self.dropout(self.sublayer(y.transpose(0, 1)).transpose(0, 1))  # sublayers take [B, S, C]
        mixed = torch.bmm(h_res.view(S * B, n, n), xs)
        out = mixed + torch.bmm(h_post.view(S * B, n, 1), f.reshape(S * B, 1, C))
        return out.view(S, B, n * C)

    def _forward_folded(self, x):  # [(B·n), S, C]
        n, C = self.n, self.dim
        BN, S, _ = x.shape
        streams = x.view(BN // n, n, S, C)
        v = streams.permute(0, 2, 1, 3).reshape(BN // n, S, n * C)
        h_pre, h_post, h_res = self.mapping(v)
        y = (streams * h_pre.permute(0, 2, 1).unsqueeze(-1)).sum(1)
        f = self.dropout(self.sublayer(y))
        mixed = torch.einsum("bsnm,bmsc->bnsc", h_res, streams)
        out = mixed + h_post.permute(0, 2, 1).unsqueeze(-1) * f.unsqueeze(1)
        return out.reshape(BN, S, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, y):  # [B, S, C]
        return self.forward_normed(self.norm(y))

    def forward_normed(self, z):
        B, S, C = z.shape
        q, k, v = self.qkv(z).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(B, S, C))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, y):
        return self.forward_normed(self.norm(y))

    def forward_normed(self, z):
        return self.down(F.gelu(self.up(z)))


class MHCGPT(nn.Module):
    """A small GPT whose every sublayer sits in a hyper-connection; input [B, S, C] embeddings.

    input_expand replicates the embedding to n streams; output_contract averages them ("mean") or
    sums them ("sum"). With layout "sbnc" the sequence dimension comes first internally.
    """

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2, n: int = 4,
                 dropout: float = 0.0, layout: str = "bsnc", sinkhorn_iters: int = 20,
                 contract: str = "mean", eps: float = 0.0, sinkhorn_init: str = "exp"):
        super().__init__()
        if contract not in ("mean", "sum"):
            raise ValueError(f"contract must be 'mean' or 'sum', got {contract!r}")
        self.n, self.dim, self.layout, self.contract = n, dim, layout, contract
        hc = dict(dropout=dropout, layout=layout, sinkhorn_iters=sinkhorn_iters, eps=eps,
                  sinkhorn_init=sinkhorn_init)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(HyperConnection(n, dim, CausalSelfAttention(dim, heads), **hc))
            self.layers.append(HyperConnection(n, dim, MLP(dim, 4 * dim), **hc))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, dim, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.weight.shape[0] != n * n + 2 * n:
                nn.init.normal_(m.weight, std=1.0 / math.sqrt(m.weight.shape[1]))

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape
        n = self.n
        if n == 1 or self.layout == "bsnc":
            return x.unsqueeze(2).expand(B, S, n, C).contiguous() if n > 1 else x
        if self.layout == "sbnc":
            return x.transpose(0, 1).repeat(1, 1, n)
        return x.unsqueeze(1).expand(B, n, S, C).reshape(B * n, S, C)

    def contract_streams(self, x: torch.Tensor, B: int) -> torch.Tensor:
        n = self.n
        if n == 1:
            return x
        reduce = torch.mean if self.contract == "mean" else torch.sum
        if self.layout == "bsnc":
            return reduce(x, dim=2)
        if self.layout == "sbnc":
            S = x.shape[0]
            return reduce(x.view(S, B, n, self.dim), dim=2).transpose(0, 1)
        return reduce(x.view(B, n, -1, self.dim), dim=1)

    def forward(self, x: torch.Tensor, recompute: object = None, block_layers: int | None = None
                ) -> torch.Tensor:
        """`recompute` ("block", "layer" or a hccompile.recompute.RecomputeConfig) runs the eager
        block-recompute manager (layout "bsnc", n > 1): blocks of `block_layers` transformer
        layers (default: the paper's L_r* sublayers, rounded up to whole layers)."""
        B = x.shape[0]
        h = self.expand(x)
        if recompute is None or self.n == 1 or not torch.is_grad_enabled():
            for layer in self.layers:
                h = layer(h)
        else:
            h = self._forward_managed(h, recompute, block_layers)
        return self.head(self.norm(self.contract_streams(h, B)))

    def _forward_managed(self, h, recompute, block_layers):
        from ..recompute import MHCSublayer, RecomputeConfig, mhc_block_forward

        if self.layout != "bsnc":
            raise ValueError("the eager recompute manager adapter supports layout 'bsnc' only")
        cfg = recompute if isinstance(recompute, RecomputeConfig) else RecomputeConfig(granularity=recompute)
        subs = [hc.as_recompute_sublayer(f"sub{i}") for i, hc in enumerate(self.layers)]
        pairs = [subs[i:i + 2] for i in range(0, len(subs), 2)]
        if block_layers is None:
            lr = round(math.sqrt(self.n * len(subs) / (self.n + 2)))
            block_layers = max(1, math.ceil(lr / 2))
        for b in range(0, len(pairs), block_layers):
            h = mhc_block_forward(h, pairs[b:b + block_layers], cfg, name=f"block{b // block_layers}")
        return h
