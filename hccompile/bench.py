"""`hccompile bench`: hccompile's ops against the same math in plain PyTorch, on this machine.

What it measures: for each op family, the forward+backward time (median of --iters calls after one
warm-up) and, on CUDA, the peak memory of one call of

  * plain: the computation written in plain PyTorch and run eagerly, as a model would without
    hccompile: the quadratic masked form for linear and lightning attention, the token-by-token
    recurrence for GDN and KDA, the reference htree algorithm;
  * hccompile: the op hccompile lowers it to (hccompile.causal_linear_attn, lightning_attn,
    chunk_gated_delta_rule, chunk_kda, htree_attention), called directly, as a compiled graph calls
    it, with the implementation `hccompile doctor` names (Triton kernels on CUDA; on the CPU the
    chunked plain-PyTorch references, or the kernels in Triton's interpreter under TRITON_INTERPRET=1);

and the relative error between the two outputs. One size, random inputs; not a model benchmark and
not compile time (see `hccompile demo` for a compiled model against Inductor). The project's
performance claims come from benchmarks/ in the source tree, on the GPU, against FLA and Inductor.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

OPS = ("linear", "lightning", "gdn", "kda", "htree")


@dataclass
class Row:
    op: str
    impl: str  # "plain" or "hccompile"
    implementation: str  # what ran: "eager PyTorch", "triton", "triton-interpreter", "reference"
    ms: float
    peak_mib: float | None
    rel_err: float | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
    for t in inputs:
        t.grad = None
    out = fn()
    out.float().sum().backward()
    return out


def time_step(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor], iters: int,
              device: torch.device) -> tuple[float, float | None, torch.Tensor]:
    """Median ms of forward+backward, peak MiB above the starting allocation (CUDA), the output."""
    out = _step(fn, inputs)  # warm-up (Triton compiles its kernels here)
    times = []
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_mem = torch.cuda.memory_allocated(device)
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        _step(fn, inputs)
        _sync(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - start_mem) / 2**20
    times.sort()
    return times[len(times) // 2] * 1e3, peak, out.detach()


def _cases(op: str, batch: int, seq: int, heads: int, dim: int, device: torch.device, dtype: torch.dtype):
    """(inputs needing gradients, plain fn, hccompile fn, hccompile implementation name)."""
    import torch.nn.functional as F

    import hccompile
    from .kernels.delta_rule import naive_recurrent_delta_rule
    from .kernels.htree.reference import htree_attention_ref
    from .kernels.lightning.decay_reference import lightning_attn_ref
    from .kernels.lightning.reference import causal_linear_attn_ref
    from .lowering import delta_rule, htree, lightning, linear_attn

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype).requires_grad_()

    B, T, H, D = batch, seq, heads, dim
    if op in ("linear", "lightning"):
        q, k, v = randn(B, T, H, D, scale=D ** -0.5), randn(B, T, H, D, scale=D ** -0.5), randn(B, T, H, D)
        scale = D ** -0.5
        if op == "linear":
            return ([q, k, v], lambda: causal_linear_attn_ref(q, k, v, scale),
                    lambda: hccompile.causal_linear_attn(q, k, v), linear_attn.implementation(device, dtype))
        decay = lightning.alibi_decay(H, device=device)
        return ([q, k, v], lambda: lightning_attn_ref(q, k, v, decay, scale)[0],
                lambda: hccompile.lightning_attn(q, k, v, decay=decay)[0], lightning.implementation(device, dtype))
    if op in ("gdn", "kda"):
        q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
        beta = torch.rand(B, T, H, generator=gen, device=device).to(dtype).requires_grad_()
        shape = (B, T, H) if op == "gdn" else (B, T, H, D)
        g = F.logsigmoid(torch.randn(*shape, generator=gen, device=device) + 2).float().requires_grad_()
        ours = hccompile.chunk_gated_delta_rule if op == "gdn" else hccompile.chunk_kda
        gate = "scalar" if op == "gdn" else "channel"
        return ([q, k, v, beta, g],
                lambda: naive_recurrent_delta_rule(q, k, v, beta, g, gate=gate, use_qk_l2norm_in_kernel=True)[0],
                lambda: ours(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0],
                delta_rule.implementation(device, dtype))
    if op == "htree":
        q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
        options = dict(compression_rate=4, top_k=4)
        return ([q, k, v], lambda: htree_attention_ref(q, k, v, **options),
                lambda: hccompile.htree_attention(q, k, v, **options), htree.implementation(device, dtype))
    raise ValueError(f"unknown op {op!r}")


def run(ops=OPS, *, device: str | None = None, dtype: str | None = None, batch: int | None = None,
        seq: int | None = None, heads: int | None = None, dim: int | None = None, iters: int | None = None,
        progress=None) -> dict[str, Any]:
    """Time every op of `ops`; one progress line per row on `progress` (default: stderr)."""
    progress = sys.stderr if progress is None else progress
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    dt = getattr(torch, dtype) if dtype else (torch.bfloat16 if gpu else torch.float32)
    # defaults: a size where kernels matter on a GPU; one that finishes in seconds on a CPU
    batch = batch or (2 if gpu else 1)
    seq = seq or (1024 if gpu else 128)
    heads = heads or (8 if gpu else 2)
    dim = dim or (64 if gpu else 32)
    iters = iters or (5 if gpu else 3)
    rows: list[Row] = []
    total = 2 * len(ops)
    done = 0
    for op in ops:
        inputs, plain, ours, impl = _cases(op, batch, seq, heads, dim, dev, dt)
        results = {}
        for name, fn, what in (("plain", plain, "eager PyTorch"), ("hccompile", ours, impl)):
            done += 1
            print(f"[{done}/{total}] {op}: {name} ({what}) ...", end="", file=progress, flush=True)
            t0 = time.perf_counter()
            ms, peak, out = time_step(fn, inputs, iters, dev)
            results[name] = out
            rows.append(Row(op, name, what, ms, peak))
            print(f" {ms:.2f} ms ({time.perf_counter() - t0:.1f} s)", file=progress, flush=True)
        a, b = results["hccompile"].double(), results["plain"].double()
        rows[-1].rel_err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    return {"device": str(dev), "device_name": torch.cuda.get_device_name(dev) if gpu else "CPU",
            "dtype": str(dt).replace("torch.", ""), "shape": {"B": batch, "T": seq, "H": heads, "D": dim},
            "iters": iters, "torch": torch.__version__, "rows": [asdict(r) for r in rows]}


def table(result: dict[str, Any]) -> str:
    s = result["shape"]
    lines = [f"hccompile bench: {result['device_name']} ({result['device']}), {result['dtype']}, "
             f"B={s['B']} T={s['T']} H={s['H']} D={s['D']}, median of {result['iters']} forward+backward calls",
             "",
             "| op | implementation | fwd+bwd (ms) | peak memory (MiB) | speed-up | rel. error vs plain |",
             "|---|---|---|---|---|---|"]
    rows = result["rows"]
    plain = {r["op"]: r for r in rows if r["impl"] == "plain"}
    for r in rows:
        mem = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        speed = "" if r["impl"] == "plain" else f"{plain[r['op']]['ms'] / r['ms']:.2f}x"
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        label = "plain PyTorch (eager)" if r["impl"] == "plain" else f"hccompile ({r['implementation']})"
        lines.append(f"| {r['op']} | {label} | {r['ms']:.2f} | {mem} | {speed} | {err} |")
    if result["device"] == "cpu":
        lines += ["", "On the CPU the ops run plain-PyTorch references (or the kernels in Triton's interpreter): "
                      "these numbers show what runs here, not the GPU kernels' speed."]
    return "\n".join(lines)


def dump_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
