"""The split wy_backward (plan.SPLIT_WY_BACKWARD): dqkw.py's and wy_bwd.py's kernels one at a time
against their float64 references (reference.dqkw_ref, reference.wy_bwd_ref) into NaN-poisoned outputs,
the whole backward with the split on and off against the float64 recurrence, and determinism."""

from __future__ import annotations

import pytest
import torch

from hccompile.kernels._triton import cdiv
from hccompile.kernels.delta_rule import chunk as chunk_kernels
from hccompile.kernels.delta_rule import dqkw, wy_bwd
from hccompile.kernels.delta_rule import chunk_delta_rule_fwd, check_delta_rule_inputs
from hccompile.kernels.delta_rule import plan as kernel_plan
from hccompile.kernels.delta_rule.dqkw import launch_dqkw
from hccompile.kernels.delta_rule.plan import intermediate_dtype_for, make_plan
from hccompile.kernels.delta_rule.reference import dqkw_ref, wy_bwd_ref
from hccompile.kernels.delta_rule.wy_bwd import launch_wy_bwd

from test_delta_rule import build_case
from test_delta_rule_chunk import (DEVICE, TOLERANCES, check_forward_and_backward, check_repeated_backward,
                                   kernel_inputs, relative_rms_error, requires_triton)

# Three sequences in one varlen row: a partial chunk, a single token, and one spanning chunks.
VARLEN = {"cu_seqlens": torch.tensor([0, 37, 38, 80], dtype=torch.int32), "initial_state": True,
          "num_sequences": 3}

# name, (batch, time, H, HV, K, V), gate, options, dtype, chunk size; T never a chunk multiple
SPLIT_CASES = [
    ("gdn-T100-K60-V100-gva-h0", (1, 100, 1, 2, 60, 100), "scalar", {"initial_state": True}, torch.bfloat16, 64),
    ("plain-T45-K100-V60", (2, 45, 1, 1, 100, 60), "none", {}, torch.float32, 32),
    ("gdn-varlen-gqa-l2norm", (1, 80, 2, 4, 32, 48), "scalar", {**VARLEN, "l2norm": True}, torch.float16, 32),
    ("gdn-K256-strong-decay", (1, 20, 1, 1, 256, 32), "scalar", {"decay": 20.0}, torch.float32, 16),
    ("plain-varlen-K100-V60-gva", (1, 80, 1, 2, 100, 60), "none", VARLEN, torch.bfloat16, 64),
]
CASE_IDS = [c[0] for c in SPLIT_CASES]


def _chunks(problem, chunk):
    """(batch row, first token, valid rows) per global chunk, in the kernels' order."""
    return [(b, start, min(chunk, eos - start)) for b, bos, eos in problem.sequence_bounds()
            for start in range(bos, eos, chunk)]


def _kernel_inputs(sizes, gate, options, dtype, chunk, seed):
    """A forward's kept intermediates (A, u, h, the gate's sum, the normed q and k) and random
    dO, dU and dh: the split kernels' inputs, with the plan to launch them."""
    inputs, kwargs = build_case(sizes, gate, options, seed=seed)
    inputs = kernel_inputs(inputs, dtype)
    _, _, kept = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, return_intermediates=True)
    problem = check_delta_rule_inputs(*(inputs.get(n) for n in ("q", "k", "v", "beta", "g")), gate,
                                      inputs.get("initial_state"), kwargs.get("cu_seqlens"), None, None, None)
    plan = make_plan(problem, chunk, kwargs.get("cu_seqlens"), inputs["q"])
    assert plan.split_wy_backward == (kernel_plan.SPLIT_WY_BACKWARD and kernel_plan.FUSED_SCORES_BACKWARD)
    stored = intermediate_dtype_for(dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    batch, time, value_heads, value_dim = inputs["v"].shape
    key_dim = inputs["q"].shape[3]

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=generator).to(device=DEVICE, dtype=dtype)

    l2norm = kwargs["use_qk_l2norm_in_kernel"]
    return dict(
        plan=plan, chunks=_chunks(problem, chunk), scale=key_dim ** -0.5,
        q=kept.q_normed if l2norm else inputs["q"], k=kept.k_normed if l2norm else inputs["k"],
        v=inputs["v"], beta=inputs["beta"], cum=kept.cum, inverse=kept.inverse, u=kept.u, h=kept.h,
        do=randn(batch, time, value_heads, value_dim, dtype=dtype),
        du=randn(batch, time, value_heads, value_dim, dtype=stored),
        dh=randn(max(plan.num_chunks, 2), value_heads, key_dim, value_dim, dtype=stored),
    )


def _nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _limits(dtype):
    _, grad_tol, gate_grad_tol = TOLERANCES[dtype]
    return grad_tol, gate_grad_tol


@requires_triton
@pytest.mark.parametrize("via_memory", [False, True], ids=["scores-in-registers", "scores-via-memory"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", SPLIT_CASES, ids=CASE_IDS)
def test_dqkw_matches_float64(monkeypatch, name, sizes, gate, options, dtype, chunk, via_memory):
    """dqkw alone; also with dS's round trip through memory (dqkw.DQKW_SCORES_VIA_MEMORY)."""
    monkeypatch.setattr(dqkw, "DQKW_SCORES_VIA_MEMORY", via_memory)
    x = _kernel_inputs(sizes, gate, options, dtype, chunk, seed=sizes[1] + 21)
    plan = x["plan"]
    batch, time, value_heads, _ = x["do"].shape
    key_dim = x["q"].shape[3]
    dq, dk = _nan(batch, time, value_heads, key_dim), _nan(batch, time, value_heads, key_dim)
    dw = _nan(batch, time, value_heads, key_dim, dtype=plan.intermediate_dtype)
    dcum = _nan(batch, time, value_heads, 1) if gate != "none" else plan.dummy
    table, seqlens = plan.chunk_args()
    cum = x["cum"] if x["cum"] is not None else plan.dummy
    second = launch_dqkw(plan, x["q"], x["k"], x["do"], cum, x["u"], x["du"], x["h"], x["dh"], dq, dk, dw, dcum,
                         plan.num_chunks, table, seqlens, x["scale"])
    key_tiles = cdiv(key_dim, dqkw.dqkw_key_block(key_dim))
    assert (second is not None) == (gate != "none" and key_tiles == 2)
    dq_ref, dk_ref, dw_ref, dg_ref = dqkw_ref(x["q"], x["k"], x["do"], x["cum"], x["u"], x["du"], x["h"], x["dh"],
                                              x["chunks"], x["scale"])
    grad_tol, gate_grad_tol = _limits(dtype)
    for label, out, ref in (("dq", dq, dq_ref), ("dk partial", dk, dk_ref), ("dw", dw, dw_ref)):
        error = relative_rms_error(out, ref)
        assert error < grad_tol, f"{label}: relative RMS error {error:.2e}"
    if gate != "none":
        # the first key tile's rows in dcum, the second's in `second`: wy_bwd adds them in that order
        dg = dcum[..., 0] + (second[..., 0] if second is not None else 0)
        error = relative_rms_error(dg, dg_ref)
        assert error < gate_grad_tol, f"dG partial: relative RMS error {error:.2e}"


TWO_KEY_TILE_CASES = [c for c in SPLIT_CASES if cdiv(c[1][4], dqkw.dqkw_key_block(c[1][4])) == 2]


@requires_triton
@pytest.mark.parametrize("via_memory", [False, True], ids=["scores-in-registers", "scores-via-memory"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", TWO_KEY_TILE_CASES,
                         ids=[c[0] for c in TWO_KEY_TILE_CASES])
def test_dqkw_key_tile_order_gives_the_same_results(monkeypatch, name, sizes, gate, options, dtype, chunk, via_memory):
    """dqkw.DQKW_KEY_TILES_FASTEST only reorders the programs (a chunk's key tiles side by side in the
    launch): every output bit for bit as with the key tile as the grid's slowest axis, dS's scratch slots
    included (via memory)."""
    monkeypatch.setattr(dqkw, "DQKW_SCORES_VIA_MEMORY", via_memory)
    x = _kernel_inputs(sizes, gate, options, dtype, chunk, seed=sizes[1] + 23)
    plan = x["plan"]
    batch, time, value_heads, _ = x["do"].shape
    key_dim = x["q"].shape[3]
    table, seqlens = plan.chunk_args()
    cum = x["cum"] if x["cum"] is not None else plan.dummy
    results = []
    for fastest in (False, True):
        monkeypatch.setattr(dqkw, "DQKW_KEY_TILES_FASTEST", fastest)
        dq, dk = _nan(batch, time, value_heads, key_dim), _nan(batch, time, value_heads, key_dim)
        dw = _nan(batch, time, value_heads, key_dim, dtype=plan.intermediate_dtype)
        dcum = _nan(batch, time, value_heads, 1) if gate != "none" else plan.dummy
        second = launch_dqkw(plan, x["q"], x["k"], x["do"], cum, x["u"], x["du"], x["h"], x["dh"], dq, dk, dw, dcum,
                             plan.num_chunks, table, seqlens, x["scale"])
        results.append([dq, dk, dw] + ([dcum, second] if gate != "none" else []))
    for label, slowest, fastest in zip(("dq", "dk", "dw", "dcum", "dcum second"), *results):
        assert torch.isfinite(slowest).all(), label
        assert torch.equal(slowest, fastest), label


def test_dqkw_key_tiles_are_at_most_two():
    """dG's rows are stored per key tile, and wy_bwd adds two at most: every K takes one or two tiles."""
    for key_dim in (16, 32, 60, 64, 100, 128, 200, 256):
        block = dqkw.dqkw_key_block(key_dim)
        assert cdiv(key_dim, block) <= 2, (key_dim, block)
    assert dqkw.dqkw_key_block(128) == 64 and dqkw.dqkw_key_block(256) == 128


@requires_triton
@pytest.mark.parametrize("half_dl", [False, True], ids=["dl-fp32-a", "dl-half"])
@pytest.mark.parametrize("parts", [1, 2], ids=["dg-one-part", "dg-two-parts"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", SPLIT_CASES, ids=CASE_IDS)
def test_wy_bwd_matches_float64(monkeypatch, name, sizes, gate, options, dtype, chunk, parts, half_dl):
    """wy_bwd alone; with two parts, dqkw's partial dG handed over as two key tiles' rows (dcum_second);
    dL from the fp32 A or (wy_bwd.WY_BWD_HALF_DL) from A and dA in the products' dtype."""
    if parts == 2 and gate == "none":
        pytest.skip("no gate: no dG")
    if half_dl and parts == 2:
        pytest.skip("dL's operands do not depend on how dG is handed over")
    monkeypatch.setattr(wy_bwd, "WY_BWD_HALF_DL", half_dl)
    x = _kernel_inputs(sizes, gate, options, dtype, chunk, seed=sizes[1] + 22)
    plan = x["plan"]
    # dqkw's outputs, from its reference: dW in the intermediates' dtype, the partial sums fp32
    _, dk_partial, dw, dg_partial = dqkw_ref(x["q"], x["k"], x["do"], x["cum"], x["u"], x["du"], x["h"], x["dh"],
                                             x["chunks"], x["scale"])
    dw = dw.to(device=DEVICE, dtype=plan.intermediate_dtype)
    dk = dk_partial.to(device=DEVICE, dtype=torch.float32)
    dcum = dg_partial[..., None].to(device=DEVICE, dtype=torch.float32) if gate != "none" else plan.dummy
    dv, dbeta = _nan(*x["v"].shape, dtype=x["v"].dtype), _nan(*x["beta"].shape, dtype=x["beta"].dtype)
    table, seqlens = plan.chunk_args()
    cum = x["cum"] if x["cum"] is not None else plan.dummy
    second = None
    if parts == 2:  # an uneven split, so that a part read twice or not at all shows
        second = (dcum * 0.75).contiguous()
        dcum = dcum - second
    launch_wy_bwd(plan, x["k"], x["v"], x["beta"], cum, x["inverse"], x["du"], dw, dv, dbeta, dk, dcum,
                  plan.num_chunks, table, seqlens, dcum_second=second)
    dv_ref, dbeta_ref, dk_ref, dg_ref = wy_bwd_ref(x["k"], x["v"], x["beta"], x["cum"], x["inverse"], x["du"], dw,
                                                   dk_partial, dg_partial, x["chunks"])
    grad_tol, gate_grad_tol = _limits(dtype)
    for label, out, ref, limit in (("dv", dv, dv_ref, grad_tol), ("dk", dk, dk_ref, grad_tol),
                                   ("dbeta", dbeta, dbeta_ref, gate_grad_tol)):
        error = relative_rms_error(out, ref)
        assert error < limit, f"{label}: relative RMS error {error:.2e}"
    if gate != "none":
        error = relative_rms_error(dcum[..., 0], dg_ref)
        assert error < gate_grad_tol, f"dG: relative RMS error {error:.2e}"


@requires_triton
@pytest.mark.parametrize("split", [True, False], ids=["split", "single"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", SPLIT_CASES, ids=CASE_IDS)
def test_backward_split_or_single_matches_float64_recurrence(monkeypatch, split, name, sizes, gate, options, dtype,
                                                             chunk):
    """The whole backward, NaN-poisoned outputs, with the split's kernels or wy.py's one (and only those)."""
    monkeypatch.setattr(kernel_plan, "SPLIT_WY_BACKWARD", split)
    launches = []
    launch = chunk_kernels.launch_split_wy_backward
    monkeypatch.setattr(chunk_kernels, "launch_split_wy_backward",
                        lambda *a, **k: launches.append(a) or launch(*a, **k))
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 23)
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)
    assert len(launches) == (1 if split else 0)


@requires_triton
def test_channel_gate_keeps_the_single_wy_backward(monkeypatch):
    """KDA's per-channel gates are not covered by the split: wy.py's kernel either way."""
    monkeypatch.setattr(kernel_plan, "SPLIT_WY_BACKWARD", True)
    monkeypatch.setattr(chunk_kernels, "launch_split_wy_backward",
                        lambda *a, **k: pytest.fail("the split launched for a per-channel gate"))
    inputs, kwargs = build_case((1, 40, 1, 2, 32, 16), "channel", {"initial_state": True}, seed=5)
    check_forward_and_backward(kernel_inputs(inputs, torch.float32), kwargs, torch.float32, 16)


# Software-pipelining stages of both kernels: two stages of the single wy_backward once gave wrong,
# run-to-run different dk and dg on the H100 with Triton 3.6 (wy.py's note). The interpreter has no
# stages: one run there.
STAGES = [1, 2, 3] if DEVICE == "cuda" else [None]


@requires_triton
@pytest.mark.parametrize("stages", STAGES, ids=lambda s: f"stages{s}" if s else "default")
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk",
                         [SPLIT_CASES[0], SPLIT_CASES[2]], ids=[CASE_IDS[0], CASE_IDS[2]])
def test_split_backward_is_deterministic(monkeypatch, stages, name, sizes, gate, options, dtype, chunk):
    monkeypatch.setattr(kernel_plan, "SPLIT_WY_BACKWARD", True)
    if stages is not None:
        monkeypatch.setitem(dqkw.DQKW_OPTIONS, "num_stages", stages)
        monkeypatch.setitem(wy_bwd.WY_BWD_OPTIONS, "num_stages", stages)
    check_repeated_backward(sizes, gate, options, dtype, chunk, checked=("k", "beta"))


def test_references_stay_on_their_inputs_device():
    """dqkw_ref and wy_bwd_ref make every tensor on their inputs' device: on the GPU they once built
    the chunk's row indices and zero gate on the CPU ("expected self and mask to be on the same
    device"). Meta tensors catch that on the CPU: a CPU tensor meeting one fails the same way."""
    meta = torch.device("meta")
    batch, time, key_heads, value_heads, key_dim, value_dim, chunk = 1, 20, 1, 2, 8, 4, 16
    problem_chunks = [(0, 0, 16), (0, 16, 4)]

    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device=meta)

    q, k = empty(batch, time, key_heads, key_dim), empty(batch, time, key_heads, key_dim)
    do, u, du = (empty(batch, time, value_heads, value_dim) for _ in range(3))
    h, dh = empty(2, value_heads, key_dim, value_dim), empty(2, value_heads, key_dim, value_dim)
    v, beta = empty(batch, time, value_heads, value_dim), empty(batch, time, value_heads)
    inverse = empty(batch, time, value_heads, chunk, dtype=torch.float32)
    for cum in (None, empty(batch, time, value_heads, 1, dtype=torch.float32)):
        dq, dk, dw, dg = dqkw_ref(q, k, do, cum, u, du, h, dh, problem_chunks, 0.5)
        assert all(t.device == meta for t in (dq, dk, dw)) and (dg is None) == (cum is None)
        outs = wy_bwd_ref(k, v, beta, cum, inverse, du, dw, dk, dg, problem_chunks)
        assert all(t.device == meta for t in outs if t is not None)


# name, (batch, time, H, HV, K, V), gate, options, dtype, chunk size: half inputs without GVA, where
# plan.half_key_gradients applies (with the l2norm: half heads read by its backward; without: the
# kernels write the op's dq and dk themselves), and a GVA case it leaves to fp32.
HALF_KEY_CASES = [
    ("gdn-T100-K60-V100-l2norm-h0", (1, 100, 1, 1, 60, 100), "scalar", {"initial_state": True, "l2norm": True},
     torch.bfloat16, 64),
    ("plain-varlen-K100-V60", (1, 80, 1, 1, 100, 60), "none", VARLEN, torch.bfloat16, 64),
    ("gdn-T70-fp16", (2, 70, 2, 2, 64, 32), "scalar", {}, torch.float16, 32),
    ("gdn-T100-gva", (1, 100, 1, 2, 64, 64), "scalar", {"l2norm": True}, torch.bfloat16, 64),
]


@requires_triton
@pytest.mark.parametrize("half_partial", [False, True], ids=["fp32-partial", "half-partial"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", HALF_KEY_CASES, ids=[c[0] for c in HALF_KEY_CASES])
def test_half_key_gradients_match_float64_recurrence(monkeypatch, name, sizes, gate, options, dtype, chunk,
                                                     half_partial):
    """plan.HALF_KEY_GRADIENTS: the split kernels' dq and (completed) dk heads in the input dtype, dk's
    partial sums fp32 or (HALF_DK_PARTIAL) the input dtype too; whole backward against float64 at the
    usual tolerances, NaN-poisoned outputs."""
    monkeypatch.setattr(kernel_plan, "HALF_KEY_GRADIENTS", True)
    monkeypatch.setattr(kernel_plan, "HALF_DK_PARTIAL", half_partial)
    monkeypatch.setattr(kernel_plan, "SPLIT_WY_BACKWARD", True)
    heads = []
    launch = chunk_kernels.launch_split_wy_backward
    monkeypatch.setattr(chunk_kernels, "launch_split_wy_backward",
                        lambda *a, **k: heads.append((a[0].half_key_gradients, a[14].dtype, a[15].dtype, a[21].dtype))
                        or launch(*a, **k))
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 41)
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)
    gva = sizes[3] != sizes[2]
    expected = torch.float32 if gva else dtype
    partial = dtype if half_partial and not gva else torch.float32
    # (the plan's answer, dq's heads, dk's partial sums from dqkw.py, dk's heads completed by wy_bwd.py)
    assert heads == [(not gva, expected, partial, expected)], heads
