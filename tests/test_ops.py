"""The custom-op plumbing: schema, fake, autograd, opcheck; errors; direct use under compile."""
import os

import pytest
import torch

import hccompile
from hccompile.lowering.linear_attn import (causal_linear_attn_backward_op, causal_linear_attn_op,
                                            implementation)
from helpers import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(B=1, T=19, H=2, K=16, V=8, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(T * 31 + K)
    return [torch.randn(B, T, H, d, generator=g, dtype=dtype).to(DEVICE).requires_grad_(grad)
            for d in (K, K, V)]


def _ref(q, k, v, scale):
    from hccompile.kernels.lightning import causal_linear_attn_ref

    return causal_linear_attn_ref(q.double(), k.double(), v.double(), scale)


@pytest.mark.parametrize("T", [1, 19, 70])
def test_opcheck_forward_and_backward(T):
    q, k, v = _qkv(T=T, grad=True)
    torch.library.opcheck(causal_linear_attn_op, (q, k, v, 0.5))
    do = torch.randn(q.shape[:3] + (v.shape[-1],), device=DEVICE)
    torch.library.opcheck(causal_linear_attn_backward_op, (q.detach(), k.detach(), v.detach(), do, 0.5))


def test_public_function_default_scale_and_gradients():
    q, k, v = _qkv(grad=True)
    out = hccompile.causal_linear_attn(q, k, v)
    ref = _ref(q, k, v, q.shape[-1] ** -0.5)
    assert rel_err(out, ref) < 1e-5
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), do)
    gr = torch.autograd.grad(ref, (q, k, v), do.double())
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(g, gr))


def test_reference_fallback_without_interpreter(monkeypatch):
    """CPU without TRITON_INTERPRET runs the documented reference path, same answer."""
    if DEVICE != "cpu":
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert implementation("cpu") == "reference"
    q, k, v = _qkv(T=70, grad=True)
    out = causal_linear_attn_op(q, k, v, 0.3)
    assert rel_err(out, _ref(q, k, v, 0.3)) < 1e-5
    assert implementation("cpu", torch.float64) == "reference"


def test_interpreter_selected_when_set():
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    assert implementation(DEVICE) in ("triton", "triton-interpreter")


def test_direct_op_under_fullgraph_dynamic_compile():
    calls = []

    def f(q, k, v):
        return hccompile.causal_linear_attn(q, k, v, scale=0.5).sum(-1)

    def counting(gm, ex):
        calls.append(1)
        return gm.forward

    cf = torch.compile(f, backend=counting, fullgraph=True, dynamic=True)
    for T in (5, 33, 64):
        q, k, v = _qkv(T=T)
        torch.testing.assert_close(cf(q, k, v), _ref(q, k, v, 0.5).sum(-1).float(), rtol=1e-4, atol=1e-4)
    assert len(calls) == 1


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v: (q[0], k, v), "q: expected a 4-D"),
    (lambda q, k, v: (q, k[..., :8], v), "k: shape"),
    (lambda q, k, v: (q, k, v[:, :5]), "v: leading dims"),
    (lambda q, k, v: (q, k.half(), v), "k: dtype torch.float16 differs"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), "q: dtype torch.int32 is not supported"),
    (lambda q, k, v: (torch.randn(1, 3, 1, 300, device=DEVICE), torch.randn(1, 3, 1, 300, device=DEVICE),
                      v[:, :3, :1]),
     "head dim 300 exceeds the supported maximum 256"),
])
def test_bad_input_names_argument(bad, match):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match=match):
        causal_linear_attn_op(*bad(q, k, v), 1.0)


def test_limit_errors_under_dynamic_shapes_show_the_size_not_only_its_symbol():
    """Under dynamic=True a head dim is a symbol (s77); the error says its value and which size it is
    (lowering/_symbols.py; issue 21, item 5)."""
    def f(q, k, v, g, beta):
        return hccompile.chunk_gated_delta_rule(q, k, v, g, beta)[0]

    q, k = torch.randn(1, 20, 2, 300), torch.randn(1, 20, 2, 300)
    v, g, beta = torch.randn(1, 20, 2, 16), -torch.rand(1, 20, 2), torch.rand(1, 20, 2)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"q: head dim 300 exceeds the supported maximum 256 \(under torch.compile "
                                        r"sizes are symbols: q\.shape\[3\] is s\d+ = 300 in this call\)"):
        torch.compile(f, backend="hc", dynamic=True, fullgraph=True)(q, k, v, g, beta)
