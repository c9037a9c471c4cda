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

The forward and the dq computation have the same shape, and so have dk and dv: two sweep
kernels do all four (sweeps.py). Each sweep program covers one segment of time, starting from that
segment's state, which two small passes make (segments.py).

Files: chunk.py (this: checks and the two entry points), sweeps.py (the sweep kernels and their
launcher), segments.py (segment plans, the summary and prefix kernels), tiles.py (tile sizes and dot
options the launchers share).

The decay is a constant: no gradient is computed for it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .decay_reference import check_cu_seqlens, check_decay_and_state
from .reference import check_attention_shapes
from .segments import _plan_segments, _segment_states
# The dtype, device and head-dim limits are the simple kernels' (same MAX_HEAD_DIM, same dtypes).
from .simple import MAX_HEAD_DIM, SUPPORTED_DTYPES, _check_kernel_inputs
from . import sweeps
from .sweeps import (_forward_sweep_bwd_kernel, _forward_sweep_kernel, _launch_reverse_pair, _launch_sweep,
                     _reverse_sweep_kernel)
from .tiles import MAX_BLOCK, MIN_DOT_DIM

from .._triton import cdiv, direct, interpreted, kept_rows, require_triton, triton_available

__all__ = [
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "SavedStates",
    "lightning_attn_fwd",
    "lightning_attn_bwd",
    "num_states",
    "saved_states",
    "saved_states_rows",
    "triton_available",
]

DEFAULT_BLOCK = 64
# The forward holds one [CBLOCK, CBLOCK] score tile at a time; the backward's micro-chunk keeps
# its shared memory small (seed 004: 64 KB at D=128 with these defaults, read off the compiled
# kernel by benchmarks/lightning.py). Both are exact for any power of two <= BLOCK. Defaults,
# column tiles and warps measured on an H100 (benchmarks/lightning_tune.py, BENCHMARKS.md).
DEFAULT_FORWARD_CBLOCK = 64
DEFAULT_BACKWARD_CBLOCK = 32
# The tiled (non-contracted) head dim: output columns are independent, so splitting them over
# programs costs recomputing the score tiles and rereading a, b; wider tiles add registers. The
# forward's flat loop (the default block and cblock) measured fastest at 64 columns and 4 warps on the
# H200 (sweeps.FLAT_SWEEPS), its nested loops at 128 columns and 8 warps; None: the choice for the loop
# that runs.
FLAT_FORWARD_COLUMN_TILE, NESTED_FORWARD_COLUMN_TILE, FORWARD_WARPS = 64, 128, None
BACKWARD_COLUMN_TILE, BACKWARD_WARPS = 64, 4
DEFAULT_CBLOCK = DEFAULT_BACKWARD_CBLOCK


def _check_power_of_two(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < MIN_DOT_DIM or value & (value - 1):
        raise ValueError(f"{name}: must be a power of two >= {MIN_DOT_DIM}, got {value}")


def _check_blocks(block: int, cblock: int, segment: int | None) -> None:
    _check_power_of_two("block", block)
    _check_power_of_two("cblock", cblock)
    if block > MAX_BLOCK:
        raise ValueError(f"block: {block} exceeds the supported maximum {MAX_BLOCK}")
    if cblock > block:
        raise ValueError(f"cblock: micro-chunk {cblock} exceeds block {block}; need cblock <= block")
    if segment is not None:
        if isinstance(segment, bool) or not isinstance(segment, int):
            raise TypeError(f"segment: expected an int or None, got {type(segment).__name__}")
        if segment < block or segment % block:
            raise ValueError(f"segment: must be a positive multiple of block={block}, got {segment}")


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


def _default_scale(scale: float | None, key_dim: int) -> float:
    return key_dim**-0.5 if scale is None else float(scale)


def _check_problem(q, k, v, decay, cu_seqlens, block, cblock, segment, **states) -> int:
    check_attention_shapes(q, k, v, **{n: t for n, t in states.items() if n == "do"})
    _check_kernel_inputs(q=q, k=k, v=v, **{n: t for n, t in states.items() if n == "do"})
    count = check_cu_seqlens(q, cu_seqlens)
    check_decay_and_state(q, v, decay, num_states=count, **{n: t for n, t in states.items() if n != "do"})
    _check_blocks(block, cblock, segment)
    return count


def num_states(q: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """N of the [N, H, K, V] states: the batch size, or the number of varlen sequences (from the
    sizes alone: symbolic sizes stay symbolic)."""
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


class SavedStates(NamedTuple):
    """The segments' starting states of one forward ([segments, H, K, V] fp32), the segment length
    and block they were planned with: what the backward's forward-state pass would recompute."""

    states: torch.Tensor
    segment: int
    block: int

    def check(self, q: torch.Tensor, v: torch.Tensor, block: int, segment: int | None) -> None:
        heads, key_dim, value_dim = q.shape[2], q.shape[3], v.shape[3]
        if self.block != block:
            raise ValueError(f"states: planned with block {self.block}, the backward runs block {block}")
        if segment is not None and segment != self.segment:
            raise ValueError(f"states: planned with segment {self.segment}, the backward was given segment {segment}")
        if tuple(self.states.shape[1:]) != (heads, key_dim, value_dim) or self.states.dtype != torch.float32:
            raise ValueError(f"states: expected float32 [segments, {heads}, {key_dim}, {value_dim}], got "
                             f"{self.states.dtype} {tuple(self.states.shape)}")


def lightning_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    cblock: int = DEFAULT_FORWARD_CBLOCK,
    segment: int | None = None,
    column_tile: int | None = None,
    num_warps: int | None = FORWARD_WARPS,
    out: torch.Tensor | None = None,
    final_state_out: torch.Tensor | None = None,
    wrap: Callable | None = None,
    return_states: bool = False,
    checked: bool = False,
) -> tuple:
    """Lightning attention forward; q, k: [B, T, H, K], v: [B, T, H, V], decay: [H] log-decays <= 0.

    `scale` None means K**-0.5. Variable-length batches: B = 1 and cu_seqlens [N + 1] (FLA's
    convention); states are [N, H, K, V] (N = B without cu_seqlens). initial_state: any float
    dtype, read as fp32. Returns (o [B, T, H, V] in v's dtype, written into `out` when given;
    final state [N, H, K, V] fp32 when `output_final_state`, written into `final_state_out` when
    given, else None).

    Tuning (every choice is exact): `block` is the inter/intra split, `cblock` the micro-chunk
    (powers of two, 16 <= cblock <= block <= 256); `segment` the rows one program sweeps (a
    multiple of block; None picks one that fills the GPU); `column_tile` the widest V tile (None: by the
    loop, FLAT_FORWARD_COLUMN_TILE or NESTED_FORWARD_COLUMN_TILE).
    `wrap`: torch.library.wrap_triton when the launches are traced for Inductor (fixed-length rows).
    `return_states`: also return SavedStates, the segments' starting states this forward computed, which
    lightning_attn_bwd can take (`states=`) instead of recomputing them. `checked`: the caller ran the
    same checks on these inputs already (hccompile's ops do, once per call, at the default tuning).
    """
    states_count = num_states(q, cu_seqlens) if checked else \
        _check_problem(q, k, v, decay, cu_seqlens, block, cblock, segment, initial_state=initial_state)
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
        state_shape = (states_count, heads, key_dim, value_dim)
        if final_state_out is None:
            final_state = torch.empty(state_shape, dtype=torch.float32, device=q.device)
        else:
            _check_out("final_state_out", final_state_out, torch.float32, q.device, state_shape)
            final_state = final_state_out
    elif final_state_out is not None:
        raise ValueError("final_state_out: given but output_final_state is False")
    _require_triton(q.device)
    segments = _forward_segments(q, v, cu_seqlens, segment, block, cblock, column_tile)
    if column_tile is None:
        column_tile = _forward_column_tile(block, cblock)
    wrap = wrap or direct
    states = _segment_states(segments, k, v, decay, scale, reverse=False, x0=initial_state, xt=final_state,
                             wrap=wrap, block=block, zero_padding=return_states)
    _launch_sweep(_forward_sweep_kernel, segments, q, k, v, decay, out, states, False,
                  scale, block, cblock, column_tile, num_warps, wrap)
    if return_states:
        return out, final_state, SavedStates(states, segments.length, block)
    return out, final_state


def _forward_column_tile(block: int, cblock: int) -> int:
    flat = sweeps.FLAT_SWEEPS and cblock == block
    return FLAT_FORWARD_COLUMN_TILE if flat else NESTED_FORWARD_COLUMN_TILE


def _forward_segments(q, v, cu_seqlens, segment, block: int, cblock: int, column_tile: int | None):
    """The forward's segments: what its states rows are planned by (lightning_attn_fwd, the op's
    fake and saved_states share this one rule)."""
    if column_tile is None:
        column_tile = _forward_column_tile(block, cblock)
    return _plan_segments(q, cu_seqlens, segment, block, cdiv(v.shape[3], min(column_tile, 256)))


def saved_states_rows(q: torch.Tensor, v: torch.Tensor):
    """Rows of the states lightning_attn_fwd(return_states=True) returns for fixed-length rows at
    the default tuning (possibly symbolic): the op's fake sizes its kept states by it."""
    return kept_rows(_forward_segments(q, v, None, None, DEFAULT_BLOCK, DEFAULT_FORWARD_CBLOCK, None).count)


def saved_states(q: torch.Tensor, v: torch.Tensor, states: torch.Tensor) -> "SavedStates | None":
    """The SavedStates of a default-tuned forward of fixed-length rows from its states tensor alone
    (the ops keep the tensor; the segment length is replanned by the forward's rule, so the
    sweeps' switches must not change between a forward and its backward). None where the rows do not
    match that plan (then the backward recomputes them); symbolic sizes are trusted, not compared
    (a comparison would guard on them)."""
    segments = _forward_segments(q, v, None, None, DEFAULT_BLOCK, DEFAULT_FORWARD_CBLOCK, None)
    rows = kept_rows(segments.count)
    if isinstance(rows, int) and isinstance(states.shape[0], int) and states.shape[0] != rows:
        return None
    return SavedStates(states, segments.length, DEFAULT_BLOCK)


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
    cu_seqlens: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    cblock: int | None = None,
    segment: int | None = None,
    column_tile: int = BACKWARD_COLUMN_TILE,
    num_warps: int | None = None,
    out: tuple | None = None,
    wrap: Callable | None = None,
    states: "SavedStates | None" = None,
    checked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients (dq, dk, dv, dh0) of lightning_attn_fwd given do = dL/do and dht = dL/dS_T.

    dh0 (in initial_state's dtype) is None when there is no initial_state; no gradient is
    computed for the decay (a constant). `out` = (dq, dk, dv) or (dq, dk, dv, dh0) to write into.
    The tuning arguments need not match the forward's: each is an exact split. `cblock` and
    `num_warps` None take the loop's defaults: with sweeps.FLAT_SWEEPS on (the default), the flat loop
    (cblock = block, sweeps.FLAT_WARPS), else DEFAULT_BACKWARD_CBLOCK and BACKWARD_WARPS. `wrap`: as the
    forward's. `states`: the forward's SavedStates (lightning_attn_fwd(return_states=True)) for the same
    inputs: the backward plans the forward's segments and skips recomputing their starting states.
    `checked`: as the forward's.
    """
    flat = sweeps.FLAT_SWEEPS
    cblock = (block if flat else DEFAULT_BACKWARD_CBLOCK) if cblock is None else cblock
    num_warps = num_warps if num_warps is not None or flat else BACKWARD_WARPS
    if not checked:
        _check_problem(q, k, v, decay, cu_seqlens, block, cblock, segment, do=do, initial_state=initial_state,
                       dht=dht)
    scale = _default_scale(scale, q.shape[3])
    want_dh0 = initial_state is not None
    expected = [("out[0] (dq)", q), ("out[1] (dk)", k), ("out[2] (dv)", v)]
    if out is None:
        grads = None  # allocated after the state passes are launched: the GPU waits for a backward's first launch
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
    _require_triton(q.device)
    tiles = cdiv(max(q.shape[3], v.shape[3]), min(column_tile, 256))
    if states is not None:
        states.check(q, v, block, segment)
        segment = states.segment
    segments = _plan_segments(q, cu_seqlens, segment, block, tiles)
    # S at each segment's start (the forward's states, or recomputed) and dS at each segment's end.
    wrap = wrap or direct
    s_states = states.states if states is not None else _segment_states(
        segments, k, v, decay, scale, reverse=False, x0=initial_state, wrap=wrap, block=block)
    ds_states = _segment_states(segments, q, do, decay, scale, reverse=True, x0=dht, xt=dh0, wrap=wrap, block=block)
    if grads is None:
        grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for _, t in expected]
    dq, dk, dv = grads
    sweep = dict(scale=scale, block=block, cblock=cblock, column_tile=column_tile, num_warps=num_warps, wrap=wrap)
    # dq: forward sweep over S^T [V, K tile]; dk: reverse sweep over dS^T [V, K tile];
    # dv: reverse sweep over dS [K, V tile].
    _launch_sweep(_forward_sweep_bwd_kernel, segments, do, v, k, decay, dq, s_states, True, **sweep)
    if flat and cblock == block and sweeps.PAIRED_REVERSE and max(q.shape[3], v.shape[3]) <= sweeps.PAIR_MAX_DIM:
        # dk and dv in one sweep over the whole dS
        _launch_reverse_pair(segments, q, k, v, do, decay, dk, dv, ds_states, scale, block, num_warps, wrap)
        return dq, dk, dv, dh0
    _launch_sweep(_reverse_sweep_kernel, segments, v, do, q, decay, dk, ds_states, True, **sweep)
    _launch_sweep(_reverse_sweep_kernel, segments, k, q, do, decay, dv, ds_states, False, **sweep)
    return dq, dk, dv, dh0
