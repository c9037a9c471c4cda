"""KDA's in-kernel gate backward (gate_cumsum.py's _gate_backward_kernel) inside a KDA fwd+bwd with the
gate in the kernel (FLA's initialisation), on the GPU: its GPU time (profiler) over its key tile and
warps (GATE_BACKWARD_BLOCK_K / _WARPS), each setting's g, A_log and dt_bias gradients against the
defaults' (issue 20). Session 47's first form took 0.553 ms at B1 T32768 H16 K128 on the H200, its
bytes ~0.13.

    python benchmarks/analysis/gate_backward_variants.py [--shape B1T32768H16D128]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from _profile import profile_step  # noqa: E402
from delta_rule import kda_gate_parameters  # noqa: E402
from profile_ops import parse_shape  # noqa: E402

import hccompile  # noqa: E402
from hccompile.kernels.delta_rule import gate_cumsum  # noqa: E402

# (BK, warps); the first is the defaults'
SETTINGS = [(gate_cumsum.GATE_BACKWARD_BLOCK_K, gate_cumsum.GATE_BACKWARD_WARPS), (32, 2), (32, 8), (16, 4), (16, 8),
            (64, 4), (64, 8)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="B1T32768H16D128")
    args = p.parse_args()
    s = parse_shape(args.shape)
    B, T, H, D = s["B"], s["T"], s["H"], s["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").bfloat16().requires_grad_()

    q, k, v, g = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
    beta = torch.rand(B, T, H, generator=gen, device="cuda").bfloat16().requires_grad_()
    A_log, dt_bias = (t.requires_grad_() for t in kda_gate_parameters(H, D, gen))
    do = torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16()
    leaves = (q, k, v, g, beta, A_log, dt_bias)

    def step():
        for leaf in leaves:
            leaf.grad = None
        o = hccompile.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                A_log=A_log, dt_bias=dt_bias)[0]
        o.backward(do)

    saved = (gate_cumsum.GATE_BACKWARD_BLOCK_K, gate_cumsum.GATE_BACKWARD_WARPS)
    reference = None
    for setting in SETTINGS:
        gate_cumsum.GATE_BACKWARD_BLOCK_K, gate_cumsum.GATE_BACKWARD_WARPS = setting
        try:
            step()
            torch.cuda.synchronize()
            grads = [g.grad.clone(), A_log.grad.clone(), dt_bias.grad.clone()]
            _, summary = profile_step(step, steps=5, top=40)
        finally:
            gate_cumsum.GATE_BACKWARD_BLOCK_K, gate_cumsum.GATE_BACKWARD_WARPS = saved
        kernel_ms = sum(row["ms"] for row in summary["top"] if "_gate_backward_kernel" in row["kernel"])
        note = ""
        if reference is None:
            reference = grads
        else:
            dg_equal = torch.equal(grads[0], reference[0])
            rel = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads[1:], reference[1:])]
            note = f"  dg {'equal' if dg_equal else 'DIFFERS'}, dA_log {rel[0]:.1e}, dt_bias {rel[1]:.1e}"
        print(f"{args.shape} BK {setting[0]:3d} warps {setting[1]:2d}: gate_backward "
              f"{kernel_ms:.3f} ms, step GPU {summary['gpu_busy_ms']:.3f} ms{note}", flush=True)


if __name__ == "__main__":
    main()
