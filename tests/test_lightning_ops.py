"""The lightning-attention custom ops (hccompile::lightning_attn{,_backward}) and lightning_attn:
opcheck, outputs and gradients against float64 autograd through the quadratic reference,
torch.compile with dynamic T, input errors.

"kernels" runs the Triton kernels (CUDA, or CPU with TRITON_INTERPRET=1 set before Python starts);
"reference" forces the documented plain-PyTorch fallback by setting TRITON_INTERPRET=0, which
triton_available reads at call time."""
from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo.testing  # not imported by torch itself on 2.15: a chunk of tests without another importer failed

from hccompile.kernels.lightning import lightning_attn_ref
from hccompile.lowering.lightning import (alibi_decay, implementation, lightning_attn, lightning_attn_backward_op,
                                          lightning_attn_op)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_CAN_RUN = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
# fp32 inputs against float64 autograd through the reference.
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


def make_case(*, B=1, T=20, H=2, K=16, V=16, decay="alibi", initial_state=True, seed=0,
              dtype=torch.float32) -> dict:
    """Inputs of one call on DEVICE: q, k, v in `dtype`, decay and initial_state float32."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    case = dict(q=randn(B, T, H, K).to(dtype), k=randn(B, T, H, K).to(dtype), v=randn(B, T, H, V).to(dtype),
                decay={"alibi": alibi_decay(H), "none": torch.zeros(H)}[decay],
                initial_state=0.5 * randn(B, H, K, V) if initial_state else None)
    return {name: None if t is None else t.to(DEVICE) for name, t in case.items()}


OPCHECK_CASES = {
    # name: (make_case kwargs, output_final_state, save_states). The interpreter makes each op call
    # slow and opcheck makes dozens, so the cases are few and tiny.
    "states": (dict(), True, False),
    "no-states": (dict(initial_state=False, decay="none"), False, False),
    "kept-states": (dict(T=70), True, True),
    # one segment: the kept states still have 2 rows eagerly, as traced (kept_rows)
    "kept-states-one-segment": (dict(), True, True),
}


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck_forward_and_backward(name, mode):
    case_kwargs, output_final_state, save_states = OPCHECK_CASES[name]
    case = make_case(**{"T": 9, "H": 1, **case_kwargs})
    q, k, v, decay, h0 = (case[n] for n in ("q", "k", "v", "decay", "initial_state"))
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), decay,
            None if h0 is None else h0.requires_grad_(), 0.3, output_final_state, None, save_states)
    torch.library.opcheck(lightning_attn_op, args)

    with torch.no_grad():
        o, final_state, states = lightning_attn_op(*args)
    assert (states.numel() > 0) == (save_states and mode == "kernels")
    do = torch.randn_like(o)
    dht = torch.randn_like(final_state) if output_final_state else None
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in (q, k, v, decay, h0)]
    torch.library.opcheck(lightning_attn_backward_op, (*detached, do, dht, 0.3, None, states))


def test_absent_outputs_are_zero_size_placeholders(mode):
    case = make_case(initial_state=False)
    q, k, v, decay = (case[n] for n in ("q", "k", "v", "decay"))
    o, final_state, states = lightning_attn_op(q, k, v, decay, None, 0.3, False)
    assert o.shape == v.shape and o.is_contiguous()
    assert final_state.shape == (0,) and final_state.dtype == torch.float32
    assert states.shape == (0,) and states.dtype == torch.float32
    dq, dk, dv, dh0 = lightning_attn_backward_op(q, k, v, decay, None, torch.ones_like(o), None, 0.3)
    assert (dq.shape, dk.shape, dv.shape, dh0.shape) == (q.shape, k.shape, v.shape, (0,))
    o, final_state = lightning_attn(q, k, v, decay)
    assert final_state is None


GRADIENT_CASES = {
    # name: make_case kwargs. T=70 crosses the kernels' default block of 64.
    "no-decay": dict(decay="none", B=2, T=40),
    "alibi": dict(decay="alibi", T=70, V=32),
    "alibi-no-initial-state": dict(decay="alibi", T=33, initial_state=False),
}


@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_outputs_and_gradients_match_float64_reference(name, mode):
    case = make_case(seed=1, **GRADIENT_CASES[name])
    names = [n for n in ("q", "k", "v", "initial_state") if case[n] is not None]
    leaves = [case[n].requires_grad_() for n in names]
    decay = None if GRADIENT_CASES[name]["decay"] == "none" else case["decay"]
    o, final_state = lightning_attn(case["q"], case["k"], case["v"], decay, initial_state=case["initial_state"],
                                    output_final_state=True)
    assert o.dtype == torch.float32 and final_state.dtype == torch.float32

    as64 = [t.detach().double().requires_grad_() for t in leaves]
    h0_64 = as64[3] if len(as64) == 4 else None
    o_ref, final_ref = lightning_attn_ref(*as64[:3], case["decay"].double(), case["q"].shape[-1] ** -0.5, h0_64,
                                          True)
    assert relative_rms_error(o, o_ref) < TOLERANCE
    assert relative_rms_error(final_state, final_ref) < TOLERANCE

    do, dht = torch.randn_like(o), torch.randn_like(final_state)
    grads = torch.autograd.grad((o, final_state), leaves, (do, dht))
    grads_ref = torch.autograd.grad((o_ref, final_ref), as64, (do.double(), dht.double()))
    for leaf_name, leaf, grad, grad_ref in zip(names, leaves, grads, grads_ref):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape
        assert relative_rms_error(grad, grad_ref) < TOLERANCE, leaf_name


def test_only_final_state_used_and_float64_uses_reference(mode):
    # Gradient through the final state alone (do is None in the backward), with a custom scale.
    case = make_case(seed=2)
    leaves = [case[n].requires_grad_() for n in ("q", "k", "v", "initial_state")]
    _, final_state = lightning_attn(*leaves[:3], case["decay"], 0.25, leaves[3], True)
    grads = torch.autograd.grad(final_state.sum(), leaves, allow_unused=True)
    as64 = [t.detach().double().requires_grad_() for t in leaves]
    _, final_ref = lightning_attn_ref(*as64[:3], case["decay"], 0.25, as64[3], True)
    grads_ref = torch.autograd.grad(final_ref.sum(), as64[1:])
    assert grads[0] is None or grads[0].abs().max() == 0  # q does not reach the final state
    for grad, grad_ref in zip(grads[1:], grads_ref):
        assert relative_rms_error(grad, grad_ref) < TOLERANCE
    # float64 inputs always run the reference and keep a float64 state.
    assert implementation(DEVICE, torch.float64) == "reference"
    o64, final64 = lightning_attn(*as64[:3], case["decay"], 0.25, as64[3], True)
    assert o64.dtype == torch.float64 and final64.dtype == torch.float64
    assert relative_rms_error(final64, final_ref) < 1e-12


@pytest.fixture
def short_segments(monkeypatch):
    """Segments of one 64-token block: on the CPU the plan gives each row a single segment (the
    interpreter gains nothing from more), which would leave the kept states trivially the initial ones."""
    from hccompile.kernels.lightning import segments

    monkeypatch.setattr(segments, "_auto_segment_length", lambda longest, *_: 64)


@pytest.mark.parametrize("initial_state", [True, False])
def test_the_backward_from_the_kept_states_equals_the_recomputing_one(initial_state, short_segments, monkeypatch):
    """The forward keeps its segments' starting states when a gradient will be taken (KEEP_STATES);
    they are lightning_attn_fwd's own, and the backward from them gives the recomputing backward's
    gradients (bit for bit in the interpreter)."""
    if not KERNELS_CAN_RUN:
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 set before Python starts")
    from hccompile.kernels.lightning.chunk import lightning_attn_fwd, saved_states_rows
    from hccompile.lowering import lightning as L

    case = make_case(B=2, T=150, H=2, K=16, V=32, initial_state=initial_state, seed=7)
    names = [n for n in ("q", "k", "v", "initial_state") if case[n] is not None]
    leaves = [case[n].requires_grad_() for n in names]
    h0 = case["initial_state"]
    do = torch.randn(2, 150, 2, 32, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    dht = torch.randn(2, 2, 16, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)

    def gradients(keep):
        monkeypatch.setattr(L, "KEEP_STATES", keep)
        assert L.keeps_states(case["q"], case["k"], case["v"], h0, None) == keep
        o, final_state = lightning_attn(case["q"], case["k"], case["v"], case["decay"], 0.3, h0, True)
        return [o, final_state, *torch.autograd.grad((o, final_state), leaves, (do, dht))]

    kept, recomputed = gradients(True), gradients(False)
    for name, a, b in zip(["o", "final_state", *names], kept, recomputed):
        # the same kernels on the same states; the GPU's compiled variants (the forward's also stores
        # the final state) may round differently in the last bits
        assert torch.equal(a, b) if DEVICE == "cpu" else relative_rms_error(a, b) < 1e-6, name
    # what the op keeps: the forward's states, rows as its fake says, three segments a row
    with torch.no_grad():
        _, _, states = lightning_attn_op(case["q"], case["k"], case["v"], case["decay"], h0, 0.3, True, None, True)
        _, _, saved = lightning_attn_fwd(case["q"], case["k"], case["v"], case["decay"], 0.3, h0, True,
                                         return_states=True)
    assert states.shape == (saved_states_rows(case["q"], case["v"]), 2, 16, 32) == (6, 2, 16, 32)
    assert torch.equal(states, saved.states)
    # no gradient, no states; and the public function asks for none then
    assert not L.keeps_states(case["q"].detach(), case["k"].detach(), case["v"].detach(), None, None)
    with torch.no_grad():
        assert not L.keeps_states(case["q"], case["k"], case["v"], h0, None)


def test_kept_states_of_another_plan_are_recomputed(short_segments):
    """States whose rows the forward's plan does not give (the sweeps' switches changed between a
    forward and its backward, say) are not used: the backward recomputes them."""
    if not KERNELS_CAN_RUN:
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 set before Python starts")
    from hccompile.kernels.lightning.chunk import saved_states

    case = make_case(B=1, T=150, H=2, K=16, V=16, initial_state=False)
    q, v = case["q"], case["v"]
    assert saved_states(q, v, torch.zeros(3, 2, 16, 16, device=DEVICE)).segment == 64
    assert saved_states(q, v, torch.zeros(2, 2, 16, 16, device=DEVICE)) is None
    with torch.no_grad():
        o, _, _ = lightning_attn_op(q, case["k"], v, case["decay"], None, 0.3, False)
        do = torch.randn_like(o)
        want = lightning_attn_backward_op(q, case["k"], v, case["decay"], None, do, None, 0.3)
        got = lightning_attn_backward_op(q, case["k"], v, case["decay"], None, do, None, 0.3, None,
                                         torch.full((2, 2, 16, 16), float("nan"), device=DEVICE))
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)


def test_compile_fullgraph_dynamic_time_compiles_once(mode):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def layer(q, k, v, decay, initial_state):
        o, final_state = lightning_attn(q, k, v, decay, initial_state=initial_state, output_final_state=True)
        return o * 2, final_state

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for T in (17, 40):
        case = make_case(T=T, seed=T)
        names = ("q", "k", "v", "initial_state")
        inputs = [case[n].requires_grad_() for n in names]
        o, final_state = compiled(*inputs[:3], case["decay"], inputs[3])
        o_eager, final_eager = layer(*inputs[:3], case["decay"], inputs[3])
        assert relative_rms_error(o, o_eager) < 1e-6 and relative_rms_error(final_state, final_eager) < 1e-6
        do, dht = torch.randn_like(o), torch.randn_like(final_state)
        grads = torch.autograd.grad((o, final_state), inputs, (do, dht))
        grads_eager = torch.autograd.grad((o_eager, final_eager), inputs, (do, dht))
        for name, grad, grad_eager in zip(names, grads, grads_eager):
            assert relative_rms_error(grad, grad_eager) < 1e-6, name
    assert counter.frame_count == 1


def test_compile_reports_bad_shapes_at_trace_time():
    case = make_case()
    compiled = torch.compile(lightning_attn, backend="eager", fullgraph=True, dynamic=True)
    with pytest.raises(Exception, match=r"decay: expected shape"):
        compiled(case["q"], case["k"], case["v"], torch.zeros(3, device=DEVICE))


def _bad_calls():
    """(description, call taking a fresh case, expected message)."""
    def call(case, **overrides):
        merged = {**case, **overrides}
        return lightning_attn(merged.pop("q"), merged.pop("k"), merged.pop("v"), **merged)

    def randn(*shape):
        return torch.randn(*shape, device=DEVICE)

    return [
        ("q 3-D", lambda c: call(c, q=c["q"][0]), r"q: expected a 4-D"),
        ("k shape", lambda c: call(c, k=c["k"][..., :8]), r"k: "),
        ("v heads", lambda c: call(c, v=c["v"][:, :, :1]), r"v: batch, time, heads"),
        ("k dtype", lambda c: call(c, k=c["k"].half()), r"k: dtype torch.float16 differs"),
        ("int q", lambda c: call(c, q=c["q"].int()), r"q: expected a floating-point"),
        ("decay shape", lambda c: call(c, decay=torch.zeros(3, device=DEVICE)), r"decay: expected shape \(2,\)"),
        ("decay positive", lambda c: call(c, decay=torch.tensor([0.0, 0.5], device=DEVICE)),
         r"decay: log-decays must be <= 0"),
        ("decay not finite", lambda c: call(c, decay=torch.tensor([0.0, float("nan")], device=DEVICE)),
         r"decay: log-decays must be finite"),
        ("decay not a tensor", lambda c: call(c, decay=[0.0, -0.1]), r"decay: expected a torch.Tensor"),
        ("decay int", lambda c: call(c, decay=torch.zeros(2, dtype=torch.int64, device=DEVICE)),
         r"decay: expected a floating-point"),
        ("initial_state shape", lambda c: call(c, initial_state=c["initial_state"][:, :1]),
         r"initial_state: shape"),
        ("head dim", lambda c: lightning_attn(randn(1, 3, 1, 300), randn(1, 3, 1, 300), randn(1, 3, 1, 8)),
         r"q: head dim 300 exceeds the supported maximum 256"),
        ("backward do shape", lambda c: lightning_attn_backward_op(c["q"], c["k"], c["v"], c["decay"], None,
                                                                   c["v"][:, :5], None, 0.3),
         r"do: "),
    ]


@pytest.mark.parametrize("description, call, match", _bad_calls(), ids=[b[0] for b in _bad_calls()])
def test_bad_input_names_argument(description, call, match, monkeypatch):
    if DEVICE != "cpu":  # reading the decay's values synchronises with a GPU: checked when asked
        monkeypatch.setenv("HCCOMPILE_CHECK_GATES", "1")
    with pytest.raises((ValueError, TypeError), match=match):
        call(make_case())


def test_varlen_opcheck_gradients_and_compile(mode):
    """cu_seqlens (FLA's varlen convention) through the ops: opcheck, gradients against each
    sequence run alone, and torch.compile(fullgraph=True) with varlen and initial states."""
    bounds = [0, 7, 7, 19]
    case = make_case(T=19, H=2, K=8, V=8, initial_state=False, seed=4)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    h0 = 0.5 * torch.randn(3, 2, 8, 8, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    args = (case["q"].requires_grad_(), case["k"].requires_grad_(), case["v"].requires_grad_(), case["decay"],
            h0.requires_grad_(), 0.3, True, cu_seqlens)
    torch.library.opcheck(lightning_attn_op, args)

    def layer(q, k, v, decay, initial_state, cu):
        return lightning_attn(q, k, v, decay, 0.3, initial_state, True, cu_seqlens=cu)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    leaves = list(args[:3]) + [h0]
    for fn in (layer, compiled):
        o, final_state = fn(*args[:5], cu_seqlens)
        assert final_state.shape == (3, 2, 8, 8)
        grads = torch.autograd.grad((o, final_state), leaves, (torch.ones_like(o), torch.ones_like(final_state)))
        for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
            alone = [t.detach()[:, bos:eos].double().requires_grad_() for t in args[:3]]
            h0_n = h0.detach()[n:n + 1].double().requires_grad_()
            o_n, f_n = lightning_attn_ref(*alone, case["decay"].double(), 0.3, h0_n, True)
            assert relative_rms_error(o[:, bos:eos], o_n) < TOLERANCE if eos > bos else True
            assert relative_rms_error(final_state[n:n + 1], f_n) < TOLERANCE
            g_n = torch.autograd.grad((o_n, f_n), alone + [h0_n], (torch.ones_like(o_n), torch.ones_like(f_n)))
            for grad, grad_n in zip(grads[:3], g_n[:3]):
                if eos > bos:
                    assert relative_rms_error(grad[:, bos:eos], grad_n) < TOLERANCE
            assert relative_rms_error(grads[3][n:n + 1], g_n[3]) < TOLERANCE


@pytest.mark.gpu
def test_gpu_inductor_code_launches_the_lightning_kernels_directly():
    """Issue 24: on CUDA lightning attention is traced into its kernel launches, so Inductor's
    output code launches our kernels itself (no call through torch.ops.hccompile), the report
    still names one op per direction, and the compiled function matches float64 (several
    segments per row, a decay, initial and final state)."""
    from helpers import Collect, calls_through_hccompile_ops, inductor_step

    case = make_case(B=2, T=300, H=3, K=64, V=64, seed=4)
    names = ("q", "k", "v", "initial_state")
    leaves = {n: case[n].clone().requires_grad_() for n in names}
    be = Collect()
    compiled = torch.compile(lambda q, k, v, h0: lightning_attn(q, k, v, case["decay"], initial_state=h0,
                                                                output_final_state=True),
                             backend=be, fullgraph=True)
    do, dht = torch.randn(2, 300, 3, 64, device=DEVICE), torch.randn(2, 3, 64, 64, device=DEVICE)
    (o, final_state), code = inductor_step(compiled, list(leaves.values()), (do, dht))
    for kernel in ("_segment_summary_kernel", "_segment_prefix_kernel", "_forward_sweep_kernel",
                   "_reverse_sweep_kernel"):
        assert kernel in code, kernel
    assert not calls_through_hccompile_ops(code), calls_through_hccompile_ops(code)[:5]
    assert be.ops("forward") == ["hccompile.lightning_attn.default"], be.ops("forward")
    assert be.ops("backward") == ["hccompile.lightning_attn_backward.default"], be.ops("backward")

    as64 = {n: case[n].detach().double().requires_grad_() for n in names}
    o_ref, final_ref = lightning_attn_ref(as64["q"], as64["k"], as64["v"], case["decay"].double(), 64 ** -0.5,
                                          as64["initial_state"], True)
    torch.autograd.backward((o_ref, final_ref), (do.double(), dht.double()))
    assert relative_rms_error(o, o_ref) < TOLERANCE
    assert relative_rms_error(final_state, final_ref) < TOLERANCE
    for n in names:
        assert relative_rms_error(leaves[n].grad, as64[n].grad) < TOLERANCE, n


def test_decay_values_on_other_devices_are_read_only_when_asked(monkeypatch):
    """Off the CPU, reading the decay synchronises: unchecked unless HCCOMPILE_CHECK_GATES=1, and
    then the op stays a host op under torch.compile, where the values exist (a meta tensor stands
    in for a CUDA one: it has no values, so reading them fails)."""
    from hccompile.kernels.lightning.decay_reference import check_decay_and_state
    from hccompile.lowering import lightning as L

    q, v, decay = torch.empty(1, 4, 2, 8, device="meta"), torch.empty(1, 4, 2, 8, device="meta"), \
        torch.empty(2, device="meta")
    monkeypatch.delenv("HCCOMPILE_CHECK_GATES", raising=False)
    check_decay_and_state(q, v, decay)
    assert L._traceable(cu_seqlens=None)
    monkeypatch.setenv("HCCOMPILE_CHECK_GATES", "1")
    with pytest.raises((RuntimeError, NotImplementedError)):
        check_decay_and_state(q, v, decay)
    assert not L._traceable(cu_seqlens=None)
