"""mHC training step: eager, eager + block manager, Inductor, and hc with recompute off/layer/block,
for n=1 (plain residual) and n=4 streams. One forward+backward step of the reference GPT.

Reports the median step time (CUDA events), the peak memory above parameters during the step, and
the compile time (first step minus a warm step). Results are appended as JSON lines to --out, so a
long sweep can be split across runs (--variants).

    python benchmarks/mhc.py --variants n1-eager,n1-inductor,n1-hc,n4-eager,n4-manager,n4-inductor
    python benchmarks/mhc.py --variants n4-hc-off,n4-hc-layer,n4-hc-block
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # cold compiles, every variant

import torch  # noqa: E402

ALL = ["n1-eager", "n1-inductor", "n1-hc", "n4-eager", "n4-manager", "n4-inductor",
       "n4-hc-off", "n4-hc-layer", "n4-hc-block"]


def build(n: int, a) -> torch.nn.Module:
    from hccompile.nn.mhc import MHCGPT

    torch.manual_seed(0)
    return MHCGPT(a.dim, a.heads, a.layers, n=n, dropout=a.dropout, layout="bsnc",
                  sinkhorn_iters=a.sinkhorn_iters).to(a.device, getattr(torch, a.dtype))


def step_fn(variant: str, model):
    if variant.endswith("eager"):
        return lambda x: model(x)
    if variant.endswith("manager"):
        return lambda x: model(x, recompute="block")
    if variant.endswith("inductor"):
        return torch.compile(model, backend="inductor")
    mode = variant.split("-")[-1] if variant.startswith("n4-hc-") else "block"
    return torch.compile(model, backend="hc", options={"hc_recompute": mode})


def measure(variant: str, a) -> dict:
    n = 4 if variant.startswith("n4") else 1
    model = build(n, a)
    fn = step_fn(variant, model)
    x = torch.randn(a.batch, a.seq, a.dim, device=a.device, dtype=getattr(torch, a.dtype))
    w = torch.randn_like(x)

    def step():
        model.zero_grad(set_to_none=True)
        (fn(x) * w).sum().backward()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = statistics.median(times)
    return {"variant": variant, "n": n, "step_ms": ms, "peak_gib": peak / 2**30,
            "compile_s": max(0.0, first - ms / 1e3) if "eager" not in variant and "manager" not in variant else 0.0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default=",".join(ALL))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--sinkhorn-iters", type=int, default=20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="mhc_results.jsonl")
    a = p.parse_args()
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "shape": f"L{a.layers} C{a.dim} H{a.heads} B{a.batch} "
            f"S{a.seq} {a.dtype} dropout {a.dropout} sinkhorn {a.sinkhorn_iters}"}
    for v in a.variants.split(","):
        if v not in ALL:
            raise SystemExit(f"unknown variant {v!r}; known: {ALL}")
        torch._dynamo.reset()
        row = {**meta, **measure(v, a)}
        print(f"{v:14s} step {row['step_ms']:8.2f} ms  peak {row['peak_gib']:6.2f} GiB  "
              f"compile {row['compile_s']:6.1f} s", flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
