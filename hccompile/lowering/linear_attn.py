"""Causal linear attention without decay, O = scale·tril(QKᵀ)V, as kernel ops (lowering/_launch.py).

Layout [B, T, H, D] (FLA's). One op per direction, so AOTAutograd puts the forward op in the forward
graph and the backward op in the backward graph. On CUDA the ops launch our Triton kernels through
wrap_triton (a compiled graph holds the launches; Inductor's code makes them); elsewhere they call
their `_host` twins, which run the kernels in Triton's interpreter (CPU, TRITON_INTERPRET=1) or the
chunked plain-PyTorch reference (CPU without the interpreter, or float64): same math, documented
fallback.
"""
from __future__ import annotations

import torch
from torch import Tensor
from ._launch import HEADS, call_op, kernel_op, register_autograd, wrap_triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_inputs(q: Tensor, k: Tensor, v: Tensor, do: Tensor | None = None) -> None:
    """Shape/dtype contract shared by both ops; errors name the argument and the limit."""
    named = [("q", q), ("k", k), ("v", v)] + ([("do", do)] if do is not None else [])
    for name, t in named:
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D [B, T, H, D] tensor, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES + (torch.float64,):
            raise TypeError(f"{name}: dtype {t.dtype} is not supported (float16, bfloat16, float32, "
                            f"float64)")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: device {t.device} differs from q's {q.device}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: shape {tuple(k.shape)} must equal q's {tuple(q.shape)}")
    if tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(f"v: leading dims [B, T, H] {tuple(v.shape[:3])} must equal q's "
                         f"{tuple(q.shape[:3])}")
    if do is not None and tuple(do.shape) != tuple(v.shape):
        raise ValueError(f"do: shape {tuple(do.shape)} must equal the output's {tuple(v.shape)}")
    for name, d in (("q/k", q.shape[-1]), ("v", v.shape[-1])):
        if isinstance(d, int) and d > MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {d} exceeds the supported maximum {MAX_HEAD_DIM}")


def uses_triton(t: Tensor) -> bool:
    from ..kernels.lightning import triton_available

    return t.dtype in SUPPORTED_DTYPES and triton_available(t.device)


def implementation(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Which implementation backs the ops for this device: 'triton', 'triton-interpreter' or
    'reference'."""
    from ..kernels.lightning import triton_available

    device = torch.device(device)
    if dtype in SUPPORTED_DTYPES and triton_available(device):
        return "triton" if device.type == "cuda" else "triton-interpreter"
    return "reference"


def _fwd_host(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    check_inputs(q, k, v)
    from ..kernels import lightning as K

    if uses_triton(q):
        return K.causal_linear_attn_fwd(q, k, v, scale)
    return K.causal_linear_attn_chunked_ref(q, k, v, scale)


def _fwd_fake(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    check_inputs(q, k, v)
    B, T, H, _ = q.shape
    return v.new_empty((B, T, H, v.shape[-1]))


def _fwd_traced(q, k, v, scale):
    check_inputs(q, k, v)
    from ..kernels import lightning as K

    return K.causal_linear_attn_fwd(q, k, v, scale, wrap=wrap_triton)


def _bwd_host(q: Tensor, k: Tensor, v: Tensor, do: Tensor, scale: float
              ) -> tuple[Tensor, Tensor, Tensor]:
    check_inputs(q, k, v, do)
    from ..kernels import lightning as K

    do = do.to(v.dtype)
    if uses_triton(q):
        return K.causal_linear_attn_bwd(q, k, v, do, scale)
    return K.causal_linear_attn_bwd_ref(q, k, v, do, scale)


def _bwd_fake(q: Tensor, k: Tensor, v: Tensor, do: Tensor, scale: float
              ) -> tuple[Tensor, Tensor, Tensor]:
    check_inputs(q, k, v, do)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _bwd_traced(q, k, v, do, scale):
    check_inputs(q, k, v, do)
    from ..kernels import lightning as K

    return K.causal_linear_attn_bwd(q, k, v, do.to(v.dtype), scale, wrap=wrap_triton)


def _simple_kernel(name: str):
    from ..kernels.lightning import simple

    return getattr(simple, name, None)


causal_linear_attn_op = kernel_op("causal_linear_attn", _fwd_host, _fwd_fake, _fwd_traced, SUPPORTED_DTYPES,
                                  (_simple_kernel("_masked_linear_attn_kernel"),),
                                  fixed_dims={"q": HEADS, "v": HEADS})
# the backward launches the same kernel three times, through a JIT handle of its own
causal_linear_attn_backward_op = kernel_op(
    "causal_linear_attn_backward", _bwd_host, _bwd_fake, _bwd_traced, SUPPORTED_DTYPES,
    (_simple_kernel("_masked_linear_attn_bwd_kernel"),), per_call=3, fixed_dims={"q": HEADS, "v": HEADS})


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scale = scale


def _backward(ctx, grad_out: Tensor):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = call_op(causal_linear_attn_backward_op, q, k, v, grad_out.contiguous(), ctx.scale)
    return dq, dk, dv, None


register_autograd(causal_linear_attn_op, _backward, _setup_context)


def causal_linear_attn(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """O = scale · tril(Q Kᵀ) V over the time axis; q, k: [B, T, H, K], v: [B, T, H, V].

    `scale` defaults to K**-0.5 as in FLA. Differentiable in q, k, v; works under
    torch.compile(fullgraph=True) with dynamic T.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return call_op(causal_linear_attn_op, q, k, v, float(scale))
