"""How close the delta rule's in-kernel l2norm (kernels/delta_rule/qk_l2norm.py) runs to the copy bandwidth
(issue 20): at B4 T4096 H16 D128 it took 0.062 ms forward and 0.124 ms backward for q and k (H200, session 41's
delta-profile), 0.186 of GDN's 1.96 ms busy (0.368 of 4.67 at B1). Counted in bytes (session 46) that is already
near the H200's copy bandwidth: the forward reads q and k and writes their bf16 rows, 4 x 67 MB in 0.062 ms = 4.3
TB/s; the backward reads q, k and the fp32 dq, dk sums and writes dq, dk, 537 MB in 0.124 ms = 4.3 TB/s. (The
1.1 TB/s this docstring said before counted elements, not bytes.) Only fewer bytes can make it faster: half
key gradients (a third less in the backward), or the norm folded into the kernels that read q and k. The
launch options changed the step by under 1 % on the H100 (BENCHMARKS.md, run 12): this times the kernel alone.

For each shape: a clone of the same bytes (the copy floor), our forward and backward at the defaults and at
other rows per program and warps, a plain flat-row forward kernel defined here (the comparison), and Inductor's
compiled l2norm of q and k (x / sqrt(sum x^2 + 1e-6), fp32
math) forward and backward, as GB/s of the bytes each reads and writes once. bf16 inputs; the normed rows in
the plan's dtype, their gradients as the backward receives them (dq_sum, dk_sum).

    python benchmarks/analysis/l2norm_bandwidth.py [--shapes B4T4096H16D128,B1T32768H16D128]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import bthd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hccompile.kernels.delta_rule import qk_l2norm  # noqa: E402
from hccompile.kernels.delta_rule.plan import normed_qk_dtype_for  # noqa: E402
from hccompile.kernels._triton import tl, triton  # noqa: E402


# A plain comparison kernel (not hccompile's): contiguous rows of one tensor, flat offsets (no batch / token /
# head arithmetic), the head dim a compile-time constant, one tensor per launch. If it runs much nearer the copy
# than ours, the difference is in those choices.
@triton.jit
def _flat_l2norm_forward(x_ptr, y_ptr, n_rows, D: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, D)
    offsets = rows[:, None].to(tl.int64) * D + cols[None, :]
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def flat_forward(q, k, qn, kn, rows: int, warps: int):
    n_rows = q.numel() // q.shape[-1]
    for x, y in ((q, qn), (k, kn)):
        _flat_l2norm_forward[(triton.cdiv(n_rows, rows),)](x, y, n_rows, D=q.shape[-1], BR=rows, num_warps=warps)


def gbps(nbytes: int, ms: float) -> str:
    return f"{ms * 1e3:7.1f} us  {nbytes / ms / 1e6:7.0f} GB/s"


def main() -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="B4T4096H16D128,B1T32768H16D128")
    p.add_argument("--rows", default="16,32,64,128")
    p.add_argument("--warps", default="2,4,8")
    a = p.parse_args()
    for shape in a.shapes.split(","):
        B, T, H, D = bthd(shape)
        q, k = (torch.randn(B, T, H, D, device="cuda").bfloat16() for _ in range(2))
        normed = normed_qk_dtype_for(q.dtype)
        # the backward's incoming gradients: fp32 sums of the key heads, or half (plan.half_key_gradients)
        dqn, dkn = (torch.randn(B, T, H, D, device="cuda") for _ in range(2))
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        half = q.element_size()
        fwd_bytes = 2 * q.numel() * (half + torch.empty((), dtype=normed).element_size())
        bwd_bytes = 2 * q.numel() * (2 * half + dqn.element_size())
        print(f"== {shape} bf16, normed rows {normed}, incoming gradients {dqn.dtype}", flush=True)
        both = torch.cat([q, k])
        print(f"copy of q and k (read + write)       {gbps(2 * both.numel() * half, do_bench(lambda: both.clone()))}",
              flush=True)
        defaults = (qk_l2norm.L2NORM_BLOCK_ROWS, qk_l2norm.L2NORM_WARPS)
        for rows, warps in itertools.product([int(r) for r in a.rows.split(",")], [int(w) for w in a.warps.split(",")]):
            qk_l2norm.L2NORM_BLOCK_ROWS, qk_l2norm.L2NORM_WARPS = rows, warps
            try:
                f = do_bench(lambda: qk_l2norm.l2norm_forward(q, k, normed))
                b = do_bench(lambda: qk_l2norm.l2norm_backward(q, k, dqn, dkn, dq, dk))
            except Exception as error:  # noqa: BLE001 -- a failed launch is a result here
                print(f"ours rows {rows:3d} warps {warps}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                continue
            mark = "  (defaults)" if (rows, warps) == defaults else ""
            print(f"ours rows {rows:3d} warps {warps}: fwd {gbps(fwd_bytes, f)}   bwd {gbps(bwd_bytes, b)}{mark}",
                  flush=True)
        qk_l2norm.L2NORM_BLOCK_ROWS, qk_l2norm.L2NORM_WARPS = defaults
        qn, kn = torch.empty_like(q, dtype=normed), torch.empty_like(k, dtype=normed)
        for rows, warps in ((16, 4), (64, 4), (64, 8), (128, 8)):
            f = do_bench(lambda: flat_forward(q, k, qn, kn, rows, warps))
            print(f"flat comparison kernel, rows {rows:3d} warps {warps}: fwd {gbps(fwd_bytes, f)} (two launches)",
                  flush=True)

        def l2norm(x):
            x32 = x.float()
            return (x32 / torch.sqrt((x32 * x32).sum(-1, keepdim=True) + 1e-6)).to(normed)

        compiled = torch.compile(lambda q, k: (l2norm(q), l2norm(k)))
        f = do_bench(lambda: compiled(q, k))
        ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()

        def fwd_bwd():
            qn, kn = compiled(ql, kl)
            torch.autograd.backward([qn, kn], [dqn.to(normed), dkn.to(normed)])

        fb = do_bench(fwd_bwd, grad_to_none=[ql, kl])
        print(f"inductor: fwd {gbps(fwd_bytes, f)}   fwd+bwd {fb * 1e3:7.1f} us (bwd about {(fb - f) * 1e3:.1f} us)",
              flush=True)


if __name__ == "__main__":
    main()
