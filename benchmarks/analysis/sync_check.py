"""Host synchronisations in a warm eager fwd+bwd of each op family (issue 22's and 24's "no host
synchronisation on the hot path"), counted with torch.cuda.set_sync_debug_mode("warn"): every call that
makes the host wait for the GPU (a blocking copy, .item(), nonzero, a stream or device synchronize) warns
once per occurrence. A call is warmed up first (kernel compiles, cached host reads of cu_seqlens), then
counted over a few steps; fixed-length and varlen (cu_seqlens) inputs. Zero everywhere would let a GPU
test hold it.

    python benchmarks/analysis/sync_check.py [--ops lightning,gdn,kda] [--steps 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def _leaves(*tensors):
    return [t.requires_grad_() for t in tensors]


def make_step(op: str, varlen: bool):
    import hccompile

    B, T, H, D = (1, 2048, 4, 64) if varlen else (2, 1024, 4, 64)
    cu = torch.tensor([0, 700, 2048], device="cuda", dtype=torch.int32) if varlen else None

    def randn(*shape):
        return torch.randn(*shape, device="cuda").bfloat16()

    q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
    do = randn(B, T, H, D)
    if op == "lightning":
        from hccompile.lowering.lightning import alibi_decay

        decay = alibi_decay(H, device="cuda")
        leaves = _leaves(q, k, v)

        def call():
            return hccompile.lightning_attn(q, k, v, decay, cu_seqlens=cu)[0]
    elif op in ("gdn", "kda"):
        beta = torch.rand(B, T, H, device="cuda").bfloat16()
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, *(() if op == "gdn" else (D,)), device="cuda"))
        leaves = _leaves(q, k, v, beta, g)
        f = hccompile.chunk_gated_delta_rule if op == "gdn" else hccompile.chunk_kda

        def call():
            return f(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
    else:
        raise SystemExit(f"unknown op {op!r}")

    def step():
        for t in leaves:
            t.grad = None
        call().backward(do)

    return step


def count(step, steps: int) -> tuple[int, list[str]]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the mode's own notice ("Synchronization debug mode is a prototype feature ...") is not a synchronisation
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]
    where = []
    for w in syncs[:3]:
        where.append(f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:120]}")
    return len(syncs), where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="lightning,gdn,kda")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    for op in a.ops.split(","):
        for varlen in (False, True):
            label = f"{op} {'varlen' if varlen else 'fixed-length'}"
            try:
                step = make_step(op, varlen)
                step()  # warm: compiles, cached host reads
                step()
                n, where = count(step, a.steps)
            except Exception:  # noqa: BLE001 - a diagnostic: say what failed and go on
                print(f"{label}: failed\n{traceback.format_exc(limit=3)}", flush=True)
                continue
            print(f"{label}: {n} host synchronisations in {a.steps} warm fwd+bwd steps", flush=True)
            for line in where:
                print(f"    {line}", flush=True)


if __name__ == "__main__":
    main()
