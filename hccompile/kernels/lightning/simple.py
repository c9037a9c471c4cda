"""Simple chunked Triton kernels for causal linear attention without decay.

One kernel computes out[t] = scale * sum over s <= t (or s >= t) of (a[t] . b[s]) c[s];
the forward pass and each of the three gradients are a launch of it with
different tensors in the a, b, c roles.
"""

from __future__ import annotations


import torch

from .reference import check_attention_shapes

from .._triton import cdiv, direct, dot, interpreted, load_tile, next_power_of_2, require_triton, tl, triton, triton_available

__all__ = [
    "MAX_HEAD_DIM",
    "causal_linear_attn_fwd",
    "causal_linear_attn_bwd",
    "triton_available",
]

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CHUNK_SIZE = 64
# Exact fp32 dots ("ieee") run on CUDA cores, not tensor cores; 64-row fp32 tiles spill
# registers there, and 32 rows measured 10-20x faster on an H100 at head dims 128-256.
FP32_CHUNK_SIZE = 32
# Wider value tiles only add registers; splitting the value dim over programs is free
# because output columns are independent.
MAX_VALUE_TILE = 64
# tl.dot needs every block dim to be at least 16.
MIN_DOT_DIM = 16
# Triton software-pipelines the loop over chunks, keeping one copy of the loaded tiles
# per stage in shared memory; three fp32 stages at head dim 256 exceed even an H100's
# 227 KiB, so the stage count is fitted to this budget.
PIPELINE_SHARED_MEMORY_BUDGET = 96 * 1024
MAX_PIPELINE_STAGES = 3


if triton is not None:

    @triton.jit
    def _masked_linear_attn_kernel(
        a_ptr, b_ptr, c_ptr, out_ptr,
        stride_ab, stride_at, stride_ah, stride_ad,
        stride_bb, stride_bt, stride_bh, stride_bd,
        stride_cb, stride_ct, stride_ch, stride_cd,
        stride_ob, stride_ot, stride_oh, stride_od,
        T, H, DIM_AB, DIM_C, scale,
        REVERSE: tl.constexpr,
        BT: tl.constexpr,
        BLOCK_AB: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_OPERANDS: tl.constexpr,
    ):
        """One program: rows [i*BT, (i+1)*BT) of one (batch, head), columns of one c-tile.

        Without REVERSE, sums over chunks j < i fully and the diagonal chunk under a
        lower-triangular mask; with REVERSE, over chunks j > i and an upper-triangular mask.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        scale = tl.cast(scale, tl.float32)
        pid_bh = tl.program_id(0)
        pid_t = tl.program_id(1)
        pid_c = tl.program_id(2)
        # int64 so that batch and head offsets cannot overflow on tensors over 2**31 elements.
        batch = (pid_bh // H).to(tl.int64)
        head = (pid_bh % H).to(tl.int64)
        a_ptr += batch * stride_ab + head * stride_ah
        b_ptr += batch * stride_bb + head * stride_bh
        c_ptr += batch * stride_cb + head * stride_ch
        out_ptr += batch * stride_ob + head * stride_oh

        local = tl.arange(0, BT)
        rows = pid_t * BT + local
        ab_cols = tl.arange(0, BLOCK_AB)
        c_cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)

        a_tile = load_tile(a_ptr, rows, ab_cols, stride_at, stride_ad, T, DIM_AB)
        acc = tl.zeros([BT, BLOCK_C], dtype=tl.float32)

        if REVERSE:
            first_chunk = pid_t + 1
            end_chunk = tl.cdiv(T, BT)
        else:
            first_chunk = 0
            end_chunk = pid_t
        for chunk in range(first_chunk, end_chunk):
            cols = chunk * BT + local
            b_tile = load_tile(b_ptr, cols, ab_cols, stride_bt, stride_bd, T, DIM_AB)
            c_tile = load_tile(c_ptr, cols, c_cols, stride_ct, stride_cd, T, DIM_C)
            # Scaling before the cast keeps fp16 scores away from overflow.
            scores = dot(a_tile, tl.trans(b_tile), DOT_PRECISION, UPCAST_OPERANDS) * scale
            acc += dot(scores.to(c_tile.dtype), c_tile, DOT_PRECISION, UPCAST_OPERANDS)

        b_tile = load_tile(b_ptr, rows, ab_cols, stride_bt, stride_bd, T, DIM_AB)
        c_tile = load_tile(c_ptr, rows, c_cols, stride_ct, stride_cd, T, DIM_C)
        scores = dot(a_tile, tl.trans(b_tile), DOT_PRECISION, UPCAST_OPERANDS) * scale
        if REVERSE:
            visible = local[:, None] <= local[None, :]
        else:
            visible = local[:, None] >= local[None, :]
        scores = tl.where(visible, scores, 0.0)
        acc += dot(scores.to(c_tile.dtype), c_tile, DOT_PRECISION, UPCAST_OPERANDS)

        out_ptrs = out_ptr + rows[:, None] * stride_ot + c_cols[None, :] * stride_od
        out_mask = (rows[:, None] < T) & (c_cols[None, :] < DIM_C)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)

    # The same kernel under a second JIT handle for the backward's three launches (same source,
    # same compiled binary): a compiled graph names kernels, and hccompile.lowering tells the
    # backward op's launches from the forward op's by the handle.
    _masked_linear_attn_bwd_kernel = triton.jit(_masked_linear_attn_kernel.fn)


def _check_kernel_inputs(**named: torch.Tensor) -> None:
    """Checks beyond shapes: dtype, device and head-dim limits shared by the launchers."""
    first_name, first = next(iter(named.items()))
    for name, tensor in named.items():
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name}: dtype {tensor.dtype} is not supported; expected one of float16, bfloat16, float32"
            )
        if tensor.dtype != first.dtype:
            raise TypeError(f"{name}: dtype {tensor.dtype} differs from {first_name}'s dtype {first.dtype}")
        if tensor.device != first.device:
            raise ValueError(f"{name}: device {tensor.device} differs from {first_name}'s device {first.device}")
        head_dim = tensor.shape[3]
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {head_dim} exceeds the supported maximum {MAX_HEAD_DIM}")
        if head_dim < 1:
            raise ValueError(f"{name}: head dim must be at least 1, got {head_dim}")


def _check_out(name: str, out: torch.Tensor, like: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(out.shape)} differs from the expected {shape}")
    if out.dtype != like.dtype:
        raise TypeError(f"{name}: dtype {out.dtype} differs from the expected {like.dtype}")
    if out.device != like.device:
        raise ValueError(f"{name}: device {out.device} differs from the expected {like.device}")


def _kernels_interpreted() -> bool:
    return interpreted(_masked_linear_attn_kernel)


def _require_triton(device: torch.device) -> None:
    require_triton(device, _masked_linear_attn_kernel, "hccompile.kernels.lightning.simple", "causal_linear_attn_chunked_ref")


def _block_dim(dim: int) -> int:
    return max(MIN_DOT_DIM, next_power_of_2(dim))


def _launch_masked_linear_attn(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    reverse: bool,
    kernel=None,
    wrap=None,
) -> None:
    """out[t] = scale * sum over s <= t (s >= t if `reverse`) of (a[t] . b[s]) c[s]; `kernel`
    defaults to _masked_linear_attn_kernel, `wrap` (torch.library.wrap_triton when traced) to
    launching it directly."""
    kernel = _masked_linear_attn_kernel if kernel is None else kernel
    launch = (direct if wrap is None else wrap)(kernel)
    batch, time, heads, dim_ab = a.shape
    dim_c = c.shape[3]
    if batch * heads == 0 or time == 0:
        return
    is_fp32 = a.dtype == torch.float32
    chunk_size = FP32_CHUNK_SIZE if is_fp32 else CHUNK_SIZE
    block_ab = _block_dim(dim_ab)
    block_c = min(_block_dim(dim_c), MAX_VALUE_TILE)
    stage_bytes = chunk_size * (block_ab + block_c) * a.element_size()
    num_stages = max(1, min(MAX_PIPELINE_STAGES, PIPELINE_SHARED_MEMORY_BUDGET // stage_bytes))
    grid = (batch * heads, cdiv(time, chunk_size), cdiv(dim_c, block_c))
    launch[grid](
        a, b, c, out,
        *a.stride(), *b.stride(), *c.stride(), *out.stride(),
        time, heads, dim_ab, dim_c, float(scale),
        REVERSE=reverse,
        BT=chunk_size,
        BLOCK_AB=block_ab,
        BLOCK_C=block_c,
        # The default for fp32 is tf32 on GPUs, which would cost about three digits.
        DOT_PRECISION="ieee" if is_fp32 else "tf32",
        UPCAST_OPERANDS=_kernels_interpreted() and a.dtype == torch.bfloat16,
        num_stages=num_stages,
    )


def causal_linear_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    wrap=None,
) -> torch.Tensor:
    """o = scale * tril(q k^T) v per batch and head; q, k: [B, T, H, K], v: [B, T, H, V].

    Returns o: [B, T, H, V] in v's dtype, written into `out` when given.
    """
    check_attention_shapes(q, k, v)
    _check_kernel_inputs(q=q, k=k, v=v)
    batch, time, heads, _ = q.shape
    o_shape = (batch, time, heads, v.shape[3])
    if out is None:
        out = torch.empty(o_shape, dtype=v.dtype, device=v.device)
    else:
        _check_out("out", out, v, o_shape)
    _require_triton(q.device)
    _launch_masked_linear_attn(q, k, v, out, scale, reverse=False, wrap=wrap)
    return out


def causal_linear_attn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of causal_linear_attn_fwd given do = dL/do.

    Written into `out` = (dq, dk, dv) when given.
    """
    check_attention_shapes(q, k, v, do=do)
    _check_kernel_inputs(q=q, k=k, v=v, do=do)
    if out is None:
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise TypeError("out: expected a tuple (dq, dk, dv)")
        dq, dk, dv = out
        for name, grad, like in (("out[0] (dq)", dq, q), ("out[1] (dk)", dk, k), ("out[2] (dv)", dv, v)):
            _check_out(name, grad, like, tuple(like.shape))
    _require_triton(q.device)
    # Each gradient is a linear attention over the other tensors (see reference.py).
    bwd = _masked_linear_attn_bwd_kernel
    _launch_masked_linear_attn(do, v, k, dq, scale, reverse=False, kernel=bwd, wrap=wrap)
    _launch_masked_linear_attn(v, do, q, dk, scale, reverse=True, kernel=bwd, wrap=wrap)
    _launch_masked_linear_attn(k, q, do, dv, scale, reverse=True, kernel=bwd, wrap=wrap)
    return dq, dk, dv
