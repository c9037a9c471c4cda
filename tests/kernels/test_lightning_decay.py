"""Tests for lightning attention with a per-head decay: the PyTorch references and the chunked
Triton kernels (forward, final state, and the micro-chunked backward of seed 004)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from hccompile.kernels.lightning.chunk import (
    MAX_HEAD_DIM,
    lightning_attn_bwd,
    lightning_attn_fwd,
    triton_available,
)
from hccompile.kernels.lightning.decay_reference import (
    lightning_attn_recurrent_ref,
    lightning_attn_ref,
)

TRITON_CAN_RUN = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
requires_triton = pytest.mark.skipif(
    not TRITON_CAN_RUN, reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative RMS error limits (output and final state, gradients). Triton's interpreter casts
# float32 to bfloat16 by truncation, which about triples the bfloat16 error on CPU.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 8e-3) if DEVICE == "cuda" else (1e-2, 1e-2),
    torch.bfloat16: (5e-3, 8e-3) if DEVICE == "cuda" else (1e-2, 1e-2),
}


def relative_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values: unwritten (NaN poison) or overflowed elements"
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_decay(kind: str, heads: int) -> torch.Tensor:
    if kind == "none":
        return torch.zeros(heads)
    if kind == "alibi":  # lightning attention's slopes: -2^(-8 (h + 1) / H)
        return -torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
    if kind == "strong":
        return torch.full((heads,), -0.5)
    if kind == "mixed":
        return torch.tensor([-0.5, 0.0, -0.03, -1e-3])[:heads]
    raise ValueError(kind)


def random_inputs(batch, time, heads, key_dim, value_dim, dtype, with_state, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k = randn(batch, time, heads, key_dim), randn(batch, time, heads, key_dim)
    v, do = randn(batch, time, heads, value_dim), randn(batch, time, heads, value_dim)
    h0 = randn(batch, heads, key_dim, value_dim) if with_state else None
    dht = randn(batch, heads, key_dim, value_dim) if with_state else None
    to = lambda t: None if t is None else t.to(device=DEVICE, dtype=dtype)  # noqa: E731
    to32 = lambda t: None if t is None else t.to(device=DEVICE)  # noqa: E731
    return to(q), to(k), to(v), to(do), to32(h0), to32(dht)


def float64_reference(q, k, v, decay, do, scale, h0=None, dht=None):
    """(o, final state, dq, dk, dv, dh0) from autograd through the quadratic reference in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    h64 = None if h0 is None else h0.detach().double().requires_grad_()
    o, final = lightning_attn_ref(*leaves, decay.double(), scale, h64, output_final_state=True)
    outputs, grads_in = [o], [do.double()]
    if dht is not None:
        outputs.append(final)
        grads_in.append(dht.double())
    inputs = leaves + ([h64] if h64 is not None else [])
    grads = torch.autograd.grad(outputs, inputs, grads_in)
    dh0 = grads[3] if h64 is not None else None
    return o.detach(), final.detach(), grads[0], grads[1], grads[2], dh0


# ---------------------------------------------------------------- references


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("decay_kind", ["none", "alibi", "strong"])
def test_quadratic_reference_matches_recurrence(decay_kind, with_state):
    q, k, v, _, h0, _ = random_inputs(2, 37, 3, 12, 9, torch.float64, with_state)
    decay = make_decay(decay_kind, 3).double().to(DEVICE)
    o, final = lightning_attn_ref(q, k, v, decay, 0.3, h0, True)
    o_rec, final_rec = lightning_attn_recurrent_ref(q, k, v, decay, 0.3, h0, True)
    assert relative_rms_error(o, o_rec) < 1e-12
    assert relative_rms_error(final, final_rec) < 1e-12


def test_reference_without_decay_is_plain_causal_linear_attention():
    from hccompile.kernels.lightning.reference import causal_linear_attn_ref

    q, k, v, _, _, _ = random_inputs(1, 20, 2, 8, 8, torch.float64, False)
    o, final = lightning_attn_ref(q, k, v, torch.zeros(2, dtype=torch.float64, device=DEVICE), 0.5)
    assert final is None
    assert relative_rms_error(o, causal_linear_attn_ref(q, k, v, 0.5)) < 1e-12


# ---------------------------------------------------------------- kernels: forward and backward

# (batch, time, heads, K, V, decay, initial state, dtype)
CASES = [
    (1, 1, 2, 16, 16, "alibi", True, torch.float32),
    (2, 17, 2, 60, 60, "strong", False, torch.float32),
    (1, 64, 3, 64, 64, "none", True, torch.float32),
    (1, 100, 4, 100, 60, "mixed", True, torch.float32),  # K != V, both not powers of two
    (1, 130, 2, 64, 16, "alibi", False, torch.float32),
    (1, 100, 2, 64, 64, "alibi", True, torch.bfloat16),
    (1, 130, 2, 60, 100, "strong", True, torch.float16),
    (1, 17, 2, 16, 64, "none", False, torch.bfloat16),
]


def case_id(case):
    batch, time, heads, key_dim, value_dim, decay, state, dtype = case
    return f"B{batch}T{time}H{heads}K{key_dim}V{value_dim}-{decay}-{'h0' if state else 'noh0'}-{str(dtype)[6:]}"


@requires_triton
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_and_backward_match_float64_reference(case):
    batch, time, heads, key_dim, value_dim, decay_kind, with_state, dtype = case
    q, k, v, do, h0, dht = random_inputs(batch, time, heads, key_dim, value_dim, dtype, with_state)
    decay = make_decay(decay_kind, heads).to(DEVICE)
    scale = key_dim**-0.5
    o_ref, final_ref, dq_ref, dk_ref, dv_ref, dh0_ref = float64_reference(q, k, v, decay, do, scale, h0, dht)
    out_tol, grad_tol = TOLERANCES[dtype]

    o, final = lightning_attn_fwd(q, k, v, decay, scale, h0, output_final_state=True)
    assert o.dtype == dtype and final.dtype == torch.float32
    assert relative_rms_error(o, o_ref) < out_tol
    assert relative_rms_error(final, final_ref) < out_tol

    dq, dk, dv, dh0 = lightning_attn_bwd(q, k, v, decay, do, scale, h0, dht)
    for name, grad, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert grad.dtype == dtype
        assert relative_rms_error(grad, ref) < grad_tol, name
    if with_state:
        assert dh0.dtype == h0.dtype
        assert relative_rms_error(dh0, dh0_ref) < grad_tol
    else:
        assert dh0 is None


@requires_triton
def test_forward_without_final_state_returns_none():
    q, k, v, _, _, _ = random_inputs(1, 20, 2, 16, 16, torch.float32, False)
    o, final = lightning_attn_fwd(q, k, v, make_decay("alibi", 2).to(DEVICE), None)
    assert final is None
    o_ref, _ = lightning_attn_ref(q.double(), k.double(), v.double(),
                                  make_decay("alibi", 2).double().to(DEVICE), 16**-0.5)
    assert relative_rms_error(o, o_ref) < 1e-4


@requires_triton
@pytest.mark.parametrize("block, cblock", [(16, 16), (32, 16), (64, 16), (64, 32), (128, 32)])
def test_gradients_hold_for_every_block_and_micro_chunk(block, cblock):
    """Varies the inter/intra block and the micro-chunk. T = 130 leaves a partial last block for
    every block size and several blocks, so an inter-block state step that is not the intra-block
    BLOCK (the seed-004 trap) double-counts or drops pairs and fails by a wide margin."""
    heads = 4
    q, k, v, do, h0, dht = random_inputs(1, 130, heads, 32, 24, torch.float32, True, seed=1)
    decay = make_decay("mixed", heads).to(DEVICE)
    scale = 32**-0.5
    o_ref, final_ref, dq_ref, dk_ref, dv_ref, dh0_ref = float64_reference(q, k, v, decay, do, scale, h0, dht)
    o, final = lightning_attn_fwd(q, k, v, decay, scale, h0, True, block=block, cblock=cblock)
    assert relative_rms_error(o, o_ref) < 1e-4
    assert relative_rms_error(final, final_ref) < 1e-4
    grads = lightning_attn_bwd(q, k, v, decay, do, scale, h0, dht, block=block, cblock=cblock)
    for name, grad, ref in zip(("dq", "dk", "dv", "dh0"), grads, (dq_ref, dk_ref, dv_ref, dh0_ref)):
        assert relative_rms_error(grad, ref) < 1e-4, f"{name} at block={block}, cblock={cblock}"


@requires_triton
def test_head_dim_256_and_strided_inputs():
    """The largest head dim, and q/k/v as non-contiguous views of one packed projection."""
    generator = torch.Generator().manual_seed(3)
    packed = torch.randn(1, 40, 2, 3 * MAX_HEAD_DIM, generator=generator).to(DEVICE)
    q, k, v = packed.split(MAX_HEAD_DIM, dim=-1)
    do = torch.randn(1, 40, 2, MAX_HEAD_DIM, generator=generator).to(DEVICE)
    decay = make_decay("alibi", 2).to(DEVICE)
    scale = MAX_HEAD_DIM**-0.5
    o_ref, _, dq_ref, dk_ref, dv_ref, _ = float64_reference(q, k, v, decay, do, scale)
    o, _ = lightning_attn_fwd(q, k, v, decay, scale, block=32, cblock=16)
    assert relative_rms_error(o, o_ref) < 1e-4
    dq, dk, dv, _ = lightning_attn_bwd(q, k, v, decay, do, scale, block=32, cblock=16)
    for grad, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert relative_rms_error(grad, ref) < 1e-4


@requires_triton
def test_every_output_element_is_written():
    """NaN-poisoned outputs: any element the kernels skip stays NaN and fails the check."""
    heads = 2
    q, k, v, do, h0, dht = random_inputs(2, 100, heads, 60, 40, torch.float32, True)
    decay = make_decay("alibi", heads).to(DEVICE)
    nan = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    o_out, final_out = nan(v), nan(h0)
    o, final = lightning_attn_fwd(q, k, v, decay, 0.2, h0, True, out=o_out, final_state_out=final_out)
    assert o is o_out and final is final_out
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    grads_out = (nan(q), nan(k), nan(v), nan(h0))
    grads = lightning_attn_bwd(q, k, v, decay, do, 0.2, h0, dht, out=grads_out)
    for grad, given in zip(grads, grads_out):
        assert grad is given
        assert torch.isfinite(grad).all()


@requires_triton
def test_empty_sequence_passes_the_state_through():
    q, k, v, do, h0, dht = random_inputs(1, 0, 2, 16, 16, torch.float32, True)
    decay = make_decay("strong", 2).to(DEVICE)
    o, final = lightning_attn_fwd(q, k, v, decay, 0.5, h0, True)
    assert o.shape == (1, 0, 2, 16)
    assert torch.equal(final, h0)
    *_, dh0 = lightning_attn_bwd(q, k, v, decay, do, 0.5, h0, dht)
    assert torch.equal(dh0, dht)


# ---------------------------------------------------------------- validation


def _valid_inputs():
    q, k, v, do, h0, dht = random_inputs(1, 8, 2, 16, 16, torch.float32, True)
    return q, k, v, make_decay("alibi", 2).to(DEVICE), do, h0, dht


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: {**a, "decay": torch.zeros(3)}, ValueError, "decay: expected shape"),
        (lambda a: {**a, "decay": torch.zeros(2, dtype=torch.int64)}, TypeError, "decay: expected a floating"),
        (lambda a: {**a, "decay": torch.tensor([-0.1, 0.2], device=DEVICE)}, ValueError,
         "decay: log-decays must be <= 0"),
        (lambda a: {**a, "decay": torch.tensor([-0.1, math.nan], device=DEVICE)}, ValueError,
         "decay: log-decays must be finite"),
        (lambda a: {**a, "initial_state": torch.zeros(1, 2, 16, 8)}, ValueError, "initial_state: expected shape"),
        (lambda a: {**a, "k": a["k"][..., :8]}, ValueError, "k: head dim"),
        (lambda a: {**a, "v": a["v"].double()}, TypeError, "v: dtype"),
        (lambda a: {**a, "block": 48}, ValueError, "block: must be a power of two"),
        (lambda a: {**a, "cblock": 8}, ValueError, "cblock: must be a power of two >= 16"),
        (lambda a: {**a, "block": 32, "cblock": 64}, ValueError, "cblock: micro-chunk 64 exceeds block 32"),
        (lambda a: {**a, "block": 512}, ValueError, "block: 512 exceeds the supported maximum 256"),
    ],
)
def test_forward_validation_errors(change, error, message, monkeypatch):
    if DEVICE != "cpu":  # reading the decay's values synchronises with a GPU: checked when asked
        monkeypatch.setenv("HCCOMPILE_CHECK_GATES", "1")
    q, k, v, decay, _, h0, _ = _valid_inputs()
    args = change({"q": q, "k": k, "v": v, "decay": decay, "initial_state": h0, "block": 64, "cblock": 16})
    with pytest.raises(error, match=message):
        lightning_attn_fwd(
            args["q"], args["k"], args["v"], args["decay"], None, args["initial_state"], True,
            block=args["block"], cblock=args["cblock"],
        )


def test_head_dim_limit_and_out_errors():
    generator = torch.Generator().manual_seed(0)
    big = torch.randn(1, 4, 1, MAX_HEAD_DIM + 1, generator=generator)
    with pytest.raises(ValueError, match=f"q: head dim {MAX_HEAD_DIM + 1} exceeds the supported maximum"):
        lightning_attn_fwd(big, big, big, torch.zeros(1), None)
    q, k, v, decay, do, h0, dht = _valid_inputs()
    with pytest.raises(ValueError, match="out: shape"):
        lightning_attn_fwd(q, k, v, decay, None, out=torch.empty(1, 8, 2, 8))
    with pytest.raises(TypeError, match="final_state_out: dtype"):
        lightning_attn_fwd(q, k, v, decay, None, h0, True, final_state_out=h0.double())
    with pytest.raises(ValueError, match="dht: expected shape"):
        lightning_attn_bwd(q, k, v, decay, do, None, h0, dht[..., :8])
    with pytest.raises(ValueError, match="do: head dim"):
        lightning_attn_bwd(q, k, v, decay, do[..., :8], None, h0, dht)
    with pytest.raises(ValueError, match=r"out\[3\] \(dh0\): given but there is no initial_state"):
        lightning_attn_bwd(q, k, v, decay, do, None, None, dht, out=(q.clone(), k.clone(), v.clone(), h0.clone()))


def test_triton_available_reports_the_interpreter():
    assert triton_available("cpu") == (os.environ.get("TRITON_INTERPRET") == "1")


# ---------------------------------------------------------------- segments and varlen


def float64_varlen_reference(q, k, v, decay, do, scale, h0, dht, cu_seqlens):
    from hccompile.kernels.lightning.decay_reference import lightning_attn_varlen_ref

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, h0)]
    o, final = lightning_attn_varlen_ref(*leaves[:3], decay.double(), scale, leaves[3], True, cu_seqlens)
    grads = torch.autograd.grad([o, final], leaves, [do.double(), dht.double()])
    return (o, final, *grads)


@requires_triton
@pytest.mark.parametrize("segment, block, cblock", [(32, 32, 16), (64, 32, 32), (128, 64, 16), (None, 64, 64)])
def test_segments_of_any_length_are_exact(segment, block, cblock):
    """Time cut into segments swept in parallel from prefix states: T = 130 leaves a ragged last
    segment; a wrong summary weight or prefix order fails every segment after the first."""
    heads = 4
    q, k, v, do, h0, dht = random_inputs(2, 130, heads, 20, 28, torch.float32, True, seed=5)
    decay = make_decay("mixed", heads).to(DEVICE)
    ref = float64_reference(q, k, v, decay, do, 0.3, h0, dht)
    o, final = lightning_attn_fwd(q, k, v, decay, 0.3, h0, True, segment=segment, block=block, cblock=cblock)
    grads = lightning_attn_bwd(q, k, v, decay, do, 0.3, h0, dht, segment=segment, block=block, cblock=cblock)
    for name, got, want in zip(("o", "final", "dq", "dk", "dv", "dh0"), (o, final, *grads), ref):
        assert relative_rms_error(got, want) < 1e-4, f"{name} at segment={segment}"


def float64_segment_states(summaries, lengths, first, decay, x0, reverse):
    """The prefix pass's contract, one segment at a time in float64: X = x0, then per segment (last
    to first if reverse) state[s] = X, X = exp(g L_s) X + summary[s]; returns (states, last X)."""
    states = torch.empty_like(summaries, dtype=torch.float64)
    finals = []
    for n in range(len(first) - 1):
        X = x0[n].double() if x0 is not None else torch.zeros_like(summaries[0], dtype=torch.float64)
        order = range(first[n], first[n + 1])
        for s in (reversed(order) if reverse else order):
            states[s] = X
            X = torch.exp(decay.double()[:, None, None] * lengths[s]) * X + summaries[s].double()
        finals.append(X)
    return states, torch.stack(finals)


@requires_triton
@pytest.mark.parametrize("scan_segments, time, bounds, segment, dims, reverse", [
    (16, 1100, None, 32, (24, 20), False),  # 35 segments a row, the last ragged: three blocks of 16
    (16, 1100, None, 32, (24, 20), True),
    (32, 96, None, 64, (100, 60), True),  # a state of 6000 elements: tiles past its end
    (16, 700, [0, 50, 50, 137, 700], 32, (24, 20), True),  # varlen: an empty sequence, one of 18 segments
    (32, 200, [0, 50, 50, 137, 200], 64, (24, 20), False),
    (16, 40, None, 16, (2, 3), False),  # a state of 6 elements in a tile of 16
])
def test_segment_prefix_equals_its_contract(scan_segments, time, bounds, segment, dims,
                                            reverse):
    """The prefix pass (a scan, SEGMENTS segments at a time with the carry between blocks)
    against its contract in float64: every segment's state and the last state (poisoned)."""
    from hccompile.kernels.lightning import segments as segments_module

    heads, (dim_b, dim_c) = 3, dims
    batch = 2 if bounds is None else 1
    generator = torch.Generator().manual_seed(21)
    q = torch.empty(batch, time, heads, dim_b, device=DEVICE)
    cu_seqlens = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    plan = segments_module._plan_segments(q, cu_seqlens, segment, 16, 1)
    if plan.varlen:
        table = plan.table.cpu()
        lengths, first = table[:, 2].tolist(), plan.first.cpu().tolist()
    else:
        lengths = [min(segment, time - (s % plan.per_sequence) * segment) for s in range(plan.count)]
        first = [n * plan.per_sequence for n in range(plan.num_sequences + 1)]
    summaries = torch.randn(plan.count, heads, dim_b, dim_c, generator=generator).to(DEVICE)
    x0 = torch.randn(plan.num_sequences, heads, dim_b, dim_c, generator=generator).to(DEVICE)
    decay = make_decay("mixed", heads).to(DEVICE)
    want_states, want_final = float64_segment_states(summaries.cpu(), lengths, first, decay.cpu(), x0.cpu(), reverse)
    states = summaries.clone()
    xt = torch.full_like(x0, float("nan"))
    table_arg, first_arg, time_arg, length, per_sequence = plan.kernel_args(decay)
    tile = segments_module.prefix_tile(dim_b, dim_c)
    segments_module._segment_prefix_kernel[(plan.num_sequences * heads, -(-dim_b * dim_c // tile))](
        states, decay, table_arg, first_arg, x0, xt, *states.stride(), *x0.stride(), *xt.stride(), decay.stride(0),
        heads, dim_b, dim_c, time_arg, length, per_sequence, IS_VARLEN=plan.varlen, REVERSE=reverse, HAS_X0=True,
        STORE_XT=True, SEGMENTS=scan_segments, TILE=tile)
    assert relative_rms_error(states.cpu(), want_states) < 1e-6
    assert relative_rms_error(xt.cpu(), want_final) < 1e-6


VARLEN_CASES = [
    # (cu_seqlens, segment, dtype): sequences shorter and longer than a segment, an empty one
    ([0, 50, 50, 137, 200], 64, torch.float32),
    ([0, 1, 65, 100], 64, torch.float32),
    ([0, 100], None, torch.float32),
    ([0, 30, 97, 161], 64, torch.bfloat16),
]


@requires_triton
@pytest.mark.parametrize("bounds, segment, dtype", VARLEN_CASES)
def test_varlen_matches_each_sequence_alone(bounds, segment, dtype):
    heads, key_dim, value_dim = 2, 24, 20
    total, count = bounds[-1], len(bounds) - 1
    q, k, v, do, _, _ = random_inputs(1, total, heads, key_dim, value_dim, dtype, False, seed=7)
    generator = torch.Generator().manual_seed(8)
    h0 = torch.randn(count, heads, key_dim, value_dim, generator=generator).to(DEVICE)
    dht = torch.randn(count, heads, key_dim, value_dim, generator=generator).to(DEVICE)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    decay = make_decay("alibi", heads).to(DEVICE)
    ref = float64_varlen_reference(q, k, v, decay, do, 0.25, h0, dht, cu_seqlens)
    nan = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    o, final = lightning_attn_fwd(q, k, v, decay, 0.25, h0, True, cu_seqlens=cu_seqlens, segment=segment,
                                  out=nan(v), final_state_out=nan(h0))
    grads = lightning_attn_bwd(q, k, v, decay, do, 0.25, h0, dht, cu_seqlens=cu_seqlens, segment=segment,
                               out=(nan(q), nan(k), nan(v), nan(h0)))
    out_tol, grad_tol = TOLERANCES[dtype]
    for name, got, want in zip(("o", "final", "dq", "dk", "dv", "dh0"), (o, final, *grads), ref):
        assert relative_rms_error(got, want) < (out_tol if name in ("o", "final") else grad_tol), name


@requires_triton
@pytest.mark.parametrize("segment", [64, None])
def test_varlen_plan_is_built_once_per_cu_seqlens_until_it_changes(monkeypatch, segment):
    """cu_seqlens is read on the host (on a GPU, a synchronisation) once per tensor and version: the
    forward and the backward share one segment plan, and a second step builds none; an in-place change
    or another tensor builds anew, and the results follow the new bounds."""
    from hccompile.kernels.lightning import segments

    built, real = [], segments._built_segments
    monkeypatch.setattr(segments, "_built_segments", lambda *a: built.append(a[-1]) or real(*a))
    q, k, v, do, _, _ = random_inputs(1, 161, 2, 24, 20, torch.float32, False, seed=7)
    decay = make_decay("alibi", 2).to(DEVICE)

    def step(cu_seqlens):
        o, _ = lightning_attn_fwd(q, k, v, decay, 0.25, cu_seqlens=cu_seqlens, segment=segment)
        dq, dk, dv, _ = lightning_attn_bwd(q, k, v, decay, do, 0.25, cu_seqlens=cu_seqlens, segment=segment)
        return o, dq, dk, dv

    cu_seqlens = torch.tensor([0, 30, 97, 161], dtype=torch.int32, device=DEVICE)
    first = step(cu_seqlens)
    assert len(built) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, step(cu_seqlens)))
    assert len(built) == 1
    cu_seqlens[1] = 50
    moved = step(cu_seqlens)
    assert len(built) == 2
    fresh = step(torch.tensor([0, 50, 97, 161], dtype=torch.int32, device=DEVICE))
    assert len(built) == 3
    assert all(torch.equal(a, b) for a, b in zip(moved, fresh))
    assert not torch.equal(moved[0], first[0])


@requires_triton
@pytest.mark.parametrize("bounds", [None, [0, 30, 97, 161]], ids=["fixed", "varlen"])
def test_backward_from_the_forwards_saved_states_is_the_same(bounds):
    """lightning_attn_bwd(states=) reads the segments' starting states the forward computed instead of
    recomputing them: the same bits, with an initial state, fixed rows and varlen; states planned for
    another block or segment are refused."""
    from hccompile.kernels.lightning.chunk import SavedStates

    batch, total = (2, 150) if bounds is None else (1, bounds[-1])
    count = batch if bounds is None else len(bounds) - 1
    q, k, v, do, _, _ = random_inputs(batch, total, 2, 24, 20, torch.float32, False, seed=11)
    h0 = torch.randn(count, 2, 24, 20, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    cu_seqlens = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    decay = make_decay("alibi", 2).to(DEVICE)
    o, final, saved = lightning_attn_fwd(q, k, v, decay, 0.25, h0, True, cu_seqlens=cu_seqlens, segment=64,
                                         return_states=True)
    assert isinstance(saved, SavedStates) and saved.segment == 64
    recomputed = lightning_attn_bwd(q, k, v, decay, do, 0.25, h0, cu_seqlens=cu_seqlens, segment=64)
    reused = lightning_attn_bwd(q, k, v, decay, do, 0.25, h0, cu_seqlens=cu_seqlens, states=saved)
    for a, b in zip(recomputed, reused):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="states: planned with segment 64"):
        lightning_attn_bwd(q, k, v, decay, do, 0.25, h0, cu_seqlens=cu_seqlens, segment=128, states=saved)
    with pytest.raises(ValueError, match="states: planned with block 64"):
        lightning_attn_bwd(q, k, v, decay, do, 0.25, h0, cu_seqlens=cu_seqlens, block=32, states=saved)


@pytest.mark.parametrize(
    "bounds, batch, error, message",
    [
        ([0, 5, 8], 2, ValueError, "cu_seqlens: a variable-length batch needs batch size 1"),
        ([0, 5, 7], 1, ValueError, "cu_seqlens: must start at 0 and end at T=8"),
        ([0, 6, 5, 8], 1, ValueError, "cu_seqlens: must be non-decreasing"),
        ([[0, 8]], 1, ValueError, "cu_seqlens: expected a 1-D tensor"),
    ],
)
def test_varlen_validation_errors(bounds, batch, error, message):
    q, k, v, _, _, _ = random_inputs(batch, 8, 2, 16, 16, torch.float32, False)
    with pytest.raises(error, match=message):
        lightning_attn_fwd(q, k, v, make_decay("alibi", 2).to(DEVICE), None,
                           cu_seqlens=torch.tensor(bounds, device=DEVICE))
    with pytest.raises(TypeError, match="cu_seqlens: expected int32 or int64"):
        lightning_attn_fwd(q[:1], k[:1], v[:1], make_decay("alibi", 2).to(DEVICE), None,
                           cu_seqlens=torch.tensor([0.0, 8.0], device=DEVICE))
    with pytest.raises(ValueError, match="segment: must be a positive multiple of block=64"):
        lightning_attn_fwd(q[:1], k[:1], v[:1], make_decay("alibi", 2).to(DEVICE), None, segment=96)
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(2, 2, 16, 16\)"):
        lightning_attn_fwd(q[:1], k[:1], v[:1], make_decay("alibi", 2).to(DEVICE), None,
                           torch.zeros(1, 2, 16, 16, device=DEVICE), cu_seqlens=torch.tensor([0, 4, 8], device=DEVICE))


FLAT_CASES = [
    # (batch, T, cu_seqlens, segment, block, dtype): ragged last blocks and segments, one block,
    # one token, several segments per row, varlen with an empty sequence and a one-token one
    (2, 130, None, None, 32, torch.float32),
    (2, 130, None, 64, 32, torch.float32),
    (1, 1, None, None, 16, torch.float32),
    (1, 48, None, None, 64, torch.float32),
    (1, 161, [0, 1, 1, 97, 161], 64, 32, torch.float32),
    (2, 200, None, 64, 64, torch.bfloat16),
]


@requires_triton
@pytest.mark.parametrize("batch, time, bounds, segment, block, dtype", FLAT_CASES)
def test_flat_sweeps_match_float64(monkeypatch, batch, time, bounds, segment, block, dtype):
    """The sweeps' flat loop (cblock == block, sweeps.FLAT_SWEEPS): forward, final state and every
    gradient against float64, with outputs poisoned so that an unwritten row fails."""
    from hccompile.kernels.lightning import sweeps

    monkeypatch.setattr(sweeps, "FLAT_SWEEPS", True)
    heads, key_dim, value_dim = 3, 24, 40
    q, k, v, do, _, _ = random_inputs(batch, time, heads, key_dim, value_dim, dtype, False, seed=11)
    count = batch if bounds is None else len(bounds) - 1
    generator = torch.Generator().manual_seed(12)
    h0 = torch.randn(count, heads, key_dim, value_dim, generator=generator).to(DEVICE)
    dht = torch.randn(count, heads, key_dim, value_dim, generator=generator).to(DEVICE)
    decay = make_decay("mixed", heads).to(DEVICE)
    cu_seqlens = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    if cu_seqlens is None:
        ref = float64_reference(q, k, v, decay, do, 0.3, h0, dht)
    else:
        ref = float64_varlen_reference(q, k, v, decay, do, 0.3, h0, dht, cu_seqlens)
    nan = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    knobs = dict(cu_seqlens=cu_seqlens, segment=segment, block=block, cblock=block)
    o, final = lightning_attn_fwd(q, k, v, decay, 0.3, h0, True, out=nan(v), final_state_out=nan(h0), **knobs)
    grads = lightning_attn_bwd(q, k, v, decay, do, 0.3, h0, dht, out=(nan(q), nan(k), nan(v), nan(h0)), **knobs)
    out_tol, grad_tol = TOLERANCES[dtype]
    for name, got, want in zip(("o", "final", "dq", "dk", "dv", "dh0"), (o, final, *grads), ref):
        assert relative_rms_error(got, want) < (out_tol if name in ("o", "final") else grad_tol), name


def _sweep_launch_recorder(monkeypatch, record):
    """A `wrap` for the lightning launchers that calls record(kernel name, launch kwargs) in place of
    each sweep launch; the segment-state passes are skipped (they need no checking here)."""
    from hccompile.kernels.lightning import chunk, sweeps

    if sweeps.triton is None:
        pytest.skip("needs Triton")
    monkeypatch.setattr(chunk, "_require_triton", lambda device: None)
    monkeypatch.setattr(chunk, "_segment_states", lambda *a, **k: None)

    class Recorder:
        def __init__(self, kernel):
            self.name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__

        def __getitem__(self, grid):
            return lambda *args, **kwargs: record(self.name, kwargs)

    return Recorder


def test_flat_sweeps_are_chosen_only_for_one_micro_chunk_per_block(monkeypatch):
    """The launcher passes FLAT to the sweep kernels exactly when the switch is on and cblock ==
    block (the flat loop is exact only then); the flat backward takes dk and dv from one paired
    sweep unless PAIRED_REVERSE is off or a head dim is over PAIR_MAX_DIM."""
    from hccompile.kernels.lightning import chunk, sweeps

    seen = []
    Recorder = _sweep_launch_recorder(monkeypatch, lambda name, kwargs: seen.append((name, kwargs.get("FLAT"))))
    decay = make_decay("alibi", 2).to(DEVICE)
    fwd, rev, pair = "_forward_sweep_kernel", "_reverse_sweep_kernel", "_reverse_pair_sweep_kernel"
    for switch, paired, cblock, dim, expected in (
            (True, True, 32, 16, [(fwd, True), (fwd, True), (pair, None)]),
            (True, False, 32, 16, [(fwd, True)] * 2 + [(rev, True)] * 2),
            (True, True, 32, 200, [(fwd, True)] * 2 + [(rev, True)] * 2),
            (True, True, 16, 16, [(fwd, False)] * 2 + [(rev, False)] * 2),
            (False, True, 32, 16, [(fwd, False)] * 2 + [(rev, False)] * 2)):
        q, k, v, do, _, _ = random_inputs(1, 40, 2, dim, dim, torch.float32, False)
        monkeypatch.setattr(sweeps, "FLAT_SWEEPS", switch)
        monkeypatch.setattr(sweeps, "PAIRED_REVERSE", paired)
        seen.clear()
        chunk.lightning_attn_fwd(q, k, v, decay, None, block=32, cblock=cblock, wrap=Recorder)
        chunk.lightning_attn_bwd(q, k, v, decay, do, None, block=32, cblock=cblock, wrap=Recorder)
        assert seen == expected, (switch, paired, cblock, dim, seen)


def test_forward_column_tile_and_warps_follow_the_loop(monkeypatch):
    """The forward's defaults by loop, as measured on the H200: the flat loop at 64 columns and
    sweeps.FLAT_WARPS warps, the nested loops at 128 columns and 8 warps (D = 128); the backward's
    flat sweeps at 64 columns and FLAT_WARPS."""
    from hccompile.kernels.lightning import chunk, sweeps

    seen = []
    Recorder = _sweep_launch_recorder(
        monkeypatch, lambda name, kwargs: seen.append((name, kwargs["BLOCK_C"], kwargs["num_warps"])))
    decay = make_decay("alibi", 2).to(DEVICE)
    q, k, v, do, _, _ = random_inputs(1, 40, 2, 128, 128, torch.float32, False)
    for flat, expected in ((True, (64, sweeps.FLAT_WARPS)), (False, (128, 8))):
        monkeypatch.setattr(sweeps, "FLAT_SWEEPS", flat)
        seen.clear()
        chunk.lightning_attn_fwd(q, k, v, decay, None, wrap=Recorder)
        assert seen == [("_forward_sweep_kernel", *expected)], (flat, seen)
    monkeypatch.setattr(sweeps, "FLAT_SWEEPS", True)
    monkeypatch.setattr(sweeps, "PAIRED_REVERSE", False)
    seen.clear()
    chunk.lightning_attn_bwd(q, k, v, decay, do, None, wrap=Recorder)
    assert {launch[1:] for launch in seen} == {(64, sweeps.FLAT_WARPS)}, seen


SEQUENTIAL_CASES = [
    # (batch, T, bounds, segment, block, with_state): ragged last chunk and segment, segments shorter than
    # the summary chunk, one token, an empty row; varlen with an empty and a one-token sequence, and
    # sequences of several segments with ragged ends
    (2, 130, None, 64, 32, True),
    (2, 130, None, None, 64, True),
    (1, 200, None, 32, 16, False),
    (1, 1, None, None, 16, True),
    (2, 0, None, None, 64, True),
    (1, 161, [0, 1, 1, 97, 161], 64, 32, True),
    (1, 200, [0, 70, 200], 32, 16, True),
]


@requires_triton
@pytest.mark.parametrize("batch, time, bounds, segment, block, with_state", SEQUENTIAL_CASES)
def test_sequential_segment_states_match_float64(monkeypatch, batch, time, bounds, segment, block, with_state):
    """segments.SEQUENTIAL_STATES: every segment's state from one walk per sequence (forward and
    reverse; fixed rows and varlen), checked through the outputs, final state and every gradient,
    outputs NaN-poisoned."""
    from hccompile.kernels.lightning import segments as segments_module

    monkeypatch.setattr(segments_module, "SEQUENTIAL_STATES", True)
    heads, key_dim, value_dim = 3, 24, 40
    q, k, v, do, h0, dht = random_inputs(batch, time, heads, key_dim, value_dim, torch.float32, with_state, seed=13)
    decay = make_decay("mixed", heads).to(DEVICE)
    cu_seqlens = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    if cu_seqlens is None:
        ref = float64_reference(q, k, v, decay, do, 0.3, h0, dht)
    else:
        generator = torch.Generator().manual_seed(14)
        h0, dht = (torch.randn(len(bounds) - 1, heads, key_dim, value_dim, generator=generator).to(DEVICE)
                   for _ in range(2))
        ref = float64_varlen_reference(q, k, v, decay, do, 0.3, h0, dht, cu_seqlens)
    nan = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    knobs = dict(cu_seqlens=cu_seqlens, segment=segment, block=block, cblock=16)
    o, final = lightning_attn_fwd(q, k, v, decay, 0.3, h0, True, out=nan(v), **knobs)
    outs = (nan(q), nan(k), nan(v)) + ((nan(h0),) if h0 is not None else ())
    grads = lightning_attn_bwd(q, k, v, decay, do, 0.3, h0, dht, out=outs, **knobs)
    for name, got, want in zip(("o", "final", "dq", "dk", "dv", "dh0"), (o, final, *grads), ref):
        if want is None or got is None:
            assert got is None and want is None, name
            continue
        if want.numel() == 0:
            assert got.shape == want.shape, name
            continue
        assert relative_rms_error(got, want) < 1e-4, name


def test_sequential_states_are_chosen_where_their_walks_fill_the_gpu(monkeypatch):
    """segments.SEQUENTIAL_STATES None: the one-walk states only on CUDA, with at least one program per
    streaming multiprocessor and at most SEQUENTIAL_MAX_CHUNKS chunks a walk, sizes known at the launch
    (a symbolic one keeps the two passes: no guard); True / False force it."""
    from types import SimpleNamespace

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from hccompile.kernels.lightning import segments as segments_module

    choose = segments_module._sequential_states_chosen
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    longest = 64 * segments_module.SEQUENTIAL_MAX_CHUNKS
    monkeypatch.setattr(segments_module, "SEQUENTIAL_STATES", None)
    assert choose(256, 4096, 64, cuda)
    assert choose(132, longest, 64, cuda)
    assert not choose(131, 4096, 64, cuda)  # fewer programs than SMs
    assert not choose(256, longest + 1, 64, cuda)  # one chunk too many
    assert not choose(256, longest, 32, cuda)  # chunks of 32: twice as many
    assert not choose(256, 4096, 64, cpu)
    symbol = ShapeEnv().create_unbacked_symint()
    assert not choose(256, symbol, 64, cuda) and not choose(symbol, 4096, 64, cuda)
    for forced in (True, False):
        monkeypatch.setattr(segments_module, "SEQUENTIAL_STATES", forced)
        assert choose(1, 10**6, 64, cpu) is forced
