"""Gated DeltaNet and Kimi Delta Attention layers, with the recurrence written in plain PyTorch
(`mode="plain"`, what the `delta_rule` pass finds and lowers) or as a call of our op (`mode="op"`).

Layout and conventions are FLA's: q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H
(grouped value heads: value head h reads key head h // (HV / H)); beta [B, T, HV]; g the natural-log
decay, [B, T, HV] for GDN, [B, T, HV, K] for KDA; states [B, HV, K, V] in float32.

The plain functions below are the recurrence as models and tutorials write it:

* `plain_recurrent_delta_rule`: the token loop S_t = D_t S_{t-1} + k_t (beta_t (v_t - (D_t S_{t-1})^T k_t))^T,
  o_t = scale S_t^T q_t;
* `plain_chunk_gated_delta_rule`: the chunked (WY) form with a scalar gate or none: the masked
  k_beta·kᵀ matrix of every chunk, its forward-substitution loop, then a loop over chunks that
  carries the state;
* `plain_chunk_kda`: the same with a per-channel gate.

Each computes in float32 and returns (o in v's dtype, final state or None).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GatedDeltaNet", "KimiDeltaAttention", "TinyDeltaNetModel", "plain_chunk_gated_delta_rule",
           "plain_chunk_kda", "plain_recurrent_delta_rule", "l2norm"]

MODES = ("plain", "op")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in x's dtype (FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, scale, use_qk_l2norm, value_heads):
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = value_heads // q.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q, k, scale


def plain_recurrent_delta_rule(q, k, v, beta, g=None, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm=False):
    """Token-by-token (gated) delta rule; g None (delta rule), [B, T, HV] (GDN) or [B, T, HV, K] (KDA)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    q, k, scale = _prepare(q, k, scale, use_qk_l2norm, HV)
    q, k, v, beta = q.float() * scale, k.float(), v.float(), beta.float()
    state = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.float()
    outputs = []
    for t in range(T):
        if g is not None:
            decay = g[:, t].float().exp()
            state = state * (decay[..., None, None] if g.dim() == 3 else decay[..., None])
        k_t = k[:, t]
        error = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k_t)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, beta[:, t, :, None] * error)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    o = torch.stack(outputs, dim=1).to(out_dtype)
    return o, (state if output_final_state else None)


def _to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, T, HV, ...] -> [B, HV, N, chunk, ...] float32, time zero-padded to a multiple of chunk."""
    x = x.transpose(1, 2).float()
    pad = (-x.shape[2]) % chunk
    if pad:
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
    return x.reshape(x.shape[0], x.shape[1], -1, chunk, *x.shape[3:])


def _solve_unit_lower(attn: torch.Tensor, chunk: int) -> torch.Tensor:
    """(I - L)^-1 for the strictly lower L in `attn`, by forward substitution row by row."""
    for i in range(1, chunk):
        row = attn[..., i, :i].clone()
        above = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * above).sum(-2)
    return attn + torch.eye(chunk, dtype=attn.dtype, device=attn.device)


def plain_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                 use_qk_l2norm=False, chunk_size=64):
    """Chunked delta rule with a scalar log-gate g [B, T, HV] (None: no gate)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    C = chunk_size
    q, k, scale = _prepare(q, k, scale, use_qk_l2norm, HV)
    q, k, v, beta = _to_chunks(q, C) * scale, _to_chunks(k, C), _to_chunks(v, C), _to_chunks(beta, C)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.triu(torch.ones(C, C, dtype=torch.bool, device=q.device))
    attn = k_beta @ k.transpose(-1, -2)
    if g is not None:
        g = _to_chunks(g, C).cumsum(-1)  # log-decay from the chunk start
        decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()
        attn = attn * decay
    attn = _solve_unit_lower(-attn.masked_fill(upper, 0), C)
    u = attn @ v_beta
    w = attn @ (k_beta * g.exp()[..., None]) if g is not None else attn @ k_beta
    state = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.float()
    o = torch.zeros_like(u)
    future = torch.triu(torch.ones(C, C, dtype=torch.bool, device=q.device), diagonal=1)
    for n in range(u.shape[2]):
        q_n, k_n = q[:, :, n], k[:, :, n]
        scores = q_n @ k_n.transpose(-1, -2)
        if g is not None:
            scores = scores * decay[:, :, n]
        scores = scores.masked_fill(future, 0)
        u_n = u[:, :, n] - w[:, :, n] @ state
        if g is not None:
            g_n = g[:, :, n]
            o[:, :, n] = (q_n * g_n[..., None].exp()) @ state + scores @ u_n
            carry = (k_n * (g_n[..., -1:] - g_n).exp()[..., None]).transpose(-1, -2) @ u_n
            state = state * g_n[..., -1, None, None].exp() + carry
        else:
            o[:, :, n] = q_n @ state + scores @ u_n
            state = state + k_n.transpose(-1, -2) @ u_n
    o = o.reshape(B, HV, -1, V)[:, :, :T].transpose(1, 2).to(out_dtype)
    return o, (state if output_final_state else None)


def plain_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    use_qk_l2norm=False, chunk_size=64):
    """Chunked delta rule with a per-channel log-gate g [B, T, HV, K] (Kimi Delta Attention)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    C = chunk_size
    q, k, scale = _prepare(q, k, scale, use_qk_l2norm, HV)
    q, k, v, beta = _to_chunks(q, C) * scale, _to_chunks(k, C), _to_chunks(v, C), _to_chunks(beta, C)
    g = _to_chunks(g, C).cumsum(-2)  # [B, HV, N, C, K]
    positions = torch.arange(C, device=q.device)
    # Column i of the intra-chunk key matrix: sum_c k_r,c k_i,c exp(G_r,c - G_i,c) for rows r > i
    # (the exponent is masked to 0 on the other rows before exp, so nothing overflows).
    columns = []
    for i in range(C):
        later = (positions > i)[:, None]
        rel = (g - g[..., i:i + 1, :]).masked_fill(~later, 0).exp()
        columns.append(((k * rel) * k[..., i:i + 1, :]).sum(-1).masked_fill(~later[:, 0], 0))
    attn = -torch.stack(columns, dim=-1) * beta[..., None]
    attn = _solve_unit_lower(attn, C) * beta[..., None, :]
    w = attn @ (g.exp() * k)
    u = attn @ v
    state = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.float()
    o = torch.zeros_like(u)
    causal = positions[:, None] >= positions[None, :]
    for n in range(u.shape[2]):
        q_n, k_n, g_n = q[:, :, n], k[:, :, n], g[:, :, n]
        rel = (g_n[..., :, None, :] - g_n[..., None, :, :]).masked_fill(~causal[..., None], 0).exp()
        scores = torch.einsum("bhtc,bhsc,bhtsc->bhts", q_n, k_n, rel).masked_fill(~causal, 0)
        u_n = u[:, :, n] - w[:, :, n] @ state
        o[:, :, n] = (q_n * g_n.exp()) @ state + scores @ u_n
        carry = (k_n * (g_n[..., -1:, :] - g_n).exp()).transpose(-1, -2) @ u_n
        state = state * g_n[..., -1, :, None].exp() + carry
    o = o.reshape(B, HV, -1, V)[:, :, :T].transpose(1, 2).to(out_dtype)
    return o, (state if output_final_state else None)


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time, [B, T, D] -> [B, T, D], then SiLU."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        return F.silu(self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2))


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim, times SiLU of an output gate (FLA's FusedRMSNormGated)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (x * F.silu(gate.float())).to(dtype)


def _check_config(hidden_size, num_heads, head_dim, num_v_heads, head_v_dim, conv_size, mode, chunk_size):
    for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                        ("num_v_heads", num_v_heads), ("head_v_dim", head_v_dim), ("conv_size", conv_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if num_v_heads % num_heads:
        raise ValueError(f"num_v_heads: must be a multiple of num_heads={num_heads}, got {num_v_heads}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if not isinstance(chunk_size, int) or chunk_size < 2:
        raise ValueError(f"chunk_size: expected an int >= 2, got {chunk_size!r}")


class _DeltaLayer(nn.Module):
    """What GDN and KDA share: projections, short convolutions, beta, gated norm, output projection."""

    def __init__(self, hidden_size, num_heads, head_dim, num_v_heads, head_v_dim, conv_size, mode, chunk_size,
                 norm_eps):
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim = head_dim if head_v_dim is None else head_v_dim
        _check_config(hidden_size, num_heads, head_dim, num_v_heads, head_v_dim, conv_size, mode, chunk_size)
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_v_heads, self.head_v_dim = num_v_heads, head_v_dim
        self.mode, self.chunk_size = mode, chunk_size
        key_dim, value_dim = num_heads * head_dim, num_v_heads * head_v_dim
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.q_conv = ShortConvolution(key_dim, conv_size)
        self.k_conv = ShortConvolution(key_dim, conv_size)
        self.v_conv = ShortConvolution(value_dim, conv_size)
        self.o_norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def _qkv_beta(self, x):
        B, T, _ = x.shape
        q = self.q_conv(self.q_proj(x)).view(B, T, self.num_heads, self.head_dim)
        k = self.k_conv(self.k_proj(x)).view(B, T, self.num_heads, self.head_dim)
        v = self.v_conv(self.v_proj(x)).view(B, T, self.num_v_heads, self.head_v_dim)
        beta = self.b_proj(x).sigmoid()
        return q, k, v, beta

    def _finish(self, x, o, gate_input, state, output_final_state):
        B, T, _ = x.shape
        gate = gate_input.view(B, T, self.num_v_heads, self.head_v_dim)
        o = self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))
        return (o, state) if output_final_state else o

    def _check_input(self, x, initial_state):
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected [batch, time, {self.hidden_size}], got shape {tuple(x.shape)}")
        expected = (x.shape[0], self.num_v_heads, self.head_dim, self.head_v_dim)
        if initial_state is not None and tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state: expected shape {expected}, got {tuple(initial_state.shape)}")


class GatedDeltaNet(_DeltaLayer):
    """Gated DeltaNet layer (FLA-style): q/k/v projections with short causal convolutions and SiLU,
    l2-normalised q and k, beta = sigmoid(b_proj x), g = -exp(A_log) * softplus(a_proj x + dt_bias),
    the gated delta rule, output RMSNorm gated by SiLU(g_proj x), o_proj.

    mode="plain" runs `plain_chunk_gated_delta_rule` (what torch.compile(backend="hc") lowers to our
    op); mode="op" calls `hccompile.chunk_gated_delta_rule`. Same parameters, same math.
    """

    def __init__(self, hidden_size: int = 256, num_heads: int = 4, head_dim: int = 64, num_v_heads: int | None = None,
                 head_v_dim: int | None = None, conv_size: int = 4, mode: str = "plain", chunk_size: int = 64,
                 norm_eps: float = 1e-5):
        super().__init__(hidden_size, num_heads, head_dim, num_v_heads, head_v_dim, conv_size, mode, chunk_size,
                         norm_eps)
        HV = self.num_v_heads
        self.a_proj = nn.Linear(hidden_size, HV, bias=False)
        self.g_proj = nn.Linear(hidden_size, HV * self.head_v_dim, bias=False)
        # Decay rates A in [1, 16] and time steps dt in [1e-3, 1e-1], as in Mamba-2 and FLA.
        self.A_log = nn.Parameter(torch.empty(HV).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(HV) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def forward(self, x: torch.Tensor, initial_state: torch.Tensor | None = None, output_final_state: bool = False):
        self._check_input(x, initial_state)
        q, k, v, beta = self._qkv_beta(x)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        if self.mode == "plain":
            o, state = plain_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                    output_final_state=output_final_state, use_qk_l2norm=True,
                                                    chunk_size=self.chunk_size)
        else:
            from ..lowering.delta_rule import chunk_gated_delta_rule

            o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                              output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)
        return self._finish(x, o, self.g_proj(x), state, output_final_state)


class KimiDeltaAttention(_DeltaLayer):
    """Kimi Delta Attention layer (FLA-style): as GatedDeltaNet, with a per-channel gate from a
    low-rank projection, g = -exp(A_log) * softplus(f_proj x + dt_bias), A_log [HV], dt_bias [HV*K],
    and a low-rank output gate.

    mode="plain" runs `plain_chunk_kda`; mode="op" calls `hccompile.chunk_kda` with the gate
    activation in the kernel (use_gate_in_kernel=True), the same formula.
    """

    def __init__(self, hidden_size: int = 256, num_heads: int = 4, head_dim: int = 64, num_v_heads: int | None = None,
                 head_v_dim: int | None = None, conv_size: int = 4, mode: str = "plain", chunk_size: int = 64,
                 norm_eps: float = 1e-5):
        super().__init__(hidden_size, num_heads, head_dim, num_v_heads, head_v_dim, conv_size, mode, chunk_size,
                         norm_eps)
        HV, K, Vd = self.num_v_heads, self.head_dim, self.head_v_dim
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, Vd, bias=False), nn.Linear(Vd, HV * K, bias=False))
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, Vd, bias=False), nn.Linear(Vd, HV * Vd, bias=False))
        self.A_log = nn.Parameter(torch.empty(HV).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(HV * K) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor, initial_state: torch.Tensor | None = None, output_final_state: bool = False):
        self._check_input(x, initial_state)
        B, T, _ = x.shape
        q, k, v, beta = self._qkv_beta(x)
        g_raw = self.f_proj(x).view(B, T, self.num_v_heads, self.head_dim)
        if self.mode == "plain":
            bias = self.dt_bias.view(self.num_v_heads, self.head_dim)
            g = -self.A_log.float().exp()[:, None] * F.softplus(g_raw.float() + bias)
            o, state = plain_chunk_kda(q, k, v, g, beta, initial_state=initial_state,
                                       output_final_state=output_final_state, use_qk_l2norm=True,
                                       chunk_size=self.chunk_size)
        else:
            from ..lowering.delta_rule import chunk_kda

            o, state = chunk_kda(q, k, v, g_raw, beta, initial_state=initial_state,
                                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=True,
                                 A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True)
        return self._finish(x, o, self.g_proj(x), state, output_final_state)


class TinyDeltaNetModel(nn.Module):
    """Pre-norm blocks of a delta layer and a GELU MLP over token embeddings; the example compiles it."""

    def __init__(self, vocab: int = 256, hidden_size: int = 64, layers: int = 2, kind: str = "gdn", **layer_args):
        super().__init__()
        if kind not in ("gdn", "kda"):
            raise ValueError(f"kind: expected 'gdn' or 'kda', got {kind!r}")
        layer = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
        self.embed = nn.Embedding(vocab, hidden_size)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "norm1": nn.RMSNorm(hidden_size),
                "attn": layer(hidden_size, **layer_args),
                "norm2": nn.RMSNorm(hidden_size),
                "mlp": nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(),
                                     nn.Linear(4 * hidden_size, hidden_size)),
            }))
        self.norm = nn.RMSNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm1"](x))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(self.norm(x))
