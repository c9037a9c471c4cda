"""Per-kernel GPU time of one forward+backward of an attention op (ours or FLA 0.6.0), so a gap in
benchmarks/*.py can be traced to the kernels that cause it.

    python benchmarks/profile_ops.py --ops gdn,kda,fla-gdn,fla-kda --shape B4T4096H16D128
    python benchmarks/profile_ops.py --ops lightning,fla-lightning --shape B4T4096H16D128
    python benchmarks/profile_ops.py --ops htree,htree-atomics,sdpa --shape B1T32768H32D128 --kv-heads 4
    python benchmarks/profile_ops.py --ops gdn --compile eager,static,dynamic   # Inductor's launches

--compile runs the op eagerly and/or under torch.compile (fullgraph; static or dynamic shapes), so a
compiled step slower than the eager one shows in which kernels (TORCH_LOGS=output_code shows the code).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _profile import profile_step  # noqa: E402


def parse_shape(text: str) -> dict:
    import re

    return {k: int(v) for k, v in re.findall(r"([A-Z])(\d+)", text)}


def build(op: str, s: dict, kv_heads: int, dtype):
    B, T, H, D = s["B"], s["T"], s["H"], s["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device="cuda").to(dt).requires_grad_()

    if op in ("gdn", "kda", "fla-gdn", "fla-kda", "kda-gate", "fla-kda-gate"):
        scalar = op.endswith("gdn")
        q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
        beta = torch.rand(B, T, H, generator=gen, device="cuda").to(dtype).requires_grad_()
        g_raw = torch.randn(*((B, T, H) if scalar else (B, T, H, D)), generator=gen, device="cuda")
        if op.endswith("kda-gate"):  # the gate activation in the kernel, inputs as benchmarks/delta_rule.py's
            g = g_raw.to(dtype).requires_grad_()
            from delta_rule import kda_gate_parameters

            A_log, dt_bias = (t.requires_grad_() for t in kda_gate_parameters(H, D, gen))
            if op.startswith("fla"):
                from fla.ops.kda import chunk_kda as f
            else:
                from hccompile import chunk_kda as f
            return [q, k, v, g, beta, A_log, dt_bias], lambda: f(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                dt_bias=dt_bias)[0]
        g = torch.nn.functional.logsigmoid(g_raw).float().requires_grad_()
        if op.startswith("fla"):
            if scalar:
                import fla.ops.common.chunk_o as chunk_o
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f

                chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only: see benchmarks/delta_rule.py
            else:
                from fla.ops.kda import chunk_kda as f
        else:
            import hccompile

            f = hccompile.chunk_gated_delta_rule if scalar else hccompile.chunk_kda
        leaves = [q, k, v, g, beta]
        return leaves, lambda: f(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    if op in ("lightning", "fla-lightning"):
        q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
        import hccompile

        decay = hccompile.lowering.lightning.alibi_decay(H, device="cuda")  # what benchmarks/lightning.py uses
        if op == "lightning":
            return [q, k, v], lambda: hccompile.lightning_attn(q, k, v, decay=decay, scale=D ** -0.5)[0]
        from fla.ops.simple_gla import chunk_simple_gla

        return [q, k, v], lambda: chunk_simple_gla(q, k, v, g_gamma=decay, scale=D ** -0.5)[0]
    if op in ("htree", "htree-nodes", "htree-atomics", "sdpa"):
        q, k, v = randn(B, T, H, D), randn(B, T, kv_heads, D), randn(B, T, kv_heads, D)
        if op.startswith("htree"):
            import hccompile
            from hccompile.kernels.htree import tiles

            from htree import node_gradients_of  # benchmarks/htree.py

            nodes = node_gradients_of(op)

            def call():
                tiles.NODE_GRADIENTS = nodes
                return hccompile.htree_attention(q, k, v)
            return [q, k, v], call
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        return [qt, kt, vt], lambda: torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, enable_gqa=True)
    raise SystemExit(f"--ops: unknown op {op!r}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="gdn,kda")
    p.add_argument("--shape", default="B4T4096H16D128")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--fwd-only", action="store_true")
    p.add_argument("--compile", default="eager", help="comma-separated: eager, static, dynamic")
    a = p.parse_args()
    shape = parse_shape(a.shape)
    for op in a.ops.split(","):
        for mode in a.compile.split(","):
            profile_one(a, op, shape, mode)


def profile_one(a, op: str, shape: dict, mode: str) -> None:
    try:
        leaves, fn = build(op, shape, a.kv_heads, getattr(torch, a.dtype))
    except ImportError as e:
        print(f"--- {op}: skipped ({e})", flush=True)
        return
    if mode != "eager":
        if mode not in ("static", "dynamic"):
            raise SystemExit(f"--compile: unknown mode {mode!r} (eager, static, dynamic)")
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, dynamic=mode == "dynamic")
    out = fn()
    do = torch.randn_like(out)

    def step():
        if a.fwd_only:
            with torch.no_grad():
                fn()
            return
        for t in leaves:
            t.grad = None
        fn().backward(do)

    for _ in range(3):
        step()
    table, _ = profile_step(step)
    print(f"--- {op} {a.shape} {'fwd' if a.fwd_only else 'fwd+bwd'} {mode}\n{table}", flush=True)


if __name__ == "__main__":
    main()
