"""Running `hccompile::chunk_delta_rule` and its backward op as context parallelism.

The two op implementations (hccompile/lowering/delta_rule.py) call forward() / backward() first;
each returns None (run the op as usual) unless a CP context applies:

* forward: the innermost active `context_parallel(ctx)` block.
* backward: the context its forward ran under (or none), remembered by the storage of q while that
  storage lives, so that `loss.backward()` after the with-block works when autograd hands the
  backward op the very q the forward op saw; otherwise the active context. Run backward inside the
  block to be independent of that (e.g. when a compiled graph recomputes q instead of saving it).

The op's arguments are this rank's local tensors: q, k [B, T_local, H, K], ...; cu_seqlens the
context's local cu_seqlens (varlen) or None (fixed-length rows, or a single local sequence);
initial_state / final state one row per local sequence. The fake implementations need no change:
shapes are the local ones.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from .context import CPContext

__all__ = ["backward", "context_parallel", "current_context", "forward", "keeps_intermediates"]

_ACTIVE: list[CPContext] = []
# storage of q -> the context its CP forward ran under
_FORWARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# cu_seqlens storages already checked against a context's local cu_seqlens (checking reads device values)
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def context_parallel(ctx: CPContext):
    """Inside this block, every `hccompile::chunk_delta_rule` op (and the functions
    chunk_delta_rule / chunk_gated_delta_rule / chunk_kda, eager or compiled with any backend)
    runs context-parallel over `ctx` on its rank-local inputs; so does its backward. Place the
    block around the (compiled) model call, not inside a compiled function, with the compiled
    model's first call inside it: on CUDA a graph compiled outside any block launches the
    single-device kernels itself and stops with a RuntimeError inside one."""
    if not isinstance(ctx, CPContext):
        raise TypeError(f"ctx: expected a CPContext (hccompile.distributed.build_cp_context), got {type(ctx).__name__}")
    _ACTIVE.append(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.pop()


def current_context() -> CPContext | None:
    return _ACTIVE[-1] if _ACTIVE else None


def _check_cu_seqlens(ctx: CPContext, cu_seqlens, batch: int) -> None:
    if not ctx.varlen:
        if cu_seqlens is not None:
            raise ValueError(f"cu_seqlens: the CP context was built for fixed-length rows (seq_len={ctx.seq_len}); "
                             "pass cu_seqlens=None")
        return
    plan = ctx.plan(1) if batch == 1 else None
    if batch != 1:
        raise ValueError(f"q: a varlen CP context needs B == 1, got B={batch}")
    if cu_seqlens is None:
        if plan.num_segments != 1:
            raise ValueError(f"cu_seqlens: rank {ctx.rank} holds {plan.num_segments} local sequences; pass "
                             "cu_seqlens=ctx.cu_seqlens")
        return
    if cu_seqlens is ctx.cu_seqlens or cu_seqlens is ctx.cu_seqlens_cpu:
        return
    storage = cu_seqlens.untyped_storage()
    if _CHECKED.get(storage) is ctx:
        return
    expected = plan.cu_seqlens()
    if tuple(cu_seqlens.shape) != (len(expected),) or cu_seqlens.tolist() != expected:
        raise ValueError(f"cu_seqlens: must be the context's local cu_seqlens {expected} (ctx.cu_seqlens) on rank "
                         f"{ctx.rank}, got {cu_seqlens.tolist()}")
    _CHECKED[storage] = ctx


def _engines(q, k, v, beta, g, initial_state, A_log, dt_bias):
    """(forward class, backward class, whether they are the Triton ones): the same rule as the
    ops' non-CP dispatch, so the CP path falls back to the reference exactly where they do."""
    from ..lowering.delta_rule import _uses_triton

    if _uses_triton(q, k, v, beta, g, initial_state, A_log, dt_bias):
        from ..kernels.delta_rule.cp import CPBackward, CPForward

        return CPForward, CPBackward, True
    from ..kernels.delta_rule.cp_reference import CPBackwardRef, CPForwardRef

    return CPForwardRef, CPBackwardRef, False


def _run(ctx: CPContext, run):
    from .exchange import new_exchange

    exchange = new_exchange(ctx)
    run.prepare()
    exchange.start(run)
    run.overlap()
    exchange.finish(run)


def keeps_intermediates(ctx: CPContext, q) -> bool:
    """Whether a forward under `ctx` keeps its intermediates for the backward (CPForward's
    keep_state_rows): where no sequence crosses a whole rank (a plan without transitions)."""
    try:
        return not ctx.plan(q.shape[0]).with_transition
    except ValueError:  # a call the op will refuse with its own message
        return False


def forward(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, gate, scale, output_final_state,
            use_qk_l2norm_in_kernel, lower_bound, chunk_size, keep_state_rows=None):
    """The forward op under the active context as (o, final state, kept), or None. With
    keep_state_rows (the op's kept h rows), kept is what CPForward.kept() gives (None where the
    reference engine ran or the plan keeps nothing)."""
    ctx = current_context()
    if ctx is None:
        if len(_FORWARDS):  # once CP has been used: remember that this forward did not use it
            _FORWARDS[q.untyped_storage()] = None
        return None
    from ..lowering.delta_rule import _check_options, _state_dtype

    _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size)
    _check_cu_seqlens(ctx, cu_seqlens, q.shape[0])
    forward_engine, _, kernels = _engines(q, k, v, beta, g, initial_state, A_log, dt_bias)
    keep = dict(keep_state_rows=keep_state_rows) if kernels else {}
    run = forward_engine(ctx.plan(q.shape[0]), q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound,
                         scale, use_qk_l2norm_in_kernel, chunk_size, **keep)
    _run(ctx, run)
    o, final_state = run.finish(output_final_state)
    kept = run.kept() if kernels else None
    _FORWARDS[q.untyped_storage()] = ctx
    if final_state is None:
        return o, q.new_empty((0,), dtype=_state_dtype(q)), kept
    return o, final_state.to(_state_dtype(q)).contiguous(), kept


def backward(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, do, dht, gate, scale,
             use_qk_l2norm_in_kernel, lower_bound, chunk_size, intermediates=None):
    """The backward op under the active context (or the one its forward ran under), or None.
    `intermediates`: the chunk.Kept its forward op returned (used where the CP forward kept them:
    cp.keeps_forward; otherwise the forward is recomputed)."""
    # The forward's choice wins where it is known: backward inside a block of a forward run outside,
    # or the other way round, still differentiates what the forward computed.
    storage = q.untyped_storage()
    ctx = _FORWARDS[storage] if len(_FORWARDS) and storage in _FORWARDS else current_context()
    if ctx is None:
        return None
    from ..lowering.delta_rule import _absent, _check_options

    _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size)
    _check_cu_seqlens(ctx, cu_seqlens, q.shape[0])
    _, backward_engine, kernels = _engines(q, k, v, beta, g, initial_state, A_log, dt_bias)
    if kernels:  # as the non-CP kernel backward: do in v's dtype, dht fp32
        do = do.to(v.dtype)
        dht = None if dht is None else dht.to(torch.float32)
    # CPBackward uses them where its forward kept them (cp.keeps_forward), else recomputes.
    keep = dict(intermediates=intermediates) if kernels and intermediates is not None else {}
    run = backward_engine(ctx.plan(q.shape[0]), q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound,
                          scale, use_qk_l2norm_in_kernel, chunk_size, do=do, dht=dht, **keep)
    from ..compat import autograd_recording

    # The gate activation's backward (and the reference engine) use autograd inside the op.
    with autograd_recording():
        _run(ctx, run)
        grads = run.finish()
    inputs = dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    return tuple(_absent(q) if inputs[name] is None else grads[name].to(inputs[name].dtype).contiguous()
                 for name in inputs)


def _register() -> None:
    import sys

    from ..lowering.delta_rule import register_context_parallel

    register_context_parallel(sys.modules[__name__])


_register()
