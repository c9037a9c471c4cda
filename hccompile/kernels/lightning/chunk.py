"""Chunked Triton kernels for lightning attention: causal linear attention with a constant
per-head decay (lightning attention 2 / FLA's ``g_gamma``), forward and backward.

Per head h with log-decay gamma <= 0, layout [B, T, H, D] (see decay_reference.py):

    o_t = scale * sum_{s <= t} exp(gamma (t - s)) (q_t . k_s) v_s + scale * exp(gamma (t + 1)) q_t S_0

Split (lightning attention 2): time is cut into blocks of BLOCK rows. For a block starting at t0
with L = min(BLOCK, T - t0) rows, local row l:

    inter:  o[t0 + l] += scale * exp(gamma (l + 1)) q[t0 + l] S_c        (S_c: state entering the block)
    intra:  o[t0 + l] += scale * sum_{m <= l} exp(gamma (l - m)) (q_l . k_m) v_m
    state:  S_{c+1} = exp(gamma L) S_c + sum_m exp(gamma (L - 1 - m)) k_m v_m^T      (fp32)

Backward (the design of seed 004, with decay): the intra-block terms are computed micro-chunk by
micro-chunk, CBLOCK rows at a time, recomputing each [CBLOCK, CBLOCK] score tile when it is needed;
no program ever holds a [BLOCK, BLOCK] tile and nothing is accumulated with atomics. The inter-block
terms come from a state sweep whose step is the SAME BLOCK as the intra-block split (the split is
exact only then; REFERENCE.md section 4): a forward sweep over the state S for dq, a reverse sweep
over dS = dL/dS_c for dk and dv:

    dq[t0 + l] = scale exp(gamma (l + 1)) do_l S_c^T + sum_{m <= l} scale exp(gamma (l - m)) (do_l . v_m) k_m
    dk[t0 + m] = exp(gamma (L - 1 - m)) v_m dS_{c+1}^T + sum_{l >= m} scale exp(gamma (l - m)) (do_l . v_m) q_l
    dv[t0 + m] = exp(gamma (L - 1 - m)) k_m dS_{c+1}   + sum_{l >= m} scale exp(gamma (l - m)) (q_l . k_m) do_l
    dS_c = exp(gamma L) dS_{c+1} + scale sum_l exp(gamma (l + 1)) q_l do_l^T,   dS_N = dht,   dh0 = dS_0

The forward and the dq computation have the same shape ("forward sweep": out_i from a_i, b_j, c_j
and a state X of b^T c), and so have dk and dv ("reverse sweep"), so there are two kernels:

    _forward_sweep_kernel:  o  = sweep(a=q,  b=k, c=v),  X = S   [K, V tile]   (+ final state)
                            dq = sweep(a=do, b=v, c=k),  X = S^T [V, K tile]
    _reverse_sweep_kernel:  dk = sweep(a=v,  b=do, c=q), X = dS^T [V, K tile]
                            dv = sweep(a=k,  b=q, c=do), X = dS   [K, V tile]  (+ dh0)

The decay is a constant: no gradient is computed for it.
"""

from __future__ import annotations


import torch

from .decay_reference import check_decay_and_state
from .reference import check_attention_shapes

from .._triton import dot as _dot
from .._triton import interpreted, load_tile as _load_tile, require_triton, tl, triton, triton_available

__all__ = [
    "MAX_HEAD_DIM",
    "lightning_attn_fwd",
    "lightning_attn_bwd",
    "triton_available",
]

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_BLOCK = 64
DEFAULT_CBLOCK = 16
MAX_BLOCK = 256
# tl.dot needs every block dim to be at least 16.
MIN_DOT_DIM = 16
# The tiled (non-contracted) head dim: output columns are independent, so splitting them over
# programs only costs recomputing the score tiles; wider tiles only add registers.
MAX_COLUMN_TILE = 64
# Triton software-pipelines the inner loops, keeping one copy of the loaded tiles per stage.
PIPELINE_SHARED_MEMORY_BUDGET = 96 * 1024
MAX_PIPELINE_STAGES = 3


if triton is not None:

    @triton.jit
    def _decay_tile(gamma, distance, scale):
        """scale * exp(gamma * distance) where distance >= 0, else 0 (the causal mask)."""
        # Clamping first keeps the masked entries' exponent <= 0, so nothing overflows.
        weights = tl.exp(gamma * tl.maximum(distance, 0).to(tl.float32)) * scale
        return tl.where(distance >= 0, weights, 0.0)

    @triton.jit
    def _forward_sweep_kernel(
        a_ptr, b_ptr, c_ptr, decay_ptr, x0_ptr, out_ptr, xt_ptr,
        stride_ab, stride_at, stride_ah, stride_ad,
        stride_bb, stride_bt, stride_bh, stride_bd,
        stride_cb, stride_ct, stride_ch, stride_cd,
        stride_ob, stride_ot, stride_oh, stride_od,
        stride_x0b, stride_x0h, stride_x0r, stride_x0c,
        stride_xtb, stride_xth, stride_xtr, stride_xtc,
        stride_decay,
        T, H, DIM_AB, DIM_C, scale,
        HAS_X0: tl.constexpr,
        STORE_XT: tl.constexpr,
        BLOCK: tl.constexpr,
        CBLOCK: tl.constexpr,
        BLOCK_AB: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_OPERANDS: tl.constexpr,
    ):
        """out[t] = scale sum_{s<=t} exp(g (t-s)) (a_t . b_s) c_s + scale exp(g (t+1)) a_t X_0.

        One program: one (batch, head) and one c-column tile, sequential over blocks of BLOCK
        rows; inside a block, micro-chunks of CBLOCK query rows against micro-chunks of CBLOCK
        key rows. Holds the fp32 state X [BLOCK_AB, BLOCK_C] (b^T c summed over past blocks).
        """
        pid_bh = tl.program_id(0)
        pid_c = tl.program_id(1)
        # int64 so that batch and head offsets cannot overflow on tensors over 2**31 elements.
        batch = (pid_bh // H).to(tl.int64)
        head = (pid_bh % H).to(tl.int64)
        a_ptr += batch * stride_ab + head * stride_ah
        b_ptr += batch * stride_bb + head * stride_bh
        c_ptr += batch * stride_cb + head * stride_ch
        out_ptr += batch * stride_ob + head * stride_oh
        gamma = tl.load(decay_ptr + head * stride_decay).to(tl.float32)

        micro = tl.arange(0, CBLOCK)
        ab_cols = tl.arange(0, BLOCK_AB)
        c_cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        if HAS_X0:
            x0_ptr += batch * stride_x0b + head * stride_x0h
            state = _load_tile(x0_ptr, ab_cols, c_cols, stride_x0r, stride_x0c, DIM_AB, DIM_C).to(tl.float32)
        else:
            state = tl.zeros([BLOCK_AB, BLOCK_C], dtype=tl.float32)

        for block_start in range(0, T, BLOCK):
            block_len = tl.minimum(T - block_start, BLOCK)
            n_micro = tl.cdiv(block_len, CBLOCK)
            # Intra-block terms plus the inter-block term from the state entering the block.
            for i in range(0, n_micro):
                local_i = i * CBLOCK + micro
                rows_i = block_start + local_i
                a_i = _load_tile(a_ptr, rows_i, ab_cols, stride_at, stride_ad, T, DIM_AB)
                row_decay = tl.where(local_i < block_len, tl.exp(gamma * (local_i + 1).to(tl.float32)) * scale, 0.0)
                acc = _dot(a_i, state.to(a_i.dtype), DOT_PRECISION, UPCAST_OPERANDS) * row_decay[:, None]
                for j in range(0, i + 1):
                    rows_j = block_start + j * CBLOCK + micro
                    b_j = _load_tile(b_ptr, rows_j, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                    c_j = _load_tile(c_ptr, rows_j, c_cols, stride_ct, stride_cd, T, DIM_C)
                    distance = (i - j) * CBLOCK + micro[:, None] - micro[None, :]
                    scores = _dot(a_i, tl.trans(b_j), DOT_PRECISION, UPCAST_OPERANDS)
                    scores = scores * _decay_tile(gamma, distance, scale)
                    acc += _dot(scores.to(c_j.dtype), c_j, DOT_PRECISION, UPCAST_OPERANDS)
                out_ptrs = out_ptr + rows_i[:, None] * stride_ot + c_cols[None, :] * stride_od
                out_mask = (rows_i[:, None] < T) & (c_cols[None, :] < DIM_C)
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
            # State step over the whole block: the same BLOCK as the intra split above.
            state = state * tl.exp(gamma * block_len.to(tl.float32))
            for j in range(0, n_micro):
                local_j = j * CBLOCK + micro
                rows_j = block_start + local_j
                b_j = _load_tile(b_ptr, rows_j, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                c_j = _load_tile(c_ptr, rows_j, c_cols, stride_ct, stride_cd, T, DIM_C)
                key_decay = tl.where(
                    local_j < block_len, tl.exp(gamma * (block_len - 1 - local_j).to(tl.float32)), 0.0
                )
                b_j = (b_j * key_decay[:, None]).to(c_j.dtype)
                state += _dot(tl.trans(b_j), c_j, DOT_PRECISION, UPCAST_OPERANDS)

        if STORE_XT:
            xt_ptr += batch * stride_xtb + head * stride_xth
            xt_ptrs = xt_ptr + ab_cols[:, None] * stride_xtr + c_cols[None, :] * stride_xtc
            xt_mask = (ab_cols[:, None] < DIM_AB) & (c_cols[None, :] < DIM_C)
            tl.store(xt_ptrs, state.to(xt_ptr.dtype.element_ty), mask=xt_mask)

    @triton.jit
    def _reverse_sweep_kernel(
        a_ptr, b_ptr, c_ptr, decay_ptr, x0_ptr, out_ptr, xt_ptr,
        stride_ab, stride_at, stride_ah, stride_ad,
        stride_bb, stride_bt, stride_bh, stride_bd,
        stride_cb, stride_ct, stride_ch, stride_cd,
        stride_ob, stride_ot, stride_oh, stride_od,
        stride_x0b, stride_x0h, stride_x0r, stride_x0c,
        stride_xtb, stride_xth, stride_xtr, stride_xtc,
        stride_decay,
        T, H, DIM_AB, DIM_C, scale,
        HAS_X0: tl.constexpr,
        STORE_XT: tl.constexpr,
        BLOCK: tl.constexpr,
        CBLOCK: tl.constexpr,
        BLOCK_AB: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_OPERANDS: tl.constexpr,
    ):
        """out[s] = scale sum_{t>=s} exp(g (t-s)) (b_t . a_s) c_t + exp(g (L-1-m)) a_s X_{c+1}.

        The reverse sweep: blocks from last to first, X_N = X0 (dht or its transpose),
        X_c = exp(g L) X_{c+1} + scale sum_l exp(g (l+1)) b_l^T c_l; X_0 is stored when
        STORE_XT (dh0). Inside a block, each key micro-chunk j sums over query micro-chunks
        i >= j, recomputing the [CBLOCK, CBLOCK] score tile; one writer per output row.
        """
        pid_bh = tl.program_id(0)
        pid_c = tl.program_id(1)
        batch = (pid_bh // H).to(tl.int64)
        head = (pid_bh % H).to(tl.int64)
        a_ptr += batch * stride_ab + head * stride_ah
        b_ptr += batch * stride_bb + head * stride_bh
        c_ptr += batch * stride_cb + head * stride_ch
        out_ptr += batch * stride_ob + head * stride_oh
        gamma = tl.load(decay_ptr + head * stride_decay).to(tl.float32)

        micro = tl.arange(0, CBLOCK)
        ab_cols = tl.arange(0, BLOCK_AB)
        c_cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        if HAS_X0:
            x0_ptr += batch * stride_x0b + head * stride_x0h
            state = _load_tile(x0_ptr, ab_cols, c_cols, stride_x0r, stride_x0c, DIM_AB, DIM_C).to(tl.float32)
        else:
            state = tl.zeros([BLOCK_AB, BLOCK_C], dtype=tl.float32)

        n_blocks = tl.cdiv(T, BLOCK)
        for reversed_index in range(0, n_blocks):
            block_start = (n_blocks - 1 - reversed_index) * BLOCK
            block_len = tl.minimum(T - block_start, BLOCK)
            n_micro = tl.cdiv(block_len, CBLOCK)
            # `state` is X_{c+1}: the gradient of the state leaving this block.
            for j in range(0, n_micro):
                local_j = j * CBLOCK + micro
                rows_j = block_start + local_j
                a_j = _load_tile(a_ptr, rows_j, ab_cols, stride_at, stride_ad, T, DIM_AB)
                key_decay = tl.where(
                    local_j < block_len, tl.exp(gamma * (block_len - 1 - local_j).to(tl.float32)), 0.0
                )
                acc = _dot(a_j, state.to(a_j.dtype), DOT_PRECISION, UPCAST_OPERANDS) * key_decay[:, None]
                for i in range(j, n_micro):
                    rows_i = block_start + i * CBLOCK + micro
                    b_i = _load_tile(b_ptr, rows_i, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                    c_i = _load_tile(c_ptr, rows_i, c_cols, stride_ct, stride_cd, T, DIM_C)
                    # scores[r, m] for query row r of micro-chunk i and key row m of micro-chunk j.
                    distance = (i - j) * CBLOCK + micro[:, None] - micro[None, :]
                    scores = _dot(b_i, tl.trans(a_j), DOT_PRECISION, UPCAST_OPERANDS)
                    scores = scores * _decay_tile(gamma, distance, scale)
                    acc += _dot(tl.trans(scores.to(c_i.dtype)), c_i, DOT_PRECISION, UPCAST_OPERANDS)
                out_ptrs = out_ptr + rows_j[:, None] * stride_ot + c_cols[None, :] * stride_od
                out_mask = (rows_j[:, None] < T) & (c_cols[None, :] < DIM_C)
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
            # State step over the whole block: the same BLOCK as the intra split above.
            state = state * tl.exp(gamma * block_len.to(tl.float32))
            for i in range(0, n_micro):
                local_i = i * CBLOCK + micro
                rows_i = block_start + local_i
                b_i = _load_tile(b_ptr, rows_i, ab_cols, stride_bt, stride_bd, T, DIM_AB)
                c_i = _load_tile(c_ptr, rows_i, c_cols, stride_ct, stride_cd, T, DIM_C)
                row_decay = tl.where(local_i < block_len, tl.exp(gamma * (local_i + 1).to(tl.float32)) * scale, 0.0)
                c_i = (c_i * row_decay[:, None]).to(c_i.dtype)
                state += _dot(tl.trans(b_i), c_i, DOT_PRECISION, UPCAST_OPERANDS)

        if STORE_XT:
            xt_ptr += batch * stride_xtb + head * stride_xth
            xt_ptrs = xt_ptr + ab_cols[:, None] * stride_xtr + c_cols[None, :] * stride_xtc
            xt_mask = (ab_cols[:, None] < DIM_AB) & (c_cols[None, :] < DIM_C)
            tl.store(xt_ptrs, state.to(xt_ptr.dtype.element_ty), mask=xt_mask)


def _check_kernel_inputs(**named: torch.Tensor) -> None:
    """dtype, device and head-dim limits shared by the launchers."""
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


def _check_blocks(block: int, cblock: int) -> None:
    for name, value in (("block", block), ("cblock", cblock)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < MIN_DOT_DIM or value & (value - 1):
            raise ValueError(f"{name}: must be a power of two >= {MIN_DOT_DIM}, got {value}")
    if block > MAX_BLOCK:
        raise ValueError(f"block: {block} exceeds the supported maximum {MAX_BLOCK}")
    if cblock > block:
        raise ValueError(f"cblock: micro-chunk {cblock} exceeds block {block}; need cblock <= block")


def _check_out(name: str, out: torch.Tensor, dtype: torch.dtype, device: torch.device, shape: tuple) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(out.shape)} differs from the expected {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name}: dtype {out.dtype} differs from the expected {dtype}")
    if out.device != device:
        raise ValueError(f"{name}: device {out.device} differs from the expected {device}")


def _kernels_interpreted() -> bool:
    return interpreted(_forward_sweep_kernel)


def _require_triton(device: torch.device) -> None:
    require_triton(device, _forward_sweep_kernel, "hccompile.kernels.lightning.chunk", "lightning_attn_ref")


def _block_dim(dim: int) -> int:
    return max(MIN_DOT_DIM, triton.next_power_of_2(dim))


def _state_strides(state: torch.Tensor | None, transpose: bool) -> tuple[int, int, int, int]:
    """(batch, head, row, col) strides of a [B, H, K, V] state, rows/cols swapped if `transpose`."""
    if state is None:
        return (0, 0, 0, 0)
    sb, sh, sk, sv = state.stride()
    return (sb, sh, sv, sk) if transpose else (sb, sh, sk, sv)


def _launch_sweep(
    kernel,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    decay: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    block: int,
    cblock: int,
    x0: torch.Tensor | None = None,
    x0_transposed: bool = False,
    xt: torch.Tensor | None = None,
    xt_transposed: bool = False,
) -> None:
    """One sweep; a, b: [B, T, H, DIM_AB] (contracted, held whole), c/out: [B, T, H, DIM_C] (tiled)."""
    batch, time, heads, dim_ab = a.shape
    dim_c = c.shape[3]
    if batch * heads == 0 or dim_c == 0:
        return
    is_fp32 = a.dtype == torch.float32
    block_ab = _block_dim(dim_ab)
    block_c = min(_block_dim(dim_c), MAX_COLUMN_TILE)
    stage_bytes = cblock * (block_ab + block_c) * a.element_size()
    num_stages = max(1, min(MAX_PIPELINE_STAGES, PIPELINE_SHARED_MEMORY_BUDGET // stage_bytes))
    grid = (batch * heads, triton.cdiv(dim_c, block_c))
    # Unused pointers must still be tensors; `out` stands in and is never read or written there.
    kernel[grid](
        a, b, c, decay, x0 if x0 is not None else out, out, xt if xt is not None else out,
        *a.stride(), *b.stride(), *c.stride(), *out.stride(),
        *_state_strides(x0, x0_transposed),
        *_state_strides(xt, xt_transposed),
        decay.stride(0),
        time, heads, dim_ab, dim_c, float(scale),
        HAS_X0=x0 is not None,
        STORE_XT=xt is not None,
        BLOCK=block,
        CBLOCK=cblock,
        BLOCK_AB=block_ab,
        BLOCK_C=block_c,
        # The default for fp32 is tf32 on GPUs, which would cost about three digits.
        DOT_PRECISION="ieee" if is_fp32 else "tf32",
        UPCAST_OPERANDS=_kernels_interpreted() and a.dtype == torch.bfloat16,
        num_stages=num_stages,
    )


def _default_scale(scale: float | None, key_dim: int) -> float:
    return key_dim**-0.5 if scale is None else float(scale)


def lightning_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    block: int = DEFAULT_BLOCK,
    cblock: int = DEFAULT_CBLOCK,
    out: torch.Tensor | None = None,
    final_state_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning attention forward; q, k: [B, T, H, K], v: [B, T, H, V], decay: [H] log-decays <= 0.

    `scale` None means K**-0.5. initial_state: [B, H, K, V] (any float dtype, read as fp32).
    Returns (o [B, T, H, V] in v's dtype, written into `out` when given; final state
    [B, H, K, V] fp32 when `output_final_state`, written into `final_state_out` when given,
    else None). `block` is the inter/intra split, `cblock` the micro-chunk (powers of two,
    16 <= cblock <= block <= 256).
    """
    check_attention_shapes(q, k, v)
    _check_kernel_inputs(q=q, k=k, v=v)
    check_decay_and_state(q, v, decay, initial_state=initial_state)
    _check_blocks(block, cblock)
    batch, time, heads, key_dim = q.shape
    value_dim = v.shape[3]
    scale = _default_scale(scale, key_dim)
    o_shape = (batch, time, heads, value_dim)
    if out is None:
        out = torch.empty(o_shape, dtype=v.dtype, device=v.device)
    else:
        _check_out("out", out, v.dtype, v.device, o_shape)
    final_state = None
    if output_final_state:
        state_shape = (batch, heads, key_dim, value_dim)
        if final_state_out is None:
            final_state = torch.empty(state_shape, dtype=torch.float32, device=q.device)
        else:
            _check_out("final_state_out", final_state_out, torch.float32, q.device, state_shape)
            final_state = final_state_out
    elif final_state_out is not None:
        raise ValueError("final_state_out: given but output_final_state is False")
    _require_triton(q.device)
    _launch_sweep(
        _forward_sweep_kernel, q, k, v, decay, out, scale, block, cblock,
        x0=initial_state, xt=final_state,
    )
    return out, final_state


def lightning_attn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    do: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None = None,
    dht: torch.Tensor | None = None,
    *,
    block: int = DEFAULT_BLOCK,
    cblock: int = DEFAULT_CBLOCK,
    out: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients (dq, dk, dv, dh0) of lightning_attn_fwd given do = dL/do and dht = dL/dS_T.

    dh0 (in initial_state's dtype) is None when there is no initial_state; no gradient is
    computed for the decay (a constant). `out` = (dq, dk, dv) or (dq, dk, dv, dh0) to write into.
    The block/cblock used need not match the forward's: each is an exact split.
    """
    check_attention_shapes(q, k, v, do=do)
    _check_kernel_inputs(q=q, k=k, v=v, do=do)
    check_decay_and_state(q, v, decay, initial_state=initial_state, dht=dht)
    _check_blocks(block, cblock)
    scale = _default_scale(scale, q.shape[3])
    want_dh0 = initial_state is not None
    expected = [("out[0] (dq)", q), ("out[1] (dk)", k), ("out[2] (dv)", v)]
    if out is None:
        grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for _, t in expected]
        dh0 = torch.empty(initial_state.shape, dtype=initial_state.dtype, device=q.device) if want_dh0 else None
    else:
        if not isinstance(out, (tuple, list)) or len(out) not in (3, 4):
            raise TypeError("out: expected a tuple (dq, dk, dv) or (dq, dk, dv, dh0)")
        grads = list(out[:3])
        for (name, like), grad in zip(expected, grads):
            _check_out(name, grad, like.dtype, like.device, tuple(like.shape))
        dh0 = out[3] if len(out) == 4 else None
        if want_dh0:
            if dh0 is None:
                dh0 = torch.empty(initial_state.shape, dtype=initial_state.dtype, device=q.device)
            else:
                _check_out("out[3] (dh0)", dh0, initial_state.dtype, q.device, tuple(initial_state.shape))
        elif dh0 is not None:
            raise ValueError("out[3] (dh0): given but there is no initial_state")
    dq, dk, dv = grads
    _require_triton(q.device)
    # dq: forward sweep over S^T [V, K tile], started from S_0^T.
    _launch_sweep(
        _forward_sweep_kernel, do, v, k, decay, dq, scale, block, cblock,
        x0=initial_state, x0_transposed=True,
    )
    # dk: reverse sweep over dS^T [V, K tile], started from dht^T.
    _launch_sweep(
        _reverse_sweep_kernel, v, do, q, decay, dk, scale, block, cblock,
        x0=dht, x0_transposed=True,
    )
    # dv: reverse sweep over dS [K, V tile], started from dht; its last state is dh0.
    _launch_sweep(
        _reverse_sweep_kernel, k, q, do, decay, dv, scale, block, cblock,
        x0=dht, xt=dh0,
    )
    return dq, dk, dv, dh0
