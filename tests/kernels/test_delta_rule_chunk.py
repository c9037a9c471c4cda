"""Tests for the chunked delta-rule Triton kernels against the float64 recurrence."""

from __future__ import annotations

import os

import pytest
import torch

from hccompile.kernels.delta_rule import (
    MAX_HEAD_DIM,
    chunk_delta_rule_bwd,
    chunk_delta_rule_fwd,
    naive_recurrent_delta_rule,
    triton_available,
)
from hccompile.kernels.delta_rule import l2norm as l2norm_ref
from hccompile.kernels.delta_rule.plan import intermediate_dtype_for, kept_state_rows, normed_qk_dtype_for
from hccompile.kernels.delta_rule.reference import intra_chunk_matrices_ref

from test_delta_rule import build_case

TRITON_CAN_RUN = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
requires_triton = pytest.mark.skipif(
    not TRITON_CAN_RUN, reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative RMS error limits for (o and final state, dq/dk/dv/dh0, dg/dbeta), FLA's for half
# precision. Under Triton's interpreter conftest.py makes float32 -> bfloat16 casts round to
# nearest as on the GPU (the interpreter truncates), so the limits are the same on both.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5, 1e-5),
    torch.float16: (5e-3, 8e-3, 2e-2),
    torch.bfloat16: (5e-3, 8e-3, 2e-2),
}
# The gate parameters are sums over all tokens of the gate gradient; with a saturated
# sigmoid those sums cancel, leaving fewer correct digits (1.5e-5 measured in fp32).
GATE_PARAMETER_TOLERANCE = 1e-4


def relative_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values: unwritten (NaN poison) or overflowed elements"
    out, ref = out.double(), ref.double().to(out.device)
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def kernel_inputs(inputs, dtype):
    """The float64 case cast for the kernels: q, k, v, beta, g in `dtype`; states and gate parameters fp32."""
    cast = {}
    for name, tensor in inputs.items():
        if tensor is None:
            cast[name] = None
        elif name in ("initial_state", "A_log", "dt_bias"):
            cast[name] = tensor.float().to(DEVICE)
        else:
            cast[name] = tensor.to(device=DEVICE, dtype=dtype)
    return cast


def float64_reference(inputs, kwargs, do=None, dht=None):
    """(o, final state) of the recurrence in float64 on the kernels' (rounded) inputs, and
    with do/dht given, the gradients of every input tensor by autograd."""
    leaves = {n: (t.detach().cpu().double().requires_grad_() if t is not None else None) for n, t in inputs.items()}
    o, state = naive_recurrent_delta_rule(**leaves, **kwargs)
    if do is None:
        return o.detach(), state.detach(), None
    wrt = [n for n, t in leaves.items() if t is not None]
    outputs, grads_out = [o], [do.cpu().double()]
    if dht is not None:
        outputs.append(state)
        grads_out.append(dht.cpu().double())
    grads = torch.autograd.grad(outputs, [leaves[n] for n in wrt], grads_out)
    return o.detach(), state.detach(), dict(zip(wrt, grads))


def random_output_gradients(inputs, dtype, seed=1):
    """do [B, T, HV, V] in `dtype` and dht [N, HV, K, V] in fp32."""
    generator = torch.Generator().manual_seed(seed)
    batch, time, value_heads, value_dim = inputs["v"].shape
    num_states = inputs["initial_state"].shape[0] if inputs.get("initial_state") is not None else batch
    do = torch.randn(batch, time, value_heads, value_dim, generator=generator).to(device=DEVICE, dtype=dtype)
    dht = torch.randn(num_states, value_heads, inputs["q"].shape[3], value_dim, generator=generator)
    return do, dht.to(DEVICE)


def kernel_case(sizes, gate, options, dtype, seed):
    """(inputs in `dtype`, forward kwargs, backward kwargs, do, dht) of a case: what the tests that run
    both launchers once per switch setting start from."""
    inputs, kwargs = build_case(sizes, gate, options, seed=seed)
    inputs = kernel_inputs(inputs, dtype)
    do, dht = random_output_gradients(inputs, dtype)
    return inputs, kwargs, {n: a for n, a in kwargs.items() if n != "output_final_state"}, do, dht


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def check_forward_and_backward(inputs, kwargs, dtype, chunk, tolerances=None):
    """Runs both launchers into NaN-poisoned outputs and compares everything with float64 autograd."""
    do, dht = random_output_gradients(inputs, dtype)
    o_ref, state_ref, grads_ref = float64_reference(inputs, kwargs, do, dht)
    o_tol, grad_tol, gate_grad_tol = tolerances or TOLERANCES[dtype]

    # NaN-filled outputs catch any element the kernels fail to write.
    out = torch.full(o_ref.shape, float("nan"), dtype=dtype, device=DEVICE)
    state_out = torch.full(state_ref.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    o, state = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, out=out, final_state_out=state_out)
    assert o is out and state is state_out
    assert relative_rms_error(o, o_ref) < o_tol, "o"
    assert relative_rms_error(state, state_ref) < o_tol, "final state"

    grads_out = {name: nan_like(t) for name, t in inputs.items() if t is not None}
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    grads = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht, out=grads_out)
    assert set(n for n, t in grads.items() if t is not None) == set(grads_ref)
    for name, grad_ref in grads_ref.items():
        assert grads[name] is grads_out[name], name
        assert grads[name].dtype == inputs[name].dtype and grads[name].shape == inputs[name].shape, name
        error = relative_rms_error(grads[name], grad_ref)
        if name in ("A_log", "dt_bias"):
            limit = max(gate_grad_tol, GATE_PARAMETER_TOLERANCE)
        else:
            limit = gate_grad_tol if name in ("g", "beta") else grad_tol
        assert error < limit, f"d{name}: relative RMS error {error:.2e}"


# A varlen batch of three sequences: a partial chunk, a single token, and one spanning chunks.
THREE_SEQUENCES = (1, 80, 1, 1, 32, 48)
THREE_SEQUENCE_OPTIONS = {"cu_seqlens": torch.tensor([0, 37, 38, 80], dtype=torch.int32), "initial_state": True,
                          "num_sequences": 3}

# name, (batch, time, H, HV, K, V), gate, options, dtype, chunk size
KERNEL_CASES = [
    ("plain-T63", (2, 63, 1, 1, 32, 32), "none", {}, torch.float32, 64),
    ("plain-T130-h0", (1, 130, 1, 2, 64, 60), "none", {"initial_state": True}, torch.bfloat16, 64),
    ("gdn-T100-gva-l2norm", (1, 100, 2, 4, 60, 64), "scalar", {"l2norm": True}, torch.float16, 32),
    ("gdn-T130-strong-decay", (1, 130, 1, 1, 64, 32), "scalar", {"decay": 20.0, "initial_state": True},
     torch.float32, 64),
    ("gdn-T63-chunk16", (1, 63, 1, 2, 32, 60), "scalar", {}, torch.bfloat16, 16),
    ("kda-T100-h0", (1, 100, 1, 2, 60, 32), "channel", {"initial_state": True}, torch.float32, 64),
    ("kda-T40-gva-l2norm", (1, 40, 2, 4, 32, 32), "channel", {"l2norm": True}, torch.bfloat16, 32),
    ("kda-T70-strong-decay", (1, 70, 1, 1, 32, 32), "channel", {"decay": 20.0}, torch.float32, 64),
    ("kda-gate-softplus", (1, 63, 1, 2, 32, 32), "channel", {"gate_in_kernel": True}, torch.float16, 64),
    ("kda-gate-lower-bound", (2, 40, 1, 1, 32, 32), "channel",
     {"gate_in_kernel": True, "lower_bound": -5.0, "initial_state": True}, torch.float32, 16),
    ("kda-gate-varlen", THREE_SEQUENCES, "channel", {**THREE_SEQUENCE_OPTIONS, "gate_in_kernel": True},
     torch.bfloat16, 32),
    ("kda-K128-V128", (1, 20, 1, 1, 128, 128), "channel", {"initial_state": True}, torch.float32, 16),
    ("gdn-K256-V256", (1, 17, 1, 1, MAX_HEAD_DIM, MAX_HEAD_DIM), "scalar", {}, torch.float32, 16),
    # D = 100: neither a tile nor a power of 2, in both the key and the value dim.
    ("gdn-K100-V100-h0-l2norm", (1, 70, 1, 2, 100, 100), "scalar", {"initial_state": True, "l2norm": True},
     torch.bfloat16, 64),
    ("kda-K100-V100-h0", (1, 45, 1, 1, 100, 100), "channel", {"initial_state": True}, torch.float16, 32),
]


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", KERNEL_CASES,
                         ids=[c[0] for c in KERNEL_CASES])
def test_kernels_match_float64_recurrence(name, sizes, gate, options, dtype, chunk):
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1])
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)


@requires_triton
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower-bound"])
def test_in_kernel_gate_backward_past_softplus_threshold(lower_bound):
    # Raw gates scaled so that g_raw + dt_bias passes 20, where softplus is the identity (its
    # slope 1, torch's threshold): the fused gate backward must take that branch as autograd does.
    options = {"gate_in_kernel": True, "initial_state": True}
    if lower_bound is not None:
        options["lower_bound"] = lower_bound
    inputs, kwargs = build_case((2, 45, 1, 2, 32, 32), "channel", options, seed=5)
    inputs["g"] = inputs["g"] * 12
    assert (inputs["g"] + inputs["dt_bias"].view(2, 32)).max() > 20
    check_forward_and_backward(kernel_inputs(inputs, torch.float32), kwargs, torch.float32, 16)


@requires_triton
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_kernels_handle_variable_length_sequences(gate):
    inputs, kwargs = build_case(THREE_SEQUENCES, gate, THREE_SEQUENCE_OPTIONS, seed=11)
    check_forward_and_backward(kernel_inputs(inputs, torch.float32), kwargs, torch.float32, 32)


@requires_triton
def test_kernels_accept_non_contiguous_inputs():
    inputs, kwargs = build_case((1, 40, 2, 2, 32, 16), "channel", {"initial_state": True}, seed=3)
    inputs = kernel_inputs(inputs, torch.float32)
    # Same values, other layouts: heads-major, a slice of wider rows, a stride-2 last dim.
    strided = {
        "q": inputs["q"].transpose(1, 2).contiguous().transpose(1, 2),
        "k": torch.cat([inputs["k"], torch.randn_like(inputs["k"])], dim=-1)[..., :32],
        "v": torch.stack([inputs["v"], torch.randn_like(inputs["v"])], dim=-1).flatten(-2)[..., ::2],
        "beta": torch.stack([inputs["beta"], torch.randn_like(inputs["beta"])], dim=-1)[..., 0],
        "g": inputs["g"].transpose(1, 2).contiguous().transpose(1, 2),
        "initial_state": inputs["initial_state"].transpose(-1, -2).contiguous().transpose(-1, -2),
    }
    assert not any(t.is_contiguous() for t in strided.values())
    assert all(torch.equal(strided[n], inputs[n]) for n in strided)
    o, state = chunk_delta_rule_fwd(**strided, **kwargs, chunk_size=32)
    o_contiguous, state_contiguous = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=32)
    # The kernels read the same values in the same order, so results are bitwise equal.
    assert torch.equal(o, o_contiguous) and torch.equal(state, state_contiguous)

    do, dht = random_output_gradients(inputs, torch.float32)
    do_strided = do.transpose(1, 2).contiguous().transpose(1, 2)
    dht_strided = dht.transpose(-1, -2).contiguous().transpose(-1, -2)
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    assert not do_strided.is_contiguous() and not dht_strided.is_contiguous()
    grads = chunk_delta_rule_bwd(**strided, **bwd_kwargs, chunk_size=32, do=do_strided, dht=dht_strided)
    grads_contiguous = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=32, do=do, dht=dht)
    for name in strided:
        assert torch.equal(grads[name], grads_contiguous[name]), name


@requires_triton
def test_kernels_handle_empty_time_and_optional_state():
    inputs, kwargs = build_case((2, 0, 1, 2, 16, 8), "channel", {"initial_state": True})
    inputs = kernel_inputs(inputs, torch.float16)
    o, state = chunk_delta_rule_fwd(**inputs, **kwargs)
    assert o.shape == (2, 0, 2, 8) and o.dtype == torch.float16
    torch.testing.assert_close(state, inputs["initial_state"])
    do, dht = random_output_gradients(inputs, torch.float16)
    grads = chunk_delta_rule_bwd(**inputs, gate="channel", do=do, dht=dht)
    torch.testing.assert_close(grads["initial_state"], dht)
    assert grads["q"].shape == inputs["q"].shape and grads["g"].shape == inputs["g"].shape

    inputs, kwargs = build_case((1, 5, 1, 1, 16, 8), "none", {})
    inputs = kernel_inputs(inputs, torch.float32)
    o, state = chunk_delta_rule_fwd(**inputs, **{**kwargs, "output_final_state": False})
    assert state is None and torch.isfinite(o).all()
    grads = chunk_delta_rule_bwd(**inputs, do=torch.ones_like(o))
    assert grads["g"] is None and grads["initial_state"] is None and grads["A_log"] is None
    assert all(torch.isfinite(grads[n]).all() for n in ("q", "k", "v", "beta"))


# The checks below run before any kernel, so they need no Triton.


def valid_inputs(**changes):
    inputs = {
        "q": torch.zeros(1, 5, 2, 16), "k": torch.zeros(1, 5, 2, 16),
        "v": torch.zeros(1, 5, 4, 8), "beta": torch.zeros(1, 5, 4),
    }
    inputs.update(changes)
    return inputs


LAUNCHER_INVALID_CASES = [
    ({"q": torch.zeros(1, 5, 2, 16, dtype=torch.float64)}, TypeError, r"q: dtype torch.float64 is not supported"),
    ({"k": torch.zeros(1, 5, 2, 16, dtype=torch.float16)}, TypeError, r"k: dtype torch.float16 differs from q's"),
    ({"beta": torch.zeros(1, 5, 4, device="meta")}, ValueError, r"beta: device meta differs from q's device cpu"),
    ({"q": torch.zeros(1, 5, 2, 300), "k": torch.zeros(1, 5, 2, 300)}, ValueError,
     r"q: head dim 300 exceeds the supported maximum 256"),
    ({"v": torch.zeros(1, 5, 4, 257)}, ValueError, r"v: head dim 257 exceeds the supported maximum 256"),
    ({"chunk_size": 48}, ValueError, r"chunk_size: expected one of \(16, 32, 64\), got 48"),
    ({"initial_state": torch.zeros(1, 4, 16, 8, dtype=torch.float64)}, TypeError,
     r"initial_state: dtype torch.float64 is not supported"),
    ({"out": torch.zeros(1, 5, 4, 16)}, ValueError,
     r"out: shape \(1, 5, 4, 16\) differs from the expected \(1, 5, 4, 8\)"),
    ({"out": torch.zeros(1, 5, 4, 8, dtype=torch.float16)}, TypeError, r"out: dtype torch.float16 differs"),
    ({"final_state_out": torch.zeros(1, 4, 16, 8, dtype=torch.float16)}, TypeError,
     r"final_state_out: dtype torch.float16 differs from the expected torch.float32"),
    ({"v": torch.zeros(1, 5, 3, 8), "beta": torch.zeros(1, 5, 3)}, ValueError,
     r"v: heads HV=3 must be a multiple of q's H=2"),
]


@pytest.mark.parametrize("changes, error, pattern", LAUNCHER_INVALID_CASES)
def test_launchers_reject_invalid_inputs(changes, error, pattern):
    with pytest.raises(error, match=pattern):
        chunk_delta_rule_fwd(**valid_inputs(**changes))
    if not any(name.endswith("out") for name in changes):
        with pytest.raises(error, match=pattern):
            named = valid_inputs(**changes)
            chunk_delta_rule_bwd(**named, do=torch.zeros(named["v"].shape))


@pytest.mark.parametrize(
    "changes, error, pattern",
    [
        ({"do": torch.zeros(1, 5, 4, 9)}, ValueError,
         r"do: shape \(1, 5, 4, 9\) differs from the expected \(1, 5, 4, 8\)"),
        ({"dht": torch.zeros(2, 4, 16, 8)}, ValueError,
         r"dht: shape \(2, 4, 16, 8\) differs from the expected \(1, 4, 16, 8\)"),
        ({"do": torch.zeros(1, 5, 4, 8, dtype=torch.float64)}, TypeError, r"do: dtype torch.float64 is not supported"),
        ({"out": {"dq": torch.zeros(1, 5, 2, 16)}}, ValueError, r"out: unknown gradient 'dq'"),
        ({"out": {"g": torch.zeros(1, 5, 4)}}, ValueError, r"out\['g'\]: given, but input g is None"),
        ({"out": {"k": torch.zeros(1, 5, 2, 8)}}, ValueError, r"out\['k'\]: shape \(1, 5, 2, 8\) differs"),
    ],
)
def test_bwd_rejects_invalid_gradients(changes, error, pattern):
    arguments = {"do": torch.zeros(1, 5, 4, 8), **changes}
    with pytest.raises(error, match=pattern):
        chunk_delta_rule_bwd(**valid_inputs(), **arguments)


def test_launchers_explain_missing_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1"):
        chunk_delta_rule_fwd(**valid_inputs())
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1"):
        chunk_delta_rule_bwd(**valid_inputs(), do=torch.zeros(1, 5, 4, 8))


def test_triton_available_reads_environment_at_call_time(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available("cpu") and triton_available("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available("cpu")
    assert not triton_available("meta")


# ----------------------------------------------------------------------------------------
# The triangular solve (wy_solve) at every chunk size, on partial chunks and hard inputs.

from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule import plan as kernel_plan  # noqa: E402
from hccompile.kernels.delta_rule import scores as score_kernels  # noqa: E402
from hccompile.kernels.delta_rule import state as state_kernels  # noqa: E402
from hccompile.kernels.delta_rule import wy as wy_kernels  # noqa: E402


def aligned_keys_case(sizes, gate, options, seed):
    """A build_case whose keys share one direction (pairwise cosines near 1) and whose beta is
    near 1, with weak decay: I + diag(beta) Kdot is then far from the identity (condition
    numbers up to ~100 at chunk 64), so a sloppy or incomplete inverse shows."""
    inputs, kwargs = build_case(sizes, gate, {**options, "decay": 0.1}, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1000)
    k = inputs["k"]
    common = torch.randn(k.shape[-1], generator=generator, dtype=torch.float64)
    noise = torch.randn(k.shape, generator=generator, dtype=torch.float64)
    inputs["k"] = torch.nn.functional.normalize(common + 0.05 * noise, dim=-1)
    inputs["beta"] = 0.97 + 0.03 * torch.rand(inputs["beta"].shape, generator=generator, dtype=torch.float64)
    return inputs, kwargs


# gate, chunk size, T (never a multiple of the chunk), cu_seqlens or None
WY_SOLVE_CASES = [
    ("none", 16, 41, None),
    ("scalar", 16, 41, None),
    ("channel", 16, 41, None),
    ("none", 32, 45, None),
    ("scalar", 32, 45, None),
    ("channel", 32, 45, None),
    ("none", 64, 70, None),
    ("scalar", 64, 70, None),
    ("channel", 64, 70, None),
    ("scalar", 64, 90, (0, 37, 38, 90)),
    ("channel", 32, 90, (0, 37, 38, 90)),
]


@requires_triton
@pytest.mark.parametrize("register_diagonal", [True, False], ids=["diagonal-in-registers", "row-loads"])
@pytest.mark.parametrize("gate, chunk, time, cu", WY_SOLVE_CASES,
                         ids=[f"{g}-BT{c}-T{t}{'-varlen' if cu else ''}" for g, c, t, cu in WY_SOLVE_CASES])
def test_wy_solve_matches_float64_inverse(gate, chunk, time, cu, register_diagonal):
    """A, W of the forward's wy_solve against float64 from the kernels' own Kdot (decayed_scores'), or
    without per-channel gates (plan.fused_scores_forward: wy_solve forms Kdot itself) from the float64
    Kdot of the keys, chunk by chunk. Reading Kdot, the substitution takes L's diagonal blocks from
    registers loaded once (plan.REGISTER_DIAGONAL_BLOCKS) or a row load per step: both are checked."""
    cu_seqlens = torch.tensor(cu, dtype=torch.int32) if cu is not None else None
    options = {"cu_seqlens": cu_seqlens} if cu is not None else {}
    inputs, kwargs = aligned_keys_case((1, time, 1, 2, 32, 16), gate, options, seed=time + chunk)
    inputs = kernel_inputs(inputs, torch.float32)
    q, k, v, beta, g = (inputs[n] for n in ("q", "k", "v", "beta", "g"))
    problem = chunk_kernels._validate(q, k, v, beta, g, gate, None, cu_seqlens, None, None, None, chunk)
    plan = kernel_plan.make_plan(problem, chunk, cu_seqlens, q)
    # NaN poison: every element of a chunk's A rows (zeros above the diagonal included) must be written.
    fwd = chunk_kernels._forward(plan, q, k, v, beta, g, 1.0, None, None, None, False, None, None, None)
    inverse = fwd.inverse  # allocated with torch.empty: refill and rerun to poison it
    inverse.fill_(float("nan"))
    table, seqlens = plan.chunk_args()
    form_kdot = plan.fused_scores_forward
    assert (fwd.kdot is None) == form_kdot
    wy_kernels._wy_solve_kernel[(plan.num_chunks, problem.value_heads)](
        fwd.k, v, beta, fwd.cum if fwd.cum is not None else plan.dummy, plan.dummy if form_kdot else fwd.kdot,
        inverse, fwd.w, torch.empty_like(fwd.u), torch.empty_like(fwd.w), plan.dummy, *fwd.k.stride(), *v.stride(),
        *beta.stride(), 0, 0, 0, table, seqlens, problem.time, plan.chunks_per_row, problem.value_heads,
        problem.group_size,
        problem.key_dim, problem.value_dim, GATE=plan.gate_code, BT=chunk, BC=min(chunk, kernel_plan.SUB_CHUNK),
        BK=kernel_plan.block_size(problem.key_dim), BV=kernel_plan.block_size(problem.value_dim),
        DOT_PRECISION=plan.dot_precision, IS_VARLEN=plan.varlen, SOLVE=True, FORM_KDOT=form_kdot,
        REGISTER_DIAGONAL=register_diagonal, FORM_CUM=False, FORM_WU=True,
    )
    kdots = fwd.kdot
    if form_kdot:
        chunks = [(b, start, min(chunk, eos - start)) for b, bos, eos in problem.sequence_bounds()
                  for start in range(bos, eos, chunk)]
        kdots, _ = intra_chunk_matrices_ref(fwd.k, fwd.k, fwd.cum, chunks, chunk, problem.value_heads)
    worst_inverse = worst_w = 0.0
    for batch, bos, eos in problem.sequence_bounds():
        for first in range(bos, eos, chunk):
            n = min(chunk, eos - first)
            rows = slice(first, first + n)
            for head in range(problem.value_heads):
                kdot = kdots[batch, rows, head, :n].double().tril(-1).to(inverse.device)
                b = beta[batch, rows, head].double()
                identity = torch.eye(n, dtype=torch.float64, device=kdot.device)
                expected = torch.linalg.inv(identity + b[:, None] * kdot)
                got = inverse[batch, rows, head, :]
                assert torch.isfinite(got).all(), "unwritten elements of A"
                worst_inverse = max(worst_inverse, relative_rms_error(got[:, :n], expected))
                assert torch.equal(got.triu(1), torch.zeros_like(got)), "A not zero above the diagonal"
                decay = torch.ones(n, 1, dtype=torch.float64, device=kdot.device)
                if fwd.cum is not None:
                    decay = fwd.cum[batch, rows, head].double().exp()
                keys = fwd.k[batch, rows, head // problem.group_size].double()
                w_expected = expected @ (b[:, None] * keys * decay)
                worst_w = max(worst_w, relative_rms_error(fwd.w[batch, rows, head], w_expected))
    assert worst_inverse < 1e-6, f"A: relative RMS error {worst_inverse:.2e}"
    assert worst_w < 1e-5, f"W: relative RMS error {worst_w:.2e}"


# gate, chunk size, sizes (batch, T, H, HV, K, V) with T not a multiple of the chunk, dtype
CHUNK_SIZE_CASES = [
    ("scalar", 16, (1, 41, 1, 2, 32, 32), torch.float32),
    ("scalar", 32, (1, 45, 1, 1, 32, 16), torch.float32),
    ("scalar", 64, (1, 70, 1, 1, 16, 32), torch.float32),
    ("channel", 16, (1, 41, 1, 1, 32, 16), torch.float32),
    ("channel", 32, (1, 45, 1, 2, 16, 32), torch.float32),
    ("channel", 64, (1, 70, 1, 1, 32, 16), torch.float32),
    ("channel", 32, (1, 45, 1, 1, 32, 32), torch.float16),
]
# bf16 inputs on aligned keys (in-chunk condition numbers ~100): with fp32 intermediates (the
# BF16_INTERMEDIATES=0 opt-out) within FLA's limits; with bf16 ones (the default, FLA's choice)
# within FLA 0.6.0's own float64 distance on such keys, measured on the H100 at T=1000 D=128
# (benchmarks/delta_rule_accuracy.py: o 1.5e-2, state 1.5e-2, dv 1.7e-2, dg 4.5e-2), rounded up.
ALIGNED_BF16_CASES = [
    ("scalar", 64, (1, 70, 1, 1, 32, 32), False, TOLERANCES[torch.bfloat16]),
    ("scalar", 64, (1, 70, 1, 1, 32, 32), True, (2e-2, 2e-2, 6e-2)),
    ("channel", 32, (1, 45, 1, 2, 32, 32), False, TOLERANCES[torch.bfloat16]),
    ("channel", 32, (1, 45, 1, 2, 32, 32), True, (2e-2, 2e-2, 6e-2)),
]


@requires_triton
@pytest.mark.parametrize("gate, chunk, sizes, dtype", CHUNK_SIZE_CASES,
                         ids=[f"{g}-BT{c}-T{s[1]}-{str(d)[6:]}" for g, c, s, d in CHUNK_SIZE_CASES])
def test_kernels_match_float64_recurrence_on_aligned_keys(gate, chunk, sizes, dtype):
    inputs, kwargs = aligned_keys_case(sizes, gate, {"initial_state": True}, seed=sizes[1] + chunk)
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)


@requires_triton
@pytest.mark.parametrize("gate, chunk, sizes, half, tolerances", ALIGNED_BF16_CASES,
                         ids=[f"{g}-BT{c}-{'bf16' if h else 'fp32'}-intermediates" for g, c, _, h, _ in
                              ALIGNED_BF16_CASES])
def test_bf16_inputs_on_aligned_keys(monkeypatch, gate, chunk, sizes, half, tolerances):
    monkeypatch.setattr(kernel_plan, "BF16_INTERMEDIATES", half)
    inputs, kwargs = aligned_keys_case(sizes, gate, {"initial_state": True}, seed=sizes[1] + chunk)
    check_forward_and_backward(kernel_inputs(inputs, torch.bfloat16), kwargs, torch.bfloat16, chunk, tolerances)


# ----------------------------------------------------------------------------------------
# Half-precision intermediates (plan.py's Plan.intermediate_dtype), also through CP's kernels.


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
def test_intermediates_take_the_planned_dtype(dtype):
    inputs, kwargs = build_case((1, 40, 1, 2, 32, 16), "scalar", {"l2norm": True}, seed=5)
    inputs = kernel_inputs(inputs, dtype)
    q, k, v, beta, g = (inputs[n] for n in ("q", "k", "v", "beta", "g"))
    problem = chunk_kernels._validate(q, k, v, beta, g, "scalar", None, None, None, None, None, 32)
    plan = kernel_plan.make_plan(problem, 32, None, q)
    half = dtype == torch.float16 or (dtype == torch.bfloat16 and kernel_plan.BF16_INTERMEDIATES)
    assert plan.intermediate_dtype == (dtype if half else torch.float32)
    fwd = chunk_kernels._forward(plan, q, k, v, beta, g, 1.0, None, None, None, True, None, None, None)
    for name in ("w", "u", "h"):
        assert getattr(fwd, name).dtype == plan.intermediate_dtype, name
    # The l2-normed q and k: fp16 for bf16 inputs with fp32 intermediates (unit vectors fit fp16).
    normed = torch.float16 if dtype == torch.bfloat16 and not half else plan.intermediate_dtype
    assert plan.normed_qk_dtype == normed
    for name in ("q", "k"):
        assert getattr(fwd, name).dtype == normed, name
    assert fwd.cum.dtype == torch.float32
    # The inverse A in the intermediates' dtype where every reader rounds it to that (the split backward
    # with its half dL, a scalar gate here), fp32 otherwise.
    assert plan.inverse_dtype == kernel_plan.inverse_dtype_for("scalar", dtype)
    assert fwd.inverse.dtype == plan.inverse_dtype
    assert plan.inverse_dtype == (plan.intermediate_dtype if plan.split_wy_backward else torch.float32)
    # Without per-channel gates (plan.fused_scores_forward) no Kdot in memory, and P (in memory for a
    # backward, which this forward without o is) in the intermediates' dtype; fp32 from decayed_scores.
    assert fwd.scores.dtype == plan.scores_dtype
    fused = kernel_plan.fused_scores_forward_for(plan.problem.gate)
    assert plan.scores_dtype == (plan.intermediate_dtype if fused else torch.float32)
    assert (fwd.kdot is None) == fused
    if fwd.kdot is not None:
        assert fwd.kdot.dtype == torch.float32


@requires_triton
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_cp_summaries_with_half_intermediates_match_fp32(gate):
    """CP's summary kernels on fp16 inputs (fp16 intermediates and products) against the same
    kernels on the fp32 values of those inputs."""
    from hccompile.kernels.delta_rule import cp

    inputs, kwargs = build_case((1, 45, 1, 2, 32, 32), gate, {"l2norm": True}, seed=7)
    cu = [0, 21, 45]
    do = torch.randn(1, 45, 2, 32, generator=torch.Generator().manual_seed(8))
    results = {}
    for dtype in (torch.float16, torch.float32):
        cast = kernel_inputs(inputs, dtype)
        args = dict(q=cast["q"], k=cast["k"], v=cast["v"], beta=cast["beta"], g=cast["g"], gate=gate, cu_seqlens=cu,
                    use_qk_l2norm_in_kernel=True, chunk_size=16)
        forward = cp.summary_forward(**args)
        backward = cp.summary_backward(**args, do=do.to(device=DEVICE, dtype=dtype))
        results[dtype] = (forward, backward)
    for part, (half, full) in zip(("[H | M]", "[dH | M^T]"), zip(results[torch.float16], results[torch.float32])):
        assert half.dtype == torch.float32
        error = relative_rms_error(half, full)
        assert error < TOLERANCES[torch.float16][0], f"{part}: relative RMS error {error:.2e}"


# ----------------------------------------------------------------------------------------
# Sweep tiles narrowed for occupancy (plan.py's SWEEP_MIN_PROGRAMS).


def test_sweep_tiles_narrow_only_while_the_grid_fills_half_the_target(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(kernel_plan, "SWEEP_MIN_PROGRAMS", 132)
    # B1 H16, V128, fp32 intermediates' widest tile 32: 64 programs fill at most half of 132 -> both
    # sweeps narrow to 16 (128 programs), the backward's floor.
    assert state_kernels.state_forward_block_v(128, 128, torch.float32, 16, cpu) == 16
    assert state_kernels.state_backward_block_v(128, 128, 16, cpu) == state_kernels.MIN_BACKWARD_SWEEP_TILE == 16
    # K = 64: the backward's widest tile is 64; it halves twice, to the floor.
    assert state_kernels.state_backward_block_v(64, 128, 16, cpu) == 16
    # A floor above the smallest tile holds: with 32, the B1 H16 backward tile stays 32.
    monkeypatch.setattr(state_kernels, "MIN_BACKWARD_SWEEP_TILE", 32)
    assert state_kernels.state_backward_block_v(128, 128, 16, cpu) == 32
    monkeypatch.setattr(state_kernels, "MIN_BACKWARD_SWEEP_TILE", kernel_plan.MIN_DOT_DIM)
    # B4 H16: 256 programs already -> unchanged; half intermediates' 64-wide tile: 128 programs -> unchanged.
    assert state_kernels.state_backward_block_v(128, 128, 64, cpu) == 32
    assert state_kernels.state_forward_block_v(128, 128, torch.float16, 64, cpu) == 64
    # Never below the smallest product dimension.
    assert state_kernels.state_forward_block_v(128, 128, torch.float32, 1, cpu) == kernel_plan.MIN_DOT_DIM
    monkeypatch.setattr(kernel_plan, "SWEEP_MIN_PROGRAMS", 0)
    assert state_kernels.state_backward_block_v(128, 128, 1, cpu) == 32
    # Off CUDA the default (None) means no narrowing.
    monkeypatch.setattr(kernel_plan, "SWEEP_MIN_PROGRAMS", None)
    assert state_kernels.state_forward_block_v(128, 128, torch.float32, 1, cpu) == 32


# name, sizes, gate, options, dtype, chunk size
NARROW_SWEEP_CASES = [
    ("gdn-h0-l2norm", (1, 70, 1, 2, 32, 64), "scalar", {"initial_state": True, "l2norm": True}, torch.float32, 32),
    ("kda-gva", (1, 50, 1, 2, 32, 64), "channel", {"initial_state": True}, torch.float16, 32),
    ("plain-varlen", THREE_SEQUENCES, "none", THREE_SEQUENCE_OPTIONS, torch.float32, 32),
    # The configuration whose 16-wide backward tiles gave a wrong initial-state gradient on the H100
    # (see state.MIN_BACKWARD_SWEEP_TILE): K = 128, bf16, l2norm, two chunks.
    ("gdn-K128-bf16-h0-l2norm", (1, 70, 1, 2, 128, 128), "scalar", {"initial_state": True, "l2norm": True},
     torch.bfloat16, 64),
]


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", NARROW_SWEEP_CASES,
                         ids=[c[0] for c in NARROW_SWEEP_CASES])
def test_kernels_with_narrowed_sweep_tiles_match_float64_recurrence(monkeypatch, name, sizes, gate, options, dtype,
                                                                    chunk):
    # A huge target forces the narrowest value tiles: 16 wide in the forward sweep, the floor in the backward.
    monkeypatch.setattr(kernel_plan, "SWEEP_MIN_PROGRAMS", 10**6)
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 1)
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)


# The configurations where two software-pipelining stages of wy_backward gave wrong dk and dg on
# the H100 in some runs and right ones in others (see wy.WY_BACKWARD_STAGES): a race or a
# miscompile shows as repeats that differ, so each case runs several times on the same inputs.
REPEAT_CASES = [
    ("kda-gate-softplus-fp16", next(c for c in KERNEL_CASES if c[0] == "kda-gate-softplus"), False),
    ("gdn-K128-bf16-narrowed", next(c for c in NARROW_SWEEP_CASES if c[0] == "gdn-K128-bf16-h0-l2norm"), True),
]


@requires_triton
@pytest.mark.parametrize("case, narrow", [c[1:] for c in REPEAT_CASES], ids=[c[0] for c in REPEAT_CASES])
def test_backward_is_deterministic(monkeypatch, case, narrow):
    _, sizes, gate, options, dtype, chunk = case
    if narrow:
        monkeypatch.setattr(kernel_plan, "SWEEP_MIN_PROGRAMS", 10**6)
    check_repeated_backward(sizes, gate, options, dtype, chunk, checked=("k", "g"))


def check_repeated_backward(sizes, gate, options, dtype, chunk, checked):
    """The backward run 8 times on the GPU (2 elsewhere): the `checked` gradients within tolerance of
    the float64 recurrence's ("k" at the gradient tolerance, the others at the gate one) every time,
    and every gradient bitwise equal across runs."""
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 3)
    inputs = kernel_inputs(inputs, dtype)
    do, dht = random_output_gradients(inputs, dtype)
    _, _, grads_ref = float64_reference(inputs, kwargs, do, dht)
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    first = None
    for _ in range(8 if DEVICE == "cuda" else 2):
        grads = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht)
        for grad_name in checked:
            error = relative_rms_error(grads[grad_name], grads_ref[grad_name])
            assert error < TOLERANCES[dtype][1 if grad_name == "k" else 2], f"d{grad_name}: {error:.2e}"
        if first is None:
            first = grads
        for grad_name, grad in grads.items():
            if grad is not None:
                assert torch.equal(grad, first[grad_name]), f"d{grad_name} differs between runs"


# ----------------------------------------------------------------------------------------
# Without per-channel gates wy_backward also takes the gradients through Kdot and P
# (plan.FUSED_SCORES_BACKWARD); off, decayed_scores_backward does, as it always does for KDA.

# name, sizes, gate, options, dtype, chunk size; T never a multiple of the chunk
FUSED_SCORES_CASES = [
    ("gdn-T45-gva-h0", (1, 45, 1, 2, 32, 16), "scalar", {"initial_state": True}, torch.float32, 32),
    # K = 100: two key tiles, the second partial, in the key loop and in dKdot's pass after it
    ("gdn-K100-gqa-h0-l2norm", (1, 50, 2, 4, 100, 32), "scalar", {"initial_state": True, "l2norm": True},
     torch.float16, 32),
    ("gdn-varlen-strong-decay", THREE_SEQUENCES, "scalar", {**THREE_SEQUENCE_OPTIONS, "decay": 20.0},
     torch.bfloat16, 64),
    ("plain-T41-gva-h0-chunk16", (1, 41, 1, 2, 32, 16), "none", {"initial_state": True}, torch.float32, 16),
    ("plain-K100-h0", (2, 37, 1, 1, 100, 32), "none", {"initial_state": True}, torch.bfloat16, 64),
    ("plain-varlen", THREE_SEQUENCES, "none", THREE_SEQUENCE_OPTIONS, torch.float16, 32),
    # per-channel gates: decayed_scores_backward either way
    ("kda-T40-gva-h0", (1, 40, 1, 2, 32, 16), "channel", {"initial_state": True}, torch.float32, 32),
]


@requires_triton
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernels"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", FUSED_SCORES_CASES,
                         ids=[c[0] for c in FUSED_SCORES_CASES])
def test_scores_backward_inside_wy_backward_or_apart(monkeypatch, fused, name, sizes, gate, options, dtype, chunk):
    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_BACKWARD", fused)
    launches = []
    launch = chunk_kernels.launch_scores_backward
    monkeypatch.setattr(chunk_kernels, "launch_scores_backward", lambda *a, **k: launches.append(a) or launch(*a, **k))
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 13)
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)
    assert len(launches) == (0 if fused and gate != "channel" else 1)


# ----------------------------------------------------------------------------------------
# The forward's intra-chunk matrices kept for the backward (return_intermediates / intermediates).

KEPT_CASES = [
    ("gdn-gva-l2norm-h0", (1, 70, 1, 2, 32, 16), "scalar", {"initial_state": True, "l2norm": True}, torch.float32, 32),
    ("kda-bf16", (2, 45, 1, 1, 32, 32), "channel", {"initial_state": True}, torch.bfloat16, 16),
    ("plain-varlen", THREE_SEQUENCES, "none", THREE_SEQUENCE_OPTIONS, torch.float32, 64),
    ("gdn-bf16-varlen", THREE_SEQUENCES, "scalar", THREE_SEQUENCE_OPTIONS, torch.bfloat16, 32),
]


@requires_triton
@pytest.mark.parametrize("fused_forward", [True, False], ids=["fused-scores-forward", "scores-kernel"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", KEPT_CASES, ids=[c[0] for c in KEPT_CASES])
def test_backward_with_kept_intermediates_equals_the_recomputing_backward(monkeypatch, fused_forward, name, sizes,
                                                                          gate, options, dtype, chunk):
    monkeypatch.setattr(kernel_plan, "FUSED_SCORES_FORWARD", fused_forward)
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 5)
    inputs = kernel_inputs(inputs, dtype)
    o, state, kept = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, return_intermediates=True)
    o_plain, state_plain = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk)
    assert torch.equal(o, o_plain) and torch.equal(state, state_plain)
    # Kdot is kept where decayed_scores wrote it (per-channel gates, plan.FUSED_SCORES_FORWARD off, or
    # the single wy_backward); P in fp32 there, else in the intermediates' dtype (the output kernel's store).
    fused = kernel_plan.fused_scores_forward_for(gate)
    assert (kept.kdot is None) == fused
    assert all(t.shape == (*o.shape[:3], chunk) for t in kept[:3] if t is not None)
    assert kept.inverse.dtype == kernel_plan.inverse_dtype_for(gate, dtype)
    assert all(t.dtype == torch.float32 for t in kept[:1] if t is not None)
    assert kept.scores.dtype == (intermediate_dtype_for(dtype) if fused else torch.float32)
    l2norm = kwargs.get("use_qk_l2norm_in_kernel", False)
    if l2norm:
        # The l2-normed q and k, in the plan's normed dtype, equal to the reference's l2norm.
        for name_, normed in (("q", kept.q_normed), ("k", kept.k_normed)):
            assert normed.shape == inputs[name_].shape and normed.is_contiguous()
            assert normed.dtype == normed_qk_dtype_for(dtype)
            assert relative_rms_error(normed, l2norm_ref(inputs[name_].double())) < 1e-6
    else:
        assert kept.q_normed is None and kept.k_normed is None
    if gate == "none":
        assert kept.cum is None
    else:
        width = sizes[4] if gate == "channel" else 1
        assert kept.cum.shape == (*o.shape[:3], width) and kept.cum.dtype == torch.float32
    stored = intermediate_dtype_for(dtype)
    batch, time, value_heads = o.shape[:3]
    key_dim = inputs["q"].shape[3]
    varlen = kwargs.get("cu_seqlens")
    rows = kept_state_rows(batch, time, chunk, None if varlen is None else len(varlen) - 1)
    assert kept.w.shape == (batch, time, value_heads, key_dim) and kept.u.shape == o.shape
    assert kept.h.shape == (rows, value_heads, key_dim, o.shape[3])
    assert all(t.dtype == stored for t in (kept.w, kept.u, kept.h))
    do, dht = random_output_gradients(inputs, dtype)
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    recomputed = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht)
    reused = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht, intermediates=kept)
    matrices_only = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht,
                                         intermediates=kept[:3])
    without_states = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht,
                                          intermediates=kept[:6])
    # The same kernels on the same values: the kept inverse (and normed q, k) are bitwise the recomputed ones.
    for name_, grad in recomputed.items():
        if grad is not None:
            assert torch.isfinite(reused[name_]).all() and torch.equal(reused[name_], grad), name_
            assert torch.equal(matrices_only[name_], grad), name_
            assert torch.equal(without_states[name_], grad), name_
    # Kept tensors that do not belong to these inputs change the gradients: each is really used, except
    # Kdot by the split wy_backward (plan.SPLIT_WY_BACKWARD: wy_bwd.py takes dbeta without it), which
    # then reads it nowhere once w, u and h are kept.
    split = kernel_plan.SPLIT_WY_BACKWARD and kernel_plan.FUSED_SCORES_BACKWARD and gate != "channel"
    for index in (i for i, t in enumerate(kept) if t is not None):
        wrong = tuple(t * 0.5 if i == index else t for i, t in enumerate(kept))
        changed = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht, intermediates=wrong)
        used = any(not torch.equal(changed[n], g) for n, g in recomputed.items() if g is not None)
        assert used != (split and kept._fields[index] == "kdot"), kept._fields[index]


HALF_INVERSE_CASES = [
    ("gdn-fp16-gva-l2norm", (1, 100, 2, 4, 60, 64), "scalar", {"l2norm": True, "initial_state": True}, torch.float16, 32),
    ("plain-bf16-varlen", THREE_SEQUENCES, "none", THREE_SEQUENCE_OPTIONS, torch.bfloat16, 64),
    ("gdn-bf16-T70", (2, 70, 1, 2, 64, 32), "scalar", {"initial_state": True}, torch.bfloat16, 64),
]


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", HALF_INVERSE_CASES,
                         ids=[c[0] for c in HALF_INVERSE_CASES])
def test_inverse_in_half_precision_is_bitwise_the_float32_inverse(monkeypatch, name, sizes, gate, options, dtype,
                                                                  chunk):
    """plan.HALF_INVERSE: A stored in the intermediates' dtype gives the outputs and every gradient of A
    stored in fp32, bit for bit (every reader rounds A before its products), kept or recomputed."""
    inputs, kwargs, bwd_kwargs, do, dht = kernel_case(sizes, gate, options, dtype, seed=sizes[1] + 3)
    results = {}
    for half in (False, True):
        monkeypatch.setattr(kernel_plan, "HALF_INVERSE", half)
        o, state, kept = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, return_intermediates=True)
        assert kept.inverse.dtype == (intermediate_dtype_for(dtype) if half else torch.float32)
        kept_grads = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht, intermediates=kept)
        recomputed = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht)
        results[half] = (o, state, kept_grads, recomputed)
    (o32, s32, kept32, rec32), (o16, s16, kept16, rec16) = results[False], results[True]
    assert torch.equal(o16, o32) and torch.equal(s16, s32)
    for grads16, grads32 in ((kept16, kept32), (rec16, rec32)):
        for name_, grad in grads32.items():
            if grad is not None:
                assert torch.isfinite(grad).all() and torch.equal(grads16[name_], grad), name_


FOLD_CASES = [
    ("gdn-varlen", THREE_SEQUENCES, "scalar", THREE_SEQUENCE_OPTIONS, torch.float32, 32),
    ("gdn-gva-l2norm-T100", (1, 100, 2, 4, 60, 64), "scalar", {"l2norm": True, "initial_state": True},
     torch.float32, 64),
]


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", FOLD_CASES, ids=[c[0] for c in FOLD_CASES])
def test_folded_gate_sums_replace_the_gate_cumsum_launches(monkeypatch, name, sizes, gate, options, dtype, chunk):
    """plan.FOLDED_GATE_SUMS: a scalar gate's G formed by wy_solve and g's gradient by wy_bwd.py, with no
    gate_cumsum launch, equal to the separate launches' results (fp32 sums of the same terms), recomputing
    or given the kept intermediates."""
    monkeypatch.setattr(kernel_plan, "FOLDED_GATE_SUMS", True)
    assert kernel_plan.fused_scores_forward_for(gate) and kernel_plan.SPLIT_WY_BACKWARD
    launches = []
    launch = chunk_kernels.launch_gate_cumsum
    monkeypatch.setattr(chunk_kernels, "launch_gate_cumsum", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    inputs, kwargs, bwd_kwargs, do, dht = kernel_case(sizes, gate, options, dtype, seed=sizes[1] + 9)
    results = {}
    for fold in (False, True):
        monkeypatch.setattr(kernel_plan, "FOLDED_GATE_SUMS", fold)
        launches.clear()
        o, state, kept = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, return_intermediates=True)
        recomputed = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht)
        given = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht, intermediates=kept)
        # forward, the recomputing backward's forward and its reverse sum, the kept one's reverse sum
        assert len(launches) == (0 if fold else 4), fold
        results[fold] = (o, state, kept.cum, recomputed, given)
    (o, state, cum, recomputed, given), (o_f, state_f, cum_f, recomputed_f, given_f) = results[False], results[True]
    for label, got, want in (("o", o_f, o), ("final state", state_f, state), ("G", cum_f, cum)):
        assert relative_rms_error(got, want) < 1e-6, label
    for grads_f, grads in ((recomputed_f, recomputed), (given_f, given)):
        for name_, grad in grads.items():
            if grad is not None:
                assert relative_rms_error(grads_f[name_], grad) < 1e-6, name_


SPLIT_SOLVE_CASES = [
    ("gdn-varlen", THREE_SEQUENCES, "scalar", THREE_SEQUENCE_OPTIONS, torch.float32, 32),
    ("kda-bf16", (2, 45, 1, 1, 32, 32), "channel", {"initial_state": True}, torch.bfloat16, 16),
    ("plain-gva-fp16-T100", (1, 100, 2, 4, 60, 64), "none", {"l2norm": True}, torch.float16, 64),
]


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", SPLIT_SOLVE_CASES,
                         ids=[c[0] for c in SPLIT_SOLVE_CASES])
def test_wy_solve_split_in_two_launches(monkeypatch, name, sizes, gate, options, dtype, chunk):
    """plan.SPLIT_WY_SOLVE: the solve, then W and U~ from the stored A (at WY_FORM_WARPS): the forward and
    every gradient within FLA's limits of float64, and near the single launch's (within 1e-6 for fp32; half
    products at other warp counts may take other tensor-core instructions, so a rounding may flip)."""
    inputs, kwargs, bwd_kwargs, do, dht = kernel_case(sizes, gate, options, dtype, seed=sizes[1] + 13)
    results = {}
    for split in (False, True):
        monkeypatch.setattr(kernel_plan, "SPLIT_WY_SOLVE", split)
        o, state, kept = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, return_intermediates=True)
        grads = chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht)
        results[split] = (o, state, kept.w, kept.u, grads)
    limit = 1e-6 if dtype == torch.float32 else 1e-2
    for label, got, want in zip(("o", "final state", "w", "u"), results[True][:4], results[False][:4]):
        assert relative_rms_error(got, want) < limit, label
    for name_, grad in results[False][4].items():
        if grad is not None:
            assert relative_rms_error(results[True][4][name_], grad) < limit, name_
    monkeypatch.setattr(kernel_plan, "SPLIT_WY_SOLVE", True)
    check_forward_and_backward(inputs, kwargs, dtype, chunk)


LOCAL_DU_CASES = [
    ("gdn-varlen", THREE_SEQUENCES, "scalar", THREE_SEQUENCE_OPTIONS, torch.float32, 32),
    ("gdn-gva-l2norm-h0-T100", (1, 100, 2, 4, 60, 100), "scalar", {"l2norm": True, "initial_state": True},
     torch.bfloat16, 64),
    ("plain-fp16-T70", (2, 70, 1, 1, 64, 60), "none", {}, torch.float16, 16),
    ("kda-keeps-it-in-the-sweep", (1, 45, 1, 2, 32, 32), "channel", {}, torch.bfloat16, 32),
]


@requires_triton
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", LOCAL_DU_CASES,
                         ids=[c[0] for c in LOCAL_DU_CASES])
def test_local_du_kernel_before_the_sweep(monkeypatch, name, sizes, gate, options, dtype, chunk):
    """plan.LOCAL_DU_KERNEL: dU's local part scale P^T dO by local_du.py's launch before the backward sweep,
    which reads it: the kernel against float64 on the kept P (NaN-poisoned dU, T not a chunk multiple,
    GVA, varlen), every gradient within FLA's limits, and the launch made only where it applies (not
    for per-channel gates)."""
    from hccompile.kernels.delta_rule import local_du as local_du_kernels
    from hccompile.kernels.delta_rule.reference import local_du_ref

    inputs, kwargs, _, do, _ = kernel_case(sizes, gate, options, dtype, seed=sizes[1] + 17)
    kept = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, return_intermediates=True)[2]
    scale = inputs["q"].shape[3] ** -0.5
    if gate != "channel":
        plan = kernel_plan.make_plan(chunk_kernels._validate(
            inputs["q"], inputs["k"], inputs["v"], inputs["beta"], inputs.get("g"), gate, inputs.get("initial_state"),
            kwargs.get("cu_seqlens"), None, None, None, chunk), chunk, kwargs.get("cu_seqlens"), inputs["q"])
        du = torch.full(do.shape, float("nan"), dtype=plan.intermediate_dtype, device=DEVICE)
        table, seqlens = plan.chunk_args()
        local_du_kernels.launch_local_du(plan, kept.scores, do, du, plan.num_chunks, table, seqlens, scale)
        chunks = [(b, s, min(chunk, e - s)) for b, lo, e in _sequence_bounds(inputs, kwargs) for s in range(lo, e, chunk)]
        want = local_du_ref(kept.scores.cpu(), do.cpu(), chunks, scale)
        assert relative_rms_error(du, want) < TOLERANCES[dtype][1], "local dU"
    launches = []
    launch = chunk_kernels.launch_local_du
    monkeypatch.setattr(chunk_kernels, "launch_local_du", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    monkeypatch.setattr(kernel_plan, "LOCAL_DU_KERNEL", True)
    check_forward_and_backward(inputs, kwargs, dtype, chunk)
    assert len(launches) == (0 if gate == "channel" else 1)


@pytest.mark.parametrize("setting, programs, sms, wanted", [
    (None, 128, 132, True), (None, 132, 132, True), (None, 256, 132, False), (None, 1, 0, False),
    (True, 256, 132, True), (False, 16, 132, False)])
def test_local_du_by_default_where_the_backward_sweep_fits_one_wave(monkeypatch, setting, programs, sms, wanted):
    """plan.local_du_wanted: LOCAL_DU_KERNEL None (the default) takes dU's local part out of the sweep when
    the sweep's programs fit one wave of the multiprocessors (GDN B1 T32768 H16 D128 on an H200: 128 of
    132); True and False force it either way. A CPU device has no multiprocessors: off."""
    monkeypatch.setattr(kernel_plan, "LOCAL_DU_KERNEL", setting)
    monkeypatch.setattr(kernel_plan, "_multiprocessor_count", lambda device: sms)
    assert kernel_plan.local_du_wanted(programs, torch.device("cuda")) is wanted


def test_local_du_setting_from_the_environment_is_checked():
    """HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL takes 1, 0 or auto; anything else is named in a clear error at import."""
    import subprocess
    import sys

    code = "import hccompile.kernels.delta_rule.plan as p; print(p.LOCAL_DU_KERNEL)"
    for value, printed in (("1", "True"), ("0", "False"), ("auto", "None")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL": value})
        assert out.returncode == 0 and out.stdout.strip() == printed, out.stderr
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL": "yes"})
    assert out.returncode != 0 and "HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL" in out.stderr and "'yes'" in out.stderr


def _sequence_bounds(inputs, kwargs):
    """(batch, first token, end) of every sequence of the case."""
    cu_seqlens = kwargs.get("cu_seqlens")
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    batch, time = inputs["q"].shape[:2]
    return [(b, 0, time) for b in range(batch)]


def test_kept_intermediates_are_checked():
    inputs, kwargs = build_case((1, 20, 1, 1, 16, 8), "scalar", {}, seed=1)
    inputs = kernel_inputs(inputs, torch.float32)
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    do = torch.zeros(1, 20, 1, 8, device=DEVICE)
    square = torch.zeros(1, 20, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"intermediates: expected \(kdot, scores, inverse\), \(kdot, scores, inverse, q_normed, k_normed, cum\) or those and \(w, u, h\), got 2"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=do, intermediates=(square, square))
    with pytest.raises(ValueError, match=r"intermediates inverse: shape \(1, 20, 1, 32\) differs"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=do, intermediates=(square, square, torch.zeros(1, 20, 1, 32, device=DEVICE)))
    with pytest.raises(TypeError, match=r"intermediates kdot: dtype torch.float16 differs"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=do, intermediates=(square.half(), square, square))
    normed = torch.zeros(1, 20, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"q_normed and k_normed given, but use_qk_l2norm_in_kernel is False"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=do,
                             intermediates=(square, square, square, normed, normed, None))
    bwd_kwargs["use_qk_l2norm_in_kernel"] = True
    with pytest.raises(ValueError, match=r"intermediates k_normed: shape \(1, 20, 1, 8\) differs"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=do,
                             intermediates=(square, square, square, normed, normed[..., :8], None))
    with pytest.raises(ValueError, match=r"intermediates cum: shape \(1, 20, 1, 16\) differs from the expected "
                                         r"\(1, 20, 1, 1\)"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=do, intermediates=(square, square, square, normed, normed,
                                                                            normed))
    bwd_kwargs["use_qk_l2norm_in_kernel"] = False
    cum = torch.zeros(1, 20, 1, 1, device=DEVICE)
    w, u = torch.zeros(1, 20, 1, 16, device=DEVICE), torch.zeros(1, 20, 1, 8, device=DEVICE)
    h = torch.zeros(2, 1, 16, 8, device=DEVICE)  # kept_state_rows: one chunk of 64, at least 2
    with pytest.raises(ValueError, match=r"w, u and h go together"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=do, intermediates=(square, square, square, None, None, cum,
                                                                            w, None, h))
    with pytest.raises(ValueError, match=r"intermediates h: shape \(1, 1, 16, 8\) differs from the expected "
                                         r"\(2, 1, 16, 8\)"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=do, intermediates=(square, square, square, None, None, cum,
                                                                            w, u, h[:1]))
    with pytest.raises(TypeError, match=r"intermediates u: dtype torch.float16 differs"):
        chunk_delta_rule_bwd(**inputs, **bwd_kwargs, do=do, intermediates=(square, square, square, None, None, cum,
                                                                            w, u.half(), h))


# ----------------------------------------------------------------------------------------
# Per-channel gates: the diagonal sub-chunk blocks factored, or summed exactly past
# scores.FACTOR_SPAN_LIMIT.

FACTORED_DIAGONAL_CASES = [
    ("kda-fp32-h0", (1, 100, 1, 2, 60, 32), "channel", {"initial_state": True}, torch.float32, 64),
    ("kda-bf16-gva-l2norm", (1, 40, 2, 4, 32, 32), "channel", {"l2norm": True}, torch.bfloat16, 32),
    ("kda-fp16-varlen", THREE_SEQUENCES, "channel", THREE_SEQUENCE_OPTIONS, torch.float16, 64),
]


@requires_triton
@pytest.mark.parametrize("limit", [0.0, float("inf")], ids=["exact-diagonal", "factored-diagonal"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", FACTORED_DIAGONAL_CASES,
                         ids=[c[0] for c in FACTORED_DIAGONAL_CASES])
def test_channel_gate_diagonal_blocks_exact_or_factored(monkeypatch, limit, name, sizes, gate, options, dtype,
                                                        chunk):
    monkeypatch.setattr(score_kernels, "FACTOR_SPAN_LIMIT", limit)
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 7)
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)


def sub_chunk_spans(g: torch.Tensor, chunk: int) -> torch.Tensor:
    """max over channels of G_first - G_last of every sub-chunk ([B, T, HV, K] log gates, T a chunk multiple)."""
    batch, time, heads, dim = g.shape
    sub = kernel_plan.SUB_CHUNK
    cum = g.double().view(batch, time // chunk, chunk, heads, dim).cumsum(2).view(batch, time // sub, sub, heads, dim)
    return (cum[:, :, 0] - cum[:, :, -1]).amax(-1)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_strong_gates_mix_factored_and_exact_diagonal_blocks(dtype):
    # Gates scaled so that some sub-chunks' spans pass FACTOR_SPAN_LIMIT and others do not: one
    # launch takes both branches, and a wrong factor or a double-counted block would show. Half
    # inputs too: their tensor-core products met the runtime branch wrongly on the H100 once.
    sizes, options = (1, 64, 1, 2, 32, 32), {"decay": 10.0, "initial_state": True}
    inputs, kwargs = build_case(sizes, "channel", options, seed=3)
    spans = sub_chunk_spans(inputs["g"], 64)
    limit = score_kernels.FACTOR_SPAN_LIMIT
    assert (spans <= limit).any() and (spans > limit).any(), spans
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, 64)
