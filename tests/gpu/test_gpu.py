"""GPU checks (marker `gpu`): the Triton kernels natively, and the whole pipeline on CUDA."""
import pytest
import torch

import hccompile
from hccompile.kernels.lightning import (causal_linear_attn_bwd, causal_linear_attn_fwd,
                                         causal_linear_attn_ref)
from hccompile.lowering.linear_attn import causal_linear_attn_backward_op, causal_linear_attn_op
from helpers import Collect, fwd_bwd, rel_err

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T,H,K,V", [(2, 63, 3, 64, 64), (1, 100, 2, 60, 100), (2, 130, 4, 128, 128),
                                       (1, 257, 2, 256, 256), (3, 2048, 4, 64, 128), (1, 1, 1, 16, 16)])
def test_kernels_vs_fp64_reference(dtype, B, T, H, K, V):
    g = torch.Generator(device=DEV).manual_seed(T + K)
    q, k, v = (torch.randn(B, T, H, d, device=DEV, generator=g).to(dtype) for d in (K, K, V))
    do = torch.randn(B, T, H, V, device=DEV, generator=g).to(dtype)
    scale = K ** -0.5
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = causal_linear_attn_ref(q64, k64, v64, scale)
    refs = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    out = torch.full((B, T, H, V), float("nan"), device=DEV, dtype=dtype)
    out = causal_linear_attn_fwd(q, k, v, scale, out=out)
    grads = causal_linear_attn_bwd(q, k, v, do, scale)
    tol_o, tol_g = (1e-4, 1e-4) if dtype == torch.float32 else (5e-3, 8e-3)
    assert rel_err(out, ref) < tol_o
    for gk, gr in zip(grads, refs):
        assert rel_err(gk, gr) < tol_g


def test_opcheck_cuda():
    q, k, v = (torch.randn(1, 70, 2, 32, device=DEV, requires_grad=True) for _ in range(3))
    torch.library.opcheck(causal_linear_attn_op, (q, k, v, 0.5))
    do = torch.randn(1, 70, 2, 32, device=DEV)
    torch.library.opcheck(causal_linear_attn_backward_op, (q.detach(), k.detach(), v.detach(), do, 0.5))


def test_model_compiled_on_cuda_bf16_matches_eager():
    from hccompile.nn import TinyLinearTransformer

    torch.manual_seed(0)
    for layout in ("bhtd", "bthd"):
        torch._dynamo.reset()
        m = TinyLinearTransformer(dim=128, num_heads=2, layers=2, layout=layout).to(DEV, torch.bfloat16)
        x = torch.randn(2, 300, 128, device=DEV, dtype=torch.bfloat16)
        be = Collect(force_disable_caches=True)
        out, (gx,) = fwd_bwd(torch.compile(m, backend=be, fullgraph=True), x)
        m32 = m.float()
        ref, (rx,) = fwd_bwd(m32, x.float())
        m.to(torch.bfloat16)
        assert len(be.matches) == 2, be.refusals
        assert be.ops("forward").count("hccompile.lightning_attn.default") == 2
        assert be.ops("backward").count("hccompile.lightning_attn_backward.default") == 2
        assert rel_err(out, ref) < 2e-2 and rel_err(gx, rx) < 5e-2


def test_dynamic_sequence_length_on_cuda():
    def f(q, k, v):
        return torch.tril(q @ k.transpose(-2, -1) * 0.125) @ v

    be = Collect()
    cf = torch.compile(f, backend=be, fullgraph=True, dynamic=True)
    for T in (65, 128, 1000):
        q, k, v = (torch.randn(2, 4, T, 64, device=DEV) for _ in range(3))
        out, grads = fwd_bwd(cf, q, k, v)
        ref, rgrads = fwd_bwd(f, q.double(), k.double(), v.double())
        assert rel_err(out, ref) < 1e-4
        assert all(rel_err(a, b) < 1e-4 for a, b in zip(grads, rgrads))
    assert len(be.reports) == 1


def test_public_op_cuda():
    q, k, v = (torch.randn(2, 99, 3, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    out = hccompile.causal_linear_attn(q, k, v)
    assert rel_err(out, causal_linear_attn_ref(q.double(), k.double(), v.double(), 0.125)) < 5e-3
