"""Plain PyTorch references for causal linear attention without decay.

Layout is [batch, time, heads, head_dim]; o[t] = scale * sum_{s <= t} (q[t] . k[s]) v[s].
"""

from __future__ import annotations

import torch

__all__ = [
    "causal_linear_attn_ref",
    "causal_linear_attn_chunked_ref",
    "causal_linear_attn_bwd_ref",
]


def check_attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **extra: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v (and `extra`, e.g. do=...) have compatible [B, T, H, D] shapes."""
    named = {"q": q, "k": k, "v": v, **extra}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name}: expected a 4-D tensor [batch, time, heads, head_dim], got shape {tuple(tensor.shape)}"
            )
    batch_time_heads = tuple(q.shape[:3])
    for name, tensor in named.items():
        if tuple(tensor.shape[:3]) != batch_time_heads:
            raise ValueError(
                f"{name}: batch, time, heads {tuple(tensor.shape[:3])} differ from q's {batch_time_heads}"
            )
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k: head dim {k.shape[3]} differs from q's head dim {q.shape[3]}")
    if "do" in extra and extra["do"].shape[3] != v.shape[3]:
        raise ValueError(f"do: head dim {extra['do'].shape[3]} differs from v's head dim {v.shape[3]}")


def causal_linear_attn_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Quadratic-memory reference, computed in the inputs' dtype (tests use float64)."""
    check_attention_shapes(q, k, v)
    scores = torch.einsum("bthk,bshk->bhts", q, k) * scale
    time = q.shape[1]
    causal = torch.ones(time, time, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, 0)
    return torch.einsum("bhts,bshv->bthv", scores, v)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 stays float64 so the references can be checked against each other exactly.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunked_masked_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    chunk: int,
    reverse: bool,
) -> torch.Tensor:
    """scale * sum over s <= t (s >= t when `reverse`) of (q[t] . k[s]) v[s], in the accumulation dtype.

    Carries the running sum of k[s]^T v[s] over finished chunks, so memory is
    O(T * chunk + K * V) instead of O(T^2).
    """
    if chunk < 1:
        raise ValueError(f"chunk: must be at least 1, got {chunk}")
    acc_dtype = _accumulation_dtype(q.dtype)
    batch, time, heads, _ = q.shape
    key_dim, value_dim = k.shape[3], v.shape[3]
    out = torch.empty(batch, time, heads, value_dim, dtype=acc_dtype, device=q.device)
    state = torch.zeros(batch, heads, key_dim, value_dim, dtype=acc_dtype, device=q.device)
    starts = list(range(0, time, chunk))
    if reverse:
        starts.reverse()
    for start in starts:
        stop = min(start + chunk, time)
        q_chunk = q[:, start:stop].transpose(1, 2).to(acc_dtype)
        k_chunk = k[:, start:stop].transpose(1, 2).to(acc_dtype)
        v_chunk = v[:, start:stop].transpose(1, 2).to(acc_dtype)
        visible = torch.ones(stop - start, stop - start, dtype=torch.bool, device=q.device)
        visible = visible.triu() if reverse else visible.tril()
        scores = (q_chunk @ k_chunk.transpose(-1, -2)).masked_fill(~visible, 0)
        out_chunk = scores @ v_chunk + q_chunk @ state
        out[:, start:stop] = (out_chunk * scale).transpose(1, 2)
        state += k_chunk.transpose(-1, -2) @ v_chunk
    return out


def causal_linear_attn_chunked_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int = 64
) -> torch.Tensor:
    """Chunked forward, fp32 accumulation (float64 for float64 inputs), output in v's dtype."""
    check_attention_shapes(q, k, v)
    return _chunked_masked_attn(q, k, v, scale, chunk, reverse=False).to(v.dtype)


def causal_linear_attn_bwd_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Explicit chunked backward; returns (dq, dk, dv) in the dtypes of q, k, v.

    Each gradient is itself a linear attention over the other tensors:
      dq[t] = scale * sum_{s <= t} (do[t] . v[s]) k[s]
      dk[s] = scale * sum_{t >= s} (v[s] . do[t]) q[t]
      dv[s] = scale * sum_{t >= s} (k[s] . q[t]) do[t]
    """
    check_attention_shapes(q, k, v, do=do)
    dq = _chunked_masked_attn(do, v, k, scale, chunk, reverse=False)
    dk = _chunked_masked_attn(v, do, q, scale, chunk, reverse=True)
    dv = _chunked_masked_attn(k, q, do, scale, chunk, reverse=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
