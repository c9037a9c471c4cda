"""No host synchronisation in a warm eager forward+backward of lightning, GDN and KDA (GPU only: torch's sync
debug mode watches CUDA calls). A synchronising call (a blocking copy, .item(), nonzero, a stream or device
synchronize) raises in "error" mode, in the backward's device thread too.

Fixed-length rows; and a varlen batch whose cu_seqlens tensor is the one the warm-up saw: the ops read a
varlen batch's offsets on the host once per tensor (cached), so a new cu_seqlens tensor costs one read.
Measured the same way on one H200 before this test (benchmarks/analysis/sync_check.py, f2963c9): no
synchronisation in any of the six.
"""
import pytest
import torch

import hccompile
from hccompile.lowering.lightning import alibi_decay

pytestmark = pytest.mark.gpu
DEV = "cuda"


def warm_step(op: str, varlen: bool):
    """One fwd+bwd of `op` on fixed inputs, run twice (compiles, cached host reads), returned for a third run."""
    B, T, H, D = (1, 300, 2, 64) if varlen else (2, 200, 2, 64)
    cu = torch.tensor([0, 130, 300], device=DEV, dtype=torch.int32) if varlen else None
    g = torch.Generator(device=DEV).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=DEV, generator=g).bfloat16()

    q, k, v, do = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
    if op == "lightning":
        decay = alibi_decay(H, device=DEV)
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def call():
            return hccompile.lightning_attn(q, k, v, decay, cu_seqlens=cu)[0]
    else:
        beta = torch.rand(B, T, H, device=DEV, generator=g).bfloat16()
        gate = torch.nn.functional.logsigmoid(torch.randn(B, T, H, *(() if op == "gdn" else (D,)), device=DEV,
                                                          generator=g))
        leaves = [t.requires_grad_() for t in (q, k, v, beta, gate)]
        f = hccompile.chunk_gated_delta_rule if op == "gdn" else hccompile.chunk_kda

        def call():
            return f(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]

    def step():
        for t in leaves:
            t.grad = None
        call().backward(do)

    step()
    step()
    torch.cuda.synchronize()
    return step, leaves


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("op", ["lightning", "gdn", "kda"])
def test_warm_fwd_bwd_never_waits_for_the_gpu(op, varlen):
    step, leaves = warm_step(op, varlen)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # the step ran: every leaf has a finite gradient
    for t in leaves:
        assert t.grad is not None and torch.isfinite(t.grad.float()).all()
