"""The CP kernels (hccompile/kernels/delta_rule/cp.py) against their plain-PyTorch references, and
every rank's CP forward and backward simulated in one process against the single-process kernels.

Summaries: fp32 kernels vs the float64 token recurrence (and autograd for dH), NaN-poisoned
outputs. Merge: the Triton fold vs the plain fold vs the log-depth scan on random summaries over
plans with middle parts. Simulation: the all-gather is a concatenation, so these cover the engine
(prepare / overlap / merge / finish) for many layouts without starting processes."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import hccompile.kernels.delta_rule.cp as cp
from hccompile.distributed import build_cp_context
from hccompile.distributed.exchange import merge_chains_scan
from hccompile.kernels.delta_rule.cp_reference import merge_chains_ref, summary_backward_ref, summary_forward_ref
from hccompile.kernels.delta_rule.reference import chunk_delta_rule_ref

from cp_cases import (GRADIENT_NAMES, local_final_grads, make_inputs, output_grads, relative_rms_error,
                      simulate, single_process)

KERNELS_CAN_RUN = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
requires_kernels = pytest.mark.skipif(not KERNELS_CAN_RUN, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-5  # fp32 kernels against float64 references, or against each other
GATE_PARAMETER_TOLERANCE = 1e-4  # sums of the gate gradient over all tokens


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(cp, "POISON", True)


SUMMARY_CASES = {
    # name: (gate, extra make_inputs kwargs, extra call kwargs)
    "delta-rule": ("none", dict(), dict()),
    "gdn": ("scalar", dict(), dict()),
    "kda": ("channel", dict(), dict()),
    "kda-gate-in-kernel": ("channel", dict(gate_in_kernel=True), dict(lower_bound=-4.0)),
}


def _summary_inputs(gate, extra):
    # GVA (HV = 2 H), K != V, an empty sequence and lengths across chunk boundaries.
    case, cu = make_inputs(gate, seqlens=[21, 0, 35], H=1, HV=2, K=16, V=32, initial_state=False, device=DEVICE,
                           **extra)
    return case, cu


@requires_kernels
@pytest.mark.parametrize("name", list(SUMMARY_CASES))
def test_summary_forward_matches_token_recurrence(name, poison):
    gate, extra, call = SUMMARY_CASES[name]
    case, cu = _summary_inputs(gate, extra)
    args = (case["q"], case["k"], case["v"], case["beta"], case["g"])
    kwargs = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, A_log=case["A_log"], dt_bias=case["dt_bias"], **call)
    out = cp.summary_forward(*args, chunk_size=16, **kwargs)
    ref = summary_forward_ref(*(t.cpu() if t is not None else None for t in args), **{
        n: (v.cpu() if isinstance(v, torch.Tensor) else v) for n, v in kwargs.items()})
    value_dim = case["v"].shape[-1]
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert relative_rms_error(out[..., :value_dim], ref[..., :value_dim]) < TOLERANCE, "H"
    assert relative_rms_error(out[..., value_dim:], ref[..., value_dim:]) < TOLERANCE, "M"
    # The empty sequence: H = 0, M = I exactly.
    assert (out[1, ..., :value_dim] == 0).all()
    assert torch.equal(out[1, ..., value_dim:].cpu(), torch.eye(16).expand(2, 16, 16))


@requires_kernels
@pytest.mark.parametrize("name", ["gdn", "kda"])
@pytest.mark.parametrize("with_final_grad", [True, False])
def test_summary_backward_matches_autograd(name, with_final_grad, poison):
    gate, extra, call = SUMMARY_CASES[name]
    case, cu = _summary_inputs(gate, extra)
    do, dht = output_grads(case, cu)
    dht = dht if with_final_grad else None
    args = (case["q"], case["k"], case["v"], case["beta"], case["g"])
    out = cp.summary_backward(*args, scale=0.3, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, chunk_size=16, do=do,
                              dht=dht)
    ref = summary_backward_ref(*(t.cpu() for t in args), scale=0.3, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                               do=do.cpu(), dht=None if dht is None else dht.cpu())
    value_dim = case["v"].shape[-1]
    assert relative_rms_error(out[..., :value_dim], ref[..., :value_dim]) < TOLERANCE, "dH"
    assert relative_rms_error(out[..., value_dim:], ref[..., value_dim:]) < TOLERANCE, "M^T"


@requires_kernels
@pytest.mark.parametrize("floor", [32, 16], ids=["floor32", "floor16"])
@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_summaries_with_narrowed_tiles_match_the_references(name, floor, poison, monkeypatch):
    # A huge occupancy target narrows the summary sweeps' column tiles (48 here: V 32 beside K 16) to the floor:
    # cp.SUMMARY_MIN_TILE's 32 (two tiles), and 16 (three; benchmarks/cp.py's summary16 mode, not yet the default).
    from hccompile.kernels.delta_rule import plan as kernel_plan

    monkeypatch.setattr(kernel_plan, "SWEEP_MIN_PROGRAMS", 10**6)
    monkeypatch.setattr(cp, "SUMMARY_MIN_TILE", floor)
    shape = SimpleNamespace(key_dim=16, value_dim=32, value_heads=2)  # the summaries' sizes below
    assert cp._summary_blocks(shape, 3, True, torch.device(DEVICE))[1] == floor
    test_summary_forward_matches_token_recurrence(name, poison)
    test_summary_backward_matches_autograd(name, True, poison)


def _random_summaries(plan, heads, key_dim, value_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    world = plan.world_size
    h = torch.randn(world * plan.out_slots, heads, key_dim, value_dim, generator=gen)
    # Contractive transitions keep long chains bounded, as real ones are.
    m = torch.eye(key_dim) * 0.7 + 0.3 * torch.randn(world * plan.out_slots, heads, key_dim, key_dim,
                                                     generator=gen) / key_dim ** 0.5
    summaries_out = torch.cat([h, m], dim=-1) if plan.with_transition else h
    summaries_in = torch.randn(world * plan.in_slots, heads, key_dim, value_dim, generator=gen)
    return summaries_out.to(DEVICE), summaries_in.to(DEVICE)


@requires_kernels
@pytest.mark.parametrize("layout, world, key_dim", [("contiguous", 4, 16), ("zigzag", 3, 80)])
def test_merge_kernel_fold_and_scan_agree_with_plain_fold(layout, world, key_dim):
    # key_dim 80 pads to 128 > 64: the merge kernel's blocked path.
    ctxs = [build_cp_context([0, 3, 50, 52, 71], layout=layout, rank=r, world_size=world) for r in range(world)]
    heads, value_dim = 2, 24
    for rank, ctx in enumerate(ctxs):
        plan = ctx.plan(1)
        assert plan.with_transition
        summaries_out, summaries_in = _random_summaries(plan, heads, key_dim, value_dim, seed=rank)
        segments = plan.num_segments
        incoming = [s for s in range(segments) if plan.incoming[s]]
        outgoing = [s for s in range(segments) if plan.outgoing[s]]
        results = {}
        for name, merge in (("kernel", cp.merge_chains), ("plain", merge_chains_ref), ("scan", merge_chains_scan)):
            initial = torch.full((segments, heads, key_dim, value_dim), float("nan"), device=DEVICE)
            grads = torch.ones(segments, heads, key_dim, value_dim, device=DEVICE)
            merge(plan, "forward", summaries_out, None, initial, value_dim)
            merge(plan, "backward", summaries_out, summaries_in, grads, value_dim)
            # Only incoming rows are written; outgoing ones accumulate.
            assert torch.isnan(initial[[s for s in range(segments) if s not in incoming]]).all()
            results[name] = (initial[incoming], grads[outgoing])
        for name in ("kernel", "scan"):
            assert relative_rms_error(results[name][0], results["plain"][0]) < TOLERANCE, (name, "forward", rank)
            assert relative_rms_error(results[name][1], results["plain"][1]) < TOLERANCE, (name, "backward", rank)


# ----------------------------------------------------------------------------------------
# Simulated ranks


def _contexts(case, cu, world, **ctx_kwargs):
    """Every rank's context for a case: varlen (cu) or fixed-length rows."""
    if cu is not None:
        return [build_cp_context(cu, rank=r, world_size=world, **ctx_kwargs) for r in range(world)]
    return [build_cp_context(seq_len=case["q"].shape[1], rank=r, world_size=world, **ctx_kwargs)
            for r in range(world)]


def _assemble(ctxs, per_rank, like, key):
    """Global tensor from every rank's local token-dim tensor (results[rank][key])."""
    out = torch.empty_like(like)
    for ctx, result in zip(ctxs, per_rank):
        offset = 0
        for piece in ctx.my_pieces:
            out[:, piece.start:piece.end] = result[key][:, offset:offset + piece.size]
            offset += piece.size
    return out


def _errors(ctxs, case, cu, options, merge=None, engine="triton"):
    """Relative errors of every output, final state and gradient of the simulated CP run."""
    batch = case["q"].shape[0]
    do, dht = output_grads(case, cu)
    o_ref, final_ref, grads_ref = single_process(case, cu, options, do, dht) if engine == "triton" else \
        _reference_single_process(case, cu, options, do, dht)
    outputs = simulate(ctxs, case, options, merge=merge, engine=engine)
    errors = {"o": relative_rms_error(_assemble(ctxs, [{"o": o} for o, _ in outputs], o_ref, "o"), o_ref)}
    finals = {}
    for ctx, (_, final) in zip(ctxs, outputs):
        plan = ctx.plan(batch)
        for segment, sequence in enumerate(plan.sequence):
            if plan.ends_sequence[segment]:
                finals[sequence] = final[segment if ctx.varlen else sequence]
    errors["final_state"] = relative_rms_error(torch.stack([finals[i] for i in range(len(finals))]), final_ref)
    grads = simulate(ctxs, case, options, do=do, dht=dht, merge=merge, engine=engine)
    for name in GRADIENT_NAMES:
        if grads_ref[name] is None:
            continue
        if name in ("A_log", "dt_bias"):
            total = sum(g[name] for g in grads)
        elif name == "initial_state":
            total = torch.zeros_like(grads_ref[name])
            for ctx, g in zip(ctxs, grads):
                if ctx.varlen:
                    total.index_add_(0, torch.tensor(ctx.plan(1).sequence, device=total.device), g[name])
                else:
                    total += g[name]
        else:
            total = _assemble(ctxs, grads, grads_ref[name], name)
        errors[f"d{name}"] = relative_rms_error(total, grads_ref[name])
    return errors


def _reference_single_process(case, cu, options, do, dht):
    leaves = {n: t.detach().requires_grad_() for n, t in case.items() if t is not None}
    o, final = chunk_delta_rule_ref(**{n: leaves.get(n) for n in case}, output_final_state=True,
                                    cu_seqlens=None if cu is None else torch.tensor(cu), **options)
    grads = torch.autograd.grad((o, final), list(leaves.values()), (do, dht))
    result = dict.fromkeys(GRADIENT_NAMES)
    result.update(zip(leaves, grads))
    return o.detach(), final.detach(), result


SIMULATION_CASES = {
    # name: (gate, make_inputs kwargs, world, context kwargs, merge)
    "gdn-varlen-middle-rank-uneven": ("scalar", dict(seqlens=[13, 60, 3, 0, 20]), 3, dict(), None),
    "gdn-fixed-b2-zigzag-scan": ("scalar", dict(batch=2, time=45, initial_state=False), 2,
                                 dict(layout="zigzag"), merge_chains_scan),
    "kda-varlen-contiguous": ("channel", dict(seqlens=[9, 31]), 2, dict(), None),
}


@requires_kernels
@pytest.mark.parametrize("middle_stores_chunks", [True, False], ids=["middle-stores-chunks", "middle-walks-again"])
@pytest.mark.parametrize("name", list(SIMULATION_CASES))
def test_simulated_ranks_match_single_process(name, middle_stores_chunks, poison, monkeypatch):
    # Both ways to state a middle segment after the merge: h = H + M S_in per chunk from its
    # summary walk's stores (the default), or a second walk.
    monkeypatch.setattr(cp, "MIDDLE_WALK_STORES_CHUNKS", middle_stores_chunks)
    gate, input_kwargs, world, ctx_kwargs, merge = SIMULATION_CASES[name]
    case, cu = make_inputs(gate, device=DEVICE, **input_kwargs)
    ctxs = _contexts(case, cu, world, **ctx_kwargs)
    options = dict(chunk_size=16, use_qk_l2norm_in_kernel=True, scale=0.3)
    errors = _errors(ctxs, case, cu, options, merge=merge)
    for quantity, error in errors.items():
        limit = GATE_PARAMETER_TOLERANCE if quantity in ("dA_log", "ddt_bias") else TOLERANCE
        assert error < limit, (quantity, error)


@requires_kernels
@pytest.mark.parametrize("fused_forward, split", [(False, True), (False, False), (True, False)],
                         ids=["scores-kernel-split", "scores-kernel-single", "fused-single"])
@pytest.mark.parametrize("name", ["gdn-varlen-middle-rank-uneven", "gdn-fixed-b2-zigzag-scan"])
def test_simulated_ranks_with_or_without_the_scores_kernel(name, fused_forward, split, poison, monkeypatch):
    """CP runs chunk.py's chunk-parallel steps: with plan.FUSED_SCORES_FORWARD off they launch
    decayed_scores (the default test above runs it on: Kdot formed in wy_solve, P in the output
    kernel, the backward's P in its P-only mode), and with plan.SPLIT_WY_BACKWARD off the single
    wy_backward reads Kdot or takes its terms from the keys."""
    from hccompile.kernels.delta_rule import plan as kernel_plan

    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_FORWARD", fused_forward)
    monkeypatch.setattr(kernel_plan, "SPLIT_WY_BACKWARD", split)
    gate, input_kwargs, world, ctx_kwargs, merge = SIMULATION_CASES[name]
    case, cu = make_inputs(gate, device=DEVICE, **input_kwargs)
    ctxs = _contexts(case, cu, world, **ctx_kwargs)
    options = dict(chunk_size=16, use_qk_l2norm_in_kernel=True, scale=0.3)
    errors = _errors(ctxs, case, cu, options, merge=merge)
    assert max(errors.values()) < TOLERANCE, errors


KEEP_CASES = {
    # name: (gate, make_inputs kwargs, world, context kwargs): plans without transitions (no sequence
    # across a whole rank), where a forward keeps its intermediates
    "gdn-varlen-two-ranks": ("scalar", dict(seqlens=[13, 60, 3, 0, 20]), 2, dict()),
    "kda-varlen-contiguous": ("channel", dict(seqlens=[9, 31]), 2, dict()),
    "delta-fixed-b2": ("none", dict(batch=2, time=45), 2, dict()),
}


@requires_kernels
@pytest.mark.parametrize("fused_forward", [True, False], ids=["fused-scores", "scores-kernel"])
@pytest.mark.parametrize("name", list(KEEP_CASES))
def test_backward_from_the_kept_forward(name, fused_forward, poison, monkeypatch):
    """CPForward(keep_state_rows=...) keeps what the backward would recompute; CPBackward given it
    recomputes nothing and gets the recomputing backward's gradients. Its kept tensors have the op's
    layout (h: the rows asked for, zeros past the chunk count)."""
    from hccompile.kernels.delta_rule import plan as kernel_plan

    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_FORWARD", fused_forward)
    gate, input_kwargs, world, ctx_kwargs = KEEP_CASES[name]
    case, cu = make_inputs(gate, device=DEVICE, **input_kwargs)
    ctxs = _contexts(case, cu, world, **ctx_kwargs)
    assert not ctxs[0].plan(case["q"].shape[0]).with_transition
    options = dict(chunk_size=16, use_qk_l2norm_in_kernel=True, scale=0.3)
    do, dht = output_grads(case, cu)
    kept_runs = simulate(ctxs, case, options, keep=True)
    for (o, _, kept), (o_plain, _) in zip(kept_runs, simulate(ctxs, case, options)):
        assert torch.equal(o, o_plain)
        assert kept is not None and kept.h is not None and kept.w is not None and kept.inverse is not None
        assert (kept.kdot is None) == (fused_forward and gate != "channel")
        assert kept.q_normed is not None and (kept.cum is None) == (gate == "none")
        assert torch.isfinite(kept.h).all() and torch.isfinite(kept.scores.float()).all()
    from_kept = simulate(ctxs, case, options, do=do, dht=dht, keep=True)
    recomputed = simulate(ctxs, case, options, do=do, dht=dht)
    for rank, (a, b) in enumerate(zip(from_kept, recomputed)):
        for quantity in GRADIENT_NAMES:
            if b[quantity] is None:
                assert a[quantity] is None
                continue
            assert relative_rms_error(a[quantity], b[quantity]) < 1e-6, (rank, quantity)
    _, _, grads_ref = single_process(case, cu, options, do, dht)
    for quantity in ("q", "k", "v", "beta"):
        total = _assemble(ctxs, from_kept, grads_ref[quantity], quantity)
        assert relative_rms_error(total, grads_ref[quantity]) < TOLERANCE, quantity


@requires_kernels
def test_a_plan_with_transitions_keeps_nothing():
    # A middle segment's backward merge needs its M, which only a forward walk forms.
    case, cu = make_inputs("scalar", seqlens=[13, 60, 3, 0, 20], device=DEVICE)
    ctxs = [build_cp_context(cu, rank=r, world_size=3) for r in range(3)]
    assert ctxs[0].plan(1).with_transition
    for _, _, kept in simulate(ctxs, case, dict(chunk_size=16), keep=True):
        assert kept is None


def test_reference_engine_float64_matches_single_process():
    # The fallback engine (float64 inputs, or no Triton): exact to float64 rounding.
    case, cu = make_inputs("scalar", seqlens=[11, 30, 6], dtype=torch.float64)
    case["initial_state"] = case["initial_state"].double()
    ctxs = [build_cp_context(cu, layout="zigzag", rank=r, world_size=2) for r in range(2)]
    options = dict(chunk_size=16, use_qk_l2norm_in_kernel=True, scale=0.3, gate="scalar")
    errors = _errors(ctxs, case, cu, options, engine="reference")
    assert max(errors.values()) < 1e-12, errors


@requires_kernels
def test_simulation_fails_without_the_exchange():
    """The comparison can fail: skipping the merge leaves incoming states at zero."""
    case, cu = make_inputs("scalar", seqlens=[40], device=DEVICE)
    ctxs = [build_cp_context(cu, rank=r, world_size=2) for r in range(2)]
    options = dict(chunk_size=16, use_qk_l2norm_in_kernel=True, scale=0.3)
    errors = _errors(ctxs, case, cu, options, merge=lambda *args: None)
    assert errors["o"] > 1e-2 and errors["dk"] > 1e-2 and errors["dinitial_state"] > 1e-2, errors


def test_local_final_grads_zero_at_rank_boundaries():
    ctxs = [build_cp_context([0, 10, 30], rank=r, world_size=2) for r in range(2)]
    dht = torch.arange(1.0, 3.0)[:, None]
    assert local_final_grads(ctxs[0], dht).flatten().tolist() == [1.0, 0.0]
    assert local_final_grads(ctxs[1], dht).flatten().tolist() == [2.0]
