"""The delta-rule custom ops (hccompile::chunk_delta_rule{,_backward}) and their FLA-style functions:
opcheck, gradients against the float64 recurrence, torch.compile with dynamic T, input errors.

"kernels" runs the Triton kernels (CUDA, or CPU with TRITON_INTERPRET=1 set before Python starts);
"reference" forces the documented plain-PyTorch fallback by setting TRITON_INTERPRET=0, which
triton_available reads at call time."""
from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo.testing  # not imported by torch itself on 2.15: a chunk of tests without another importer failed
import torch.nn.functional as F

from hccompile.kernels.delta_rule import naive_recurrent_delta_rule
from hccompile.kernels.delta_rule.plan import kept_state_rows
from hccompile.lowering.delta_rule import (chunk_delta_rule, chunk_delta_rule_backward_op, chunk_delta_rule_op,
                                           chunk_gated_delta_rule, chunk_kda, implementation)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_CAN_RUN = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
# fp32 inputs against the float64 recurrence; the gate parameters sum the gate gradient over all
# tokens, which cancels and leaves fewer digits (as in the kernel tests).
TOLERANCE = 1e-4


@pytest.fixture(params=["kernels", "reference"])
def mode(request, monkeypatch):
    if request.param == "kernels":
        if not KERNELS_CAN_RUN:
            pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 set before Python starts")
    else:
        if DEVICE != "cpu":
            pytest.skip("the reference fallback is forced through TRITON_INTERPRET, a CPU-only switch")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    expected = "reference" if request.param == "reference" else ("triton" if DEVICE == "cuda" else
                                                                "triton-interpreter")
    assert implementation(DEVICE) == expected
    return request.param


def relative_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values"
    out, ref = out.detach().double(), ref.detach().double().to(out.device)
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_case(gate: str, *, B=1, T=20, H=1, HV=2, K=16, V=16, initial_state=True, seqlens=None,
              gate_in_kernel=False, seed=0, dtype=torch.float32) -> dict:
    """Inputs of one call, every tensor fp32 (states, gate parameters) or `dtype`; seqlens given
    makes a varlen batch (B = 1, cu_seqlens)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    if seqlens is not None:
        B, T = 1, sum(seqlens)
    N = B if seqlens is None else len(seqlens)
    case = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, HV, V),
                beta=torch.rand(B, T, HV, generator=gen), g=None, initial_state=None, cu_seqlens=None,
                A_log=None, dt_bias=None)
    if gate == "scalar":
        case["g"] = F.logsigmoid(randn(B, T, HV))
    elif gate == "channel":
        case["g"] = randn(B, T, HV, K) if gate_in_kernel else F.logsigmoid(randn(B, T, HV, K) + 2)
    if gate_in_kernel:
        case["A_log"], case["dt_bias"] = 0.3 * randn(HV), 0.5 * randn(HV * K)
    if initial_state:
        case["initial_state"] = 0.5 * randn(N, HV, K, V)
    if seqlens is not None:
        case["cu_seqlens"] = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)), dtype=torch.int64)
    for name in ("q", "k", "v", "beta", "g"):
        if case[name] is not None:
            case[name] = case[name].to(dtype)
    return {name: None if t is None else t.to(DEVICE) for name, t in case.items()}


def op_args(case: dict, gate: str, *, scale=0.3, output_final_state=True, l2norm=True, lower_bound=None,
            chunk_size=16, save_intermediates=None) -> tuple:
    args = (case["q"], case["k"], case["v"], case["beta"], case["g"], case["initial_state"], case["cu_seqlens"],
            case["A_log"], case["dt_bias"], gate, scale, output_final_state, l2norm, lower_bound, chunk_size)
    return args if save_intermediates is None else (*args, save_intermediates)


OPCHECK_CASES = {
    # name: (gate, make_case kwargs, op_args kwargs)
    # The interpreter makes each op call take about a second and opcheck makes dozens, so the cases
    # are few: GDN and KDA with initial and final state, and one varlen batch (with an empty sequence).
    "gdn": ("scalar", dict(), dict()),
    "kda-gate-in-kernel": ("channel", dict(gate_in_kernel=True), dict(lower_bound=-5.0)),
    "gdn-varlen": ("scalar", dict(seqlens=(7, 0, 13)), dict()),
    # The forward keeps its intra-chunk matrices and state sweep, and the backward op takes them;
    # varlen: the kept chunk states' rows are a bound the fake computes from shapes (kept_state_rows).
    "kda-kept": ("channel", dict(), dict(save_intermediates=True)),
    "gdn-varlen-kept": ("scalar", dict(seqlens=(7, 0, 13)), dict(save_intermediates=True)),
}


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck_forward_and_backward(name, mode):
    gate, case_kwargs, arg_kwargs = OPCHECK_CASES[name]
    case = make_case(gate, **case_kwargs)
    differentiable = {n: (t.requires_grad_() if t is not None and t.is_floating_point() else t)
                      for n, t in case.items()}
    args = op_args(differentiable, gate, **arg_kwargs)
    torch.library.opcheck(chunk_delta_rule_op, args)

    o, final_state, *kept = chunk_delta_rule_op(*op_args(case, gate, **arg_kwargs))
    if arg_kwargs.get("save_intermediates"):
        # The intra-chunk matrices, the l2-normed q and k (op_args asks for the l2norm), the gate's
        # sum, and the state sweep's w, u, h. Without per-channel gates (plan.FUSED_SCORES_FORWARD) no
        # Kdot (a zero-size placeholder), and P in the intermediates' dtype.
        from hccompile.kernels.delta_rule import plan as kernel_plan

        fused = kernel_plan.fused_scores_forward_for(gate)
        assert len(kept) == 9 and all(tuple(t.shape) == (*o.shape[:3], 16) for t in kept[int(fused):3])
        assert tuple(kept[0].shape) == ((0,) if fused else (*o.shape[:3], 16))
        assert kept[1].dtype == (kernel_plan.intermediate_dtype_for(case["q"].dtype) if fused else torch.float32)
        assert all(t.shape == case["q"].shape for t in kept[3:5])
        assert kept[5].shape == case["g"].shape[:3] + (case["g"].shape[3] if case["g"].dim() == 4 else 1,)
        key_dim, value_dim = case["q"].shape[3], case["v"].shape[3]
        sequences = None if case["cu_seqlens"] is None else len(case["cu_seqlens"]) - 1
        rows = kept_state_rows(o.shape[0], o.shape[1], 16, sequences)
        assert kept[6].shape == (*o.shape[:3], key_dim) and kept[7].shape == o.shape
        assert kept[8].shape == (rows, o.shape[2], key_dim, value_dim)
    do = torch.randn_like(o)
    dht = torch.randn_like(final_state) if arg_kwargs.get("output_final_state", True) else None
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    backward_args = (*detached[:9], do, dht, *[detached[i] for i in (9, 10, 12, 13, 14)])
    if arg_kwargs.get("save_intermediates"):
        backward_args = (*backward_args, *kept)
    torch.library.opcheck(chunk_delta_rule_backward_op, backward_args)


def test_absent_outputs_are_zero_size_placeholders(mode):
    case = make_case("scalar", initial_state=False)
    o, final_state, *kept = chunk_delta_rule_op(*op_args(case, "scalar", output_final_state=False))
    assert [tuple(t.shape) for t in kept] == [(0,)] * 9  # nothing kept unless asked for
    assert o.shape == case["v"].shape and final_state.shape == (0,) and final_state.dtype == torch.float32
    grads = chunk_delta_rule_backward_op(*op_args(case, "scalar")[:9], torch.ones_like(o), None, "scalar", 0.3,
                                         True, None, 16)
    # dq, dk, dv, dbeta, dg present; dinitial_state, dA_log, ddt_bias absent.
    assert [tuple(g.shape) for g in grads[5:]] == [(0,)] * 3
    o, final_state = chunk_gated_delta_rule(case["q"], case["k"], case["v"], case["g"], case["beta"])
    assert final_state is None


GRADIENT_CASES = {
    # name: (public function, gate, make_case kwargs, extra keyword arguments)
    "gdn": (chunk_gated_delta_rule, "scalar", dict(T=40), dict(use_qk_l2norm_in_kernel=True)),
    "kda": (chunk_kda, "channel", dict(T=40, B=2, H=2), dict()),
    "kda-gate-in-kernel": (chunk_kda, "channel", dict(T=40, gate_in_kernel=True),
                           dict(use_gate_in_kernel=True, lower_bound=-4.0, use_qk_l2norm_in_kernel=True)),
    "kda-varlen": (chunk_kda, "channel", dict(seqlens=(9, 31)), dict(use_qk_l2norm_in_kernel=True)),
    "delta-rule": (chunk_delta_rule, "none", dict(T=40), dict(use_qk_l2norm_in_kernel=True)),
}


@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_gradients_match_float64_recurrence(name, mode):
    function, gate, case_kwargs, extra = GRADIENT_CASES[name]
    case = make_case(gate, seed=1, **case_kwargs)
    leaves = {n: t.requires_grad_() for n, t in case.items() if t is not None and t.is_floating_point()}
    positional = [case["q"], case["k"], case["v"]] + ([case["g"]] if gate != "none" else []) + [case["beta"]]
    kwargs = dict(initial_state=case["initial_state"], output_final_state=True, cu_seqlens=case["cu_seqlens"],
                  **extra)
    if case["A_log"] is not None:
        kwargs.update(A_log=case["A_log"], dt_bias=case["dt_bias"])
    o, final_state = function(*positional, **kwargs)
    assert o.dtype == case["v"].dtype and final_state.dtype == torch.float32

    as64 = {n: None if t is None else (t.detach().double().requires_grad_() if t.is_floating_point() else t)
            for n, t in case.items()}
    o_ref, final_ref = naive_recurrent_delta_rule(
        as64["q"], as64["k"], as64["v"], as64["beta"], as64["g"], gate=gate, initial_state=as64["initial_state"],
        output_final_state=True, cu_seqlens=case["cu_seqlens"],
        use_qk_l2norm_in_kernel=extra.get("use_qk_l2norm_in_kernel", False), A_log=as64["A_log"],
        dt_bias=as64["dt_bias"], lower_bound=extra.get("lower_bound"),
    )
    assert relative_rms_error(o, o_ref) < TOLERANCE
    assert relative_rms_error(final_state, final_ref) < TOLERANCE

    do, dht = torch.randn_like(o), torch.randn_like(final_state)
    grads = torch.autograd.grad((o, final_state), list(leaves.values()), (do, dht))
    grads_ref = torch.autograd.grad((o_ref, final_ref), [as64[n] for n in leaves], (do.double(), dht.double()))
    for leaf_name, grad, grad_ref in zip(leaves, grads, grads_ref):
        assert grad.dtype == leaves[leaf_name].dtype and grad.shape == leaves[leaf_name].shape
        assert relative_rms_error(grad, grad_ref) < TOLERANCE, leaf_name


def test_compile_fullgraph_dynamic_time_compiles_once(mode):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def layer(q, k, v, g, beta, initial_state):
        o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o * 2, final_state

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for T in (17, 40, 64):
        case = make_case("scalar", B=2, T=T, seed=T)
        names = ("q", "k", "v", "g", "beta", "initial_state")
        inputs = [case[n].requires_grad_() for n in names]
        o, final_state = compiled(*inputs)
        o_eager, final_eager = layer(*inputs)
        assert relative_rms_error(o, o_eager) < 1e-6 and relative_rms_error(final_state, final_eager) < 1e-6
        do, dht = torch.randn_like(o), torch.randn_like(final_state)
        grads = torch.autograd.grad((o, final_state), inputs, (do, dht))
        grads_eager = torch.autograd.grad((o_eager, final_eager), inputs, (do, dht))
        for name, grad, grad_eager in zip(names, grads, grads_eager):
            assert relative_rms_error(grad, grad_eager) < 1e-6, name
    assert counter.frame_count == 1


def test_compile_reports_bad_shapes_at_trace_time():
    case = make_case("scalar")
    compiled = torch.compile(chunk_gated_delta_rule, backend="eager", fullgraph=True, dynamic=True)
    with pytest.raises(Exception, match=r"g: shape"):
        compiled(case["q"], case["k"], case["v"], torch.zeros(1, 20, 2, 16, device=case["q"].device), case["beta"])


def _bad_calls():
    """(description, call taking a fresh case, expected message)."""
    def gdn(case, **overrides):
        args = {n: case[n] for n in ("q", "k", "v", "g", "beta")}
        kwargs = dict(initial_state=case["initial_state"], cu_seqlens=case["cu_seqlens"])
        merged = {**args, **kwargs, **overrides}
        return chunk_gated_delta_rule(merged.pop("q"), merged.pop("k"), merged.pop("v"), merged.pop("g"),
                                      merged.pop("beta"), **merged)

    return [
        ("q 3-D", lambda c: gdn(c, q=c["q"][0]), r"q: expected a 4-D"),
        ("k shape", lambda c: gdn(c, k=c["k"][..., :8]), r"k: shape"),
        ("v heads", lambda c: gdn(c, q=torch.randn(1, 20, 2, 16), k=torch.randn(1, 20, 2, 16),
                                    v=torch.randn(1, 20, 3, 16), beta=torch.rand(1, 20, 3), g=torch.zeros(1, 20, 3)),
         r"v: heads HV=3 must be a multiple of q's H=2"),
        ("beta shape", lambda c: gdn(c, beta=c["beta"][:, :5]), r"beta: shape"),
        ("g per channel for GDN", lambda c: gdn(c, g=torch.zeros(1, 20, 2, 16)), r"g: shape"),
        ("k dtype", lambda c: gdn(c, k=c["k"].half()), r"k: dtype torch.float16 differs"),
        ("int q", lambda c: gdn(c, q=c["q"].int(), k=c["k"].int()), r"q: expected a floating-point"),
        ("initial_state shape", lambda c: gdn(c, initial_state=c["initial_state"][:, :1]), r"initial_state: shape"),
        ("cu_seqlens with B=2", lambda c: gdn(c, q=c["q"].expand(2, -1, -1, -1), k=c["k"].expand(2, -1, -1, -1),
                                              v=c["v"].expand(2, -1, -1, -1), g=c["g"].expand(2, -1, -1),
                                              beta=c["beta"].expand(2, -1, -1), initial_state=None,
                                              cu_seqlens=torch.tensor([0, 20])),
         r"cu_seqlens: requires B == 1"),
        ("cu_seqlens end", lambda c: gdn(c, initial_state=None, cu_seqlens=torch.tensor([0, 5, 19])),
         r"cu_seqlens: must end at T=20"),
        ("head dim", lambda c: chunk_delta_rule(torch.randn(1, 3, 1, 300), torch.randn(1, 3, 1, 300),
                                                torch.randn(1, 3, 1, 8), torch.rand(1, 3, 1)),
         r"q: head dim 300 exceeds the supported maximum 256"),
        ("A_log without use_gate_in_kernel", lambda c: chunk_kda(c["q"], c["k"], c["v"], torch.zeros(1, 20, 2, 16),
                                                                  c["beta"], A_log=torch.zeros(2)),
         r"A_log: only used with use_gate_in_kernel=True"),
        ("use_gate_in_kernel without A_log", lambda c: chunk_kda(c["q"], c["k"], c["v"], torch.zeros(1, 20, 2, 16),
                                                                  c["beta"], use_gate_in_kernel=True),
         r"A_log: required"),
        ("positive lower_bound", lambda c: chunk_kda(c["q"], c["k"], c["v"], torch.zeros(1, 20, 2, 16), c["beta"],
                                                     A_log=torch.zeros(2), use_gate_in_kernel=True, lower_bound=1.0),
         r"lower_bound: must be negative"),
        ("chunk size", lambda c: chunk_delta_rule_op(*op_args(c, "scalar", chunk_size=48)),
         r"chunk_size: expected one of"),
    ]


@pytest.mark.parametrize("description, call, match", _bad_calls(), ids=[b[0] for b in _bad_calls()])
def test_bad_input_names_argument(description, call, match):
    case = make_case("scalar")
    # the cases' own tensors are made on the test device too, so that a GPU run checks the GPU path
    with torch.device(DEVICE), pytest.raises((ValueError, TypeError), match=match):
        call(case)


def test_training_calls_keep_the_intra_chunk_matrices_for_the_backward(monkeypatch):
    """With gradients wanted, the public functions have the forward op keep kdot, scores and the
    solved inverse (and with KEEP_STATES the state sweep's w, u, h), and the kernel backward reuses
    them; the gradients equal those of a backward that recomputes them, and calls without gradients
    keep nothing."""
    if not KERNELS_CAN_RUN:
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 set before Python starts")
    import hccompile.lowering.delta_rule as lowering

    reused = []
    kernel_backward = lowering.chunk_delta_rule_bwd

    def spy(*args, intermediates=None, **kwargs):
        reused.append("none" if intermediates is None else "states" if intermediates.h is not None else "matrices")
        return kernel_backward(*args, intermediates=intermediates, **kwargs)

    monkeypatch.setattr(lowering, "chunk_delta_rule_bwd", spy)
    case = make_case("channel")

    def gradients():
        leaves = {n: case[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
        o, _ = chunk_kda(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), use_qk_l2norm_in_kernel=True)
        o.backward(torch.ones_like(o))
        return [leaves[n].grad for n in leaves]

    kept = gradients()
    monkeypatch.setattr(lowering, "KEEP_STATES", False)
    matrices_only = gradients()
    monkeypatch.setattr(lowering, "keeps_intermediates", lambda *inputs: False)
    recomputed = gradients()
    assert reused == ["states", "matrices", "none"]
    for a, b, c in zip(kept, matrices_only, recomputed):
        assert torch.equal(a, c) and torch.equal(b, c)
    monkeypatch.undo()
    with torch.no_grad():
        assert not lowering.keeps_intermediates(case["q"].requires_grad_())


# ----------------------------------------------------------------------------------------
# Gate values and the layout guard (issue 23)


def _gdn_inputs(B=1, T=20, H=2, K=8):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    return q, k, v, F.logsigmoid(torch.randn(B, T, H, generator=gen)), torch.rand(B, T, H, generator=gen)


def test_positive_or_non_finite_log_gates_raise_naming_g(monkeypatch):
    """GDN/KDA log-gates must be finite and <= 0; the error names g, the first bad value and where
    it is. Checked in the op, so also where a compiled graph calls it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the check runs before dispatch: the reference is enough
    q, k, v, g, beta = _gdn_inputs()
    bad = g.clone()
    bad[0, 3, 1] = 0.5
    with pytest.raises(ValueError, match=r"g: log-gates must be <= 0 .*got 0\.5 at index \(0, 3, 1\) \(1 of 40"):
        chunk_gated_delta_rule(q, k, v, bad, beta)
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = g.clone()
        bad[0, 7, 0] = value
        with pytest.raises(ValueError, match=r"g: log-gates must be finite, got .* at index \(0, 7, 0\)"):
            chunk_gated_delta_rule(q, k, v, bad, beta)
    channel = F.logsigmoid(torch.randn(1, 20, 2, 8) + 2)
    with pytest.raises(ValueError, match=r"g: log-gates must be <= 0 .*use_gate_in_kernel=True"):
        chunk_kda(q, k, v, channel.abs(), beta)
    # a gate of exactly 0 (no decay) is valid; raw activations of the in-kernel gate are unchecked
    chunk_gated_delta_rule(q, k, v, torch.zeros_like(g), beta)
    chunk_kda(q, k, v, torch.randn(1, 20, 2, 8).abs(), beta, A_log=torch.zeros(2), use_gate_in_kernel=True)

    def f(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta)[0]

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    compiled(q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"g: log-gates must be <= 0"):
        compiled(q, k, v, -g, beta)

    # the op without check_gates (what the delta_rule pass emits for the user's own recurrence,
    # whose math holds for any finite gate) runs
    case = dict(q=q, k=k, v=v, beta=beta, g=-g, initial_state=None, cu_seqlens=None, A_log=None, dt_bias=None)
    o, *_ = chunk_delta_rule_op(*op_args(case, "scalar", output_final_state=False))
    ref, _ = naive_recurrent_delta_rule(q.double(), k.double(), v.double(), beta.double(), -g.double(),
                                        gate="scalar", scale=0.3, use_qk_l2norm_in_kernel=True)
    assert relative_rms_error(o, ref) < TOLERANCE


def test_gate_values_on_other_devices_are_read_only_when_asked(monkeypatch):
    """Off the CPU, reading the gates synchronises: unchecked unless HCCOMPILE_CHECK_GATES=1 (a
    meta tensor stands in for a CUDA one: it has no values, so reading them fails)."""
    from hccompile.lowering.delta_rule import _check_gate_values

    g = torch.empty(1, 4, 2, device="meta")
    _check_gate_values(g, "scalar", None)
    monkeypatch.setenv("HCCOMPILE_CHECK_GATES", "1")
    with pytest.raises((RuntimeError, NotImplementedError)):
        _check_gate_values(g, "scalar", None)


@pytest.mark.parametrize("swapped, blamed", [
    (("q", "k", "v"), "q, k, v look head-first"),
    (("beta",), "beta looks head-first"),
    (("v",), "v looks head-first"),
    (("k",), "k looks head-first"),
    (("g",), "g looks head-first"),
])
def test_head_first_tensors_are_named(swapped, blamed, monkeypatch):
    """A [B, H, T, D] tensor among FLA-layout ones: the shape error says which tensors look
    head-first and how to fix them."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    names = ("q", "k", "v", "g", "beta")
    args = dict(zip(names, _gdn_inputs()))
    for name in swapped:
        args[name] = args[name].transpose(1, 2)
    fix = ", ".join(f"{n}.transpose(1, 2)" for n in swapped)
    with pytest.raises(ValueError, match=f"{blamed} .*T=20, HV=2.*Pass {fix.replace('(', '[(]').replace(')', '[)]')}$"):
        chunk_gated_delta_rule(**args)


def test_head_first_hint_under_torch_compile():
    """The fake implementation (what torch.compile traces) gives the same hint."""
    q, k, v, g, beta = _gdn_inputs()

    def f(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta)[0]

    with pytest.raises(Exception, match=r"q, k, v look head-first"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), g, beta)


def test_shape_errors_without_a_layout_explanation_have_no_hint(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, g, beta = _gdn_inputs()
    with pytest.raises(ValueError) as raised:
        chunk_gated_delta_rule(q, k, v, g, beta[:, :5])
    assert "head-first" not in str(raised.value)


def test_all_head_first_with_implausible_head_count_warns(monkeypatch):
    """Every tensor head-first gives consistent shapes; when that reading has more heads than any
    model (and than steps), a warning says what to check."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(1, 4, 300, 8)  # 4 heads of 300 steps, passed head-first
    with pytest.warns(UserWarning, match=r"reads as T=4 steps of H=300 heads.*transpose dims 1 and 2"):
        chunk_gated_delta_rule(x, x, x, -torch.rand(1, 4, 300), torch.rand(1, 4, 300))


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_gpu_inductor_code_launches_the_delta_rule_kernels_directly(gate):
    """Issue 24: on CUDA the delta-rule ops are traced into their kernel launches, so Inductor's
    output code launches our kernels itself (no call through torch.ops.hccompile but the run-time
    context-parallel check), the report still names one op per direction, and the compiled
    function (GVA, l2norm, initial and final state) matches the float64 recurrence."""
    from helpers import Collect, calls_through_hccompile_ops, inductor_step

    case = make_case(gate, B=2, T=100, H=2, HV=4, K=64, V=64, seed=3)
    function = chunk_gated_delta_rule if gate == "scalar" else chunk_kda
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = {n: case[n].clone().requires_grad_() for n in names}
    be = Collect()
    compiled = torch.compile(lambda q, k, v, g, beta, h0: function(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True),
        backend=be, fullgraph=True)
    do = torch.randn(2, 100, 4, 64, device=DEVICE)
    dht = torch.randn(2, 4, 64, 64, device=DEVICE)
    (o, final_state), code = inductor_step(compiled, list(leaves.values()), (do, dht))
    from hccompile.kernels.delta_rule import plan as kernel_plan

    kernels = ["_output_kernel", "_wy_solve_kernel", "_state_forward_kernel", "_state_backward_kernel"]
    # Without per-channel gates the forward forms Kdot in wy_solve and P in the output kernel
    # (plan.FUSED_SCORES_FORWARD): no decayed_scores launch; the backward takes the kept P.
    fused_forward = kernel_plan.fused_scores_forward_for(gate)
    # Per-channel gates: decayed_scores with one program per chunk while plan.CHUNK_SCORE_PROGRAMS.
    per_chunk = gate == "channel" and kernel_plan.CHUNK_SCORE_PROGRAMS
    scores_kernel = "_chunk_scores_kernel" if per_chunk else "_decayed_scores_kernel"
    (kernels if not fused_forward else []).append(scores_kernel)
    if fused_forward:
        assert "_decayed_scores_kernel" not in code and "_chunk_scores_kernel" not in code
    # Without per-channel gates wy_backward does decayed_scores_backward's work (plan.FUSED_SCORES_BACKWARD),
    # split in dqkw and wy_bwd while plan.SPLIT_WY_BACKWARD is on.
    fused = kernel_plan.FUSED_SCORES_BACKWARD and gate != "channel"
    split = fused and kernel_plan.SPLIT_WY_BACKWARD
    (kernels if not fused else []).append("_decayed_scores_backward_kernel")
    kernels += ["_dqkw_kernel", "_wy_bwd_kernel"] if split else ["_wy_backward_kernel"]
    for kernel in kernels:
        assert kernel in code, kernel
    if fused:
        assert "_decayed_scores_backward_kernel" not in code
    if split:
        assert "_wy_backward_kernel" not in code
    assert not calls_through_hccompile_ops(code), calls_through_hccompile_ops(code)[:5]
    assert be.ops("forward") == ["hccompile.chunk_delta_rule.default"], be.ops("forward")
    assert be.ops("backward") == ["hccompile.chunk_delta_rule_backward.default"], be.ops("backward")

    as64 = {n: case[n].detach().double().requires_grad_() for n in names}
    o_ref, final_ref = naive_recurrent_delta_rule(
        as64["q"], as64["k"], as64["v"], as64["beta"], as64["g"], gate=gate, initial_state=as64["initial_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.autograd.backward((o_ref, final_ref), (do.double(), dht.double()))
    assert relative_rms_error(o, o_ref) < TOLERANCE
    assert relative_rms_error(final_state, final_ref) < TOLERANCE
    for n in names:
        assert relative_rms_error(leaves[n].grad, as64[n].grad) < TOLERANCE, n


def test_eager_calls_skip_the_run_time_context_check(monkeypatch):
    """Issue 24: the traced body's context_parallel check is an op of its own so that a compiled
    graph runs it every time; an eager call of that body (CUDA, outside any block: _traceable
    checked) allocates the kernels' scratch tensor without dispatching it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hccompile.lowering import delta_rule as D

    calls = []
    monkeypatch.setattr(D, "outside_context_parallel_op", lambda q: calls.append(q) or torch.empty(2))
    q = torch.randn(1, 4, 2, 8)
    scratch = D._scratch(q)
    assert scratch.shape == (2,) and scratch.dtype == torch.float32 and not calls
    with FakeTensorMode() as mode:
        D._scratch(mode.from_tensor(q))
    assert len(calls) == 1
