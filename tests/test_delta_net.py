"""GatedDeltaNet and KimiDeltaAttention: the plain-PyTorch forms compute the delta rule (against
the float64 token recurrence of the kernel package), mode="plain" and mode="op" agree (outputs and
gradients, same parameters), and torch.compile(backend="hc") lowers the plain layers to the op."""
import pytest
import torch

import hccompile.passes.delta_rule  # noqa: F401  (registers the pass now)
from helpers import Collect, fwd_bwd, rel_err
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


@pytest.mark.parametrize("cls", [GatedDeltaNet, KimiDeltaAttention], ids=["gdn", "kda"])
def test_compiled_plain_layer_is_lowered(cls, reference_op):
    plain, _ = _layers(cls, num_v_heads=4, head_v_dim=8)
    x = torch.randn(2, 21, 32)
    be = Collect(compiler="aot_eager")
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
    be = Collect(compiler="aot_eager")
    out = torch.compile(model, backend=be, fullgraph=True)(tokens)
    assert len(_delta_rule_matches(be)) == 2 and not be.refusals
    assert [m['kernel'] for m in be.matches if m['pattern'] == 'depthwise_conv1d'] == [4] * 6  # q, k, v per layer
    assert rel_err(out, model(tokens)) < 1e-5


def test_bf16_layer_lowered(reference_op):
    plain, _ = _layers(GatedDeltaNet)
    plain = plain.to(torch.bfloat16)
    x = torch.randn(1, 17, 32, dtype=torch.bfloat16)
    be = Collect(compiler="aot_eager")
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
