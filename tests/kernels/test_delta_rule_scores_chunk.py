"""decayed_scores for per-channel gates with one program per chunk (scores_chunk.py,
plan.CHUNK_SCORE_PROGRAMS) against the float64 Kdot and P (reference.intra_chunk_matrices_ref) and
against scores.py's one program per sub-chunk, into NaN-poisoned outputs: chunk sizes 16/32/64 (one,
two and four sub-chunks), T never a chunk multiple, varlen, GVA, key dims off the tiles, the diagonal
blocks factored, split (the factor limit at 0) and, with strong gates, mixed; then the whole forward
and backward with the switch on against the float64 recurrence; decayed_scores_backward with one program
per chunk against one per sub-chunk, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hccompile.kernels.delta_rule import chunk as chunk_kernels
from hccompile.kernels.delta_rule import plan as kernel_plan
from hccompile.kernels.delta_rule import scores as score_kernels
from hccompile.kernels.delta_rule.reference import intra_chunk_matrices_ref
from hccompile.kernels.delta_rule.scores import launch_decayed_scores
from hccompile.kernels.delta_rule.scores_chunk import launch_chunk_scores

from test_delta_rule import build_case
from test_delta_rule_chunk import check_forward_and_backward, kernel_inputs, relative_rms_error, requires_triton
from test_delta_rule_wy_split import _nan

VARLEN = {"cu_seqlens": torch.tensor([0, 37, 38, 90], dtype=torch.int32), "num_sequences": 3}
# name, (batch, time, H, HV, K, V), options, dtype, chunk size
CASES = [
    ("chunk64-T100-K60-gva", (1, 100, 1, 2, 60, 16), {}, torch.float32, 64),
    ("chunk32-T45-K100-b2", (2, 45, 2, 2, 100, 16), {}, torch.float32, 32),
    ("chunk16-T41-K32", (1, 41, 1, 1, 32, 16), {}, torch.float32, 16),
    ("chunk64-varlen-bf16", (1, 90, 1, 2, 64, 16), VARLEN, torch.bfloat16, 64),
    ("chunk32-strong-fp16", (1, 75, 1, 2, 48, 16), {"decay": 50.0}, torch.float16, 32),
]
IDS = [c[0] for c in CASES]
# float64 distance of Kdot and P: fp32 products exact; half ones round q and k (and the factors)
LIMITS = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _scores_inputs(sizes, options, dtype, chunk, seed):
    inputs, kwargs = build_case(sizes, "channel", options, seed=seed)
    inputs = kernel_inputs(inputs, dtype)
    q, k, v, beta, g = (inputs[n] for n in ("q", "k", "v", "beta", "g"))
    cu_seqlens = inputs.get("cu_seqlens")
    problem = chunk_kernels._validate(q, k, v, beta, g, "channel", None, cu_seqlens, None, None, None, chunk)
    plan = kernel_plan.make_plan(problem, chunk, cu_seqlens, q)
    fwd = chunk_kernels._forward(plan, q, k, v, beta, g, 1.0, None, None, None, False, None, None, None)
    chunks = [(b, start, min(chunk, eos - start)) for b, bos, eos in problem.sequence_bounds()
              for start in range(bos, eos, chunk)]
    return plan, fwd, chunks, (inputs, kwargs)


def _run(launch, plan, fwd):
    batch, time, value_heads, chunk = fwd.inverse.shape
    kdot = _nan(batch, time, value_heads, chunk)
    scores = _nan(batch, time, value_heads, chunk, dtype=plan.scores_dtype)
    table, seqlens = plan.chunk_args()
    launch(plan, fwd.q, fwd.k, fwd.cum, kdot, scores, plan.num_chunks, table, seqlens)
    return kdot, scores


@requires_triton
@pytest.mark.parametrize("limit", [None, 0.0], ids=["factored", "split"])
@pytest.mark.parametrize("name, sizes, options, dtype, chunk", CASES, ids=IDS)
def test_chunk_programs_match_float64_and_the_sub_chunk_programs(monkeypatch, name, sizes, options, dtype, chunk,
                                                                 limit):
    if limit is not None:
        monkeypatch.setattr(score_kernels, "FACTOR_SPAN_LIMIT", limit)
    plan, fwd, chunks, _ = _scores_inputs(sizes, options, dtype, chunk, seed=sizes[1] + 3)
    kdot, scores = _run(launch_chunk_scores, plan, fwd)
    kdot_ref, scores_ref = intra_chunk_matrices_ref(fwd.q, fwd.k, fwd.cum, chunks, chunk, plan.problem.value_heads)
    for label, got, want in (("kdot", kdot, kdot_ref), ("scores", scores, scores_ref)):
        error = relative_rms_error(got, want)  # fails on any unwritten (NaN) element
        assert error < LIMITS[dtype], f"{label}: relative RMS error {error:.2e}"
    # The same products of the same rounded operands; only the key tiles' summation order may differ
    # (the two kernels' tiles are 32 and 64 wide at K >= 64).
    kdot_sub, scores_sub = _run(launch_decayed_scores, plan, fwd)
    for label, got, want in (("kdot", kdot, kdot_sub), ("scores", scores, scores_sub)):
        error = relative_rms_error(got, want)
        assert error < 1e-5, f"{label} against scores.py's kernel: relative RMS error {error:.2e}"


@requires_triton
@pytest.mark.parametrize("name, sizes, options, dtype, chunk", [CASES[0], CASES[3], CASES[4]],
                         ids=[IDS[0], IDS[3], IDS[4]])
def test_forward_and_backward_with_chunk_programs_match_float64_recurrence(monkeypatch, name, sizes, options, dtype,
                                                                           chunk):
    launched = []
    monkeypatch.setattr(kernel_plan, "CHUNK_SCORE_PROGRAMS", True)
    original = chunk_kernels.launch_chunk_scores
    monkeypatch.setattr(chunk_kernels, "launch_chunk_scores", lambda *a: launched.append(1) or original(*a))
    inputs, kwargs = build_case(sizes, "channel", {**options, "initial_state": True}, seed=sizes[1] + 9)
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)
    assert launched, "the per-chunk score kernel was not launched"


@requires_triton
@pytest.mark.parametrize("limit", [None, 0.0], ids=["factored", "split"])
@pytest.mark.parametrize("name, sizes, options, dtype, chunk", CASES, ids=IDS)
def test_backward_chunk_programs_equal_the_sub_chunk_programs(monkeypatch, name, sizes, options, dtype, chunk,
                                                              limit):
    """decayed_scores_backward with one program per chunk (its sub-chunks one after another) against one
    program per sub-chunk: each sub-chunk's body writes only its own rows, so the gradients it adds to dq,
    dk and dG must be bit-for-bit those of the other layout; and it must have added them (no row left as
    it was)."""
    if limit is not None:
        monkeypatch.setattr(score_kernels, "FACTOR_SPAN_LIMIT", limit)
    plan, fwd, chunks, _ = _scores_inputs(sizes, options, dtype, chunk, seed=sizes[1] + 5)
    batch, time, value_heads, _ = fwd.inverse.shape
    key_dim = plan.problem.key_dim
    gen = torch.Generator().manual_seed(sizes[1])
    device = fwd.q.device
    dkdot, dscores = (torch.randn(batch, time, value_heads, chunk, generator=gen).to(device) for _ in range(2))
    start = [torch.randn(batch, time, value_heads, key_dim, generator=gen).to(device) for _ in range(3)]
    table, seqlens = plan.chunk_args()
    results = {}
    for per_chunk in (True, False):
        monkeypatch.setattr(kernel_plan, "CHUNK_SCORE_PROGRAMS", per_chunk)
        dq, dk, dcum = (s.clone() for s in start)
        score_kernels.launch_scores_backward(plan, fwd.q, fwd.k, fwd.cum, dkdot, dscores, dq, dk, dcum,
                                             plan.num_chunks, table, seqlens)
        results[per_chunk] = (dq, dk, dcum)
    rows = torch.zeros(batch, time, dtype=torch.bool, device=device)
    for b, first, length in chunks:
        rows[b, first:first + length] = True
    for label, per_chunk, per_sub_chunk, before in zip(("dq", "dk", "dG"), results[True], results[False], start):
        assert torch.equal(per_chunk, per_sub_chunk), \
            f"{label}: max difference {(per_chunk - per_sub_chunk).abs().max():.2e}"
        changed = (per_chunk != before).flatten(2).any(-1)
        assert changed[rows].all(), f"{label}: {(~changed[rows]).sum()} token rows left unwritten"
