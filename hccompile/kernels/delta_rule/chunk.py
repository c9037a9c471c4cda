"""Chunked Triton kernels for the (gated) delta rule, forward and backward: the two entry points.

The forward pass is five small kernels, each one idea and each in its own file (see
reference.chunk_delta_rule_ref for the math they implement):

  1. gate_cumsum     chunk-local cumulative log-gate G (and KDA's gate activation)       gate_cumsum.py
  2. decayed_scores  Kdot[t,s] = sum_c k_t k_s e^(G_t-G_s) and P[t,s] = sum_c q_t k_s e^(G_t-G_s)  scores.py
                     (per-channel gates: one program per chunk, scores_chunk.py, plan.CHUNK_SCORE_PROGRAMS)
  3. wy_solve        A = (I + diag(beta) Kdot)^-1, W = A diag(beta)(K*e^G), U~ = A diag(beta) V    wy.py
  4. state_forward   sequential over chunks: chunk-start states h, corrected values U = U~ - W h   state.py
  5. output          O = scale ((Q*e^G) h + P U)                                         output.py

Without per-channel gates (plan.fused_scores_forward) step 2 is not launched: wy_solve forms Kdot's
blocks from the keys and the output kernel forms P (stored, in the intermediates' dtype, only for a
forward that keeps its intermediates; a recomputing backward runs the output kernel's P-only mode).

The backward pass recomputes them (or takes the forward's kept Kdot, P and A), then runs
state_backward (state.py; sequential, reverse), wy_backward (wy.py; without per-channel gates split
in dqkw.py and wy_bwd.py while plan.SPLIT_WY_BACKWARD is on), decayed_scores_backward (scores.py;
per-channel gates only while plan.FUSED_SCORES_BACKWARD is on: without them wy_backward does its
work) and gate_cumsum in reverse; a small kernel does the optional l2norm of q and k both
ways (qk_l2norm.py). A forward asked for its intermediates (return_intermediates) also hands over the
l2-normed q and k, so that the backward's recomputation starts from them.

The kernels share jit helpers (tiles.py: tiles, chunk coordinates, gates and their decays) and a
launch plan (plan.py: what the kernels support, the precision of the intermediates, tile widths).
This file holds the checks, the buffers and the order of the launches; cp.py runs the same steps on a
rank's segments around one exchange of state summaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from . import plan as kernel_plan
from .gate_cumsum import ACTIVATION_NONE, gate_activation, gate_activation_backward, gate_backward, launch_gate_cumsum
from .plan import (DEFAULT_CHUNK_SIZE, GATE_CODES, MAX_HEAD_DIM, SUB_CHUNK, Plan, block_size, check_kernel_inputs,
                   intermediate_dtype_for, kept_state_rows, make_plan, normed_qk_dtype_for)
from .output import launch_output, launch_scores_only
from .qk_l2norm import l2norm_backward, l2norm_forward
from .reference import check_delta_rule_inputs, checked_problem
from .scores import launch_decayed_scores, launch_scores_backward
from .decayed_keys import launch_decayed_keys
from .scores_chunk import launch_chunk_scores
from .state import state_backward_block_v, state_forward_block_v, state_launch_options
from .dqkw import launch_dqkw
from .wy import WY_BACKWARD_OPTIONS, wy_solve_options
from .local_du import launch_local_du
from .wy_bwd import launch_wy_bwd

from .._triton import cdiv, direct, require_triton, scratch_rows, triton, zero_padding_rows

if triton is not None:
    from .output import _output_kernel
    from .state import _state_backward_kernel, _state_forward_kernel
    from .wy import _wy_backward_kernel, _wy_solve_kernel

__all__ = [
    "GRADIENT_NAMES",
    "ChunkLocal",
    "Kept",
    "chunk_delta_rule_bwd",
    "chunk_delta_rule_fwd",
    "chunk_local_steps",
    "launch_split_wy_backward",
    "sum_key_groups",
    "sweep_launch_options",
]


def _require_triton(device: torch.device) -> None:
    require_triton(device, _output_kernel, "hccompile.kernels.delta_rule.chunk", "chunk_delta_rule_ref")


def _check_out(name: str, out, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(out.shape)} differs from the expected {shape}")
    if out.dtype != dtype:
        raise TypeError(f"{name}: dtype {out.dtype} differs from the expected {dtype}")
    if out.device != device:
        raise ValueError(f"{name}: device {out.device} differs from the expected {device}")


class Kept(NamedTuple):
    """What chunk_delta_rule_fwd(return_intermediates=True) keeps for chunk_delta_rule_bwd(intermediates=...):
    the intra-chunk matrices, each [B, T, HV, chunk_size]: Kdot (fp32; None without per-channel gates
    while plan.fused_scores_forward, nothing forms it in memory then), P (fp32 from decayed_scores, or
    in the intermediates' dtype from the output kernel) and the inverse A (in the plan's inverse_dtype);
    with use_qk_l2norm_in_kernel the l2-normed q and k ([B, T, H, K] contiguous, in the plan's
    normed_qk_dtype; None without); with a
    gate, its chunk-local cumulative sum (fp32 [B, T, HV, K or 1]; None without); and the state
    sweep's results, in the plan's intermediate_dtype: w [B, T, HV, K], the corrected values u
    [B, T, HV, V] and the chunk-start states h [plan.kept_state_rows, HV, K, V]. With w, u and h the
    backward runs neither the WY solve nor the forward state sweep again (FLA recomputes both: at
    B1 T32768 H16 K128 on the H100 they were 2.5 ms of KDA's 14.3 ms step); they hold
    (2 T + T K / BT) HV K elements per batch row (K = V), h the most (K / BT = 2 times w's at BT 64)."""

    kdot: torch.Tensor | None
    scores: torch.Tensor
    inverse: torch.Tensor
    q_normed: torch.Tensor | None = None
    k_normed: torch.Tensor | None = None
    cum: torch.Tensor | None = None
    w: torch.Tensor | None = None
    u: torch.Tensor | None = None
    h: torch.Tensor | None = None


@dataclass
class ChunkLocal:
    """What the chunk-parallel steps (the l2norm, gate_cumsum, decayed_scores, wy_solve) give the
    state sweeps, independent of any state: l2normed q and k in the plan's normed_qk_dtype, w, u~
    and k_decayed in its intermediate_dtype, P in its scores_dtype, A in its inverse_dtype, the rest
    fp32. cp.py's segments start from it too."""

    q: torch.Tensor  # q or its l2norm
    k: torch.Tensor
    cum: torch.Tensor | None  # [B, T, HV, K or 1] chunk-local cumulative log-gate
    kdot: torch.Tensor | None  # [B, T, HV, BT]; None where wy_solve forms it (plan.fused_scores_forward)
    scores: torch.Tensor | None  # [B, T, HV, BT]; None where the output kernel will form it (fused, scores_now off)
    inverse: torch.Tensor  # [B, T, HV, BT]
    w: torch.Tensor  # [B, T, HV, K]
    u_tilde: torch.Tensor  # [B, T, HV, V] values before the state's correction (the plan's dummy when kept)
    k_decayed: torch.Tensor  # [B, T, HV, K] K e^(G_last - G) with a channel gate (the plan's dummy without)


@dataclass
class _Forward(ChunkLocal):
    """The whole forward's intermediates: the chunk-parallel ones and the state sweep's, in the
    plan's intermediate_dtype."""

    u: torch.Tensor  # [B, T, HV, V] corrected values
    h: torch.Tensor  # [chunks, HV, K, V] chunk-start states


def _launch_scores(plan: Plan, q, k, cum, kdot, scores, num_chunks, table, seqlens) -> None:
    """decayed_scores: with per-channel gates one program per chunk while plan.CHUNK_SCORE_PROGRAMS
    (scores_chunk.py), else one per sub-chunk (scores.py); the same Kdot and P either way."""
    if plan.gate_code == GATE_CODES["channel"] and kernel_plan.CHUNK_SCORE_PROGRAMS:
        launch_chunk_scores(plan, q, k, cum, kdot, scores, num_chunks, table, seqlens)
    else:
        launch_decayed_scores(plan, q, k, cum, kdot, scores, num_chunks, table, seqlens)


def chunk_local_steps(plan: Plan, q, k, v, beta, g, use_qk_l2norm_in_kernel, A_log, dt_bias, lower_bound,
                      kept: Kept | None = None, empty: Callable | None = None, scores_now: bool = True) -> ChunkLocal:
    """Steps 1-3 of the forward, chunk-parallel. With `kept`, what an earlier forward on the same
    inputs kept, decayed_scores and the WY solve are skipped (wy_solve only forms W and U~ from the
    kept inverse), and so are the l2norm and the gate's cumulative sum when it kept their results,
    and wy_solve itself when it kept w, u and h (the sweep is skipped then too). `empty(*shape,
    dtype=...)` allocates the buffers on q's device (default torch.empty; CP's can poison them).

    With plan.fused_scores_forward there is no decayed_scores launch: wy_solve forms Kdot's blocks
    itself (local.kdot is None) and P is the output kernel's. `scores_now`: P must be in memory when
    these steps return (a backward's recomputation, which launches no output kernel: the output
    kernel's P-only mode runs here); off (a forward, whose output kernel forms P), local.scores is None."""
    problem = plan.problem
    batch, time, value_heads = problem.batch, problem.time, problem.value_heads
    key_dim, value_dim, chunk = problem.key_dim, problem.value_dim, plan.chunk_size
    stored = plan.intermediate_dtype
    device = q.device

    def buffer(*shape, dtype=torch.float32):
        return empty(*shape, dtype=dtype) if empty is not None else torch.empty(*shape, dtype=dtype, device=device)

    if use_qk_l2norm_in_kernel:
        if kept is not None and kept.q_normed is not None:
            q, k = kept.q_normed, kept.k_normed
        else:
            q, k = l2norm_forward(q, k, plan.normed_qk_dtype, plan.launch)
    fused = plan.fused_scores_forward
    # wy_solve, G's first reader where it forms Kdot itself, forms a scalar gate's G (plan.FOLDED_GATE_SUMS)
    form_cum = (kernel_plan.FOLDED_GATE_SUMS and problem.gate == "scalar" and kept is None and fused
                and bool(plan.num_chunks))
    cum = None
    if kept is not None and kept.cum is not None:
        cum = kept.cum
    elif form_cum:
        cum = buffer(batch, time, value_heads, 1)
    elif problem.gate != "none" and plan.num_chunks:
        cum = launch_gate_cumsum(plan, g, gate_activation(problem, lower_bound), A_log, dt_bias, lower_bound,
                                 reverse=False)
    if kept is not None:
        kdot, scores, inverse = kept.kdot, kept.scores, kept.inverse
    elif fused:
        kdot, inverse = None, buffer(batch, time, value_heads, chunk, dtype=plan.inverse_dtype)
        scores = buffer(batch, time, value_heads, chunk, dtype=plan.scores_dtype) if scores_now else None
    else:
        kdot, inverse = buffer(batch, time, value_heads, chunk), buffer(batch, time, value_heads, chunk,
                                                                         dtype=plan.inverse_dtype)
        scores = buffer(batch, time, value_heads, chunk, dtype=plan.scores_dtype)
    if kept is not None and kept.h is not None:
        return ChunkLocal(q=q, k=k, cum=cum, kdot=kdot, scores=scores, inverse=inverse, w=kept.w,
                          u_tilde=plan.dummy, k_decayed=plan.dummy)
    w = buffer(batch, time, value_heads, key_dim, dtype=stored)
    # A channel gate's keys decayed to their chunk's end, for the state sweeps (wy_solve forms them).
    k_decayed = buffer(batch, time, value_heads, key_dim, dtype=stored) if problem.gate == "channel" else plan.dummy
    u_tilde = buffer(batch, time, value_heads, value_dim, dtype=stored)
    if plan.num_chunks:
        table, seqlens = plan.chunk_args()
        cum_arg = cum if cum is not None else plan.dummy
        if kept is None and not fused:
            _launch_scores(plan, q, k, cum_arg, kdot, scores, plan.num_chunks, table, seqlens)
        elif kept is None and scores_now and not form_cum:
            launch_scores_only(plan, q, k, cum_arg, scores, plan.num_chunks, table, seqlens)
        # plan.SPLIT_WY_SOLVE: the solve alone, then W and U~ from the stored A as for a kept A
        split = kernel_plan.SPLIT_WY_SOLVE and kept is None
        launches = [(kept is None, not split, form_cum, wy_solve_options(plan))]
        if split:
            launches.append((False, True, False, {"num_warps": kernel_plan.WY_FORM_WARPS}))
        for solve, form_wu, form_g, options in launches:
            plan.launch(_wy_solve_kernel)[(plan.num_chunks, value_heads)](
                k, v, beta, cum_arg, kdot if kdot is not None else plan.dummy, inverse, w, u_tilde, k_decayed,
                g if form_g else plan.dummy, *k.stride(), *v.stride(), *beta.stride(),
                *(g.stride() if form_g else (0, 0, 0)),
                table, seqlens, time, plan.chunks_per_row, value_heads, problem.group_size, key_dim, value_dim,
                GATE=plan.gate_code, BT=chunk, BC=min(chunk, SUB_CHUNK), BK=block_size(key_dim),
                BV=block_size(value_dim), DOT_PRECISION=plan.dot_precision, SOLVE=solve,
                FORM_KDOT=solve and fused, REGISTER_DIAGONAL=kernel_plan.REGISTER_DIAGONAL_BLOCKS,
                FORM_CUM=form_g, FORM_WU=form_wu, IS_VARLEN=plan.varlen, **options,
            )
        if form_cum and scores_now:  # P from G, which wy_solve formed
            launch_scores_only(plan, q, k, cum_arg, scores, plan.num_chunks, table, seqlens)
    return ChunkLocal(q=q, k=k, cum=cum, kdot=kdot, scores=scores, inverse=inverse, w=w, u_tilde=u_tilde,
                      k_decayed=k_decayed)


def _forward(plan: Plan, q, k, v, beta, g, scale, initial_state, final_state, o, use_qk_l2norm_in_kernel,
             A_log, dt_bias, lower_bound, kept: Kept | None = None, keep_states: bool = False) -> _Forward:
    """Runs the five forward kernels; writes o and final_state (when not None). With `kept`, what
    chunk_local_steps skips (see there), and the state sweep when it kept w, u and h (then neither
    o nor final_state may be asked for). The chunk states get kept_state_rows rows when
    `keep_states`, so that the forward can hand them to an op's output of a shape its fake knows,
    and where the output kernel forms P (plan.fused_scores_forward) it stores it too (the result's
    scores; None otherwise when o is given). Without o, P is in memory either way (chunk_local_steps'
    scores_now)."""
    problem = plan.problem
    time, value_heads = problem.time, problem.value_heads
    key_dim, value_dim = problem.key_dim, problem.value_dim
    chunk = plan.chunk_size
    device = q.device
    stored = plan.intermediate_dtype
    local = chunk_local_steps(plan, q, k, v, beta, g, use_qk_l2norm_in_kernel, A_log, dt_bias, lower_bound, kept,
                              scores_now=o is None)
    q, k, cum = local.q, local.k, local.cum
    if kept is not None and kept.h is not None:
        assert o is None and final_state is None, "kept states serve the backward only"
        return _Forward(**vars(local), u=kept.u, h=kept.h)
    table, seqlens = plan.chunk_args()
    common = dict(IS_VARLEN=plan.varlen)
    cum_arg = cum if cum is not None else plan.dummy
    u = torch.empty(problem.batch, time, value_heads, value_dim, dtype=stored, device=device)
    state_rows = plan_kept_state_rows(plan) if keep_states else scratch_rows(plan.num_chunks)
    h = torch.empty(state_rows, value_heads, key_dim, value_dim, dtype=stored, device=device)
    if keep_states:
        # Kept h is an op's output: the rows past the chunk count (a varlen bound, or the minimum
        # of 2) are zeros, not whatever the allocator left, eager or traced (where slicing at the
        # symbolic count would guard on it: HF's delta-rule layers compiled twice, at T = 40, on
        # the H100 at 28f9071)
        zero_padding_rows(h, plan.num_chunks)
    group = problem.group_size
    nt = plan.chunks_per_row
    block_k_full = block_size(key_dim, MAX_HEAD_DIM)
    block_v_state = state_forward_block_v(block_k_full, value_dim, stored, problem.num_sequences * value_heads,
                                          device)
    h0 = initial_state if initial_state is not None else plan.dummy
    h0_strides = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    ht = final_state if final_state is not None else plan.dummy
    ht_strides = final_state.stride() if final_state is not None else (0, 0, 0, 0)
    if problem.num_sequences and (final_state is not None or plan.num_chunks):
        plan.launch(_state_forward_kernel)[(problem.num_sequences, value_heads, cdiv(value_dim, block_v_state))](
            k, local.k_decayed, cum_arg, local.w, local.u_tilde, h0, h, u, ht, *k.stride(), *h0_strides,
            *ht_strides, plan.chunk_offsets if plan.chunk_offsets is not None else plan.dummy, seqlens,
            time, nt, value_heads, group, key_dim, value_dim,
            GATE=plan.gate_code, BT=chunk, BKF=block_k_full, BV=block_v_state,
            HAS_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=final_state is not None,
            DOT_PRECISION=plan.dot_precision, **sweep_launch_options(plan, block_k_full, k.dtype, "forward"), **common,
        )
    form_scores = local.scores is None  # the output kernel forms P (plan.fused_scores_forward)
    if form_scores and keep_states:
        local.scores = torch.empty(problem.batch, time, value_heads, chunk, dtype=plan.scores_dtype, device=device)
    if o is not None and plan.num_chunks:
        launch_output(plan, q, k, cum_arg, h, local.scores if local.scores is not None else plan.dummy, u, o,
                      plan.num_chunks, table, seqlens, scale, form_scores=form_scores,
                      store_scores=form_scores and keep_states)
    return _Forward(**vars(local), u=u, h=h)


def sweep_launch_options(plan: Plan, block_k_full: int, k_dtype: torch.dtype, direction: str) -> dict[str, int]:
    """The launch options of the forward or backward state sweep (state.state_launch_options' timed
    rule), here and in cp.py's sweeps of the same kernels."""
    return state_launch_options(block_k_full, k_dtype, timed_sweep=(plan.gate_code == GATE_CODES["channel"], direction),
                                intermediates=plan.intermediate_dtype)


def plan_kept_state_rows(plan: Plan):
    problem = plan.problem
    return kept_state_rows(problem.batch, problem.time, plan.chunk_size,
                           problem.num_sequences if problem.varlen else None)


def _validate(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound, chunk_size,
              **extra):
    problem = check_delta_rule_inputs(
        q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound, **extra
    )
    check_kernel_inputs(problem, chunk_size, q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state,
                        A_log=A_log, dt_bias=dt_bias, **extra)
    return problem


def chunk_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    gate: str | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    out: torch.Tensor | None = None,
    final_state_out: torch.Tensor | None = None,
    return_intermediates: bool = False,
    wrap: Callable | None = None,
    dummy: torch.Tensor | None = None,
):
    """Chunked delta rule forward; arguments as naive_recurrent_delta_rule, plus chunk_size (16, 32, 64).

    Returns (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] fp32 or None), written
    into `out` / `final_state_out` when given (final_state_out implies output_final_state).
    With return_intermediates, a third element: a Kept (see there): the intra-chunk matrices, the
    l2-normed q and k, the gate's sum and the state sweep's w, u and h, which
    chunk_delta_rule_bwd(intermediates=...) then reuses instead of recomputing them (FLA keeps its
    score matrices and solved A the same way, and recomputes the rest).
    `wrap`: torch.library.wrap_triton when the launches are traced for Inductor (fixed-length rows);
    `dummy`: a float32 tensor of >= 2 elements standing in for absent optional tensors (never read).
    """
    problem = _validate(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound,
                        chunk_size)
    o_shape = (problem.batch, problem.time, problem.value_heads, problem.value_dim)
    if out is None:
        out = torch.empty(o_shape, dtype=v.dtype, device=v.device)
    else:
        _check_out("out", out, o_shape, v.dtype, v.device)
    state_shape = (problem.num_sequences, problem.value_heads, problem.key_dim, problem.value_dim)
    if final_state_out is not None:
        _check_out("final_state_out", final_state_out, state_shape, torch.float32, v.device)
    elif output_final_state:
        final_state_out = torch.empty(state_shape, dtype=torch.float32, device=v.device)
    _require_triton(q.device)
    scale = problem.key_dim**-0.5 if scale is None else scale
    plan = make_plan(problem, chunk_size, cu_seqlens, q, wrap or direct, dummy)
    fwd = _forward(plan, q, k, v, beta, g, scale, initial_state, final_state_out, out, use_qk_l2norm_in_kernel,
                   A_log, dt_bias, lower_bound, keep_states=return_intermediates)
    if return_intermediates:
        normed = (fwd.q, fwd.k) if use_qk_l2norm_in_kernel else (None, None)
        return out, final_state_out, Kept(fwd.kdot, fwd.scores, fwd.inverse, *normed, fwd.cum, fwd.w, fwd.u, fwd.h)
    return out, final_state_out


GRADIENT_NAMES = ("q", "k", "v", "beta", "g", "initial_state", "A_log", "dt_bias")


def _checked_intermediates(given, problem, chunk_size: int, q: torch.Tensor, l2norm: bool) -> Kept:
    """`intermediates` of chunk_delta_rule_bwd as a Kept, each tensor checked against the problem."""
    if len(given) not in (3, 6, 9):
        raise ValueError("intermediates: expected (kdot, scores, inverse), (kdot, scores, inverse, q_normed, "
                         f"k_normed, cum) or those and (w, u, h), got {len(given)} tensors")
    kept = Kept(*given)
    square = (problem.batch, problem.time, problem.value_heads, chunk_size)
    # P as decayed_scores stores it (fp32) or as the output kernel does (the intermediates' dtype), and A
    # as wy_solve stores it (plan.inverse_dtype: either, with the switches as they were at the forward;
    # every reader loads either); Kdot may be absent without per-channel gates (the split backward takes
    # its terms from K; the single wy_backward has decayed_scores form it again).
    either = (torch.float32, intermediate_dtype_for(q.dtype))
    expected = [("scores", square, either), ("inverse", square, either)]
    if kept.kdot is not None:
        expected.insert(0, ("kdot", square, torch.float32))
    elif problem.gate == "channel":
        raise ValueError("intermediates: kdot is None, but per-channel gates need it (decayed_scores' Kdot)")
    if kept.q_normed is not None or kept.k_normed is not None:
        if not l2norm:
            raise ValueError("intermediates: q_normed and k_normed given, but use_qk_l2norm_in_kernel is False")
        normed_dtype = normed_qk_dtype_for(q.dtype)
        expected += [("q_normed", tuple(q.shape), normed_dtype), ("k_normed", tuple(q.shape), normed_dtype)]
    if kept.cum is not None:
        if problem.gate == "none":
            raise ValueError("intermediates: cum given, but there is no gate")
        width = problem.key_dim if problem.gate == "channel" else 1
        expected.append(("cum", (problem.batch, problem.time, problem.value_heads, width), torch.float32))
    if (kept.w is None) != (kept.h is None) or (kept.u is None) != (kept.h is None):
        raise ValueError("intermediates: w, u and h go together (all three or none)")
    if kept.h is not None:
        stored = intermediate_dtype_for(q.dtype)
        batch, time, value_heads = problem.batch, problem.time, problem.value_heads
        rows = kept_state_rows(batch, time, chunk_size, problem.num_sequences if problem.varlen else None)
        expected += [("w", (batch, time, value_heads, problem.key_dim), stored),
                     ("u", (batch, time, value_heads, problem.value_dim), stored),
                     ("h", (rows, value_heads, problem.key_dim, problem.value_dim), stored)]
    for name, shape, dtype in expected:
        tensor = getattr(kept, name)
        if isinstance(dtype, tuple):  # any of these
            dtype = tensor.dtype if getattr(tensor, "dtype", None) in dtype else dtype[0]
        _check_out(f"intermediates {name}", tensor, shape, dtype, q.device)
        if not tensor.is_contiguous():
            raise ValueError(f"intermediates {name}: expected a contiguous tensor")
    return kept


def launch_split_wy_backward(plan: Plan, q, k, v, beta, do, cum, inverse, u, du, h, dh, dv, dbeta, dq_heads,
                             dk_heads, dcum, num_chunks, table, seqlens, scale: float, dk_out=None,
                             reverse_dg: bool = False) -> None:
    """wy_backward split in two (plan.split_wy_backward): dqkw.py's kernel writes dq complete and dk,
    dG partial with dW; wy_bwd.py's completes dk and dG and writes dv and dbeta. `h` and `dh` start at
    the first of the `num_chunks` chunks that `table` (varlen) lists; cp.py launches it per segment run.
    reverse_dg (a scalar gate, nothing added to dG after): dcum leaves holding g's gradient, dG's reverse
    chunk-local sum, instead of dG."""
    problem = plan.problem
    dw = torch.empty(problem.batch, problem.time, problem.value_heads, problem.key_dim,
                     dtype=plan.intermediate_dtype, device=q.device)
    dcum_second = launch_dqkw(plan, q, k, do, cum, u, du, h, dh, dq_heads, dk_heads, dw, dcum, num_chunks, table,
                              seqlens, scale)
    launch_wy_bwd(plan, k, v, beta, cum, inverse, du, dw, dv, dbeta, dk_heads, dcum, num_chunks, table, seqlens,
                  dk_out, dcum_second, reverse_dg=reverse_dg)


def sum_key_groups(heads: torch.Tensor, key_heads: int, group: int) -> torch.Tensor:
    """Value heads sharing a key head add their key gradients: [B, T, HV, K] -> [B, T, H, K].
    Without GVA there is nothing to add, and no pass over the fp32 gradients is spent on it."""
    if group == 1:
        return heads
    batch, time, _, key_dim = heads.shape
    return heads.view(batch, time, key_heads, group, key_dim).sum(3)


def chunk_delta_rule_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    gate: str | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    out: dict[str, torch.Tensor] | None = None,
    intermediates: Kept | tuple | None = None,
    wrap: Callable | None = None,
    dummy: torch.Tensor | None = None,
    checked: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Gradients of chunk_delta_rule_fwd given do = dL/do and dht = dL/d(final state) (optional).

    Takes the forward's inputs (it recomputes the forward intermediates) and returns a dict
    keyed by input name: "q", "k", "v", "beta", "g", "initial_state", "A_log", "dt_bias";
    a gradient is None where its input was None. Each has its input's dtype and shape ("g"
    is the gradient of the raw g_raw when A_log/dt_bias are given). Gradients are written
    into the tensors of `out` (same keys, any subset) when given. `intermediates`: the Kept that
    chunk_delta_rule_fwd(return_intermediates=True) returned for the same inputs and chunk size (or
    its first three, the matrices, or its first six); the recomputation then skips them. `wrap`, `dummy`: as the forward's.
    `checked`: the inputs are those of a forward that checked them, do and dht shaped like its outputs, and
    `intermediates` that forward's own (hccompile's ops: the forward's autograd calls the backward): no check
    runs again. The state sweep is launched before the other gradients' buffers are allocated: the host work
    before a backward's first launch is time the GPU waits.
    """
    if checked:
        problem = checked_problem(q, v, g, gate, cu_seqlens, A_log, dt_bias)
    else:
        problem = _validate(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound,
                            chunk_size, do=do, dht=dht)
    inputs = dict(zip(GRADIENT_NAMES, (q, k, v, beta, g, initial_state, A_log, dt_bias)))
    out = dict(out or {})
    for name, given in out.items():
        if name not in GRADIENT_NAMES:
            raise ValueError(f"out: unknown gradient {name!r}; expected keys among {GRADIENT_NAMES}")
        if inputs[name] is None:
            raise ValueError(f"out[{name!r}]: given, but input {name} is None")
        like = inputs[name]
        _check_out(f"out[{name!r}]", given, tuple(like.shape), like.dtype, like.device)
    scale = problem.key_dim**-0.5 if scale is None else scale
    if intermediates is not None:
        intermediates = Kept(*intermediates) if checked else _checked_intermediates(
            intermediates, problem, chunk_size, q, use_qk_l2norm_in_kernel)
    # after the arguments: a wrong argument is named wherever the kernels can or cannot run
    _require_triton(q.device)
    plan = make_plan(problem, chunk_size, cu_seqlens, q, wrap or direct, dummy)
    fwd = _forward(plan, q, k, v, beta, g, scale, initial_state, None, None, use_qk_l2norm_in_kernel,
                   A_log, dt_bias, lower_bound, kept=intermediates)

    batch, time, value_heads = problem.batch, problem.time, problem.value_heads
    key_dim, value_dim, chunk = problem.key_dim, problem.value_dim, plan.chunk_size
    device = q.device

    def buffer(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=device)

    def result(name):
        return out[name] if name in out else torch.empty_like(inputs[name], memory_format=torch.contiguous_format)

    dh0 = result("initial_state") if initial_state is not None else None
    dh = buffer(scratch_rows(plan.num_chunks), value_heads, key_dim, value_dim, dtype=plan.intermediate_dtype)
    du = buffer(batch, time, value_heads, value_dim, dtype=plan.intermediate_dtype)
    cum_arg = fwd.cum if fwd.cum is not None else plan.dummy
    table, seqlens = plan.chunk_args()
    group, nt = problem.group_size, plan.chunks_per_row
    block_k, block_v = block_size(key_dim), block_size(value_dim)
    block_k_full = block_size(key_dim, MAX_HEAD_DIM)
    block_v_state = state_backward_block_v(block_k_full, value_dim, problem.num_sequences * value_heads, device)
    common = dict(GATE=plan.gate_code, BT=chunk, IS_VARLEN=plan.varlen, DOT_PRECISION=plan.dot_precision)
    no_strides = (0, 0, 0, 0)

    # a channel gate's decayed queries and keys formed before the sweep (kernel_plan.PREPARED_CHANNEL_SWEEP)
    prepared = problem.gate == "channel" and kernel_plan.PREPARED_CHANNEL_SWEEP and bool(plan.num_chunks)
    qg = kg = plan.dummy
    if prepared:
        qg, kg = (buffer(batch, time, value_heads, key_dim, dtype=plan.intermediate_dtype) for _ in range(2))
        launch_decayed_keys(plan, fwd.q, fwd.k, cum_arg, qg, kg, plan.num_chunks, table, seqlens)
    # dU's local part by its own chunk-parallel launch (kernel_plan.local_du_wanted; not per-channel gates)
    sweep_programs = problem.num_sequences * value_heads * cdiv(value_dim, block_v_state)
    local_du = (problem.gate != "channel" and bool(plan.num_chunks)
                and kernel_plan.local_du_wanted(sweep_programs, device))
    if local_du:
        launch_local_du(plan, fwd.scores, do, du, plan.num_chunks, table, seqlens, float(scale))
    if problem.num_sequences and (plan.num_chunks or dh0 is not None):
        grid = (problem.num_sequences, value_heads, cdiv(value_dim, block_v_state))
        plan.launch(_state_backward_kernel)[grid](
            fwd.q, fwd.k, cum_arg, fwd.w, fwd.scores, do, dht if dht is not None else plan.dummy, dh, du,
            dh0 if dh0 is not None else plan.dummy,
            *fwd.q.stride(), *fwd.k.stride(), *do.stride(),
            *(dht.stride() if dht is not None else no_strides), *(dh0.stride() if dh0 is not None else no_strides),
            plan.chunk_offsets if plan.chunk_offsets is not None else plan.dummy, seqlens,
            time, nt, value_heads, group, key_dim, value_dim, float(scale),
            BKF=block_k_full, BV=block_v_state,
            HAS_FINAL_STATE_GRAD=dht is not None, STORE_INITIAL_STATE_GRAD=dh0 is not None,
            **sweep_launch_options(plan, block_k_full, fwd.k.dtype, "backward"), **common,
            qg_ptr=qg, kg_ptr=kg, PREPARED=prepared, LOCAL_DU=local_du,
        )
    # the other gradients' buffers, while the sweep runs
    dv, dbeta = result("v"), result("beta")
    dq, dk = result("q"), result("k")
    # dk_heads: the single kernel's dk (fp32) or dqkw.py's partial sums (plan.dk_partial_dtype), which
    # wy_bwd.py completes into dk_out
    dk_heads = buffer(batch, time, value_heads, key_dim, dtype=plan.dk_partial_dtype)
    if not plan.half_key_gradients:
        dq_heads, dk_out = buffer(batch, time, value_heads, key_dim), dk_heads
    elif use_qk_l2norm_in_kernel or not (dq.is_contiguous() and dk.is_contiguous()):
        dq_heads, dk_out = (buffer(batch, time, value_heads, key_dim, dtype=q.dtype) for _ in range(2))
    else:  # the kernels write the op's gradients themselves (no GVA: one value head per key head)
        dq_heads, dk_out = dq, dk
    gate_width = key_dim if problem.gate == "channel" else 1
    # wy_bwd.py, which completes dG, takes its reverse sum too (plan.FOLDED_GATE_SUMS): dcum is then g's
    # gradient, written into the op's when that has the sum's dtype and layout.
    reverse_dg = (kernel_plan.FOLDED_GATE_SUMS and problem.gate == "scalar" and bool(plan.num_chunks)
                  and plan.split_wy_backward)
    dg_out = result("g") if reverse_dg else None
    dg_in_place = reverse_dg and dg_out.dtype == torch.float32 and dg_out.is_contiguous()
    if dg_in_place:
        dcum = dg_out.view(batch, time, value_heads, 1)
    else:
        dcum = buffer(batch, time, value_heads, gate_width) if problem.gate != "none" else plan.dummy
    fused_scores = plan.fused_scores_backward
    dkdot, dscores = plan.score_gradients(fused_scores, batch, time, value_heads, buffer)
    if plan.num_chunks and plan.split_wy_backward:
        launch_split_wy_backward(plan, fwd.q, fwd.k, v, beta, do, cum_arg, fwd.inverse, fwd.u, du, fwd.h, dh, dv,
                                 dbeta, dq_heads, dk_heads, dcum, plan.num_chunks, table, seqlens, float(scale),
                                 dk_out, reverse_dg=reverse_dg)
    elif plan.num_chunks:
        kdot = fwd.kdot
        if kdot is None:
            # Intermediates kept by a forward without decayed_scores (plan.fused_scores_forward), a
            # backward whose plan takes the single wy_backward (switches changed in between): it reads
            # Kdot, formed again here (P into a scratch: the kept one serves).
            kdot = buffer(batch, time, value_heads, chunk)
            _launch_scores(plan, fwd.q, fwd.k, cum_arg, kdot,
                                  buffer(batch, time, value_heads, chunk, dtype=plan.scores_dtype),
                                  plan.num_chunks, table, seqlens)
        plan.launch(_wy_backward_kernel)[(plan.num_chunks, value_heads)](
            fwd.q, fwd.k, v, beta, do, cum_arg, fwd.inverse, kdot,
            fwd.u, du, fwd.h, dh, dv, dbeta, dq_heads, dk_heads, dcum, dkdot, dscores,
            *fwd.q.stride(), *fwd.k.stride(), *v.stride(), *beta.stride(), *do.stride(), *dv.stride(),
            *dbeta.stride(), table, seqlens,
            time, nt, value_heads, group, key_dim, value_dim, float(scale),
            BK=block_k, BV=block_v, FUSE_SCORES=fused_scores,
            **WY_BACKWARD_OPTIONS, **common,
        )
        if not fused_scores:
            launch_scores_backward(plan, fwd.q, fwd.k, cum_arg, dkdot, dscores, dq_heads, dk_heads, dcum,
                                   plan.num_chunks, table, seqlens)
    else:
        dq_heads.zero_()
        dk_out.zero_()
        if problem.gate != "none":
            dcum.zero_()

    dq_sum = sum_key_groups(dq_heads, problem.key_heads, group)
    dk_sum = sum_key_groups(dk_out, problem.key_heads, group)
    grads: dict[str, torch.Tensor | None] = dict.fromkeys(GRADIENT_NAMES)
    if use_qk_l2norm_in_kernel:
        l2norm_backward(q, k, dq_sum, dk_sum, dq, dk, plan.launch)
    elif dq_sum is not dq:
        dq.copy_(dq_sum)
        dk.copy_(dk_sum)
    grads["q"], grads["k"] = dq, dk
    grads["v"], grads["beta"], grads["initial_state"] = dv, dbeta, dh0

    if problem.gate_in_kernel and plan.num_chunks:
        # d(loss)/dg_t is the sum of d(loss)/dG over the rest of t's chunk, taken through the
        # activation in the same kernel.
        dg, dA_log, ddt_bias = gate_backward(plan, dcum, g, gate_activation(problem, lower_bound), A_log, dt_bias,
                                             lower_bound, out=out.get("g"))
        for name, grad in (("A_log", dA_log), ("dt_bias", ddt_bias)):
            grads[name] = out[name].copy_(grad) if name in out else grad.to(inputs[name].dtype)
        grads["g"] = dg
    elif reverse_dg:  # wy_bwd.py left g's gradient in dcum
        grads["g"] = dg_out if dg_in_place else dg_out.copy_(dcum.view(g.shape))
    elif problem.gate != "none":
        # d(loss)/dg_t is the sum of d(loss)/dG over the rest of t's chunk.
        dg_out = result("g")
        # The reverse sum writes g's gradient in place when nothing follows it (no gate activation)
        # and it has the sum's dtype and layout: no copy of a [B, T, HV, K] tensor.
        in_place = (plan.num_chunks and not problem.gate_in_kernel and dg_out.dtype == torch.float32
                  and dg_out.is_contiguous())
        if plan.num_chunks:
            dg = launch_gate_cumsum(plan, dcum, ACTIVATION_NONE, None, None, None, reverse=True,
                                    out=dg_out.view(batch, time, value_heads, gate_width) if in_place else None)
        else:
            dg = torch.zeros(batch, time, value_heads, gate_width, dtype=torch.float32, device=device)
        dg = dg.view(g.shape) if problem.gate == "channel" else dg.view(batch, time, value_heads)
        if problem.gate_in_kernel:
            dg, dA_log, ddt_bias = gate_activation_backward(g, dg, A_log, dt_bias, lower_bound)
            for name, grad in (("A_log", dA_log), ("dt_bias", ddt_bias)):
                grads[name] = out[name].copy_(grad) if name in out else grad.to(inputs[name].dtype)
        grads["g"] = dg_out if in_place else dg_out.copy_(dg)
    return grads
