"""The forward without decayed_scores (plan.FUSED_SCORES_FORWARD; no gate or a scalar one, R2 of
benchmarks/analysis/gdn_traffic_2026-11-26.md): wy_solve forming Kdot's blocks from the keys and the
output kernel forming P (storing it, or P only), one kernel at a time against their float64 references
(reference.wy_solve_ref, reference.output_ref) into NaN-poisoned outputs; wy.py's single wy_backward
(which reads Kdot) against reference.dqkw_ref + reference.wy_bwd_ref; the whole forward and backward
with the switch on and off (in force only with the split wy_backward and the fused score backward)
against the float64 recurrence; kept against recomputed intermediates, also across switch settings
(a single-kernel backward given no Kdot has decayed_scores form it)."""

from __future__ import annotations

import pytest
import torch

from hccompile.kernels.delta_rule import chunk as chunk_kernels
from hccompile.kernels.delta_rule import chunk_delta_rule_bwd, chunk_delta_rule_fwd
from hccompile.kernels.delta_rule import plan as kernel_plan
from hccompile.kernels.delta_rule import wy as wy_kernels
from hccompile.kernels.delta_rule.output import launch_output, launch_scores_only
from hccompile.kernels.delta_rule.plan import SUB_CHUNK, block_size, intermediate_dtype_for
from hccompile.kernels.delta_rule.reference import (dqkw_ref, intra_chunk_matrices_ref, output_ref, wy_bwd_ref,
                                                    wy_solve_ref)

from test_delta_rule import build_case
from test_delta_rule_chunk import (DEVICE, TOLERANCES, check_forward_and_backward, float64_reference,
                                   kernel_inputs, random_output_gradients, relative_rms_error, requires_triton)
from test_delta_rule_wy_split import VARLEN, _kernel_inputs, _limits, _nan

# name, (batch, time, H, HV, K, V), gate, options, dtype, chunk size; T never a chunk multiple
CASES = [
    ("gdn-T100-K60-V100-gva-h0", (1, 100, 1, 2, 60, 100), "scalar", {"initial_state": True}, torch.bfloat16, 64),
    ("plain-T45-K100-V60", (2, 45, 1, 1, 100, 60), "none", {}, torch.float32, 32),
    ("gdn-varlen-gqa-l2norm", (1, 80, 2, 4, 32, 48), "scalar", {**VARLEN, "l2norm": True}, torch.float16, 32),
    ("gdn-T41-strong-decay-chunk16", (1, 41, 1, 2, 64, 32), "scalar", {"decay": 20.0}, torch.float32, 16),
    ("plain-varlen-K100-V60-gva-h0", (1, 80, 1, 2, 100, 60), "none", VARLEN, torch.bfloat16, 64),
]
IDS = [c[0] for c in CASES]


@pytest.fixture
def fused(monkeypatch):
    """The forward without decayed_scores in force, whatever the environment set: it needs the split
    backward and the fused score backward too."""
    for switch in ("FUSED_SCORES_FORWARD", "SPLIT_WY_BACKWARD", "FUSED_SCORES_BACKWARD"):
        monkeypatch.setattr(kernel_plan, switch, True)


def _intermediates(sizes, gate, options, dtype, chunk, seed):
    """The kernels' inputs and a forward's kept intermediates (normed q and k, the gate's sum, A, h,
    u), with the plan and the chunk list (test_delta_rule_wy_split's)."""
    return _kernel_inputs(sizes, gate, options, dtype, chunk, seed)


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", CASES, ids=IDS)
def test_wy_solve_forming_kdot_matches_float64(fused, name, sizes, gate, options, dtype, chunk):
    x = _intermediates(sizes, gate, options, dtype, chunk, seed=sizes[1] + 31)
    plan = x["plan"]
    assert plan.fused_scores_forward
    k, v, beta = x["k"], x["v"], x["beta"]
    batch, time, value_heads, value_dim = v.shape
    key_dim = k.shape[3]
    inverse = _nan(batch, time, value_heads, chunk)
    w = _nan(batch, time, value_heads, key_dim, dtype=plan.intermediate_dtype)
    u_tilde = _nan(batch, time, value_heads, value_dim, dtype=plan.intermediate_dtype)
    table, seqlens = plan.chunk_args()
    cum = x["cum"] if x["cum"] is not None else plan.dummy
    wy_kernels._wy_solve_kernel[(plan.num_chunks, value_heads)](
        k, v, beta, cum, plan.dummy, inverse, w, u_tilde, plan.dummy, plan.dummy, *k.stride(), *v.stride(),
        *beta.stride(), 0, 0, 0, table, seqlens, time, plan.chunks_per_row, value_heads, plan.problem.group_size, key_dim, value_dim,
        GATE=plan.gate_code, BT=chunk, BC=min(chunk, SUB_CHUNK), BK=block_size(key_dim), BV=block_size(value_dim),
        DOT_PRECISION=plan.dot_precision, IS_VARLEN=plan.varlen, SOLVE=True, FORM_KDOT=True, REGISTER_DIAGONAL=True,
        FORM_CUM=False, FORM_WU=True, **wy_kernels.wy_solve_options(plan),
    )
    inverse_ref, w_ref, u_ref = wy_solve_ref(k, v, beta, x["cum"], x["chunks"], chunk)
    # A is fp32 from the exact (or fp32-accumulated half) key products; W and U~ take half operands.
    error = relative_rms_error(inverse, inverse_ref)
    assert error < (1e-6 if dtype == torch.float32 else 1e-5), f"A: relative RMS error {error:.2e}"
    for label, out, ref in (("W", w, w_ref), ("U~", u_tilde, u_ref)):
        error = relative_rms_error(out, ref)
        assert error < TOLERANCES[dtype][0], f"{label}: relative RMS error {error:.2e}"
    # The kept inverse of the forward (the same kernel on the same keys) is the one just formed, stored in
    # plan.inverse_dtype (the fp32 one rounded).
    assert x["inverse"].dtype == plan.inverse_dtype
    assert torch.equal(inverse.to(plan.inverse_dtype), x["inverse"])


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", CASES, ids=IDS)
def test_output_forming_scores_matches_float64(fused, name, sizes, gate, options, dtype, chunk):
    x = _intermediates(sizes, gate, options, dtype, chunk, seed=sizes[1] + 32)
    plan = x["plan"]
    q, k, u, h = x["q"], x["k"], x["u"], x["h"]
    batch, time, value_heads, value_dim = u.shape
    o = _nan(batch, time, value_heads, value_dim, dtype=dtype)
    scores = _nan(batch, time, value_heads, chunk, dtype=plan.scores_dtype)
    assert plan.scores_dtype == intermediate_dtype_for(dtype)
    table, seqlens = plan.chunk_args()
    cum = x["cum"] if x["cum"] is not None else plan.dummy
    launch_output(plan, q, k, cum, h, scores, u, o, plan.num_chunks, table, seqlens, x["scale"], form_scores=True,
                  store_scores=True)
    o_ref, scores_ref = output_ref(q, k, x["cum"], h, u, x["chunks"], x["scale"], chunk)
    o_tol = TOLERANCES[dtype][0]
    error = relative_rms_error(o, o_ref)
    assert error < o_tol, f"o: relative RMS error {error:.2e}"
    # P stored in the intermediates' dtype: its rounding only (fp32: accumulation order).
    error = relative_rms_error(scores, scores_ref)
    assert error < (1e-6 if dtype == torch.float32 else o_tol), f"P: relative RMS error {error:.2e}"
    # Without the store, o is the same; the P-only mode (a recomputing backward's) stores the same P.
    o_again = _nan(batch, time, value_heads, value_dim, dtype=dtype)
    launch_output(plan, q, k, cum, h, plan.dummy, u, o_again, plan.num_chunks, table, seqlens, x["scale"],
                  form_scores=True)
    assert torch.equal(o_again, o)
    scores_only = _nan(batch, time, value_heads, chunk, dtype=plan.scores_dtype)
    launch_scores_only(plan, q, k, cum, scores_only, plan.num_chunks, table, seqlens)
    assert torch.equal(scores_only, scores)


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", CASES, ids=IDS)
def test_single_wy_backward_matches_float64(name, sizes, gate, options, dtype, chunk):
    """wy.py's wy_backward (FUSE_SCORES) is dqkw.py's and wy_bwd.py's work in one kernel: against their
    references chained, Kdot read from its float64 reference (fp32)."""
    x = _intermediates(sizes, gate, options, dtype, chunk, seed=sizes[1] + 33)
    plan = x["plan"]
    q, k, v, beta, do = x["q"], x["k"], x["v"], x["beta"], x["do"]
    batch, time, value_heads, value_dim = v.shape
    key_dim = k.shape[3]
    kdot, _ = intra_chunk_matrices_ref(q, k, x["cum"], x["chunks"], chunk, value_heads)
    kdot = kdot.to(device=DEVICE, dtype=torch.float32)
    dv, dbeta = _nan(*v.shape, dtype=v.dtype), _nan(*beta.shape, dtype=beta.dtype)
    dq, dk = _nan(batch, time, value_heads, key_dim), _nan(batch, time, value_heads, key_dim)
    dcum = _nan(batch, time, value_heads, 1) if gate != "none" else plan.dummy
    table, seqlens = plan.chunk_args()
    cum = x["cum"] if x["cum"] is not None else plan.dummy
    wy_kernels._wy_backward_kernel[(plan.num_chunks, value_heads)](
        q, k, v, beta, do, cum, x["inverse"], kdot, x["u"], x["du"], x["h"], x["dh"], dv, dbeta, dq, dk, dcum,
        plan.dummy, plan.dummy, *q.stride(), *k.stride(), *v.stride(), *beta.stride(), *do.stride(), *dv.stride(),
        *dbeta.stride(), table, seqlens, time, plan.chunks_per_row, value_heads, plan.problem.group_size, key_dim,
        value_dim, x["scale"], GATE=plan.gate_code, BT=chunk, BK=block_size(key_dim), BV=block_size(value_dim),
        IS_VARLEN=plan.varlen, DOT_PRECISION=plan.dot_precision, FUSE_SCORES=True,
        **wy_kernels.WY_BACKWARD_OPTIONS,
    )
    dq_ref, dk_partial, dw_ref, dg_partial = dqkw_ref(q, k, do, x["cum"], x["u"], x["du"], x["h"], x["dh"],
                                                      x["chunks"], x["scale"])
    dv_ref, dbeta_ref, dk_ref, dg_ref = wy_bwd_ref(k, v, beta, x["cum"], x["inverse"], x["du"], dw_ref, dk_partial,
                                                   dg_partial, x["chunks"])
    grad_tol, gate_grad_tol = _limits(dtype)
    for label, out, ref, limit in (("dq", dq, dq_ref, grad_tol), ("dk", dk, dk_ref, grad_tol),
                                   ("dv", dv, dv_ref, grad_tol), ("dbeta", dbeta, dbeta_ref, gate_grad_tol)):
        error = relative_rms_error(out, ref)
        assert error < limit, f"{label}: relative RMS error {error:.2e}"
    if gate != "none":
        error = relative_rms_error(dcum[..., 0], dg_ref)
        assert error < gate_grad_tol, f"dG: relative RMS error {error:.2e}"


def _count_launches(monkeypatch):
    """Counts of decayed_scores launches (either program layout, scores.py's or scores_chunk.py's) and
    of the output kernel's P-only launches (chunk.py's)."""
    counts = {"decayed_scores": 0, "scores_only": 0}
    for name, attribute in (("decayed_scores", "launch_decayed_scores"), ("decayed_scores", "launch_chunk_scores"),
                            ("scores_only", "launch_scores_only")):
        launch = getattr(chunk_kernels, attribute)

        def spy(*args, _launch=launch, _name=name, **kwargs):
            counts[_name] += 1
            return _launch(*args, **kwargs)

        monkeypatch.setattr(chunk_kernels, attribute, spy)
    return counts


@requires_triton
@pytest.mark.parametrize("switch, split", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["fused-split", "fused-single", "scores-kernel-split", "scores-kernel-single"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", CASES, ids=IDS)
def test_forward_and_backward_with_or_without_the_scores_kernel(monkeypatch, switch, split, name, sizes, gate,
                                                                options, dtype, chunk):
    """The whole forward and (recomputing) backward, NaN-poisoned outputs, against the float64
    recurrence; decayed_scores launched (forward and the backward's recomputation) unless the switch
    is on with the split backward, the P-only output launch (the backward's recomputation) only then:
    the single wy_backward reads Kdot, so the switch alone does not drop decayed_scores."""
    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_BACKWARD", True)
    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_FORWARD", switch)
    monkeypatch.setattr(kernel_plan, "SPLIT_WY_BACKWARD", split)
    counts = _count_launches(monkeypatch)
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 34)
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)
    fused_forward = switch and split
    assert counts == ({"decayed_scores": 0, "scores_only": 1} if fused_forward
                      else {"decayed_scores": 2, "scores_only": 0})


def _kept_forward(inputs, kwargs, chunk):
    """(o, final state, Kept) of a forward without decayed_scores (the caller's `fused` fixture)."""
    o, state, kept = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, return_intermediates=True)
    assert kept.kdot is None
    return o, state, kept


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", [CASES[0], CASES[4]], ids=[IDS[0], IDS[4]])
def test_unfused_score_backward_given_no_kdot(monkeypatch, fused, name, sizes, gate, options, dtype, chunk):
    """Intermediates kept without Kdot, then plan.FUSED_SCORES_BACKWARD off (so the single wy_backward,
    which stores dKdot for decayed_scores_backward): decayed_scores forms Kdot again, once, and the
    gradients match the float64 recurrence's."""
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 35)
    inputs = kernel_inputs(inputs, dtype)
    _, _, kept = _kept_forward(inputs, kwargs, chunk)
    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_BACKWARD", False)
    counts = _count_launches(monkeypatch)
    do, dht = random_output_gradients(inputs, dtype)
    _, _, grads_ref = float64_reference(inputs, kwargs, do, dht)
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    grads = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht, intermediates=kept)
    assert counts == {"decayed_scores": 1, "scores_only": 0}
    _check_gradients(grads, grads_ref, dtype, "unfused")


def _check_gradients(grads, grads_ref, dtype, label):
    for grad_name, grad_ref in grads_ref.items():
        error = relative_rms_error(grads[grad_name], grad_ref)
        limit = TOLERANCES[dtype][2 if grad_name in ("g", "beta") else 1]
        assert error < limit, f"{label}: d{grad_name} {error:.2e}"


@requires_triton
def test_channel_gates_keep_the_scores_kernel(monkeypatch, fused):
    counts = _count_launches(monkeypatch)
    inputs, kwargs = build_case((1, 40, 1, 2, 32, 16), "channel", {"initial_state": True}, seed=7)
    inputs = kernel_inputs(inputs, torch.float32)
    _, _, kept = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=16, return_intermediates=True)
    assert kept.kdot is not None and kept.kdot.dtype == kept.scores.dtype == torch.float32
    check_forward_and_backward(inputs, kwargs, torch.float32, 16)
    assert counts == {"decayed_scores": 3, "scores_only": 0}


KEPT_CASES = [CASES[0], CASES[2], CASES[3]]


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", KEPT_CASES, ids=[c[0] for c in KEPT_CASES])
def test_kept_scores_equal_the_recomputed_ones(fused, name, sizes, gate, options, dtype, chunk):
    """A forward that keeps its intermediates has the output kernel store P (the intermediates' dtype,
    no Kdot); the backward with them equals the one that recomputes P in the P-only mode, bit for bit."""
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 36)
    inputs = kernel_inputs(inputs, dtype)
    o, state, kept = _kept_forward(inputs, kwargs, chunk)
    o_plain, state_plain = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk)
    assert torch.equal(o, o_plain) and torch.equal(state, state_plain)
    assert kept.scores.dtype == intermediate_dtype_for(dtype)
    assert kept.inverse.dtype == kernel_plan.inverse_dtype_for(gate, dtype)
    do, dht = random_output_gradients(inputs, dtype)
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    recomputed = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht)
    for given in (kept, kept[:3], kept[:6]):
        reused = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht, intermediates=given)
        for grad_name, grad in recomputed.items():
            if grad is not None:
                assert torch.equal(reused[grad_name], grad), (len(given), grad_name)


@requires_triton
@pytest.mark.parametrize("forward_switch", [True, False], ids=["kept-without-kdot", "kept-with-kdot"])
def test_kept_intermediates_serve_either_switch_setting(monkeypatch, forward_switch):
    """Intermediates kept with the switch one way serve a backward with it the other way, split or
    single (the single wy_backward reads Kdot: kept, or formed again by decayed_scores; P in either
    dtype)."""
    sizes, gate, options, dtype, chunk = (1, 70, 1, 2, 32, 48), "scalar", {"initial_state": True}, torch.float16, 32
    inputs, kwargs = build_case(sizes, gate, options, seed=37)
    inputs = kernel_inputs(inputs, dtype)
    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_BACKWARD", True)
    monkeypatch.setattr(kernel_plan, "SPLIT_WY_BACKWARD", True)
    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_FORWARD", forward_switch)
    _, _, kept = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, return_intermediates=True)
    assert (kept.kdot is None) == forward_switch
    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_FORWARD", not forward_switch)
    do, dht = random_output_gradients(inputs, dtype)
    _, _, grads_ref = float64_reference(inputs, kwargs, do, dht)
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    for split in (True, False):
        monkeypatch.setattr(kernel_plan, "SPLIT_WY_BACKWARD", split)
        for given in (kept, kept[:3]):
            grads = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht,
                                         intermediates=given)
            _check_gradients(grads, grads_ref, dtype, f"split {split}, {len(given)} kept")


def test_kept_kdot_is_required_only_with_channel_gates():
    inputs, kwargs = build_case((1, 20, 1, 1, 16, 8), "channel", {}, seed=1)
    inputs = kernel_inputs(inputs, torch.float32)
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    square = torch.zeros(1, 20, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"kdot is None, but per-channel gates need it"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=torch.zeros(1, 20, 1, 8, device=DEVICE),
                             intermediates=(None, square, square))
    inputs, kwargs = build_case((1, 20, 1, 1, 16, 8), "scalar", {}, seed=1)
    inputs = kernel_inputs(inputs, torch.float16)
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    with pytest.raises(TypeError, match=r"intermediates scores: dtype torch.bfloat16 differs"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=torch.zeros(1, 20, 1, 8, device=DEVICE, dtype=torch.float16),
                             intermediates=(None, square.bfloat16(), square))
