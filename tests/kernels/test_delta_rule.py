"""Tests for the delta-rule PyTorch references: the chunked form against the recurrence, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hccompile.kernels.delta_rule import (
    check_delta_rule_inputs,
    chunk_delta_rule_ref,
    kda_gate,
    naive_recurrent_delta_rule,
)


def make_inputs(
    batch, time, key_heads, value_heads, key_dim, value_dim, gate, dtype=torch.float64, seed=0,
    gate_in_kernel=False, initial_state=False, num_sequences=None, decay=1.0,
):
    """FLA-like inputs: unit-norm keys, beta in (0, 1), log-gates <= 0 (scaled by `decay`)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    inputs = {
        "q": randn(batch, time, key_heads, key_dim),
        "k": F.normalize(randn(batch, time, key_heads, key_dim), dim=-1),
        "v": randn(batch, time, value_heads, value_dim),
        "beta": randn(batch, time, value_heads).sigmoid(),
        "g": None,
    }
    if gate == "scalar":
        inputs["g"] = F.logsigmoid(randn(batch, time, value_heads) + 2) * decay
    elif gate == "channel" and not gate_in_kernel:
        inputs["g"] = F.logsigmoid(randn(batch, time, value_heads, key_dim) + 2) * decay
    elif gate == "channel":
        inputs["g"] = randn(batch, time, value_heads, key_dim)
        inputs["A_log"] = randn(value_heads) * 0.5 - 1
        inputs["dt_bias"] = randn(value_heads * key_dim) * 0.5
    if initial_state:
        states = num_sequences if num_sequences is not None else batch
        inputs["initial_state"] = randn(states, value_heads, key_dim, value_dim) * 0.5
    return {name: (t.to(dtype) if name not in ("A_log", "dt_bias", "initial_state") and t is not None else t)
            for name, t in inputs.items()}


# name, (batch, time, H, HV, K, V), gate, options
REFERENCE_CASES = [
    ("plain-T63", (2, 63, 1, 1, 32, 32), "none", {}),
    ("plain-T100-K60-V64", (1, 100, 2, 2, 60, 64), "none", {"initial_state": True}),
    ("gdn-T130-K64-V60", (2, 130, 1, 1, 64, 60), "scalar", {"initial_state": True}),
    ("gdn-T100-gva", (1, 100, 2, 4, 32, 32), "scalar", {"l2norm": True}),
    ("gdn-T63-strong-decay", (1, 63, 1, 2, 32, 60), "scalar", {"decay": 8.0}),
    ("kda-T130-K60-V32", (1, 130, 1, 2, 60, 32), "channel", {"initial_state": True}),
    ("kda-T100-gva-l2norm", (2, 100, 2, 4, 32, 64), "channel", {"l2norm": True}),
    ("kda-T63-strong-decay", (1, 63, 1, 1, 32, 32), "channel", {"decay": 8.0}),
    ("kda-gate-in-kernel", (1, 100, 1, 2, 32, 32), "channel", {"gate_in_kernel": True, "initial_state": True}),
    ("kda-gate-lower-bound", (2, 63, 2, 4, 32, 32), "channel", {"gate_in_kernel": True, "lower_bound": -5.0}),
]


def build_case(sizes, gate, options, dtype=torch.float64, seed=0):
    batch, time, key_heads, value_heads, key_dim, value_dim = sizes
    inputs = make_inputs(
        batch, time, key_heads, value_heads, key_dim, value_dim, gate, dtype=dtype, seed=seed,
        gate_in_kernel=options.get("gate_in_kernel", False), initial_state=options.get("initial_state", False),
        num_sequences=options.get("num_sequences"), decay=options.get("decay", 1.0),
    )
    kwargs = {"gate": gate, "output_final_state": True,
              "use_qk_l2norm_in_kernel": options.get("l2norm", False)}
    if "lower_bound" in options:
        kwargs["lower_bound"] = options["lower_bound"]
    if "cu_seqlens" in options:
        kwargs["cu_seqlens"] = options["cu_seqlens"]
    return inputs, kwargs


def differentiable(inputs):
    return {name: (t.detach().clone().requires_grad_() if t is not None else None) for name, t in inputs.items()}


def call(fn, inputs, kwargs, **extra):
    return fn(**inputs, **kwargs, **extra)


@pytest.mark.parametrize("name, sizes, gate, options", REFERENCE_CASES, ids=[c[0] for c in REFERENCE_CASES])
def test_chunked_reference_matches_recurrence(name, sizes, gate, options):
    inputs, kwargs = build_case(sizes, gate, options)
    inputs = differentiable(inputs)
    o_ref, state_ref = call(naive_recurrent_delta_rule, inputs, kwargs)
    chunk = 16 if sizes[1] == 63 else 64
    o, state = call(chunk_delta_rule_ref, inputs, kwargs, chunk_size=chunk)
    assert o.dtype == torch.float64 and o.shape == o_ref.shape
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, state_ref, rtol=1e-10, atol=1e-10)

    generator = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    dht = torch.randn(state.shape, generator=generator, dtype=torch.float64)
    wrt = [name for name, t in inputs.items() if t is not None]
    grads_ref = torch.autograd.grad((o_ref, state_ref), [inputs[n] for n in wrt], (do, dht))
    grads = torch.autograd.grad((o, state), [inputs[n] for n in wrt], (do, dht))
    for name, grad, grad_ref in zip(wrt, grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_references_handle_variable_length_sequences(gate):
    lengths = [37, 1, 90]
    cu_seqlens = torch.tensor([0, 37, 38, 128], dtype=torch.int32)
    options = {"cu_seqlens": cu_seqlens, "initial_state": True, "num_sequences": 3}
    inputs, kwargs = build_case((1, sum(lengths), 1, 2, 32, 48), gate, options, seed=5)
    inputs = differentiable(inputs)
    o_ref, state_ref = call(naive_recurrent_delta_rule, inputs, kwargs)
    o, state = call(chunk_delta_rule_ref, inputs, kwargs, chunk_size=32)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, state_ref, rtol=1e-10, atol=1e-10)

    # Each sequence alone, from its own initial state, gives the same output and final state.
    for index, (bos, eos) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        alone = {name: (t[:, bos:eos] if name in ("q", "k", "v", "beta", "g") and t is not None else t)
                 for name, t in inputs.items()}
        alone["initial_state"] = inputs["initial_state"][index:index + 1]
        o_alone, state_alone = call(naive_recurrent_delta_rule, alone, {**kwargs, "cu_seqlens": None})
        torch.testing.assert_close(o[:, bos:eos], o_alone, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state[index:index + 1], state_alone, rtol=1e-10, atol=1e-10)

    do = torch.randn(o.shape, dtype=torch.float64)
    wrt = [name for name, t in inputs.items() if t is not None]
    grads_ref = torch.autograd.grad((o_ref, state_ref.sum()), [inputs[n] for n in wrt], (do, None))
    grads = torch.autograd.grad((o, state.sum()), [inputs[n] for n in wrt], (do, None))
    for name, grad, grad_ref in zip(wrt, grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


def test_recurrence_matches_its_definition_for_one_head():
    """The recurrence written out for one token pair, decay applied before the delta correction."""
    inputs = make_inputs(1, 2, 1, 1, 3, 2, "channel", seed=3)
    q, k, v, beta, g = (inputs[n][0, :, 0] for n in ("q", "k", "v", "beta", "g"))
    state = torch.zeros(3, 2, dtype=torch.float64)
    expected = []
    for t in range(2):
        decayed = torch.diag(g[t].exp()) @ state
        state = decayed + beta[t] * torch.outer(k[t], v[t] - decayed.T @ k[t])
        expected.append(state.T @ q[t] * 3**-0.5)
    o, final_state = naive_recurrent_delta_rule(**inputs, output_final_state=True)
    torch.testing.assert_close(o[0, :, 0], torch.stack(expected), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final_state[0, 0], state, rtol=1e-12, atol=1e-12)


def test_kda_gate_formulas():
    g_raw = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    A_log = torch.randn(3, dtype=torch.float64)
    dt_bias = torch.randn(12, dtype=torch.float64)
    x = g_raw + dt_bias.view(3, 4)
    expected = -A_log.exp().view(3, 1) * torch.log1p(x.exp())
    torch.testing.assert_close(kda_gate(g_raw, A_log, dt_bias), expected)
    bounded = kda_gate(g_raw, A_log, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(bounded, -5.0 * torch.sigmoid(A_log.exp().view(3, 1) * x))
    # in (-5, 0) in exact arithmetic; in float64 the sigmoid rounds to 1 once A*x > ~37, so -5 is reached
    assert (bounded < 0).all() and (bounded >= -5).all()
    assert kda_gate(g_raw.float(), A_log.float(), dt_bias.float()).dtype == torch.float32


def test_references_handle_empty_inputs():
    inputs = make_inputs(2, 0, 1, 2, 16, 8, "scalar", initial_state=True)
    for fn in (naive_recurrent_delta_rule, chunk_delta_rule_ref):
        o, state = fn(**inputs, output_final_state=True)
        assert o.shape == (2, 0, 2, 8)
        torch.testing.assert_close(state, inputs["initial_state"])


def test_references_keep_dtypes():
    inputs = make_inputs(1, 20, 1, 1, 16, 8, "scalar", dtype=torch.bfloat16)
    for fn in (naive_recurrent_delta_rule, chunk_delta_rule_ref):
        o, state = fn(**inputs, output_final_state=True)
        assert o.dtype == torch.bfloat16 and state.dtype == torch.float32


def shaped(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


def valid_inputs():
    return {"q": shaped(1, 5, 2, 16), "k": shaped(1, 5, 2, 16), "v": shaped(1, 5, 4, 8), "beta": shaped(1, 5, 4)}


INVALID_INPUT_CASES = [
    ({"q": shaped(5, 2, 16)}, ValueError, r"q: expected a 4-D tensor"),
    ({"q": [[0.0]]}, TypeError, r"q: expected a torch.Tensor"),
    ({"k": shaped(1, 5, 2, 32)}, ValueError, r"k: shape \(1, 5, 2, 32\) differs from q's shape"),
    ({"v": shaped(1, 5, 3, 8), "beta": shaped(1, 5, 3)}, ValueError, r"v: heads HV=3 must be a multiple of q's H=2"),
    ({"v": shaped(1, 6, 4, 8)}, ValueError, r"v: batch, time \(1, 6\) differ from q's \(1, 5\)"),
    ({"beta": shaped(1, 5, 2)}, ValueError, r"beta: shape \(1, 5, 2\) differs from the expected \(1, 5, 4\)"),
    ({"v": shaped(1, 5, 4, 8, dtype=torch.int32)}, TypeError, r"v: expected a floating-point tensor"),
    ({"g": shaped(1, 5, 4, 8)}, ValueError, r'g: shape \(1, 5, 4, 8\) differs from the expected \(1, 5, 4, 16\)'),
    ({"gate": "scalar"}, ValueError, r'g: required for gate="scalar"'),
    ({"gate": "vector"}, ValueError, r"gate: expected one of"),
    ({"gate": "none", "g": shaped(1, 5, 4)}, ValueError, r'g: must be None for gate="none"'),
    ({"cu_seqlens": torch.tensor([0, 5])}, ValueError, r"cu_seqlens: requires B == 1, got B=2"),
    ({"cu_seqlens": torch.tensor([0, 3])}, ValueError, r"cu_seqlens: must end at T=5, got 3"),
    ({"cu_seqlens": torch.tensor([0, 4, 3, 5])}, ValueError, r"cu_seqlens: must be non-decreasing"),
    ({"cu_seqlens": torch.tensor([0.0, 5.0])}, TypeError, r"cu_seqlens: expected dtype int32 or int64"),
    ({"initial_state": shaped(1, 4, 16, 9)}, ValueError,
     r"initial_state: shape \(1, 4, 16, 9\) differs from the expected \(1, 4, 16, 8\)"),
    ({"g": shaped(1, 5, 4), "A_log": shaped(4), "dt_bias": shaped(64)}, ValueError,
     r'A_log: the in-kernel gate needs gate="channel"'),
    ({"g": shaped(1, 5, 4, 16), "A_log": shaped(4)}, ValueError, r"A_log: the in-kernel gate needs both"),
    ({"g": shaped(1, 5, 4, 16), "A_log": shaped(4), "dt_bias": shaped(63)}, ValueError,
     r"dt_bias: shape \(63,\) differs from the expected \(64,\)"),
    ({"g": shaped(1, 5, 4, 16), "A_log": shaped(4), "dt_bias": shaped(64), "lower_bound": 1.0}, ValueError,
     r"lower_bound: must be negative"),
    ({"g": shaped(1, 5, 4, 16), "lower_bound": -5.0}, ValueError, r"lower_bound: only used by the in-kernel gate"),
]


@pytest.mark.parametrize("changes, error, pattern", INVALID_INPUT_CASES)
def test_input_checks_name_the_argument(changes, error, pattern):
    named = {**valid_inputs(), **changes}
    if "cu_seqlens" in changes and "requires B" in pattern:
        named = {n: (torch.cat([t, t]) if n in ("q", "k", "v", "beta") else t) for n, t in named.items()}
    with pytest.raises(error, match=pattern):
        check_delta_rule_inputs(**named)
    with pytest.raises(error, match=pattern):
        naive_recurrent_delta_rule(**named)
