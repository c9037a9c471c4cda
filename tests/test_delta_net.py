"""GatedDeltaNet and KimiDeltaAttention: the plain-PyTorch forms compute the delta rule (against
the float64 token recurrence of the kernel package), mode="plain" and mode="op" agree (outputs and
gradients, same parameters), and torch.compile(backend="hc") lowers the plain layers to the op: by
default through the substitutes (hccompile.substitutes: the chunked functions traced as the op, one
graph for every length), with substitutes disabled through the delta_rule pass on the unrolled loop."""
import pytest
import torch

import hccompile.passes.delta_rule  # noqa: F401  (registers the pass now)
from helpers import Collect, fwd_bwd, rel_err
from hccompile import substitutes
from hccompile.kernels.delta_rule import naive_recurrent_delta_rule
from hccompile.nn.delta_net import (GatedDeltaNet, KimiDeltaAttention, TinyDeltaNetModel, plain_chunk_gated_delta_rule,
                                    plain_chunk_kda, plain_recurrent_delta_rule)


@pytest.fixture
def reference_op(monkeypatch):
    """The op's plain-PyTorch fallback instead of interpreted kernels (CPU only): KDA's kernels take
    minutes in the Triton interpreter; tests/test_delta_rule_ops.py checks them."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def _case(gate, B=2, T=23, H=1, HV=2, K=16, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    g = None if gate == "none" else -0.4 * torch.rand((B, T, HV) if gate == "scalar" else (B, T, HV, K), generator=gen,
                                                      dtype=torch.float64)
    h0 = torch.randn(B, HV, K, V, generator=gen, dtype=torch.float64)
    return q, k, v, beta, g, h0


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_plain_forms_compute_the_delta_rule(gate, form):
    q, k, v, beta, g, h0 = _case(gate)
    ref, ref_state = naive_recurrent_delta_rule(q, k, v, beta, g, gate=gate, scale=0.3, initial_state=h0,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    if form == "recurrent":
        o, state = plain_recurrent_delta_rule(q, k, v, beta, g, scale=0.3, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm=True)
    elif gate == "channel":
        o, state = plain_chunk_kda(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm=True, chunk_size=8)
    else:
        o, state = plain_chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm=True, chunk_size=8)
    # the plain forms compute in float32
    assert o.dtype == torch.float64 and state.dtype == torch.float32
    assert rel_err(o, ref) < 1e-5 and rel_err(state, ref_state) < 1e-5


def _layers(cls, **kw):
    torch.manual_seed(0)
    plain = cls(hidden_size=32, num_heads=2, head_dim=16, mode="plain", chunk_size=8, **kw)
    op = cls(hidden_size=32, num_heads=2, head_dim=16, mode="op", chunk_size=8, **kw)
    op.load_state_dict(plain.state_dict())
    return plain, op


@pytest.mark.parametrize("cls", [GatedDeltaNet, KimiDeltaAttention], ids=["gdn", "kda"])
def test_plain_and_op_modes_agree(cls, reference_op):
    plain, op = _layers(cls, num_v_heads=4, head_v_dim=8)
    x = torch.randn(2, 19, 32)
    h0 = torch.randn(2, 4, 16, 8) * 0.1

    def run(layer):
        def f(x, h0):
            o, state = layer(x, initial_state=h0, output_final_state=True)
            return torch.cat([o.flatten(), state.flatten()])
        return f

    out, grads = fwd_bwd(run(plain), x, h0)
    ref, ref_grads = fwd_bwd(run(op), x, h0)
    assert rel_err(out, ref) < 1e-5
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(grads, ref_grads))
    params = [p for p in plain.parameters()]
    gp = torch.autograd.grad(run(plain)(x, h0).sum(), params)
    go = torch.autograd.grad(run(op)(x, h0).sum(), list(op.parameters()))
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(gp, go))


def test_gdn_op_mode_runs_the_kernels():
    """mode="op" on the Triton kernels (interpreted on CPU) against the plain layer."""
    plain, op = _layers(GatedDeltaNet)
    x = torch.randn(1, 20, 32)
    out, (gx,) = fwd_bwd(op, x)
    ref, (rx,) = fwd_bwd(plain, x)
    assert rel_err(out, ref) < 2e-3 and rel_err(gx, rx) < 2e-3


def _delta_rule_matches(be):
    # the layers' short convolutions are matches too (depthwise_conv, as shifted sums)
    return [m for m in be.matches if m["pattern"] == "delta_rule"]


def PassCollect(**options):
    """hc with the substitutions off: the plain chunked forms reach the delta_rule pass as written."""
    return Collect(disable_passes=("substitutes",), **options)


@pytest.mark.parametrize("cls", [GatedDeltaNet, KimiDeltaAttention], ids=["gdn", "kda"])
def test_compiled_plain_layer_is_lowered(cls, reference_op):
    plain, _ = _layers(cls, num_v_heads=4, head_v_dim=8)
    x = torch.randn(2, 21, 32)
    be = PassCollect(compiler="aot_eager")
    out, (gx,) = fwd_bwd(torch.compile(plain, backend=be, fullgraph=True), x)
    ref, (rx,) = fwd_bwd(plain, x)
    (m,) = _delta_rule_matches(be)
    assert m["gate"] == ("scalar" if cls is GatedDeltaNet else "channel")
    assert m["grouped_heads"] and m["use_qk_l2norm_in_kernel"] and m["scale"] == pytest.approx(16 ** -0.5)
    assert not be.refusals
    assert rel_err(out, ref) < 1e-5 and rel_err(gx, rx) < 1e-5


def test_tiny_model_two_layers_two_matches(reference_op):
    torch.manual_seed(0)
    model = TinyDeltaNetModel(vocab=64, hidden_size=32, layers=2, num_heads=2, head_dim=16, chunk_size=8)
    tokens = torch.randint(0, 64, (1, 18))
    be = PassCollect(compiler="aot_eager")
    out = torch.compile(model, backend=be, fullgraph=True)(tokens)
    assert len(_delta_rule_matches(be)) == 2 and not be.refusals
    assert [m['kernel'] for m in be.matches if m['pattern'] == 'depthwise_conv1d'] == [4] * 6  # q, k, v per layer
    assert rel_err(out, model(tokens)) < 1e-5


def test_bf16_layer_lowered(reference_op):
    plain, _ = _layers(GatedDeltaNet)
    plain = plain.to(torch.bfloat16)
    x = torch.randn(1, 17, 32, dtype=torch.bfloat16)
    be = PassCollect(compiler="aot_eager")
    out = torch.compile(plain, backend=be, fullgraph=True)(x)
    assert len(_delta_rule_matches(be)) == 1, be.refusals
    assert out.dtype == torch.bfloat16 and rel_err(out, plain(x)) < 2e-2


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=2, num_v_heads=3), "num_v_heads: must be a multiple of num_heads"),
    (dict(mode="fast"), "mode: expected one of"),
    (dict(head_dim=0), "head_dim: expected a positive int"),
    (dict(chunk_size=1), "chunk_size: expected an int >= 2"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatedDeltaNet(hidden_size=32, **kwargs)


def test_bad_input_shapes():
    layer = GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"x: expected \[batch, time, 32\]"):
        layer(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="initial_state: expected shape"):
        layer(torch.randn(2, 5, 32), initial_state=torch.zeros(2, 2, 16, 8))


# --- the substitutes: one graph for every length ----------------------------------------------------
OP = "hccompile.chunk_delta_rule.default"
OP_BWD = "hccompile.chunk_delta_rule_backward.default"
CLIENTS = {GatedDeltaNet: "hccompile.nn.delta_net.plain_chunk_gated_delta_rule",
           KimiDeltaAttention: "hccompile.nn.delta_net.plain_chunk_kda"}
LENGTHS = (19, 27, 41)  # chunk_size 8: three, four and six chunks, the last one partial


def _out_and_grads(layer, x, w):
    leaves = [x] + list(layer.parameters())
    out = layer(x)
    return out.detach(), torch.autograd.grad((out * w).sum(), leaves)


@pytest.mark.parametrize("cls", [GatedDeltaNet, KimiDeltaAttention], ids=["gdn", "kda"])
def test_plain_layer_is_one_graph_for_every_length(cls, reference_op):
    """dynamic=True at three lengths: one graph (the unrolled chunk loop would pin the length: three),
    the chunked function traced as the op in forward and backward (Inductor), outputs and every
    gradient as the plain layer's."""
    torch._dynamo.reset()
    plain, _ = _layers(cls, num_v_heads=4, head_v_dim=8)
    be = Collect(force_disable_caches=True)
    compiled = torch.compile(plain, backend=be, fullgraph=True, dynamic=True)
    for T in LENGTHS:
        gen = torch.Generator().manual_seed(T)
        x = torch.randn(1, T, 32, generator=gen).requires_grad_(True)
        w = torch.randn(1, T, 32, generator=gen)
        out, grads = _out_and_grads(compiled, x, w)
        ref, ref_grads = _out_and_grads(plain, x, w)
        assert rel_err(out, ref) < 1e-5, T
        for (name, _), a, b in zip([("x", None)] + list(plain.named_parameters()), grads, ref_grads):
            assert rel_err(a, b) < 1e-4, (T, name)
    assert len(be.reports) == 1, f"{len(be.reports)} graphs for lengths {LENGTHS}"
    report = be.reports[0]
    (m,) = [m for m in report.matches if m["pattern"] == "substitute"]
    assert m["client"] == CLIENTS[cls] and m["probe_error"] < substitutes.PROBE_TOLERANCE
    assert not _delta_rule_matches(be)  # the loop never reached the pass
    assert OP in report.lowered_ops["forward"] and OP_BWD in report.lowered_ops["backward"], report.lowered_ops
    assert not report.fallback and not report.refusals


def _ungated_with_state(q, k, v, beta, h0):
    o, state = plain_chunk_gated_delta_rule(q, k, v, None, beta, scale=0.3, initial_state=h0, output_final_state=True,
                                            chunk_size=8)
    return torch.cat([o.flatten(), state.flatten()])


def test_plain_function_without_gate_with_states_is_substituted(reference_op):
    """g=None (the delta rule, op chunk_delta_rule), a scale, an initial and a final state: one graph
    at three lengths, outputs, final state and every input's gradient as the plain function's."""
    torch._dynamo.reset()
    be = Collect(compiler="aot_eager")
    compiled = torch.compile(_ungated_with_state, backend=be, fullgraph=True, dynamic=True)
    for T in LENGTHS:
        q, k, v, beta, _, h0 = (None if t is None else t.float() for t in _case("none", B=1, T=T, seed=T))
        out, grads = fwd_bwd(compiled, q, k, v, beta, h0)
        ref, ref_grads = fwd_bwd(_ungated_with_state, q, k, v, beta, h0)
        assert rel_err(out, ref) < 1e-5 and all(rel_err(a, b) < 1e-5 for a, b in zip(grads, ref_grads)), T
    assert len(be.reports) == 1
    (m,) = be.matches
    assert m["pattern"] == "substitute" and m["config"] == [1, 2, 16, 8, 8, False, True, "none", 0.3]  # H, HV, K, V, chunk, l2norm, h0, gate, scale


def _tensor_scale(q, k, v, beta, g):
    return plain_chunk_gated_delta_rule(q, k, v, g, beta, scale=torch.tensor(0.3), chunk_size=8)[0]


def test_tensor_scale_is_refused_with_the_reason_and_traced_as_written(reference_op):
    q, k, v, beta, g, _ = (t.float() for t in _case("scalar", B=1, T=19))
    be = Collect(compiler="aot_eager")
    out = torch.compile(_tensor_scale, backend=be, fullgraph=True)(q, k, v, beta, g)
    refused = [r for r in be.refusals if r["pattern"] == "substitute"]
    assert len(refused) == 1 and "scale is not a Python number" in refused[0]["reason"], be.refusals
    assert refused[0]["client"] == CLIENTS[GatedDeltaNet]
    assert not [m for m in be.matches if m["pattern"] == "substitute"]
    assert rel_err(out, _tensor_scale(q, k, v, beta, g)) < 1e-5


def test_substitutes_disabled_leaves_the_unrolled_loop_to_the_pass(reference_op):
    """The same layer with disable_passes=("substitutes",): the length is pinned again (two lengths,
    two graphs), each lowered by the delta_rule pass."""
    torch._dynamo.reset()
    plain, _ = _layers(GatedDeltaNet)
    be = PassCollect(compiler="aot_eager")
    compiled = torch.compile(plain, backend=be, fullgraph=True, dynamic=True)
    for T in LENGTHS[:2]:
        x = torch.randn(1, T, 32)
        assert rel_err(compiled(x), plain(x)) < 1e-5
    assert len(be.reports) == 2 and len(_delta_rule_matches(be)) == 2
    assert not [m for m in be.matches if m["pattern"] == "substitute"]


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_the_probe_tells_a_different_function_apart(per_channel):
    """The nn clients' probe: the plain form itself passes, one whose output is off by 1e-3 does not."""
    from hccompile.substitutes.clients import _nn_probe

    plain = plain_chunk_kda if per_channel else plain_chunk_gated_delta_rule

    def off(*args, **kwargs):
        o, state = plain(*args, **kwargs)
        return o * (1 + 1e-3), state

    config = (1, 2, 16, 8, 8, True, True, "channel" if per_channel else "scalar", None)
    assert _nn_probe(per_channel)(plain, *config) < substitutes.PROBE_TOLERANCE
    assert _nn_probe(per_channel)(off, *config) > substitutes.PROBE_TOLERANCE
