"""Plain PyTorch references for lightning attention: causal linear attention with a constant
per-head decay (lightning attention 2, FLA's ``g_gamma``).

Per head h with log-decay gamma_h <= 0 (0 = no decay), layout [B, T, H, D]:

    o_t = scale * sum_{s <= t} exp(gamma_h (t - s)) (q_t . k_s) v_s
          + scale * exp(gamma_h (t + 1)) q_t S_0                   (initial state S_0: [B, H, K, V])
    S_T = sum_s exp(gamma_h (T - 1 - s)) k_s v_s^T + exp(gamma_h T) S_0

Both references compute in float64 when given float64 inputs (float32 otherwise) and are
differentiable by autograd; the decay is treated as a constant.
"""

from __future__ import annotations

import torch

from ..value_checks import host_ints, values_checked

from .reference import check_attention_shapes

__all__ = [
    "check_cu_seqlens",
    "check_decay_and_state",
    "lightning_attn_ref",
    "lightning_attn_recurrent_ref",
    "lightning_attn_varlen_ref",
]


def check_decay_and_state(
    q: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    **states,
) -> None:
    """Raise unless `decay` is [H] and every given state (initial_state=, dht=) is [N, H, K, V],
    N = `num_states` (the batch size unless given: the number of sequences of a varlen batch)."""
    batch, _, heads, key_dim = q.shape
    batch = states.pop("num_states", None) or batch
    value_dim = v.shape[3]
    if not isinstance(decay, torch.Tensor):
        raise TypeError(f"decay: expected a torch.Tensor of shape [{heads}], got {type(decay).__name__}")
    if tuple(decay.shape) != (heads,):
        raise ValueError(f"decay: expected shape ({heads},) (one log-decay per head), got {tuple(decay.shape)}")
    if not decay.is_floating_point():
        raise TypeError(f"decay: expected a floating-point tensor, got dtype {decay.dtype}")
    if decay.device != q.device:
        raise ValueError(f"decay: device {decay.device} differs from q's device {q.device}")
    # Checking the values needs them on the host; on a GPU that is a synchronisation, so GPU
    # decays are checked only when asked (HCCOMPILE_CHECK_GATES=1, kernels/value_checks.py).
    if values_checked(decay.device):
        if not torch.isfinite(decay).all():
            raise ValueError("decay: log-decays must be finite")
        if (decay > 0).any():
            raise ValueError(f"decay: log-decays must be <= 0 (0 = no decay), got max {decay.max().item()}")
    expected = (batch, heads, key_dim, value_dim)
    for name, state in states.items():
        if state is None:
            continue
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(state).__name__}")
        if tuple(state.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected} [N, heads, K, V], got {tuple(state.shape)}")
        if not state.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got dtype {state.dtype}")
        if state.device != q.device:
            raise ValueError(f"{name}: device {state.device} differs from q's device {q.device}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def lightning_attn_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quadratic reference: the full [T, T] decayed causal score matrix per head.

    Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] or None).
    """
    check_attention_shapes(q, k, v)
    check_decay_and_state(q, v, decay, initial_state=initial_state)
    dtype = _compute_dtype(q.dtype)
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    gamma = decay.detach().to(dtype)  # a constant: no gradient flows to the decay
    time = q.shape[1]
    index = torch.arange(time, device=q.device, dtype=dtype)
    distance = index[:, None] - index[None, :]  # t - s
    causal = distance >= 0
    # Clamping before exp keeps the masked (s > t) entries from overflowing.
    weights = torch.exp(gamma[:, None, None] * distance.clamp_min(0)) * causal  # [H, T, T]
    scores = torch.einsum("bthk,bshk->bhts", qf, kf) * scale * weights
    o = torch.einsum("bhts,bshv->bthv", scores, vf)
    if initial_state is not None:
        s0 = initial_state.to(dtype)
        query_decay = torch.exp(gamma[:, None] * (index[None, :] + 1))  # [H, T]
        o = o + scale * torch.einsum("bthk,bhkv->bthv", qf * query_decay.t()[None, :, :, None], s0)
    final_state = None
    if output_final_state:
        key_decay = torch.exp(gamma[:, None] * (time - 1 - index[None, :]))  # [H, T]
        final_state = torch.einsum("bshk,bshv->bhkv", kf * key_decay.t()[None, :, :, None], vf)
        if initial_state is not None:
            final_state = final_state + torch.exp(gamma * time)[None, :, None, None] * initial_state.to(dtype)
        if dtype != torch.float64:
            final_state = final_state.float()
    return o.to(v.dtype), final_state


def lightning_attn_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence S_t = exp(gamma) S_{t-1} + k_t v_t^T, o_t = scale q_t S_t.

    An independent formulation for cross-checking lightning_attn_ref; O(T) Python steps.
    """
    check_attention_shapes(q, k, v)
    check_decay_and_state(q, v, decay, initial_state=initial_state)
    dtype = _compute_dtype(q.dtype)
    batch, time, heads, key_dim = q.shape
    value_dim = v.shape[3]
    step = torch.exp(decay.detach().to(dtype))[None, :, None, None]
    if initial_state is None:
        state = torch.zeros(batch, heads, key_dim, value_dim, dtype=dtype, device=q.device)
    else:
        state = initial_state.to(dtype)
    outputs = []
    for t in range(time):
        kt, vt = k[:, t].to(dtype), v[:, t].to(dtype)
        state = step * state + kt[..., :, None] * vt[..., None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t].to(dtype), state))
    if outputs:
        o = torch.stack(outputs, dim=1)
    else:
        o = torch.zeros(batch, 0, heads, value_dim, dtype=dtype, device=q.device)
    final_state = None
    if output_final_state:
        final_state = state if dtype == torch.float64 else state.float()
    return o.to(v.dtype), final_state


def check_cu_seqlens(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    """Number of sequences (states): B for fixed-length batches, len(cu_seqlens) - 1 for varlen.

    Varlen batches follow FLA: B = 1, cu_seqlens an integer tensor [N + 1] starting at 0,
    non-decreasing, ending at T. The values are read on the host (one sync on a GPU).
    """
    if cu_seqlens is None:
        return q.shape[0]
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: a variable-length batch needs batch size 1, got q with batch {q.shape[0]}")
    bounds = list(host_ints(cu_seqlens))
    if bounds[0] != 0 or bounds[-1] != q.shape[1]:
        raise ValueError(f"cu_seqlens: must start at 0 and end at T={q.shape[1]}, got {bounds[0]} .. {bounds[-1]}")
    if any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError("cu_seqlens: must be non-decreasing")
    return len(bounds) - 1


def lightning_attn_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lightning_attn_ref over the sequences of a varlen batch (B = 1, cu_seqlens [N + 1]);
    states are [N, H, K, V]. Without cu_seqlens it is lightning_attn_ref."""
    if cu_seqlens is None:
        return lightning_attn_ref(q, k, v, decay, scale, initial_state, output_final_state)
    check_cu_seqlens(q, cu_seqlens)
    bounds = list(host_ints(cu_seqlens))
    outputs, states = [], []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, state = lightning_attn_ref(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], decay, scale, h0, True)
        outputs.append(o)
        states.append(state)
    final_state = torch.cat(states) if output_final_state else None
    return torch.cat(outputs, dim=1), final_state
