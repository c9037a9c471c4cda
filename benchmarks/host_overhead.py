"""Host (CPU) time of one forward+backward of our ops against its GPU time: when the
host takes as long as the GPU, the GPU idles between kernels and the wall time is the host's.
Prints the wall time per step, the host time to enqueue a step (no synchronisation, GPU queue
kept busy) and the top of a cProfile of the enqueues; eager calls, and with --compiled the same
step under torch.compile (Inductor's code launching the kernels, issue 24). --jsonl appends one
row per op and mode for benchmarks/targets.py ("bench": "host").

    python benchmarks/host_overhead.py --ops gdn,kda,floor --shape B4T4096H16D128 --compiled \
        --jsonl benchmarks/results/host_<date>_h100.jsonl --commit <sha>

--static-launch: also the compiled step with Inductor's static CUDA launcher for user-defined Triton
kernels (`static_launch_user_defined_triton_kernels`, off by default in torch 2.11-2.13): our kernels reach
Inductor's code as user-defined kernels, launched through Triton's Python launcher unless it is set. Its rows
carry "static_launch": true; targets.py reads the default configuration's rows only.

--ops floor: a pointwise op under the same compile, the host time torch.compile itself costs per step.
Every family (issue 24, item 5): gdn, kda, lightning (with decay), linear (causal_linear_attn), htree
(H/4 KV heads), mhc_post and mhc_aggregate (n = 4 streams of C = H*D, one per token).
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tune_delta_rule import parse_shape, step_fn  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="gdn,kda")
    p.add_argument("--shape", default="B4T4096H16D128")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--sort", default="cumulative", help="pstats order of the profile: cumulative, tottime, ...")
    p.add_argument("--compiled", action="store_true", help="also the step under torch.compile (Inductor)")
    p.add_argument("--static-launch", action="store_true",
                   help="also the compiled step with static_launch_user_defined_triton_kernels=True")
    p.add_argument("--through-op", action="store_true",
                   help="also the eager step with every call through the op (lowering/_launch.DIRECT_CALLS off, "
                        "as before call_op); its rows carry \"direct\": false")
    p.add_argument("--jsonl", help="append one row per op and mode here")
    p.add_argument("--commit", default="", help="the measured tree's commit (a copied tree has no .git)")
    args = p.parse_args()
    shape = parse_shape(args.shape)
    modes = [(False, False)] + ([(True, False)] if args.compiled else []) + \
        ([(True, True)] if args.static_launch else []) + ([("through-op", False)] if args.through_op else [])
    for op in args.ops.split(","):
        for compiled, static in modes:
            torch._dynamo.reset()  # each mode compiles afresh: the launcher is chosen when kernels load
            patch = {"static_launch_user_defined_triton_kernels": static} \
                if hasattr(torch._inductor.config, "static_launch_user_defined_triton_kernels") else {}
            if static and not patch:
                raise SystemExit("--static-launch: this torch's Inductor has no static_launch_user_defined_triton_kernels")
            from hccompile.lowering import _launch

            _launch.DIRECT_CALLS = compiled != "through-op"
            with torch._inductor.config.patch(patch):
                measure_one(args, op, shape, compiled is True, static, direct=_launch.DIRECT_CALLS)
            _launch.DIRECT_CALLS = True


def floor_step_fn(shape: dict, compiled: bool):
    """The "floor" op: one pointwise op on q, k, v of the shape, forward and backward, so that a
    compiled step costs what torch.compile itself costs per call (Dynamo's guards, AOTAutograd's
    wrappers, the autograd engine, two generated `call`s with a launch each): the part of a
    compiled GDN/KDA step's host time no kernel of ours can remove."""
    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    call = (lambda q, k, v: q * k + v)
    if compiled:
        call = torch.compile(call, fullgraph=True, dynamic=True)

    def step():
        torch.autograd.backward(call(q, k, v), do)

    return step


def family_step_fn(op: str, shape: dict, compiled: bool, device: str = "cuda"):
    """One fwd+bwd of the op family `op` on bf16 inputs of `shape` (see the module docstring)."""
    import hccompile
    from hccompile.lowering.lightning import alibi_decay
    from hccompile.lowering.mhc import mhc_aggregate, mhc_post

    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*s, grad=True):
        t = torch.randn(*s, generator=gen, device=device).bfloat16()
        return t.requires_grad_() if grad else t

    if op in ("lightning", "linear"):
        args = (randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D))
        if op == "lightning":
            decay = alibi_decay(H, device=device)
            call = (lambda q, k, v: hccompile.lightning_attn(q, k, v, decay=decay)[0])
        else:
            call = hccompile.causal_linear_attn
    elif op == "htree":
        kv_heads = max(1, H // 4)
        args = (randn(B, T, H, D), randn(B, T, kv_heads, D), randn(B, T, kv_heads, D))
        call = (lambda q, k, v: hccompile.htree_attention(q, k, v, causal=True))
    elif op in ("mhc_post", "mhc_aggregate"):
        n, C = 4, H * D
        h_res = torch.softmax(torch.randn(B, T, n, n, generator=gen, device=device), -1).requires_grad_()
        weights = torch.sigmoid(torch.randn(B, T, n, generator=gen, device=device)).requires_grad_()
        if op == "mhc_post":
            args = (randn(B, T, n, C), h_res, weights, randn(B, T, C))
            call = mhc_post
        else:
            args = (randn(B, T, n, C), weights)
            call = mhc_aggregate
    else:
        raise SystemExit(f"--ops: unknown op {op!r}")
    if compiled:  # Inductor's code launches the kernels (issue 24); one graph for every length
        call = torch.compile(call, fullgraph=True, dynamic=True)
    out = call(*args)
    grad = torch.randn(out.shape, generator=gen, device=device).to(out.dtype)

    def step():
        torch.autograd.backward(call(*args), grad)

    return step


def measure_one(args, op: str, shape: dict, compiled: bool, static: bool = False, direct: bool = True) -> None:
    import triton

    if op == "floor":
        step = floor_step_fn(shape, compiled)
    elif op in ("gdn", "kda"):
        step = step_fn(op, shape, compiled=compiled)
    else:
        step = family_step_fn(op, shape, compiled)
    label = f"{op} {args.shape}" + (" compiled" if compiled else "") + (" static-launch" if static else "") + \
        ("" if direct else " through the op")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / args.steps * 1e3
    # Host time: enqueue behind a long GPU sleep so that the queue never drains.
    torch.cuda._sleep(int(2e9))
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    host = (time.perf_counter() - started) / args.steps * 1e3
    torch.cuda.synchronize()
    print(f"{label}: wall {wall:.3f} ms/step, host enqueue {host:.3f} ms/step", flush=True)
    if args.jsonl:
        row = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__, "commit": args.commit,
               "bench": "host", "op": op, "shape": args.shape, "compiled": compiled, "static_launch": static,
               "direct": direct, "wall_ms": round(wall, 4), "host_ms": round(host, 4)}
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
    profiler = cProfile.Profile()
    torch.cuda._sleep(int(2e9))
    profiler.enable()
    for _ in range(args.steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.top)
    print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main()
