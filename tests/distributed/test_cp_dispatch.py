"""The CP dispatch of the delta-rule custom ops (hccompile/distributed/dispatch.py), in one process:
a one-rank context runs the whole CP path (plan, engine, exchange skipped: nothing crosses a rank)
and must reproduce the ops without CP; bad calls under a context name the argument."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import hccompile
from hccompile.distributed import build_cp_context, context_parallel, current_context

from cp_cases import make_inputs, output_grads, relative_rms_error

KERNELS_CAN_RUN = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gdn(case, cu_seqlens, **kwargs):
    return hccompile.chunk_gated_delta_rule(case["q"], case["k"], case["v"], case["g"], case["beta"],
                                            initial_state=case["initial_state"], output_final_state=True,
                                            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, **kwargs)


def _fwd_bwd(case, cu_seqlens, context=None, backward_inside=True):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in case.items() if t is not None}
    tensors = {n: leaves.get(n) for n in case}
    do, dht = output_grads(case, None if cu_seqlens is None else cu_seqlens.tolist())
    if context is None:
        o, final = _gdn(tensors, cu_seqlens)
        grads = torch.autograd.grad((o, final), list(leaves.values()), (do, dht))
    else:
        with context_parallel(context):
            assert current_context() is context
            o, final = _gdn(tensors, cu_seqlens)
            if backward_inside:
                grads = torch.autograd.grad((o, final), list(leaves.values()), (do, dht))
        assert current_context() is None
        if not backward_inside:  # the backward op finds the context its forward ran under
            grads = torch.autograd.grad((o, final), list(leaves.values()), (do, dht))
    return o, final, dict(zip(leaves, grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backward_inside", [True, False])
def test_one_rank_context_reproduces_the_ops(dtype, backward_inside):
    if dtype == torch.float32 and not KERNELS_CAN_RUN:
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    case, cu = make_inputs("scalar", seqlens=[7, 0, 26], dtype=dtype, device=DEVICE)
    if dtype == torch.float64:  # the reference engine
        case["initial_state"] = case["initial_state"].double()
    ctx = build_cp_context(cu, rank=0, world_size=1, device=DEVICE)
    o, final, grads = _fwd_bwd(case, ctx.cu_seqlens, context=ctx, backward_inside=backward_inside)
    o_ref, final_ref, grads_ref = _fwd_bwd(case, torch.tensor(cu, device=DEVICE))
    limit = 1e-12 if dtype == torch.float64 else 1e-6
    assert relative_rms_error(o, o_ref) < limit
    assert relative_rms_error(final, final_ref) < limit
    for name, grad in grads.items():
        assert relative_rms_error(grad, grads_ref[name]) < limit, name


@pytest.mark.parametrize("keep_states, dtype", [(True, torch.float32), (False, torch.float32),
                                                (True, torch.bfloat16)])
def test_the_backward_op_reuses_what_the_forward_kept(keep_states, dtype, monkeypatch):
    # Under a plan without transitions the forward op keeps its intermediates (as without CP) and the
    # backward recomputes nothing; with KEEP_STATES off it keeps nothing and recomputes. bf16: the
    # kept tensors' half dtypes (w, u, h, P, the normed q and k) match the layout the fake promised.
    if not KERNELS_CAN_RUN:
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    import hccompile.kernels.delta_rule.cp as cp
    import hccompile.kernels.delta_rule.plan as kernel_plan
    from hccompile.lowering import delta_rule as lowering

    monkeypatch.setattr(lowering, "KEEP_STATES", keep_states)
    # CP's sweep forms dU's local part itself; the plain op, by default, launches local_du.py for it
    # where its sweep fits one wave (a GPU's small batches), rounding it to the intermediate dtype
    # first: bf16 k's gradient then differs by 1.2e-3 (H200, e243096). Same kernels on both sides here.
    monkeypatch.setattr(kernel_plan, "LOCAL_DU_KERNEL", False)
    reused = []
    kept_forward = cp.CPBackward._kept_forward

    def spy(self):
        reused.append(True)
        kept_forward(self)

    monkeypatch.setattr(cp.CPBackward, "_kept_forward", spy)
    case, cu = make_inputs("scalar", seqlens=[7, 0, 26], dtype=dtype, device=DEVICE)
    ctx = build_cp_context(cu, rank=0, world_size=1, device=DEVICE)
    o, final, grads = _fwd_bwd(case, ctx.cu_seqlens, context=ctx)
    assert reused == ([True] if keep_states else [])
    o_ref, final_ref, grads_ref = _fwd_bwd(case, torch.tensor(cu, device=DEVICE))
    # The same kernels on the same tokens: equal bits in the interpreter (bf16 too); on a GPU a sweep's
    # value tiles may be cut differently per launch, so half outputs get a half-precision bound.
    limit = 1e-6 if dtype == torch.float32 else 1e-3
    assert relative_rms_error(o, o_ref) < limit
    for name, grad in grads.items():
        assert relative_rms_error(grad, grads_ref[name]) < limit, name


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_one_rank_zigzag_passes_states_between_its_own_pieces(strategy):
    # One rank holds both zigzag pieces: the sequence crossing them goes through the exchange and merge.
    if not KERNELS_CAN_RUN:
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    case, cu = make_inputs("scalar", seqlens=[10, 31], device=DEVICE)
    ctx = build_cp_context(cu, layout="zigzag", strategy=strategy, rank=0, world_size=1, device=DEVICE)
    assert ctx.plan(1).out_slots == 1
    local = dict(case, initial_state=ctx.local_initial_state(case["initial_state"]))
    with context_parallel(ctx):
        o, _ = _gdn(local, ctx.cu_seqlens)
    o_ref, _ = _gdn(case, torch.tensor(cu, device=DEVICE))
    assert relative_rms_error(o, o_ref) < 1e-6


def test_backward_follows_the_forward_not_the_block():
    # A forward run outside any block, differentiated inside one, stays non-CP (and vice versa).
    case, cu = make_inputs("scalar", seqlens=[10, 31], dtype=torch.float64)
    case["initial_state"] = case["initial_state"].double()
    ctx = build_cp_context(cu, layout="zigzag", rank=0, world_size=1)
    local = dict(case, initial_state=ctx.local_initial_state(case["initial_state"]))
    with context_parallel(ctx):  # registers CP use, so that later non-CP forwards are remembered too
        _gdn(local, ctx.cu_seqlens)
    results = []
    for inside in (False, True):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in local.items() if t is not None}
        o, final = _gdn({n: leaves.get(n) for n in local}, ctx.cu_seqlens)  # plain: three local sequences
        with context_parallel(ctx) if inside else contextlib.nullcontext():
            results.append(torch.autograd.grad(o.sum() + final.sum(), list(leaves.values())))
    for plain, in_block in zip(*results):
        assert torch.equal(plain, in_block)


@pytest.mark.skipif(not KERNELS_CAN_RUN, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_fixed_length_rows_without_cu_seqlens():
    case, _ = make_inputs("scalar", batch=2, time=19, device=DEVICE)
    ctx = build_cp_context(seq_len=19, rank=0, world_size=1)
    o, final, grads = _fwd_bwd(case, None, context=ctx)
    o_ref, final_ref, grads_ref = _fwd_bwd(case, None)
    assert relative_rms_error(o, o_ref) < 1e-6 and relative_rms_error(final, final_ref) < 1e-6
    for name, grad in grads.items():
        assert relative_rms_error(grad, grads_ref[name]) < 1e-6, name


@pytest.mark.skipif(not KERNELS_CAN_RUN, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_zigzag_rows_with_more_chunks_than_the_kept_rows():
    # One rank holding both zigzag pieces of each row: 2 x 2 chunks of 20 tokens where the op's kept h
    # has 2 x ceil(40 / 64) rows. The forward keeps nothing then and the backward recomputes.
    case, _ = make_inputs("scalar", batch=2, time=40, device=DEVICE)
    ctx = build_cp_context(seq_len=40, layout="zigzag", rank=0, world_size=1)
    assert not ctx.plan(2).with_transition
    o, final, grads = _fwd_bwd(case, None, context=ctx)
    o_ref, final_ref, grads_ref = _fwd_bwd(case, None)
    assert relative_rms_error(o, o_ref) < 1e-6 and relative_rms_error(final, final_ref) < 1e-6
    for name, grad in grads.items():
        assert relative_rms_error(grad, grads_ref[name]) < 1e-6, name


def _bad_calls():
    def varlen_case():
        return make_inputs("scalar", seqlens=[7, 26], initial_state=False)

    def call(ctx, case, cu_seqlens):
        with context_parallel(ctx):
            return _gdn(case, cu_seqlens)

    varlen = build_cp_context([0, 7, 33], rank=0, world_size=1)
    fixed = build_cp_context(seq_len=33, rank=0, world_size=1)
    return [
        ("cu_seqlens values", lambda: call(varlen, varlen_case()[0], torch.tensor([0, 8, 33])),
         r"cu_seqlens: .*must be the context's local cu_seqlens \[0, 7, 33\]"),
        ("cu_seqlens missing", lambda: call(varlen, varlen_case()[0], None),
         r"cu_seqlens: rank 0 holds 2 local sequences; pass cu_seqlens=ctx.cu_seqlens"),
        ("cu_seqlens for fixed rows", lambda: call(fixed, varlen_case()[0], torch.tensor([0, 7, 33])),
         r"cu_seqlens: the CP context was built for fixed-length rows"),
        ("local token count", lambda: call(fixed, make_inputs("scalar", batch=1, time=30)[0], None),
         r"q: 1 x 30 local tokens, but the context parallel plan of rank 0 holds 33"),
        ("varlen with B=2", lambda: call(varlen, make_inputs("scalar", batch=2, time=33, initial_state=False)[0],
                                         None),
         r"q: a varlen CP context needs B == 1, got B=2"),
    ]


@pytest.mark.parametrize("description, call, match", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_calls_under_a_context_name_the_argument(description, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_context_parallel_needs_a_context():
    with pytest.raises(TypeError, match=r"ctx: expected a CPContext"):
        with context_parallel("not a context"):
            pass
