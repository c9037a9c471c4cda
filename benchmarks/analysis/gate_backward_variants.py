"""KDA's in-kernel gate backward (gate_cumsum.py's _gate_backward_kernel) alone, on the GPU: where its
time goes (issue 20). At B1 T32768 H16 K128 bf16 it took 0.401 ms on the H200 (BK 32, 8 warps) where
its bytes (dG fp32 in, g bf16 in, dg bf16 out: 537 MB) move in ~0.13 ms.

Variants of a copy of the kernel, each checked against the hccompile kernel's dg, dA_log and dt_bias
partials (except the timing-only bound), then timed (do_bench, median):
  reverse   the reverse chunk sum by tl.cumsum(reverse=True) instead of total - cumsum + dG
  nopartial no dA_log / dt_bias partial sums (timing only: wrong partials)
  copy      dG read and dg written, nothing else (the bytes' floor in this layout)
over BK 16 / 32 / 64 / 128 and 2 / 4 / 8 / 16 warps.

    python benchmarks/analysis/gate_backward_variants.py
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hccompile.kernels.delta_rule import gate_cumsum  # noqa: E402
from hccompile.kernels.delta_rule.gate_cumsum import _softplus  # noqa: E402


@triton.jit
def _variant_kernel(dcum_ptr, g_ptr, A_log_ptr, dt_bias_ptr, dg_ptr, dA_log_partial_ptr, dt_bias_partial_ptr,
                    T, NT, HV, GK, MODE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    pid_chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    pid_k = tl.program_id(2)
    batch = pid_chunk // NT
    start = (pid_chunk % NT) * BT
    length = tl.minimum(T - start, BT)
    local = tl.arange(0, BT)
    cols = pid_k * BK + tl.arange(0, BK)
    valid = local < length
    row = HV * GK
    offsets = (batch * T + start + local[:, None]).to(tl.int64) * row + head * GK + cols[None, :]
    mask = valid[:, None] & (cols[None, :] < GK)
    dcum = tl.load(dcum_ptr + offsets, mask=mask, other=0.0)
    if MODE == 3:  # copy
        tl.store(dg_ptr + offsets, dcum.to(dg_ptr.dtype.element_ty), mask=mask)
    else:
        if MODE == 1:
            dgate = tl.cumsum(dcum, axis=0, reverse=True)
        else:
            dgate = tl.sum(dcum, axis=0)[None, :] - tl.cumsum(dcum, axis=0) + dcum
        g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rate = tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
        x = g + tl.load(dt_bias_ptr + head * GK + cols, mask=cols < GK, other=0.0).to(tl.float32)[None, :]
        slope = tl.where(x > 20.0, 1.0, tl.sigmoid(x))
        dx = tl.where(mask, -rate * slope * dgate, 0.0)
        tl.store(dg_ptr + offsets, dx.to(dg_ptr.dtype.element_ty), mask=mask)
        if MODE != 2:
            dA_log = tl.where(mask, -rate * _softplus(x) * dgate, 0.0)
            partial_row = (pid_chunk * HV + head).to(tl.int64)
            tl.store(dA_log_partial_ptr + partial_row * tl.num_programs(2) + pid_k,
                     tl.sum(tl.sum(dA_log, axis=1), axis=0))
            tl.store(dt_bias_partial_ptr + partial_row * GK + cols, tl.sum(dx, axis=0), mask=cols < GK)


MODES = {"current": 0, "reverse": 1, "nopartial": 2, "copy": 3}
# the reference (current at BK 32, 8 warps) first
BLOCKS = (32, 16, 64, 128)
WARPS = (8, 2, 4, 16)


def main() -> None:
    B, T, H, K, BT = 1, int(os.environ.get("GATE_T", 32768)), 16, 128, 64
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test under TRITON_INTERPRET=1
    torch.manual_seed(0)
    dcum = torch.randn(B, T, H, K, device=device)
    g = torch.randn(B, T, H, K, device=device).bfloat16()
    A_log = torch.rand(H, device=device) * 2
    dt_bias = torch.randn(H * K, device=device) - 4
    chunks = B * T // BT
    print(f"bytes {(dcum.numel() * 4 + g.numel() * 4) / 1e6:.0f} MB", flush=True)

    want_dg = torch.empty_like(g)
    for bk in BLOCKS:
        tiles = K // bk
        dA = torch.empty(chunks, H, tiles, device=device)
        dt = torch.empty(chunks, H, K, device=device)
        for warps in WARPS:
            for name, mode in MODES.items():
                dg = torch.empty_like(g)

                def launch():
                    _variant_kernel[(chunks, H, tiles)](dcum, g, A_log, dt_bias, dg, dA, dt, T, T // BT, H, K,
                                                        MODE=mode, BT=BT, BK=bk, num_warps=warps)

                try:
                    launch()
                    if device == "cuda":
                        torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 - a config past the GPU's resources
                    print(f"BK {bk:3d} warps {warps:2d} {name:9s}: failed {str(error).splitlines()[0][:100]}")
                    continue
                note = ""
                if mode in (0, 1):
                    if name == "current" and bk == 32 and warps == 8:
                        want_dg.copy_(dg)
                        want = (dA.sum((0, 2)).clone(), dt.sum(0).clone())
                    elif want_dg.abs().sum() > 0:
                        note = (f" dg max diff {(dg.float() - want_dg.float()).abs().max().item():.1e}"
                                f" dA_log {(dA.sum((0, 2)) - want[0]).abs().max().item():.1e}"
                                f" dt_bias {(dt.sum(0) - want[1]).abs().max().item():.1e}")
                if device != "cuda":
                    print(f"BK {bk:3d} warps {warps:2d} {name:9s}: ran{note}", flush=True)
                    continue
                ms = do_bench(launch, warmup=25, rep=200, return_mode="median")
                print(f"BK {bk:3d} warps {warps:2d} {name:9s}: {ms * 1e3:7.1f} us{note}", flush=True)
    print("hccompile's BK / warps:", gate_cumsum.GATE_BACKWARD_BLOCK_K, gate_cumsum.GATE_BACKWARD_WARPS)


if __name__ == "__main__":
    main()
